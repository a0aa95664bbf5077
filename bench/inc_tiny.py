"""The test-model figures of docs/inc.md: every INC mode on the tests' decoder, encoder and conv net.

    # in the inc environment: quantize every case into OUT and print the errors on this CPU
    .bitpress-envs/inc/bin/python bench/inc_tiny.py quantize OUT
    # the same saved models, errors only, on an emulated AVX2 CPU (no VNNI)
    qemu-x86_64 -cpu Haswell .bitpress-envs/inc/bin/python bench/inc_tiny.py errors OUT

The error is the tests' (``tests/plugins/test_inc.py``): ``||y_q - y|| / ||y||`` of the first output,
the worse of two random batches of 2 x 16 tokens (seeds 123, 124).
"""

from __future__ import annotations

import sys
from pathlib import Path

from bitpress import synthetic
from bitpress.testing import output_error

DATA = {"source": "random", "samples": 8, "seq_len": 32}
#: case -> (pass, options, needs data)
CASES: dict[str, tuple[str, dict, bool]] = {
    "qoperator": ("inc_static", {}, True),
    "qoperator_linear": ("inc_static", {"op_types_to_quantize": ["MatMul", "Gemm", "Conv"]}, True),
    "qdq": ("inc_static", {"quant_format": "QDQ"}, True),
    "qdq_per_channel": ("inc_static", {"quant_format": "QDQ", "per_channel": True}, True),
    "qoperator_linear_per_channel": ("inc_static", {"op_types_to_quantize": ["MatMul", "Gemm", "Conv"],
                                                    "per_channel": True}, True),
    "qdq_percentile": ("inc_static", {"quant_format": "QDQ", "calibrate_method": "Percentile"}, True),
    "qdq_int8_activations": ("inc_static", {"quant_format": "QDQ", "activation_type": "int8"}, True),
    "qdq_uint8_weights": ("inc_static", {"quant_format": "QDQ", "weight_type": "uint8"}, True),
    **{f"qdq_smoothquant_{a}": ("inc_static", {"quant_format": "QDQ", "extra_options": {
        "SmoothQuant": True, "SmoothQuantAlpha": a / 10}}, True) for a in (3, 5, 7)},
    "dynamic": ("inc_dynamic", {}, False),
    "dynamic_per_channel": ("inc_dynamic", {"per_channel": True}, False),
    "dynamic_uint8_weights": ("inc_dynamic", {"weight_type": "uint8"}, False),
    **{f"rtn_asym_{g}": ("inc_woq", {"weight_only_config": {"group_size": g}}, False) for g in (16, 32, 128)},
    "rtn_sym_32": ("inc_woq", {"weight_only_config": {"scheme": "sym"}}, False),
    "awq_asym_32": ("inc_woq", {"weight_only_config": {"algorithm": "AWQ"}}, True),
}
MODELS = ("decoder", "encoder", "convnet")


def build_models(folder: Path) -> dict[str, Path]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "plugins"))
    from test_inc import build_convnet  # the tests' conv net

    folder.mkdir(parents=True, exist_ok=True)
    return {
        "decoder": synthetic.build_decoder(folder / "decoder.onnx", hidden=64, layers=2, heads=4, vocab=256),
        "encoder": synthetic.build_encoder(folder / "encoder.onnx", hidden=64, layers=2),
        "convnet": build_convnet(folder / "convnet.onnx"),
    }


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("quantize", "errors"):
        print(__doc__)
        return 2
    out = Path(argv[1])
    models = {m: out / f"{m}.onnx" for m in MODELS}
    if argv[0] == "quantize":
        from bitpress.api import quantize
        from bitpress.errors import BitpressError

        models = build_models(out)
        for case, (pass_name, options, data) in CASES.items():
            for m, src in models.items():
                try:
                    quantize(src, out / f"{case}.{m}.onnx", algorithm=pass_name, options=options,
                             data=DATA if data else None, overwrite=True)
                except BitpressError as exc:
                    print(f"{case:30s} {m:8s} -  ({str(exc).splitlines()[0][:90]})", flush=True)
    for case in CASES:
        for m, src in models.items():
            q = out / f"{case}.{m}.onnx"
            if q.exists():
                print(f"{case:30s} {m:8s} {output_error(src, q):.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
