"""bitpress-gguf: GGUF files (llama.cpp) read without a llama.cpp build.

``bitpress_load_model`` takes ``.gguf`` files (:class:`bitpress_gguf.model.GgufModel`): the file is
checked and memory-mapped (:mod:`bitpress_gguf.reader`); :mod:`bitpress_gguf.codec` turns each
llama.cpp quant type into ONNX Runtime's ``(q - zero_point) * scale`` block form exactly;
``bitpress inspect model.gguf`` reports what each tensor maps to.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bitpress.plugin import hookimpl


@hookimpl
def bitpress_load_model(source: Path, options: dict[str, Any]) -> Any:
    source = Path(source)
    if source.suffix.lower() != ".gguf" or not source.is_file():
        return None
    from bitpress_gguf.model import GgufModel

    return GgufModel.load(source)


@hookimpl
def bitpress_register_passes(register: Any) -> None:
    from bitpress_gguf.passes import GgufToGenaiPass

    register(GgufToGenaiPass)
