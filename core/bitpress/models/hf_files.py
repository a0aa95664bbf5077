"""The files of a Hugging Face folder, checked before anything else reads them (no torch needed).

transformers and safetensors open files by names they read from the folder: the weight files
a listing finds, the shards a ``*.safetensors.index.json`` names, ``config.json``. Everything
here is confined to the folder (:mod:`bitpress.paths`) and every safetensors header is checked
against its file (lengths, offsets, dtypes, shapes), so a hostile folder gets one clear error
instead of a read outside it or a crash in a native library.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

from bitpress import paths
from bitpress.errors import ModelLoadError

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
#: files that are weights or the config (written anew), never copied as companions
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".pkl", ".msgpack", ".h5", ".gguf", ".onnx",
                   ".onnx.data", ".index.json")
#: bits per element of each safetensors dtype
SAFETENSORS_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32,
    "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64,
}
#: safetensors' own limit on the JSON header
MAX_HEADER_BYTES = 100_000_000


def top_files(folder: Path) -> list[Path]:
    """The regular files at the top of ``folder`` (as listed), each checked to stay inside it."""
    return [p for p, _ in paths.listdir(folder, "file in the model folder")]


def weight_files(folder: Path) -> tuple[list[Path], list[Path]]:
    """(safetensors files, pickled weight files) at the top of ``folder``."""
    files = top_files(folder)
    st = [p for p in files if p.name.endswith(".safetensors")]
    pk = [p for p in files if p.name.endswith(PICKLE_SUFFIXES) and not p.name.startswith("training_args")]
    return st, pk


def companion_files(folder: Path) -> list[Path]:
    """Top-level files to carry over unchanged: tokenizer, generation config, chat template, README."""
    return [p for p in top_files(folder) if p.name != "config.json" and not p.name.endswith(WEIGHT_SUFFIXES)]


def read_json(folder: Path, name: str, *, unique_keys: bool = False) -> Any:
    """A JSON file of the folder, confined to it and of bounded size (``unique_keys``: no key twice)."""
    where = Path(folder) / name
    text = paths.read_text(folder, name, name)
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates(where) if unique_keys else None)
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{where} is not valid JSON: {exc}") from None
    except RecursionError:
        raise ModelLoadError(f"{where} is not valid JSON: nested too deeply") from None


def check_folder(folder: Path) -> list[Path]:
    """Check everything transformers would read in ``folder``; returns its safetensors files.

    Every file (at any depth) must stay inside the folder; ``config.json`` must be a JSON
    object; shard indexes must name shards inside the folder that exist; every safetensors
    header must describe its file. A PEFT adapter (``adapter_config.json``) is refused: it names
    its base model by a path that transformers would follow.
    """
    folder = Path(folder)
    paths.walk(folder, "file in the model folder")
    config = read_json(folder, "config.json")
    if not isinstance(config, dict):
        raise ModelLoadError(f"{folder / 'config.json'} must hold a JSON object, not {paths.kind_of(config)}")
    if paths.lexists(folder / "adapter_config.json"):
        raise ModelLoadError(
            f"{folder} holds a PEFT adapter (adapter_config.json), which names its base model elsewhere; "
            "merge the adapter into the model and save the merged folder"
        )
    st, _ = weight_files(folder)
    for index in [p for p in top_files(folder) if p.name.endswith(".index.json")]:
        for shard in check_index(folder, index):
            if shard.name.endswith(".safetensors") and shard not in st:
                st.append(shard)
    for f in st:
        check_safetensors(folder, _within(folder, f))
    return sorted(st)


def _within(folder: Path, path: Path) -> Path:
    """``path`` as :func:`bitpress.paths.inside` takes it: a name relative to ``folder`` (a path built as
    ``folder / name`` from a relative ``folder`` would otherwise be joined to it twice), or absolute."""
    path = Path(path)
    if not path.is_absolute() and path.is_relative_to(folder):
        return path.relative_to(folder)
    return path


def check_index(folder: Path, index: Path) -> list[Path]:
    """The shards a ``*.index.json`` names: relative names of files inside the folder that exist."""
    data = read_json(folder, index.name, unique_keys=True)
    where = f"{index.name}"
    if not isinstance(data, dict):
        raise ModelLoadError(f"{folder / index.name} must hold a JSON object, not {paths.kind_of(data)}")
    weight_map = data.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelLoadError(f"{folder / index.name} has no 'weight_map' object naming the shards")
    base = paths.resolve_root(folder)
    shards: list[Path] = []
    for key, value in weight_map.items():
        name = paths.check_name(value, f"{where} weight_map[{key!r}]")
        shard = Path(folder) / name
        if shard in shards:
            continue
        if not paths.lexists(shard):
            raise ModelLoadError(f"{folder / index.name} names the shard {value!r}, which is not in {folder}")
        paths.inside(folder, _within(folder, shard), f"shard {value!r} of {index.name}", base=base)
        shards.append(shard)
    return shards


def check_safetensors(folder: Path, path: Path) -> dict[str, Any]:
    """The header of a safetensors file, refused unless it describes the file exactly.

    Mirrors what the safetensors library requires, with errors that say what is wrong: a header
    length that fits the file, a JSON object of tensors with known dtypes, non-negative shapes
    whose byte size matches their offsets, offsets that tile the data without gaps or overlaps.
    """
    with paths.open_inside(folder, path, "weights file") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise ModelLoadError(f"{path} is empty; expected safetensors weights")
        if size < 8:
            raise ModelLoadError(f"{path} is {size} bytes long, too short for a safetensors file")
        (n,) = struct.unpack("<Q", f.read(8))
        if n == 0 or n > MAX_HEADER_BYTES or n > size - 8:
            raise ModelLoadError(
                f"{path} is not a safetensors file: its header claims {n} bytes (the file has {size})"
            )
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates(path))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ModelLoadError(f"{path} has a safetensors header that is not JSON: {_short(exc)}") from None
    if not isinstance(header, dict):
        raise ModelLoadError(f"{path} has a safetensors header that is not a JSON object")
    data_len = size - 8 - n
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                raise ModelLoadError(f"{path}: __metadata__ must map names to strings")
            continue
        spans.append((*_span(path, name, info), name))
    if not spans:
        raise ModelLoadError(f"{path} holds no tensors")
    spans.sort()
    pos = 0
    for begin, end, name in spans:
        if begin != pos:
            what = "overlaps the tensor before it" if begin < pos else f"leaves a gap at byte {pos}"
            raise ModelLoadError(f"{path}: tensor {name!r} (bytes {begin}..{end}) {what}")
        pos = end
    if pos != data_len:
        raise ModelLoadError(
            f"{path}: the tensors end at byte {pos} of the data, but the file holds {data_len} bytes of data "
            "(truncated, or trailing bytes)"
        )
    return header


def _span(path: Path, name: str, info: Any) -> tuple[int, int]:
    if not isinstance(info, dict):
        raise ModelLoadError(f"{path}: tensor {name!r} is not described by an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in SAFETENSORS_BITS:
        raise ModelLoadError(f"{path}: tensor {name!r} has an unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
        raise ModelLoadError(f"{path}: tensor {name!r} has a shape that is not a list of integers: {shape!r}")
    if any(d < 0 for d in shape):
        raise ModelLoadError(f"{path}: tensor {name!r} has a negative dimension: {shape}")
    if (
        not isinstance(offsets, list) or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
    ):
        raise ModelLoadError(f"{path}: tensor {name!r} has malformed data_offsets {offsets!r}")
    begin, end = offsets
    if begin < 0 or end < begin:
        raise ModelLoadError(f"{path}: tensor {name!r} has data_offsets {offsets} (negative or reversed)")
    count = 1
    for d in shape:
        count *= d
    bits = count * SAFETENSORS_BITS[dtype]
    if bits % 8 or bits // 8 != end - begin:
        raise ModelLoadError(
            f"{path}: tensor {name!r} ({dtype} {shape}) needs {bits / 8:g} bytes, but its offsets span {end - begin}"
        )
    return begin, end


def _no_duplicates(where: Path):
    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in pairs:
            if k in out:
                raise ModelLoadError(f"{where} gives {k[:80]!r} twice")
            out[k] = v
        return out

    return hook


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__
