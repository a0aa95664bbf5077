"""The host's machinery for vendor-toolkit plugins (bitpress.toolkit): containment, workspace, feeds.

A stand-in "toolkit" below does, inside :func:`contained`, what the real ones were measured to do
(each plugin's sandbox lists them); every check fails if the matching containment is removed.
"""

from __future__ import annotations

import gc
import logging
import os
import random
import sys
import types
import warnings
from pathlib import Path

import numpy as np
import pytest

from bitpress.errors import UsageError
from bitpress.models.onnx_model import OnnxModel
from bitpress.passes import PassContext
from bitpress.toolkit import workspace
from bitpress.toolkit.containment import contained
from bitpress.toolkit.feeds import FeedReader, calibration_feeds, split_feeds
from bitpress.toolkit.workspace import ToolReport, Workspace, count_ops, record_report

RELAY = logging.getLogger("bitpress.test.toolkit")


class Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def capture():
    handler = Capture()
    RELAY.addHandler(handler)
    RELAY.setLevel(logging.DEBUG)
    yield handler
    RELAY.removeHandler(handler)


def _toolkit_side_effects(module: types.ModuleType) -> None:
    """What toolkits do to their caller's process (measured on Quark, AIMET, INC, ModelOpt)."""
    logging.basicConfig(level=logging.INFO, force=True)
    existing = logging.getLogger("vendor.core")
    existing.warning("from an existing vendor logger")
    fresh = logging.getLogger("vendor.fresh.child")
    fresh.addHandler(logging.StreamHandler(sys.stderr))
    fresh.error("from a logger the toolkit made during the call")
    logging.warning("on the root logger")
    print("progress 50%")
    warnings.simplefilter("ignore", UserWarning)
    Path("vendor_workspace.csv").write_text("x")
    os.environ["VENDOR_FLAG"] = "1"
    sys.path.append("/vendor/lib")
    module.TMP_DIR = "/tmp/vendor-tmp"
    random.seed(1)
    np.random.seed(1)


def test_contained_undoes_toolkit_side_effects(tmp_path: Path, capture: Capture, monkeypatch) -> None:
    module = types.ModuleType("vendor_globals")
    module.TMP_DIR = None
    monkeypatch.setitem(sys.modules, "vendor_globals", module)
    existing = logging.getLogger("vendor.core")
    mine = logging.StreamHandler(sys.stderr)
    existing.addHandler(mine)
    root = logging.getLogger()
    root_before = (list(root.handlers), root.level)
    filters_before = list(warnings.filters)
    cwd, path = os.getcwd(), list(sys.path)
    random_state, np_state = random.getstate(), np.random.get_state()
    monkeypatch.chdir(tmp_path)
    cwd = os.getcwd()
    with contained(tmp_path / "scratch", relay=RELAY, loggers=("vendor",),
                   module_globals=(("vendor_globals", "TMP_DIR"),), environ={"OMP_NUM_THREADS": "1"}) as messages:
        assert os.environ["TQDM_DISABLE"] == "1" and os.environ["OMP_NUM_THREADS"] == "1"
        _toolkit_side_effects(module)
    assert (root.handlers, root.level) == root_before
    assert warnings.filters == filters_before
    assert os.getcwd() == cwd and not (tmp_path / "vendor_workspace.csv").exists()
    assert (tmp_path / "scratch" / "cwd" / "vendor_workspace.csv").exists()
    assert "VENDOR_FLAG" not in os.environ and "OMP_NUM_THREADS" not in os.environ
    assert sys.path == path and module.TMP_DIR is None
    assert random.getstate() == random_state and np.array_equal(np.random.get_state()[1], np_state[1])
    assert existing.handlers == [mine] and existing.propagate
    assert logging.getLogger("vendor.fresh.child").handlers == []
    # what the toolkit said: kept, and re-emitted demoted on the relay logger
    texts = [t for _, t in messages.records]
    for text in ("from an existing vendor logger", "from a logger the toolkit made during the call",
                 "on the root logger", "progress 50%"):
        assert text in texts
    assert messages.errors() == ["from a logger the toolkit made during the call"]
    levels = {r.getMessage(): r.levelno for r in capture.records}
    assert levels["from a logger the toolkit made during the call"] == logging.WARNING
    assert levels["from an existing vendor logger"] == logging.INFO
    assert levels["(printed) progress 50%"] == logging.DEBUG
    existing.removeHandler(mine)


def test_contained_restores_on_error(tmp_path: Path) -> None:
    cwd = os.getcwd()
    with pytest.raises(RuntimeError), contained(tmp_path, relay=RELAY):
        os.environ["VENDOR_FLAG"] = "1"
        raise RuntimeError("toolkit failed")
    assert os.getcwd() == cwd and "VENDOR_FLAG" not in os.environ


