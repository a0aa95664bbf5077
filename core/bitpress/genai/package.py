"""Reading an ONNX Runtime GenAI package: ``genai_config.json``, companion files, the model that runs.

Layouts seen in practice: ``model.onnx`` + ``genai_config.json`` + tokenizer files at the top,
or sub-model folders (``decoder/``, ``embedding/``, ``vision_encoder/``).

* :func:`read_genai_config` / :func:`check_genai_config`: a package's ``genai_config.json``, its
  shape checked and every file name it gives kept inside the folder;
* :func:`companion` / :func:`find_genai_config`: a file beside a model (``tokenizer.json``,
  ``genai_config.json``) found from the model's folder up to the package's, never above;
* :func:`resolve_model`: the ``.onnx`` file of a path that runs (``bitpress eval``, ``bitpress
  bench``).

The folder of ONNX models as a model handle (what passes receive) is
:class:`bitpress.models.onnx_package.OnnxPackage`, which reads its config here. This module imports
only :mod:`bitpress.paths` and :mod:`bitpress.errors` (see :mod:`bitpress.genai`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bitpress import paths
from bitpress.errors import ModelLoadError, UsageError

GENAI_CONFIG = "genai_config.json"


def read_genai_config(folder: Path, *, require_decoder: bool = True) -> dict[str, Any] | None:
    """``folder``'s ``genai_config.json``, checked (None when there is none).

    The file must be inside the folder (a link is followed only when it stays there), hold a
    JSON object with a ``model.decoder`` object, and every file name it gives (``filename``,
    ``config_filename``, ...) must be a relative name that stays inside the folder; with
    ``require_decoder`` the decoder's file must exist.
    """
    folder = Path(folder)
    cfg = paths.optional(folder, GENAI_CONFIG, GENAI_CONFIG)
    if cfg is None:
        return None
    where = folder / GENAI_CONFIG
    text = paths.read_text(folder, GENAI_CONFIG, GENAI_CONFIG)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{where} is not valid JSON: {exc}") from None
    except RecursionError:
        raise ModelLoadError(f"{where} is not valid JSON: nested too deeply") from None
    check_genai_config(data, folder, require_decoder=require_decoder)
    return data


def check_genai_config(data: Any, folder: Path, *, require_decoder: bool = True) -> None:
    """Raise ModelLoadError unless ``data`` has the shape of a ``genai_config.json`` of ``folder``.

    File names must stay inside ``folder``; with ``require_decoder`` the decoder's must exist.
    """
    where = Path(folder) / GENAI_CONFIG
    if not isinstance(data, dict):
        raise ModelLoadError(f"{where} must hold a JSON object, not {paths.kind_of(data)}")
    model = data.get("model")
    if not isinstance(model, dict):
        what = "has no 'model' section" if model is None else f"'model' must be an object, not {paths.kind_of(model)}"
        raise ModelLoadError(f"{where} {what}")
    decoder = model.get("decoder")
    if not isinstance(decoder, dict):
        what = ("has no 'model.decoder' section" if decoder is None
                else f"'model.decoder' must be an object, not {paths.kind_of(decoder)}")
        raise ModelLoadError(f"{where} {what}")
    base = paths.resolve_root(folder)
    for keys, value in _file_names(data, ()):
        label = f"{GENAI_CONFIG} {'.'.join(keys)}"
        name = paths.check_name(value, label)
        # relative to the folder, or to a sub-folder named like the section (model.vision -> vision/)
        section = keys[1] if len(keys) > 2 and keys[0] == "model" else None
        candidates = [Path(name)]  # relative to the folder (paths.inside joins them)
        if section:
            candidates.append(Path(section) / name)
        found = False
        for c in candidates:
            if paths.lexists(Path(folder) / c):
                paths.inside(folder, c, label, kind="any", base=base)
                found = True
        if not found and require_decoder and keys == ("model", "decoder", "filename"):
            raise ModelLoadError(f"{where} names the decoder {value!r}, which is not in {folder}")


def _file_names(value: Any, keys: tuple[str, ...]) -> list[tuple[tuple[str, ...], Any]]:
    """``(key path, value)`` of every entry whose key ends in ``filename``, at any depth."""
    out: list[tuple[tuple[str, ...], Any]] = []
    stack: list[tuple[tuple[str, ...], Any]] = [(keys, value)]
    while stack:
        at, v = stack.pop()
        if isinstance(v, dict):
            for k, item in v.items():
                if k.lower().endswith("filename"):
                    out.append(((*at, k), item))
                elif isinstance(item, (dict, list)):
                    stack.append(((*at, k), item))
        elif isinstance(v, list):
            stack.extend(((*at, str(i)), item) for i, item in enumerate(v) if isinstance(item, (dict, list)))
    return sorted(out, key=lambda e: e[0])


# -- companion files ----------------------------------------------------------------------------------
def search_folders(model_dir: Path, root: Path | None) -> list[Path]:
    """``model_dir`` and its parents up to ``root`` (the package's folder), nearest first.

    Without ``root`` (or with a ``root`` that does not hold ``model_dir``) only ``model_dir``:
    nothing above the model's own folder is ever read.
    """
    model_dir = Path(model_dir)
    if root is None:
        return [model_dir]
    root = Path(root)
    try:
        rel = model_dir.resolve().relative_to(root.resolve())
    except (ValueError, OSError):
        return [model_dir]
    out = [model_dir]
    for depth in range(len(rel.parts)):
        out.append(model_dir.parents[depth])
    return out


def companion(name: str, model_dir: Path, root: Path | None, what: str) -> Path | None:
    """The nearest ``name`` from ``model_dir`` up to ``root``, checked to stay inside ``root``.

    A file that is a link leaving the folder is refused (:class:`~bitpress.errors.UnsafePathError`).
    """
    folders = search_folders(model_dir, root)
    top = folders[-1]
    for folder in folders:
        found = paths.optional(top, str((folder / name).relative_to(top)), what)
        if found is not None:
            return found
    return None


def find_genai_config(model_dir: Path, root: Path | None = None) -> dict[str, Any] | None:
    """``genai_config.json`` of the model's folder, else of the package's root (never above)."""
    folders = search_folders(model_dir, root)
    cfg = companion(GENAI_CONFIG, model_dir, root, GENAI_CONFIG)
    if cfg is None:
        return None
    try:
        data = json.loads(paths.read_text(folders[-1], cfg, GENAI_CONFIG))
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{cfg} is not valid JSON: {exc}") from None
    check_genai_config(data, cfg.parent, require_decoder=False)  # its shape, and file names inside the folder
    return data


# -- which .onnx file of a path runs (bitpress eval, bitpress bench) ---------------------------------------
@dataclass(frozen=True)
class ModelFile:
    """The .onnx file to run and the folder its companions (tokenizer, genai_config) live in."""

    path: Path
    root: Path
    genai: dict[str, Any] | None


def resolve_model(path: str | Path, what: str) -> ModelFile:
    """An .onnx file as given, or the decoder of a folder (genai_config.json, else its only .onnx)."""
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(f"{what} model not found: {path}")
    path = path.absolute()  # the checks below join names to it: a relative folder would be joined twice
    if path.is_file():
        return ModelFile(path, path.parent, _genai_config(path.parent))
    path = paths.run_output_model(path) or path  # what `quantize -o OUT` wrote: OUT/<name>/
    genai = _genai_config(path)
    decoder = ((genai or {}).get("model") or {}).get("decoder") or {}
    if decoder.get("pipeline") and not decoder.get("filename"):
        stages = ", ".join(str(next(iter(s), "?")) for s in decoder["pipeline"] if isinstance(s, dict))
        raise UsageError(f"{path} is a decoder-pipeline package ({stages}): bitpress eval runs one decoder model; "
                         "evaluate the package built without split_embedding (the same weights)")
    filename = decoder.get("filename")
    if filename:
        file = path / paths.check_name(filename, f"{GENAI_CONFIG} model.decoder.filename")
        if not file.is_file():
            raise ModelLoadError(f"{path / GENAI_CONFIG} names the decoder {filename!r}, which is not in {path}")
        paths.inside(path, file, "decoder")  # a link leaving the folder is refused
        return ModelFile(file, path, genai)
    found = [p for p, _ in paths.walk(path, "file in the model folder") if p.name.endswith(".onnx")]
    if not found:
        raise ModelLoadError(f"{path} is a folder without any .onnx model")
    if len(found) > 1:
        names = ", ".join(p.relative_to(path).as_posix() for p in found)
        raise UsageError(f"{path} holds several models ({names}); pass the .onnx file to evaluate")
    return ModelFile(found[0], path, genai)


def sliding_window(config: dict[str, Any] | None) -> int:
    """The decoder's sliding window a ``genai_config.json`` gives (0 when none); its KV cache must hold it."""
    decoder = ((config or {}).get("model") or {}).get("decoder") or {}
    return int((decoder.get("sliding_window") or {}).get("window_size") or 0)


def _genai_config(folder: Path) -> dict[str, Any] | None:
    return read_genai_config(folder, require_decoder=False)


__all__ = [
    "GENAI_CONFIG",
    "ModelFile",
    "check_genai_config",
    "companion",
    "find_genai_config",
    "read_genai_config",
    "resolve_model",
    "search_folders",
    "sliding_window",
]
