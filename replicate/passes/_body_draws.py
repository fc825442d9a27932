"""Helper of the draw pass: the functions of a cond or loop, rewritten to draw the global
batch's rows.

A dropout under a training flag (``tf.compat.v1.layers.dropout(training=flag)``, Keras
``Dropout``) draws its mask inside an ``If`` branch. Every tower calls the same branch
functions, so the towers cannot each get a copy with their own offset baked in; instead each
rewritten branch takes two more arguments, the global batch size and the tower's first row,
and every tower passes its own. In the branch that draws, each random op draws the tower's
shape with the batch dimension set to the global size, with its original seeds, and a
``Slice`` under the op's own name keeps the tower's rows, so every reference to the op's
output inside the function (returns included) reads the tower's rows. The other branch only
gains the two (unused) arguments: both branches of an ``If`` take the same arguments.

A dropout inside a defun (a ``tf.function`` called from the graph: ``PartitionedCall``) is
rewritten like a branch: its function takes the two values as two more arguments.

A dropout inside a loop body (``DropoutWrapper`` cells in ``dynamic_rnn``) is rewritten the
same way; the two values become two more loop variables that the body passes on unchanged and
the condition ignores. Each tower's loop runs its own kernel of every random op, with the
original seeds, so iteration ``t`` of every tower draws what iteration ``t`` draws on one
device (when iterations run one at a time: the draw pass requires ``parallel_iterations=1``).

Requires: the ``body`` Draw of :mod:`replicate.passes._draws` (which random ops of which
branch draw rows of which axis).

Produces: new library functions ``<branch>_replicate_rows`` (once per branch, shared by the
towers) and :func:`rewire_call`, which points one tower's copy of the cond at them.
"""

from __future__ import annotations

import numpy as np
from tensorflow.core.framework import attr_value_pb2, function_pb2, node_def_pb2
from tensorflow.python.framework import dtypes, tensor_util

from replicate.ir import IR, Node, make_attr

__all__ = ["rewrite_branches", "rewire_call", "SUFFIX", "FUNCTION_ATTRS"]

#: The function attributes of the calls whose bodies the draw pass rewrites, and whether the
#: body's results are the loop variables (which must then pass the two values on).
FUNCTION_ATTRS = {"If": (("then_branch", False), ("else_branch", False)),
                  "StatelessIf": (("then_branch", False), ("else_branch", False)),
                  "While": (("cond", False), ("body", True)),
                  "StatelessWhile": (("cond", False), ("body", True)),
                  "PartitionedCall": (("f", False),),
                  "StatefulPartitionedCall": (("f", False),)}

SUFFIX = "_replicate_rows"

#: Names of the two arguments every rewritten branch gains.
BATCH_ARG, OFFSET_ARG = "replicate_global_batch", "replicate_first_row"


def rewrite_branches(ir: IR, call: str, draw) -> tuple[str, ...]:
    """The names of the rewritten functions of cond, loop or defun call ``call`` (made once),
    in the order of :data:`FUNCTION_ATTRS`."""
    node = ir.nodes[call]
    names = []
    by_function: dict[str, list] = {}
    for d in draw.inner:
        fname, op = d.name.split("/", 1)
        by_function.setdefault(fname, []).append((op, d))
    for key, passes_on in FUNCTION_ATTRS[node.op]:
        fname = node.attr(key)
        new = fname + SUFFIX
        if ir.function(new) is None:
            ir.add_function(_rewrite(ir.function(fname), new, by_function.get(fname, []), passes_on))
        names.append(new)
    return tuple(names)


def rewire_call(ir: IR, copy: str, branches: tuple[str, ...], batch: str, offset: str) -> None:
    """Point tower copy ``copy`` of the cond, loop or defun call at the rewritten functions,
    passing the global batch size and the tower's first row."""
    node = ir.nodes[copy]
    loop = node.op in ("While", "StatelessWhile")
    types = "T" if loop else "Tin"
    tin = list(node.attr(types, [])) + [dtypes.int32.as_datatype_enum] * 2
    inputs = list(node.inputs) + [batch, offset]
    ir.remove_many([copy])
    attrs = dict(node.attrs)
    attrs[types] = make_attr(tin, "list(type)")
    if loop and "output_shapes" in attrs:
        shapes = attr_value_pb2.AttrValue()
        shapes.CopyFrom(attrs["output_shapes"])
        shapes.list.shape.add()
        shapes.list.shape.add()             # two scalars
        attrs["output_shapes"] = shapes
    for (key, _), name in zip(FUNCTION_ATTRS[node.op], branches):
        value = attr_value_pb2.AttrValue()
        value.CopyFrom(node.attrs[key])
        value.func.name = name
        attrs[key] = value
    ir.add_node(Node(copy, node.op, inputs, list(node.control), node.device, attrs))


