"""The input side of streaming: a checkpoint's tensors read by byte range, and its model's structure.

:class:`CheckpointFiles` opens the safetensors files transformers would read (``model.safetensors``,
else the shards ``model.safetensors.index.json`` names), each checked by
:mod:`bitpress.models.hf_files` (confined to the folder, header true to the file), and reads rows
of a tensor with positional reads on the checked file descriptor: nothing is memory-mapped, so
what was read leaves the process's memory once it is used (a mapping would keep every page it
touched resident).

:func:`meta_model` builds the model transformers' ``from_pretrained(folder, dtype="auto")`` would
build, on the meta device (no weight memory): the same class, config and dtype, tied the way
loading ties it. It raises :class:`NotStreamable` wherever loading would do more than copy each
checkpoint tensor into the parameter of the same name (renamed or fused tensors, missing ones
it would initialize, both sides of a tie stored, float32-kept modules, shapes that differ):
the pass then loads the whole model instead.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch
from torch import nn

from bitpress import paths
from bitpress.hf.safetensors_writer import INDEX_FILE, SINGLE_FILE
from bitpress.models import hf_files

log = logging.getLogger(__name__)

#: safetensors dtype codes and the torch dtypes they hold
TORCH_DTYPES: dict[str, torch.dtype] = {
    code: dt for code, name in (
        ("F64", "float64"), ("F32", "float32"), ("F16", "float16"), ("BF16", "bfloat16"), ("I64", "int64"),
        ("I32", "int32"), ("I16", "int16"), ("I8", "int8"), ("U8", "uint8"), ("BOOL", "bool"), ("U16", "uint16"),
        ("U32", "uint32"), ("U64", "uint64"), ("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"),
        ("C64", "complex64"),
    ) if isinstance(dt := getattr(torch, name, None), torch.dtype)
}
SAFETENSORS_CODES = {dt: code for code, dt in TORCH_DTYPES.items()}


class NotStreamable(Exception):
    """Why the streaming path cannot reproduce what loading the whole model gives."""


@dataclass(frozen=True)
class Stored:
    """One tensor of the checkpoint: where its bytes are and how to read them."""

    file: int
    dtype: str
    shape: tuple[int, ...]
    offset: int  # of its first byte, from the start of the file

    @property
    def itemsize(self) -> int:
        return hf_files.SAFETENSORS_BITS[self.dtype] // 8

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


class CheckpointFiles:
    """The safetensors tensors of a Hugging Face folder, read by byte range from checked files."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder).absolute()  # names below are joined to it, never to the cwd
        self.files: list[Path] = []
        self._handles: list[IO[bytes]] = []
        self.tensors: dict[str, Stored] = {}
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    def _open(self) -> None:
        folder = self.folder
        if paths.lexists(folder / SINGLE_FILE):  # what transformers reads first
            files = [folder / SINGLE_FILE]
        elif paths.lexists(folder / INDEX_FILE):
            files = hf_files.check_index(folder, folder / INDEX_FILE)
            other = [f.name for f in files if not f.name.endswith(".safetensors")]
            if other:
                raise NotStreamable(f"{INDEX_FILE} names {other[0]}, which is not a safetensors file")
        else:
            raise NotStreamable(f"the folder has neither {SINGLE_FILE} nor {INDEX_FILE}")
        base = paths.resolve_root(folder)
        for path in files:
            handle = paths.open_inside(folder, path, "weights file", base=base)
            self._handles.append(handle)
            header = hf_files.check_safetensors(folder, path)
            fd = handle.fileno()
            (n,) = struct.unpack("<Q", os.pread(fd, 8, 0))
            ends = [info["data_offsets"][1] for k, info in header.items() if k != "__metadata__"]
            if os.fstat(fd).st_size != 8 + n + max(ends):
                raise NotStreamable(f"{path.name} changed while it was being read")
            index = len(self.files)
            self.files.append(path)
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                if name in self.tensors:
                    raise NotStreamable(f"tensor {name} is stored twice ({self.files[self.tensors[name].file].name} "
                                        f"and {path.name})")
                if info["dtype"] not in TORCH_DTYPES:
                    raise NotStreamable(f"tensor {name} has dtype {info['dtype']}, which streaming does not read")
                self.tensors[name] = Stored(index, info["dtype"], tuple(info["shape"]),
                                            8 + n + info["data_offsets"][0])

    def read_bytes(self, name: str, start: int, count: int) -> np.ndarray:
        """``count`` bytes of tensor ``name`` from its byte ``start`` (a fresh, writable buffer)."""
        t = self.tensors[name]
        buf = np.empty(count, np.uint8)
        view, pos = memoryview(buf), t.offset + start
        fd = self._handles[t.file].fileno()
        while view.nbytes:
            n = os.preadv(fd, [view], pos)
            if n <= 0:
                raise OSError(f"{self.files[t.file]} ended early while reading {name}")
            view, pos = view[n:], pos + n
        return buf

    def read_elements(self, name: str, e0: int, e1: int) -> torch.Tensor:
        """Elements ``e0:e1`` of the flattened tensor, in its stored dtype (1-D)."""
        t = self.tensors[name]
        raw = self.read_bytes(name, e0 * t.itemsize, (e1 - e0) * t.itemsize)
        return torch.from_numpy(raw).view(TORCH_DTYPES[t.dtype])

    def read_rows(self, name: str, r0: int, r1: int) -> torch.Tensor:
        """Rows ``r0:r1`` of the tensor seen as ``[prod(shape[:-1]), shape[-1]]`` (contiguous on disk)."""
        width = self.tensors[name].shape[-1]
        return self.read_elements(name, r0 * width, r1 * width).reshape(r1 - r0, width)

    def real_path(self, index: int) -> Path:
        """The resolved path of the ``index``-th file, as checked when it was opened (what a worker
        process opens to read it, :class:`bitpress.hf.streaming.RemoteSolve`)."""
        return Path(os.path.realpath(self.files[index]))

    def close(self) -> None:
        for h in self._handles:
            h.close()
        self._handles = []


