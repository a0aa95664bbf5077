"""Moved: what the GenAI exporters need installed is :data:`bitpress.genai.GENAI_INSTALL_HINT` (the ``genai``
package owns everything about GenAI packages).

This path keeps working for one release and warns when imported.
"""

from __future__ import annotations

import warnings

from bitpress.genai import GENAI_INSTALL_HINT

warnings.warn("bitpress.hf.genai_extra moved to bitpress.genai; import GENAI_INSTALL_HINT from there",
              DeprecationWarning, stacklevel=2)

__all__ = ["GENAI_INSTALL_HINT"]