def test_workspace_lifetime(tiny_decoder: Path, tmp_path: Path, monkeypatch) -> None:
    """Without a host work folder: removed on failure, with an inline result, or with an external-data handle."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(scratch))
    model = OnnxModel.load(tiny_decoder)
    with pytest.raises(ValueError), Workspace.open(model, PassContext(), prefix="t") as ws:
        assert ws.input.is_file() and ws.output.parent.is_dir() and not ws.external
        raise ValueError
    assert list(scratch.iterdir()) == []
    ws = Workspace.open(model, PassContext(), prefix="t")
    result = ws.load(ws.input, model)
    assert result.source == model.source and result.modified
    ws.finish(result)
    assert list(scratch.iterdir()) == []  # inline tensors: nothing left to read
    monkeypatch.setattr(workspace, "SINGLE_FILE_LIMIT", 0)
    ws = Workspace.open(model, PassContext(), prefix="t")
    assert ws.external
    from bitpress.onnx.save import SaveOptions, save_onnx

    save_onnx(OnnxModel.load(ws.input), ws.output, SaveOptions(check=False, external_data=True))
    result = ws.load(ws.output, model)
    ws.finish(result)
    assert len(list(scratch.iterdir())) == 1  # the handle reads its tensors there
    assert count_ops(result.proto)["MatMul"] > 0
    del result
    gc.collect()
    assert list(scratch.iterdir()) == []
    # in the host's work folder: the host removes it
    ctx = PassContext(workdir=tmp_path / "work")
    ws = Workspace.open(model, ctx, prefix="t")
    ws.discard()
    assert ws.folder.is_dir() and ws.folder.parent == tmp_path / "work"


def test_reports_and_feeds(tiny_decoder: Path) -> None:
    model = OnnxModel.load(tiny_decoder)
    ctx = PassContext()
    report = ToolReport("Tool", "1.0", "int8", 1.25, {"QuantizeLinear": 3}, {"reduce_range": True})
    record_report(ctx, "tool_int8", model, report)
    assert ctx.extras["reports"] == [("tool_int8", model.source, report)]
    assert report.summary() == "Tool 1.0 int8 in 1.2 s: QuantizeLinear x3"
    assert report.to_json()["reduce_range"] is True and report.to_json()["quantized_ops"] == {"QuantizeLinear": 3}
    with pytest.raises(UsageError, match="toy pass needs calibration data"):
        calibration_feeds(model, None, who="toy pass")
    feeds = calibration_feeds(model, {"source": "random", "samples": 5, "seq_len": 8})
    reader = FeedReader(feeds)
    assert len([reader.get_next() for _ in range(5)]) == 5 and reader.get_next() is None
    reader.rewind()
    assert reader.get_next() is feeds[0] and len(reader) == 5
    calib, held = split_feeds(feeds, 0.2)
    assert len(calib) == 4 and held == feeds[4:]
    with pytest.raises(UsageError, match="at least 2"):
        split_feeds(feeds[:1], 0.5)


def test_workspace_keeps_lazily_read_inline_tensors(tmp_path: Path, monkeypatch) -> None:
    """A toolkit's single-file output: its large inline tensors stay in the file until the handle goes."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from bitpress.onnx.save import save_onnx

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    weight = np.arange(64 * 32, dtype=np.float32).reshape(64, 32) / 100  # 8 KiB: read lazily from the file
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 32])],
        [numpy_helper.from_array(weight, "w")],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    src = tmp_path / "in.onnx"
    onnx.save(proto, src)
    model = OnnxModel.load(src)
    ws = Workspace.open(model, PassContext(), prefix="t")
    onnx.save(proto, ws.output)  # what the toolkit wrote
    result = ws.load(ws.output, model)
    ws.finish(result)
    assert ws.folder.is_dir()  # the handle still reads the weight from the toolkit's file
    files = save_onnx(result, tmp_path / "out" / "model.onnx")
    saved = onnx.load(files[0])
    assert np.array_equal(numpy_helper.to_array(saved.graph.initializer[0]), weight)


def test_sidecar_files_land_beside_the_output(make_registry, tiny_decoder: Path, tmp_path: Path) -> None:
    """A pass's ``result.sidecars`` ({suffix: path}) are copied to ``<output stem><suffix>``; bad ones are bugs."""
    from types import SimpleNamespace

    import bitpress
    from bitpress import hookimpl
    from bitpress.passes import Pass

    class SidecarPass(Pass):
        name = "sidecar_test"
        algorithms = ("sidecar_test",)
        suffix = ".encodings"

        def run(self, model, context):
            Path(context.workdir).mkdir(parents=True, exist_ok=True)
            path = Path(context.workdir) / "enc.json"
            path.write_text('{"param_encodings": []}')
            model.modified = True
            model.sidecars = {self.suffix: path}
            return model

    @hookimpl
    def bitpress_register_passes(register):
        register(SidecarPass)

    reg = make_registry(SimpleNamespace(bitpress_register_passes=bitpress_register_passes))
    out = tmp_path / "q.onnx"
    result = bitpress.quantize(tiny_decoder, out, algorithm="sidecar_test", registry=reg)
    assert (tmp_path / "q.encodings").read_text() == '{"param_encodings": []}'
    assert tmp_path / "q.encodings" in result.files
    SidecarPass.suffix = ".onnx"  # would overwrite the model itself
    with pytest.raises(Exception, match=r"bad suffix '\.onnx'"):
        bitpress.quantize(tiny_decoder, tmp_path / "r.onnx", algorithm="sidecar_test", registry=reg)
    assert not (tmp_path / "r.onnx").exists()
