"""A Hugging Face model folder (``config.json`` + safetensors + tokenizer files) as a model handle.

The folder is checked when it is loaded; the PyTorch model itself is built only when a pass
asks for it (:meth:`HfModel.torch_model`), so listing, selecting and validating passes never
import torch. Loading is conservative: pickled weights (``.bin``) are refused unless
``allow_pickle`` is given (unpickling runs arbitrary code), and a folder's own model code
(``auto_map``) runs only with ``trust_remote_code``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from bitpress.errors import ModelLoadError, UsageError
from bitpress.models.base import ModelHandle
from bitpress.models.hf_files import check_folder, read_json

if TYPE_CHECKING:
    from torch import nn

LOAD_OPTIONS = ("trust_remote_code", "allow_pickle")


def is_hf_folder(path: Path) -> bool:
    """A folder with ``config.json`` and no ONNX model in it."""
    path = Path(path)
    return path.is_dir() and (path / "config.json").is_file() and not any(path.rglob("*.onnx"))


class HfModel(ModelHandle):
    """A Hugging Face folder; the PyTorch model is loaded lazily and then kept in memory."""

    kind: ClassVar[str] = "hf"

    def __init__(self, source: Path, options: dict[str, Any] | None = None) -> None:
        super().__init__(source)
        options = dict(options or {})
        unknown = sorted(set(options) - set(LOAD_OPTIONS))
        if unknown:
            raise UsageError(f"unknown load option(s) {', '.join(unknown)} for a Hugging Face folder; "
                             f"valid: {', '.join(LOAD_OPTIONS)}")
        self.trust_remote_code = bool(options.get("trust_remote_code", False))
        self.allow_pickle = bool(options.get("allow_pickle", False))
        self._model: nn.Module | None = None
        self.quantization_config: dict[str, Any] = {}
        #: the passes run on this model, written to quantization_config["passes"]
        self.history: list[dict[str, Any]] = []
        #: the history of a folder bitpress wrote in full (:meth:`written`): saved by copying its files
        self._written: list[dict[str, Any]] | None = None

    @classmethod
    def load(cls, folder: Path, options: dict[str, Any] | None = None) -> HfModel:
        folder = Path(folder)
        if not is_hf_folder(folder):
            raise ModelLoadError(f"{folder} is not a Hugging Face folder (config.json and no .onnx model)")
        # every file confined to the folder, config.json an object, shard indexes and safetensors
        # headers true to their files: checked here, before torch or transformers read anything
        check_folder(folder)
        config = read_json(folder, "config.json")
        handle = cls(folder, options)
        qc = config.get("quantization_config")
        if isinstance(qc, dict):
            passes = qc.get("passes") or []
            if not isinstance(passes, list):
                raise ModelLoadError(f"{folder / 'config.json'}: quantization_config.passes must be a list")
            handle.history = list(passes)
        return handle

    @classmethod
    def written(cls, folder: Path, *, history: list[dict[str, Any]], like: HfModel | None = None) -> HfModel:
        """A handle on a folder bitpress has just written whole (a streaming pass's output, in the run's scratch).

        Not loaded: a pass that needs torch loads it from there, and :meth:`save` copies (hard-links
        where it can) its files instead of loading and writing them again. ``like``: the handle it was
        made from (its load opt-ins carry over).
        """
        options = {} if like is None else {"trust_remote_code": like.trust_remote_code,
                                           "allow_pickle": like.allow_pickle}
        handle = cls(Path(folder), options)
        handle.history = list(history)
        handle._written = list(history)
        return handle

    def allow(self, *, trust_remote_code: bool = False, allow_pickle: bool = False) -> None:
        """Opt in to more before the model is loaded (a pass's own options); never opts out."""
        self.trust_remote_code |= trust_remote_code
        self.allow_pickle |= allow_pickle

    @property
    def loaded(self) -> bool:
        return self._model is not None

    def torch_model(self) -> nn.Module:
        """The PyTorch model (quantized parameters restored), loaded on first use."""
        if self._model is None:
            from bitpress.hf.checkpoint import load_model

            self._model, self.quantization_config = load_model(
                self.source, trust_remote_code=self.trust_remote_code, allow_pickle=self.allow_pickle
            )
        return self._model

    def save(self, destination: Path) -> list[Path]:
        """Write the (possibly quantized) model as a Hugging Face folder at ``destination``."""
        if self._model is None and self._written is not None and self._written == self.history:
            return self._copy_folder(Path(destination))
        from bitpress.hf.checkpoint import save_model

        return save_model(self.torch_model(), Path(destination), source=self.source, history=self.history)

    def _copy_folder(self, destination: Path) -> list[Path]:
        """The files of a folder bitpress wrote, hard-linked (copied across file systems) into ``destination``."""
        import os

        from bitpress import paths

        destination.mkdir(parents=True, exist_ok=True)
        files = []
        for src, real in paths.listdir(self.source, "file in the model folder"):
            target = destination / src.name
            try:
                os.link(real, target)
            except OSError:  # another file system, or links not allowed: the bytes
                paths.copy_inside(self.source, src, target, "file in the model folder")
            files.append(target)
        order = {"config.json": 1}
        return sorted(files, key=lambda f: (0 if f.name.endswith(".safetensors") else order.get(f.name, 2), f.name))

    def describe(self) -> str:
        return f"Hugging Face model {self.source}"
