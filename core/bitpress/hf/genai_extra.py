"""What the GenAI exporters need installed: the ``genai`` extra, for the builder and mobius routes alike."""

from __future__ import annotations

#: how to install what either exporter needs (torch pinned first: an unpinned one can pull a CUDA build)
GENAI_INSTALL_HINT = 'pip install "torch==2.13.0" "bitpress[genai]"'

__all__ = ["GENAI_INSTALL_HINT"]
