"""The Python API, mirroring the CLI."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bitpress.data import DataConfig
from bitpress.evaluate import EvalResult  # also makes `bitpress.evaluate(...)` callable after `import bitpress`
from bitpress.models.base import ModelHandle
from bitpress.onnx.save import SaveOptions
from bitpress.passes import Pass
from bitpress.plugins import Registry, get_registry
from bitpress.workflow import (
    PassStep,
    RunResult,
    Workflow,
    build_workflow,
    input_kind,
    load_config,
    run_workflow,
)


def load_model(path: str | Path, **options: Any) -> ModelHandle:
    """Load a model through the plugins' loaders (ONNX files and folders by default)."""
    return get_registry().hook.bitpress_load_model(source=Path(path), options=options)


def quantize(
    model: str | Path,
    output: str | Path,
    *,
    algorithm: str,
    precision: str | None = None,
    options: dict[str, Any] | None = None,
    components: list[str] | None = None,
    jobs: int | None = None,
    overwrite: bool = False,
    external_data: bool | None = None,
    max_shard_size: int | None = None,
    check: bool = True,
    data: Any = None,
    progress: Any = None,
    registry: Registry | None = None,
    env_timeout: float | None = None,
) -> RunResult:
    """Quantize ``model`` with the pass that provides ``algorithm`` at ``precision``.

    ``data``: calibration data for passes that use it (a :class:`bitpress.data.DataConfig`, a
    source string such as ``"random"`` / ``"calib.npz"`` / ``"text.txt"``, or a mapping).
    ``env_timeout``: seconds after which a pass running in a plugin environment is killed.
    """
    registry = registry or get_registry()
    model_path = Path(model)
    cls = _select(registry, algorithm, precision, model_path)
    step = PassStep(cls.from_config(options or {}, precision), f"{algorithm}/{precision or '-'}")
    if env_timeout is not None:
        from bitpress.envs.remote import parse_timeout

        step.pass_.env_timeout = parse_timeout(env_timeout, "env_timeout")  # type: ignore[attr-defined]
    wf = Workflow(
        input=model_path, output=Path(output), steps=[step], components=components, jobs=jobs,
        overwrite=overwrite,
        save=SaveOptions(external_data=external_data, max_shard_size=max_shard_size, check=check),
        data=None if data is None else DataConfig.from_value(data),
    )
    return run_workflow(wf, registry, progress=progress)


def _select(registry: Registry, algorithm: str, precision: str | None, path: Path) -> type[Pass]:
    """The pass for ``algorithm`` that accepts the kind of model ``path`` holds."""
    return registry.select(algorithm, precision, input_kind(registry, path))


def run(config: dict[str, Any] | str | Path, *, progress: Any = None,
        registry: Registry | None = None) -> RunResult:
    """Run a workflow config (a mapping, or a JSON/YAML file)."""
    if not isinstance(config, dict):
        config = load_config(Path(config))
    wf = build_workflow(config, registry)
    return run_workflow(wf, registry, progress=progress)


def evaluate(
    quantized: str | Path,
    reference: str | Path,
    *,
    data: Any = None,
    samples: int = 8,
    seq_len: int = 128,
    batch: int = 1,
    seed: int = 0,
    text: str | Path | None = None,
    tokenizer: str | Path | None = None,
    max_windows: int | None = None,
    threads: int = 1,
    weights: bool = True,
    progress: Any = None,
) -> EvalResult:
    """Compare ``quantized`` with its float ``reference`` (.onnx files or GenAI folders) in ONNX Runtime.

    ``data``: the inputs of the output comparison (``None``: random; a .npz file/folder; a .txt
    with a tokenizer; a :class:`bitpress.data.DataConfig` or mapping), ``samples`` runs of
    ``batch`` x ``seq_len``. ``text``: a text file for the perplexity of both models (windows of
    ``seq_len`` tokens, at most ``max_windows``; tokenizer.json beside a model or ``tokenizer``);
    without ``data`` the outputs are compared on those windows too. ``weights``: also the SQNR of
    every quantized weight against the reference's. ``threads``: ONNX Runtime intra-op threads.
    ``EvalResult.to_json()`` / ``write_html(path)`` give the reports.
    """
    from bitpress.evaluate.runner import run_evaluation

    return run_evaluation(
        quantized, reference, data=data, samples=samples, seq_len=seq_len, batch=batch, seed=seed, text=text,
        tokenizer=tokenizer, max_windows=max_windows, threads=threads, weights=weights, progress=progress,
    )
