"""Reading and writing Hugging Face folders, quantized ones included.

On disk a quantized folder is an ordinary Hugging Face folder (``config.json``,
``model.safetensors``, tokenizer files) where each quantized parameter ``P`` is replaced by
``P_qweight`` (uint8, packed), ``P_scales`` (float32) and, when asymmetric, ``P_qzeros`` (uint8 or
float32), laid out as :mod:`bitpress.hf.qtensor` describes; float parameters keep their names.
``config.json`` gains::

    "quantization_config": {
        "quant_method": "bitpress",
        "format": "bitpress-blockwise-v1",
        "modules": {"model.layers.0.mlp.up_proj.weight": {"bits": 4, "group_size": 128, "symmetric": true,
                                                          "shape": [1536, 576], "dtype": "float32",
                                                          "zero_points": "none"}, ...},
        "tied": [["model.embed_tokens.weight", "lm_head.weight"]],
        "passes": [{"pass": "rtn_hf", "options": {...}}]
    }

``tied`` lists parameters stored once and shared (the first name is the one in the file); a
tie that quantization split (one side float) is simply absent, and ``tie_word_embeddings`` is
false so transformers does not re-tie it either. transformers itself ignores the unknown
``quant_method`` (with a warning) and loads only the float weights: reload through bitpress.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bitpress import paths
from bitpress.errors import BitpressError, ModelLoadError
from bitpress.hf.qtensor import QuantSpec, QuantTensor
from bitpress.models import hf_files

log = logging.getLogger(__name__)

QUANT_METHOD = "bitpress"
FORMAT = "bitpress-blockwise-v1"
SAFETENSORS = "model.safetensors"
PICKLE_SUFFIXES = hf_files.PICKLE_SUFFIXES
#: files that are weights or the config (written anew), never copied as companions
_WEIGHT_SUFFIXES = hf_files.WEIGHT_SUFFIXES


def weight_files(folder: Path) -> tuple[list[Path], list[Path]]:
    """(safetensors files, pickled weight files) at the top of ``folder``, each confined to it."""
    return hf_files.weight_files(folder)


def companion_files(folder: Path) -> list[Path]:
    """Top-level files to carry over unchanged: tokenizer, generation config, chat template, README.

    Each is checked to stay inside ``folder`` (a link to a file outside it is an error); copy
    them with :func:`copy_companion`, which checks again right before reading.
    """
    return hf_files.companion_files(folder)


def copy_companion(folder: Path, src: Path, dst: Path) -> Path:
    """Copy a companion file of ``folder`` (its in-folder target's bytes when it is a link)."""
    return paths.copy_inside(folder, src, dst, "file in the model folder")


def read_config(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    data = hf_files.read_json(folder, "config.json")
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} must hold a JSON object")
    return data


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    # missing / unexpected keys are expected when reading a quantized folder: they are restored afterwards
    from transformers.utils import logging as tlog

    level = tlog.get_verbosity()
    bars = tlog.is_progress_bar_enabled()
    tlog.set_verbosity_error()
    tlog.disable_progress_bar()  # the library logs; progress belongs to the CLI
    try:
        yield
    finally:
        tlog.set_verbosity(level)
        if bars:
            tlog.enable_progress_bar()


def _model_class(config: Any, trust_remote_code: bool) -> Any:
    import transformers

    if getattr(config, "auto_map", None) and trust_remote_code:
        return transformers.AutoModelForCausalLM
    for arch in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, arch, None)
        if cls is not None:
            return cls
    return transformers.AutoModelForCausalLM


