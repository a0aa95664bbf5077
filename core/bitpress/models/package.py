"""A folder of ONNX models with companion files (an ONNX Runtime GenAI package).

Layouts seen in practice: ``model.onnx`` + ``genai_config.json`` + tokenizer files at the top,
or sub-model folders (``decoder/``, ``embedding/``, ``vision_encoder/``). Passes run on the
components the user picks; everything else is carried over byte for byte.
"""

from __future__ import annotations

import fnmatch
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from bitpress import paths
from bitpress.errors import ModelLoadError, UsageError
from bitpress.models.base import ModelHandle
from bitpress.models.onnx_model import OnnxModel
from bitpress.onnx.tensors import is_external, iter_tensors

log = logging.getLogger(__name__)

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


class OnnxPackage(ModelHandle):
    kind: ClassVar[str] = "onnx-folder"

    def __init__(self, root: Path, onnx_files: list[str], genai: dict[str, Any] | None = None) -> None:
        super().__init__(root)
        self.root = Path(root)
        self.onnx_files = onnx_files  # relative posix paths, sorted
        self.loaded: dict[str, OnnxModel] = {}
        self._genai = genai

    @classmethod
    def load(cls, root: Path) -> OnnxPackage:
        """The folder's models and config; every file in it must stay inside it (links included)."""
        root = Path(root)
        entries = paths.walk(root, "file in the model folder")
        files = sorted(p.relative_to(root).as_posix() for p, _ in entries if p.name.endswith(".onnx"))
        if not files:
            raise ModelLoadError(f"{root} is a folder without any .onnx model")
        genai = read_genai_config(root)
        return cls(root, files, genai)

    @property
    def genai_config(self) -> dict | None:
        return self._genai

    def configured_component(self, section: str) -> list[str]:
        """The model that a ``genai_config.json`` section (``decoder``, ``embedding``, ...) names.

        Its ``filename`` is relative to the folder, or to a sub-folder of the section's name.
        """
        entry = ((self.genai_config or {}).get("model") or {}).get(section)
        filename = entry.get("filename") if isinstance(entry, dict) else None
        if not isinstance(filename, str) or not filename:
            return []
        for rel in self.onnx_files:
            if rel == filename or (rel.endswith("/" + filename) and rel.startswith(section + "/")):
                return [rel]
        return []

    def default_components(self) -> list[str]:
        """The decoder of a GenAI package, else every model in the folder."""
        configured = self.configured_component("decoder")
        if configured:
            return configured
        decoders = [f for f in self.onnx_files if f.startswith("decoder/")]
        return decoders or list(self.onnx_files)

    def select(self, patterns: list[str] | None) -> list[str]:
        """Components matching names (``decoder``), paths or globs; default as above."""
        if not patterns:
            return self.default_components()
        chosen: list[str] = []
        for pat in patterns:
            hits = [
                f for f in self.onnx_files
                if f == pat or fnmatch.fnmatch(f, pat) or f.split("/")[0] == pat
                or Path(f).stem == pat
            ]
            # a genai_config.json section: `decoder` is model.onnx in the builder's flat layout
            hits = hits or self.configured_component(pat)
            if not hits:
                raise UsageError(
                    f"component {pat!r} not found in {self.root}; it holds: {', '.join(self.onnx_files)}"
                )
            chosen.extend(h for h in hits if h not in chosen)
        return chosen

    def component(self, rel: str) -> OnnxModel:
        if rel not in self.loaded:
            paths.inside(self.root, self.root / rel, "model")  # checked again right before it is read
            self.loaded[rel] = OnnxModel.load(self.root / rel)
            self.loaded[rel].package_root = self.root  # calibration finds genai_config.json, tokenizer here
        return self.loaded[rel]

    def files_of(self, rel: str) -> set[Path]:
        """The .onnx file of a component and the external data files it references."""
        model = self.component(rel)
        files = {(self.root / rel).resolve()}
        for t in iter_tensors(model.proto):
            if is_external(t):
                files.add(model.resolver.path(t)[0].resolve())
        return files

    def companion_files(self, replaced: list[str]) -> list[Path]:
        """Files to copy as they are: all but the replaced components' own files."""
        skip: set[Path] = set()
        for rel in replaced:
            skip |= self.files_of(rel)
        keep_for_others: set[Path] = set()
        for rel in self.onnx_files:
            if rel not in replaced:
                keep_for_others.add((self.root / rel).resolve())
        out = []
        for p, real in paths.walk(self.root, "file in the model folder"):
            if real not in skip or real in keep_for_others:
                out.append(p)
        return out

    def copy_file(self, src: Path, dst: Path) -> Path:
        """Copy a companion file (its in-folder target's bytes when it is a link), checked right before."""
        return paths.copy_inside(self.root, src, dst, "file in the model folder")


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


def _genai_config(folder: Path) -> dict[str, Any] | None:
    return read_genai_config(folder, require_decoder=False)
