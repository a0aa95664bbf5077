"""A folder of ONNX models with companion files (an ONNX Runtime GenAI package, or any folder of ``.onnx``).

Layouts seen in practice: ``model.onnx`` + ``genai_config.json`` + tokenizer files at the top,
or sub-model folders (``decoder/``, ``embedding/``, ``vision_encoder/``). Passes run on the
components the user picks; everything else is carried over byte for byte. ``genai_config.json``
is read and checked by :mod:`bitpress.genai.package`.
"""

from __future__ import annotations

import fnmatch
from pathlib import Path
from typing import Any, ClassVar

from bitpress import paths
from bitpress.errors import ModelLoadError, UsageError
from bitpress.genai.package import read_genai_config
from bitpress.models.base import ModelHandle
from bitpress.models.onnx_model import OnnxModel
from bitpress.onnx.tensors import is_external, iter_tensors


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


__all__ = ["OnnxPackage"]