def load_model(folder: Path, *, trust_remote_code: bool = False, allow_pickle: bool = False) -> tuple[nn.Module, dict]:
    """The model of ``folder`` (quantized parameters restored) and its ``quantization_config`` ({} if none)."""
    from transformers import AutoConfig

    folder = Path(folder)
    raw = read_config(folder)
    qc = raw.get("quantization_config") or {}
    ours = isinstance(qc, dict) and qc.get("quant_method") == QUANT_METHOD
    if qc and not ours:
        method = qc.get("quant_method") if isinstance(qc, dict) else qc
        raise ModelLoadError(
            f"{folder} is already quantized by another tool ({method!r}); bitpress reads float checkpoints and its own"
        )
    if ours and qc.get("format") != FORMAT:
        raise ModelLoadError(f"{folder}: unknown bitpress checkpoint format {qc.get('format')!r} (expected {FORMAT})")
    if ours:
        _check_quantization_config(folder, qc)
    # confined to the folder, shard indexes and safetensors headers true to their files: checked
    # right before transformers reads them (it opens what the index names)
    st = hf_files.check_folder(folder)
    _, pk = weight_files(folder)
    if not st:
        if not pk:
            raise ModelLoadError(f"{folder} has a config.json but no weights (*.safetensors)")
        if not allow_pickle:
            raise ModelLoadError(
                f"{folder} holds only pickled weights ({', '.join(p.name for p in pk)}): loading them can run "
                "arbitrary code. Convert them to safetensors, or, for a source you trust, opt in with "
                "allow_pickle=true (a load option, or the option of the pass)"
            )
        log.warning("loading pickled weights from %s (allow_pickle=true)", folder)
    try:
        config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
        if ours and hasattr(config, "quantization_config"):
            del config.quantization_config  # ours: restored by hand below, not by a transformers quantizer
        cls = _model_class(config, trust_remote_code)
        with _quiet_transformers():
            model = cls.from_pretrained(
                folder, config=config, trust_remote_code=trust_remote_code, use_safetensors=bool(st), dtype="auto"
            )
    except BitpressError:
        raise
    except Exception as exc:  # whatever transformers / safetensors raise on a bad folder
        hint = ""
        if "trust_remote_code" in str(exc) or (raw.get("auto_map") and not trust_remote_code):
            hint = " (the folder ships its own model code: opt in with trust_remote_code=true if you trust it)"
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ModelLoadError(f"transformers cannot load {folder}: {first}{hint}") from None
    model.eval()
    if ours:
        _restore_quantized(model, st, qc)
        if qc.get("online"):
            from bitpress.hf import online

            online.restore(model, st, qc["online"], f"{folder / 'config.json'} quantization_config")
    return model, (qc if ours else {})


def _set_param(model: nn.Module, name: str, param: nn.Parameter) -> None:
    mod_name, _, attr = name.rpartition(".")
    mod = model.get_submodule(mod_name) if mod_name else model
    setattr(mod, attr, param)


def _restore_quantized(model: nn.Module, files: list[Path], qc: dict[str, Any]) -> None:
    from safetensors import safe_open

    wanted: dict[str, torch.Tensor] = {}
    names = set()
    for spec_name in qc.get("modules", {}):
        names |= {f"{spec_name}_qweight", f"{spec_name}_scales", f"{spec_name}_qzeros"}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for key in sf.keys():  # noqa: SIM118 - safe_open is not a mapping
                if key in names:
                    wanted[key] = sf.get_tensor(key)
    params: dict[str, nn.Parameter] = {}
    for name, spec_json in qc.get("modules", {}).items():
        try:
            spec = QuantSpec.from_json(spec_json)
        except (KeyError, ValueError, TypeError, AttributeError) as exc:
            raise ModelLoadError(f"quantization_config.modules[{name!r}] is malformed: {exc}") from None
        try:
            qt = QuantTensor(wanted[f"{name}_qweight"], wanted[f"{name}_scales"], wanted.get(f"{name}_qzeros"), spec)
        except (KeyError, ValueError) as exc:
            raise ModelLoadError(f"quantized parameter {name} is missing or malformed in the checkpoint: {exc}") \
                from None
        params[name] = nn.Parameter(qt, requires_grad=False)
        try:
            _set_param(model, name, params[name])
        except AttributeError:
            raise ModelLoadError(f"the checkpoint quantizes {name}, which the model does not have") from None
    for group in qc.get("tied", []):
        canonical = group[0]
        try:
            shared = params[canonical] if canonical in params else model.get_parameter(canonical)
            for alias in group[1:]:
                _set_param(model, alias, shared)
        except AttributeError:
            raise ModelLoadError(f"quantization_config.tied names {group}, which the model does not have") from None


