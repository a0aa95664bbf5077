"""Moved: the Hugging Face model handle is :mod:`bitpress.hf.model` (the ``hf`` package owns its model).

This path keeps working for one release and warns when imported.
"""

from __future__ import annotations

import warnings

from bitpress.hf.model import HfModel, is_hf_folder

warnings.warn("bitpress.models.hf_model moved to bitpress.hf.model; import HfModel from there",
              DeprecationWarning, stacklevel=2)

__all__ = ["HfModel", "is_hf_folder"]
