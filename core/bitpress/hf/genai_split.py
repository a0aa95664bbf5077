"""Moved: splitting a GenAI package into embedding and decoder is :mod:`bitpress.genai.split` (the ``genai``
package owns everything about GenAI packages).

This path keeps working for one release and warns when imported.
"""

from __future__ import annotations

import warnings

from bitpress.genai.split import DECODER, EMBEDDING, EMBEDS, split_package

warnings.warn("bitpress.hf.genai_split moved to bitpress.genai.split; import split_package from there",
              DeprecationWarning, stacklevel=2)

__all__ = ["DECODER", "EMBEDDING", "EMBEDS", "split_package"]
