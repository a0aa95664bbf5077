"""Moved: ``bitpress-manifest.json`` (write, verify) is :mod:`bitpress.genai.manifest` (the ``genai`` package owns
everything about GenAI packages).

This path keeps working for one release and warns when imported.
"""

from __future__ import annotations

import warnings

from bitpress.genai.manifest import (
    FORMAT,
    MANIFEST,
    TOOLKITS,
    VerifyResult,
    add_evaluation,
    check,
    sha256_of,
    verify,
    versions,
    write_manifest,
)

warnings.warn("bitpress.manifest moved to bitpress.genai.manifest; import write_manifest and verify from there",
              DeprecationWarning, stacklevel=2)

__all__ = ["FORMAT", "MANIFEST", "TOOLKITS", "VerifyResult", "add_evaluation", "check", "sha256_of", "verify",
           "versions", "write_manifest"]
