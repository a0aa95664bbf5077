"""A built GenAI package split into an embedding and a decoder component, the tied table kept one.

Neither exporter writes separate components for a text decoder (the builder's ``exclude_embeds``
drops the table; mobius splits multimodal models only), so bitpress cuts the built graph: the
node that gathers ``input_ids`` (``Gather`` or ``GatherBlockQuantized``) and what it reads
(the table, and for a tied table the ``Transpose`` / ``Reshape`` nodes that view the LM head's
tensors as a table) become ``embedding.onnx`` (``input_ids -> inputs_embeds``); the rest,
reading ``inputs_embeds``, becomes ``decoder.onnx``. ``genai_config.json`` becomes ONNX Runtime
GenAI's ``decoder-pipeline``: the embedding stage, then the decoder stage, on the prompt and on
every generated token.

The two graphs stay in the package's folder and keep their initializers' external-data
entries: a tied table (float, or quantized: ``GatherBlockQuantized`` + ``MatMulNBits``) is
stored once, in the one data file both read. Separate ``embedding/`` and ``decoder/`` folders
cannot share it: ONNX Runtime refuses external data outside a model's folder ("External data
path escapes model directory", measured with 1.32), so they would hold two copies.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from bitpress.errors import ExportError

log = logging.getLogger(__name__)

EMBEDDING, DECODER = "embedding.onnx", "decoder.onnx"
EMBEDS = "inputs_embeds"
_GATHERS = ("Gather", "GatherBlockQuantized")


def split_package(folder: Path) -> tuple[Path, Path]:
    """Split ``folder/model.onnx`` (see the module's docstring); returns the two graphs' paths."""
    import onnx
    from onnx import helper

    source = folder / "model.onnx"
    cfg_path = folder / "genai_config.json"
    if not source.is_file() or not cfg_path.is_file():
        raise ExportError(f"cannot split {folder}: it has no model.onnx / genai_config.json")
    proto = onnx.load(str(source), load_external_data=False)
    g = proto.graph
    users = [n for n in g.node if "input_ids" in n.input]
    if len(users) != 1 or users[0].op_type not in _GATHERS or users[0].input[1] != "input_ids":
        got = ", ".join(f"{n.op_type} {n.name}" for n in users) or "nothing"
        raise ExportError(f"cannot split {folder.name}: input_ids feeds {got}, not one embedding Gather")
    gather = users[0]
    producer = {o: n for n in g.node for o in n.output}
    inits = {t.name: t for t in g.initializer}
    # what the gather reads, back to initializers (views of a tied table: Transpose, Reshape)
    emb_nodes, todo, seen = [], [i for i in gather.input if i and i != "input_ids"], set()
    while todo:
        name = todo.pop()
        if name in seen or name in inits:
            continue
        seen.add(name)
        node = producer.get(name)
        if node is None:
            raise ExportError(f"cannot split {folder.name}: the embedding reads {name!r}, not computed from weights")
        emb_nodes.append(node)
        todo += [i for i in node.input if i]
    emb_nodes = [n for n in g.node if any(n is m for m in emb_nodes)] + [gather]  # graph order
    embeds_out = gather.output[0]
    dtype = _value_type(g, embeds_out, inits, gather)

    # the embedding graph: input_ids -> inputs_embeds, with its initializers' external-data entries as they are
    ids = next(i for i in g.input if i.name == "input_ids")
    e_nodes = [_copy(n) for n in emb_nodes]
    for n in e_nodes:
        _rename(n.output, embeds_out, EMBEDS)
    needed = {i for n in e_nodes for i in n.input}
    e_graph = helper.make_graph(
        e_nodes, "embedding", [ids],
        [helper.make_tensor_value_info(EMBEDS, dtype, ["batch_size", "sequence_length", "hidden_size"])],
        [t for t in g.initializer if t.name in needed])
    e_model = helper.make_model(e_graph, opset_imports=list(proto.opset_import), ir_version=proto.ir_version,
                                producer_name="bitpress")

    # the decoder: the gather removed, its output an input; nodes and initializers nothing reads any more dropped
    kept = [n for n in g.node if n is not gather]
    for n in kept:
        _rename(n.input, embeds_out, EMBEDS)
    kept = _live(kept, [o.name for o in g.output])
    used = {i for n in kept for i in n.input}
    d_inputs = [helper.make_tensor_value_info(EMBEDS, dtype, ["batch_size", "sequence_length", "hidden_size"])]
    d_inputs += [i for i in g.input if i.name != "input_ids" and i.name in used]
    del g.node[:]
    g.node.extend(kept)
    keep_inits = [t for t in g.initializer if t.name in used]
    del g.initializer[:]
    g.initializer.extend(keep_inits)
    del g.input[:]
    g.input.extend(d_inputs)
    infos = [v for v in g.value_info if v.name != embeds_out]
    del g.value_info[:]
    g.value_info.extend(infos)

    emb_path, dec_path = folder / EMBEDDING, folder / DECODER
    onnx.save(e_model, str(emb_path))
    onnx.save(proto, str(dec_path))
    source.unlink()
    _pipeline_config(cfg_path, [i.name for i in d_inputs], [o.name for o in g.output])
    shared = sorted({t.name for t in e_graph.initializer} & {t.name for t in keep_inits})
    log.info("split into %s (%d nodes) and %s; shared initializers stored once: %s", EMBEDDING, len(e_nodes),
             DECODER, ", ".join(shared) or "none")
    return emb_path, dec_path


def _rename(names: object, old: str, new: str) -> None:
    """Rename ``old`` to ``new`` in a node's inputs or outputs (a protobuf repeated field)."""
    for i, name in enumerate(list(names)):  # type: ignore[call-overload]
        if name == old:
            names[i] = new  # type: ignore[index]


def _copy(node: object) -> object:
    import onnx

    out = onnx.NodeProto()
    out.CopyFrom(node)  # type: ignore[arg-type]
    return out


def _live(nodes: list, outputs: list[str]) -> list:
    """``nodes`` that some graph output depends on, in order."""
    producer = {o: n for n in nodes for o in n.output}
    keep, todo = set(), list(outputs)
    while todo:
        n = producer.get(todo.pop())
        if n is None or id(n) in keep:
            continue
        keep.add(id(n))
        todo += [i for i in n.input if i]
    return [n for n in nodes if id(n) in keep]


def _value_type(graph: object, name: str, inits: dict, gather: object) -> int:
    """The element type of the embeddings: a float table's, or a quantized table's scales'."""
    from onnx import TensorProto

    for v in list(graph.value_info) + list(graph.output):  # type: ignore[attr-defined]
        if v.name == name and v.type.tensor_type.elem_type:
            return int(v.type.tensor_type.elem_type)
    src = gather.input[2] if gather.op_type == "GatherBlockQuantized" else gather.input[0]  # type: ignore[attr-defined]
    t = inits.get(src)
    if t is None:  # a view of an initializer: follow the names back to one
        producer = {o: n for n in graph.node for o in n.output}  # type: ignore[attr-defined]
        while t is None and src in producer:
            src = producer[src].input[0]
            t = inits.get(src)
    return int(t.data_type) if t is not None else TensorProto.FLOAT


def _pipeline_config(path: Path, decoder_inputs: list[str], decoder_outputs: list[str]) -> None:
    """``genai_config.json`` as a ``decoder-pipeline``: embedding, then decoder."""
    cfg = json.loads(path.read_text())
    model = cfg["model"]
    dec = model["decoder"]
    dec.pop("filename", None)
    dec.setdefault("inputs", {})["input_ids"] = "input_ids"
    dec["inputs"].pop(EMBEDS, None)
    stage = {"run_on_prompt": True, "run_on_token_gen": True}
    if "session_options" in dec:  # each stage on the package's EP
        stage["session_options"] = dec["session_options"]
    dec["pipeline"] = [
        {"embedding": {"filename": EMBEDDING, "inputs": ["input_ids"], "outputs": [EMBEDS], **stage}},
        {"decoder": {"filename": DECODER, "inputs": decoder_inputs, "outputs": decoder_outputs, **stage}},
    ]
    model["type"] = "decoder-pipeline"
    path.write_text(json.dumps(cfg, indent=4) + "\n")