def _check_quantization_config(folder: Path, qc: dict[str, Any]) -> None:
    """The shape of our own ``quantization_config`` (read from a file: anything may be in it)."""
    where = f"{folder / 'config.json'} quantization_config"
    modules = qc.get("modules", {})
    if not isinstance(modules, dict) or not all(isinstance(v, dict) for v in modules.values()):
        raise ModelLoadError(f"{where}.modules must map parameter names to objects")
    tied = qc.get("tied", [])
    if not isinstance(tied, list) or not all(
        isinstance(g, list) and g and all(isinstance(n, str) for n in g) for g in tied
    ):
        raise ModelLoadError(f"{where}.tied must be a list of lists of parameter names")
    passes = qc.get("passes", [])
    if passes is not None and not isinstance(passes, list):
        raise ModelLoadError(f"{where}.passes must be a list")


def parameter_groups(model: nn.Module) -> list[tuple[list[str], torch.Tensor]]:
    """State-dict entries grouped by object: ``([name, alias, ...], tensor)`` in state-dict order."""
    groups: dict[int, tuple[list[str], torch.Tensor]] = {}
    for name, value in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(value), ([], value))[0].append(name)
    return list(groups.values())


def save_model(model: nn.Module, dest: Path, *, source: Path | None = None,
               history: list[dict[str, Any]] | None = None) -> list[Path]:
    """Write ``model`` as a Hugging Face folder at ``dest``; returns the files written."""
    from safetensors.torch import save_file

    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    modules: dict[str, Any] = {}
    tied: list[list[str]] = []
    for names, value in parameter_groups(model):
        canonical = names[0]
        if len(names) > 1:
            tied.append(names)
        if isinstance(value, QuantTensor):
            modules[canonical] = value.spec.to_json()
            tensors[f"{canonical}_qweight"] = value.qweight.contiguous()
            tensors[f"{canonical}_scales"] = value.scales.contiguous()
            if value.qzeros is not None:
                tensors[f"{canonical}_qzeros"] = value.qzeros.contiguous()
        else:
            tensors[canonical] = value.detach().contiguous()
    save_file(tensors, str(dest / SAFETENSORS), metadata={"format": "pt"})
    files = [dest / SAFETENSORS]

    config = getattr(model, "config", None)
    if config is None:
        raise ModelLoadError("the model has no transformers config to save")
    from bitpress.hf.online import products

    files.append(write_config(config, dest, modules, tied, history, online=sorted(products(model))))
    if source is not None:
        files += copy_companions(Path(source), dest)
    return files


def write_config(config: Any, dest: Path, modules: dict[str, Any], tied: list[list[str]],
                 history: list[dict[str, Any]] | None, *, online: list[str] | None = None) -> Path:
    """``dest/config.json``: ``config`` with our ``quantization_config`` (when anything is quantized, or a
    module carries an online product: :mod:`bitpress.hf.online`)."""
    config.save_pretrained(dest)
    cfg_path = Path(dest) / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("quantization_config", None)
    if modules or online:
        cfg["quantization_config"] = {
            "quant_method": QUANT_METHOD, "format": FORMAT, "modules": modules, "tied": tied,
            "passes": list(history or []),
        }
        if online:
            cfg["quantization_config"]["online"] = list(online)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return cfg_path


def copy_companions(source: Path, dest: Path) -> list[Path]:
    """Copy the companion files of ``source`` (tokenizer, ...) into ``dest``, leaving files already there."""
    files = []
    for f in companion_files(source):
        target = Path(dest) / f.name
        if not target.exists():
            copy_companion(source, f, target)
            files.append(target)
    return files
