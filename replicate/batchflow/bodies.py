"""Function bodies as graphs of their own, with the static shapes their callers know.

Requires: a FunctionDef, the static shapes of the tensors a call passes it, and the host graph
holding the function library.

Produces: the body's IR with TensorFlow's shape inference run on it, and its argument and
result tensor names.

TensorFlow's ``function_def_to_graph`` gives each argument a placeholder of the call's input
shape, but two kinds of argument lose what their shape inference needs, since their *handle
data* is not serialized with the function:

- a resource variable's handle: its reads had no shape, so a bias added in a loop body (or
  ``trans[None]`` in a ``tf.scan`` CRF) had an unknown rank;
- a TensorList (``tf.scan``'s and ``map_fn``'s inputs, a while loop's accumulators): the
  elements read from it had an unknown rank.

A *probe* says what such an argument holds (:func:`probe_of`, from the op that made it, through
identities and the loops that carry it). While importing, the argument's placeholder is
replaced by an op of that kind (``VarHandleOp`` with the variable's shape, ``EmptyTensorList``
with the elements' shape), so inference propagates the shapes through the whole body; the IR
then gets the placeholders back, and records the probes of its own arguments for the bodies
nested in it.
"""

from __future__ import annotations

from typing import NamedTuple

from replicate.batchflow.table import behind
from replicate.graph.ir import IR, node_of, parse_tensor

__all__ = ["Probe", "probe_of", "import_body"]


class Probe(NamedTuple):
    """What a resource or variant argument holds: ``kind`` "variable" (``shape`` its shape) or
    "list" (``shape`` its elements' shape, None entries unknown); ``dtype`` a DataType enum."""
    kind: str
    shape: tuple
    dtype: int


#: Where a handle or a list passes unchanged on its way into a body.
_PATH = frozenset({"Identity", "Enter", "Switch", "Merge", "NextIteration"})

_LISTS = frozenset({"TensorListReserve", "EmptyTensorList"})


def probe_of(ir: IR, shape_of, ref: str) -> Probe | None:
    """The probe of tensor ``ref`` of ``ir`` (``shape_of(ref)``: a static shape), or None."""
    for _ in range(16):
        ref = behind(ir, ref, _PATH)
        name, idx = parse_tensor(ref)
        node = ir.nodes.get(name)
        if node is None:
            return None
        if name in ir.probes:
            return ir.probes[name]
        if node.op in ("While", "StatelessWhile") and idx < len(node.inputs):
            ref = node.inputs[idx]          # a loop variable comes out as it went in
            continue
        if node.op == "VarHandleOp":
            shape = node.attr("shape")
            return None if shape is None else Probe("variable", tuple(shape), node.attr("dtype"))
        if node.op == "TensorListFromTensor":
            shape = shape_of(node.inputs[0])
            if not shape:
                return None
            return Probe("list", tuple(shape[1:]), node.attr("element_dtype"))
        if node.op in _LISTS:
            value = ir.const_value(node_of(behind(ir, node.inputs[0], _PATH)))
            if value is None or value.ndim != 1:
                return None
            return Probe("list", tuple(int(d) if d >= 0 else None for d in value),
                         node.attr("element_dtype"))
        return None
    return None


def _stand_in(gd, node, probe: Probe) -> None:
    """Make placeholder ``node`` of GraphDef ``gd`` an op whose handle data is ``probe``'s."""
    from tensorflow.core.framework import types_pb2
    from tensorflow.python.framework import tensor_util

    dims = [-1 if d is None else int(d) for d in probe.shape]
    node.ClearField("attr")
    del node.input[:]
    if probe.kind == "variable":
        node.op = "VarHandleOp"
        node.attr["dtype"].type = probe.dtype
        node.attr["shape"].shape.CopyFrom(_shape_proto(dims))
        node.attr["shared_name"].s = b"replicate_probe_" + node.name.encode()
        node.attr["container"].s = b""
        return
    node.op = "EmptyTensorList"
    for suffix, value in (("element_shape", dims), ("max_num_elements", -1)):
        const = gd.node.add()
        const.name = f"{node.name}/replicate_probe_{suffix}"
        const.op = "Const"
        const.attr["dtype"].type = types_pb2.DT_INT32
        const.attr["value"].tensor.CopyFrom(tensor_util.make_tensor_proto(value, dtype="int32"))
        node.input.append(const.name)
    node.attr["element_dtype"].type = probe.dtype
    node.attr["shape_type"].type = types_pb2.DT_INT32


def _called(host, nodes) -> list:
    """The FunctionDefs ``nodes`` call, directly or through each other, from ``host``."""
    def names(defs):
        for nd in defs:
            for value in nd.attr.values():
                if value.HasField("func"):
                    yield value.func.name
                yield from (f.name for f in value.list.func)

    work, seen, out = list(names(nodes)), set(), []
    while work:
        name = work.pop()
        if name in seen:
            continue
        seen.add(name)
        function = host._get_function(name)     # noqa: SLF001 - the host graph's library
        if function is None:
            continue
        out.append(function.definition)
        work.extend(names(function.definition.node_def))
    return out


def _shape_proto(dims):
    from tensorflow.core.framework import tensor_shape_pb2

    proto = tensor_shape_pb2.TensorShapeProto()
    for d in dims:
        proto.dim.add().size = d
    return proto


def import_body(host, fdef, shapes: list, probes: list[Probe | None]) -> tuple[IR, list[str], list[str]]:
    """Import ``fdef`` under ``host`` (a tf.Graph with the library) with argument ``k`` of static
    shape ``shapes[k]`` holding ``probes[k]``: (body IR with static shapes, argument tensor
    names, result tensor names)."""
    import copy

    import tensorflow as tf
    from tensorflow.python.framework import function_def_to_graph, importer
    from tensorflow.python.framework.func_graph import FuncGraph

    with host.as_default():        # nested functions are looked up in the host's library
        gd, flat = function_def_to_graph.function_def_to_graph_def(
            fdef, [tf.TensorShape(s) for s in shapes])
    args = [flat[a.name] for a in fdef.signature.input_arg]
    results = [flat[fdef.ret[a.name]] for a in fdef.signature.output_arg]
    nodes = {n.name: n for n in gd.node}
    for ref, shape in zip(args, shapes):
        # the shapes recorded when the function was traced replace the call's: an argument
        # traced without a rank keeps none although the call now passes a vector
        node = nodes.get(node_of(ref))
        if shape is not None and node is not None and node.op == "Placeholder" \
                and node.attr["shape"].shape.unknown_rank:
            node.attr["shape"].shape.CopyFrom(tf.TensorShape(shape).as_proto())
    originals, own = [], {}
    for ref, probe in zip(args, probes):
        name = node_of(ref)
        if probe is None or name not in nodes or nodes[name].op != "Placeholder":
            continue
        originals.append(copy.deepcopy(nodes[name]))
        _stand_in(gd, nodes[name], probe)
        own[name] = probe
    # the functions it calls go along: with them the import infers a nested call's results
    # (a tf.function calling another had results of unknown rank, review 10)
    gd.library.function.extend(_called(host, gd.node))
    with host.as_default():
        graph = FuncGraph(fdef.signature.name)
        with graph.as_default():
            importer.import_graph_def_for_function(gd, name="")
    out = graph.as_graph_def()
    if originals:
        restored = {n.name: n for n in originals}
        kept = [restored.get(n.name, n) for n in out.node if "/replicate_probe_" not in n.name]
        del out.node[:]
        out.node.extend(kept)
    body = IR.from_graph_def(out)
    body.load_static_shapes(graph)
    body.probes.update(own)
    return body, args, results