@contextlib.contextmanager
def _quiet() -> Any:
    from bitpress.hf.checkpoint import _quiet_transformers

    with _quiet_transformers():
        yield


def meta_model(folder: Path, ckpt: CheckpointFiles) -> tuple[nn.Module, dict[int, str]]:
    """The model ``from_pretrained(folder, dtype="auto")`` builds, on the meta device, and for each of its
    state-dict tensors (by ``id``) the name of the checkpoint tensor loading copies into it.

    Mirrors transformers 5's loading: the class of ``config.architectures``, the config's dtype set
    on it and its sub-configs, the model built in transformers' own init context (meta device),
    the checkpoint's names run through the model's weight conversions, ties resolved with the
    checkpoint's missing names as ``tie_weights`` resolves them. Raises :class:`NotStreamable`
    wherever loading would do anything but copy (and cast to the parameter's dtype) each tensor.
    """
    from transformers import AutoConfig
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key
    from transformers.utils import ContextManagers

    from bitpress.hf.checkpoint import _model_class, parameter_groups

    with _quiet():
        config = AutoConfig.from_pretrained(folder)
    dtype = getattr(config, "dtype", None)
    if not isinstance(dtype, torch.dtype):
        raise NotStreamable("config.json gives no dtype (transformers would guess it from the weights)")
    if getattr(config, "transformers_weights", None):
        raise NotStreamable("config.json names its own weights file (transformers_weights)")
    cls = _model_class(config, trust_remote_code=False)
    # what from_pretrained does to the config before building the model
    config = copy.deepcopy(config)
    config.dtype = dtype
    for key in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, key, None)
        if sub is not None:
            sub.dtype = dtype
    config.name_or_path = folder
    config = copy.deepcopy(config)
    with _quiet(), ContextManagers(cls.get_init_context(dtype, False, False, None)):
        model = cls(config)
    if model._get_dtype_plan(dtype):
        raise NotStreamable(f"{cls.__name__} keeps some modules in float32 whatever the dtype")
    meta_sd = model.state_dict()
    real = [n for n, t in meta_sd.items() if t.device.type != "meta"]
    if real:
        raise NotStreamable(f"{real[0]} was built with real storage")

    # the names loading gives the checkpoint's tensors: streaming needs every one unchanged
    transforms = get_model_conversion_mapping(model, None, None)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    prefix = model.base_model_prefix
    for key in sorted(ckpt.tensors, key=dot_natural_key):  # the order loading renames them in (converters keep state)
        renamed, pattern = rename_source_key(key, renamings, converters, prefix, meta_sd)
        if renamed not in meta_sd and key in meta_sd:
            renamed, pattern = rename_source_key(key, [], [], base_model_prefix=prefix, meta_state_dict=meta_sd)
        if renamed in meta_sd and (renamed != key or pattern is not None):
            how = "converts" if pattern is not None else "renames"
            raise NotStreamable(f"transformers {how} the checkpoint's tensors when it loads them ({key} -> {renamed})")

    present = set(ckpt.tensors) & set(meta_sd)
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    both = [(t, s) for t, s in tied.items() if t in present and s in present]
    if both:
        raise NotStreamable(f"the checkpoint stores both sides of the tie {both[0][1]} / {both[0][0]} (transformers "
                            "ties them only if they are equal)")
    missing = set(meta_sd) - present
    with _quiet():
        model.tie_weights(missing_keys=missing, recompute_mapping=False)

    source: dict[int, str] = {}
    for names, value in parameter_groups(model):
        stored = [n for n in names if n in present]
        if not stored:
            raise NotStreamable(f"the checkpoint has no tensor {names[0]} (transformers would initialize it)")
        if len(stored) > 1:
            raise NotStreamable(f"the checkpoint stores {stored[0]} and {stored[1]}, which are one tensor of the model")
        t = ckpt.tensors[stored[0]]
        if t.shape != tuple(value.shape):
            raise NotStreamable(f"tensor {stored[0]} is {list(t.shape)} in the checkpoint but {list(value.shape)} in "
                                "the model")
        if value.dtype not in SAFETENSORS_CODES:
            raise NotStreamable(f"{names[0]} has dtype {value.dtype}, which streaming does not write")
        source[id(value)] = stored[0]
    return model, source