def _rewrite(fdef, name: str, draws: list, passes_on: bool) -> function_pb2.FunctionDef:
    out = function_pb2.FunctionDef()
    out.CopyFrom(fdef)
    out.signature.name = name
    for arg in (BATCH_ARG, OFFSET_ARG):
        new = out.signature.input_arg.add()
        new.name = arg
        new.type = dtypes.int32.as_datatype_enum
        if passes_on:                       # a loop body returns its loop variables
            result = out.signature.output_arg.add()
            result.name = f"{arg}_next"
            result.type = dtypes.int32.as_datatype_enum
            out.ret[result.name] = arg
    for op, d in draws:
        _rows(out, op, d)
    return out


def _rows(fdef, op: str, d) -> None:
    """Replace node ``op`` of ``fdef`` by a global-shape draw and a slice of the tower's rows."""
    node = next(n for n in fdef.node_def if n.name == op)
    shape_ref = node.input[0]
    shape_type = node.attr["T"].type if "T" in node.attr else node.attr["Tshape"].type
    index = dtypes.as_dtype(shape_type)
    base = f"{op}/replicate_global_draw"
    added = []

    def add(name: str, kind: str, inputs: list[str], **attrs) -> str:
        nd = node_def_pb2.NodeDef(name=f"{base}/{name}", op=kind)
        nd.input.extend(inputs)
        for key, value in attrs.items():
            nd.attr[key].CopyFrom(value)
        added.append(nd)
        return nd.name

    def const(name: str, value) -> str:
        array = np.asarray(value, dtype=index.as_numpy_dtype)
        return add(name, "Const", [], dtype=make_attr(index),
                   value=attr_value_pb2.AttrValue(tensor=tensor_util.make_tensor_proto(array))) + ":output:0"

    def arith(name: str, kind: str, a: str, b: str) -> str:
        return add(name, kind, [a, b], T=make_attr(index)) + ":z:0"

    def as_index(arg: str) -> str:
        if index == dtypes.int32:
            return arg
        return add(f"{arg}_cast", "Cast", [arg], SrcT=make_attr(dtypes.int32), DstT=make_attr(index),
                   Truncate=make_attr(False)) + ":y:0"

    hot = np.zeros(d.rank)
    hot[d.axis] = 1
    hot_ref = const("axis_mask", hot)
    axis = add("axis", "Const", [], dtype=make_attr(dtypes.int32),
               value=attr_value_pb2.AttrValue(tensor=tensor_util.make_tensor_proto(
                   np.int32(d.axis)))) + ":output:0"
    zero = add("zero", "Const", [], dtype=make_attr(dtypes.int32),
               value=attr_value_pb2.AttrValue(tensor=tensor_util.make_tensor_proto(
                   np.int32(0)))) + ":output:0"
    local = add("local_rows", "GatherV2", [shape_ref, axis, zero], Tparams=make_attr(index),
                Tindices=make_attr(dtypes.int32), Taxis=make_attr(dtypes.int32),
                batch_dims=make_attr(0)) + ":output:0"
    grow = arith("grow", "Mul", hot_ref, arith("missing", "Sub", as_index(BATCH_ARG), local))
    global_shape = arith("shape", "AddV2", shape_ref, grow)
    one = const("one", 1)
    begin = arith("begin", "Mul", hot_ref, as_index(OFFSET_ARG))
    size = arith("size", "Sub", arith("rows_plus_one", "Mul", hot_ref,
                                      arith("count_plus_one", "AddV2", local, one)), one)
    draw = node_def_pb2.NodeDef()
    draw.CopyFrom(node)
    draw.name = base
    draw.input[0] = global_shape
    out_type = node.attr["dtype"].type
    node.op = "Slice"
    del node.input[:]
    node.input.extend([f"{base}:output:0", begin, size])
    node.ClearField("attr")
    node.attr["T"].type = out_type
    node.attr["Index"].type = shape_type
    fdef.node_def.extend(added + [draw])
