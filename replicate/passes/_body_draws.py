"""Helper of the draw pass: the functions of a cond or loop, rewritten to draw the global
batch's rows.

A dropout under a training flag (``tf.compat.v1.layers.dropout(training=flag)``, Keras
``Dropout``) draws its mask inside an ``If`` branch. Every tower calls the same branch
functions, so the towers cannot each get a copy with their own offset baked in; instead each
rewritten branch takes two more arguments, the other towers' example count (what the global
batch adds to the tower's) and the tower's first row, and every tower passes its own. In the
branch that draws, each random op draws the tower's shape with the batch dimension set to the
global size, with its original seeds, and a ``Slice`` under the op's own name keeps the
tower's rows, so every reference to the op's output inside the function (returns included)
reads the tower's rows. The other branch only gains the two (unused) arguments: both branches
of an ``If`` take the same arguments.

A dropout inside a defun (a ``tf.function`` called from the graph: ``PartitionedCall``) is
rewritten like a branch: its function takes the two values as two more arguments.

A dropout inside a loop body (``DropoutWrapper`` cells in ``dynamic_rnn``) is rewritten the
same way; the two values become two more loop variables that the body passes on unchanged and
the condition ignores.

Bodies nest: a ``dropout(training=flag)`` in a ``tf.while_loop`` body is an ``If`` inside the
``While``'s body. The rewritten body then passes its two arguments on to the ``If`` it calls,
whose branches are rewritten in turn, down to the functions that draw; every function on
the way is rewritten once. Each tower's loop runs its own kernel of every random op, with the
original seeds, so iteration ``t`` of every tower draws what iteration ``t`` draws on one
device (when iterations run one at a time: the draw pass requires ``parallel_iterations=1``).
Under conds and loops only (no defun on the way), a draw the counter-based way can take
(:func:`streams_of`) draws only the tower's rows from the tower's copy of its stream state
(:mod:`replicate.passes._streams`) instead of the global rows.

Requires: the ``body`` Draw of :mod:`replicate.passes._draws` (which random ops of which
branch draw rows of which axis).

Produces: new library functions ``<branch>_replicate_rows`` (once per branch, shared by the
towers) and :func:`rewire_call`, which points one tower's copy of the cond at them;
:func:`calls_of` finds the calls of a function inside another.
"""

from __future__ import annotations

import numpy as np
from tensorflow.core.framework import attr_value_pb2, function_pb2, node_def_pb2
from tensorflow.python.framework import dtypes, tensor_util

from replicate.graph.ir import IR, Node, make_attr
from replicate.passes._streams import Plan, in_function, plan, state_name

__all__ = ["rewrite_branches", "rewire_call", "calls_of", "streams_of", "SUFFIX", "FUNCTION_ATTRS"]

#: The function attributes of the calls whose bodies the draw pass rewrites, and whether the
#: body's results are the loop variables (which must then pass the two values on).
FUNCTION_ATTRS = {"If": (("then_branch", False), ("else_branch", False)),
                  "StatelessIf": (("then_branch", False), ("else_branch", False)),
                  "While": (("cond", False), ("body", True)),
                  "StatelessWhile": (("cond", False), ("body", True)),
                  "PartitionedCall": (("f", False),),
                  "StatefulPartitionedCall": (("f", False),)}

SUFFIX = "_replicate_rows"

#: Calls whose functions TensorFlow lowers into the graph that runs them (conds and loops):
#: their kernels are the session's, one per node, whatever a run fetches, as a state variable
#: is. A defun's kernels can be one per fetch signature instead (measured: a dropout in a cond
#: in a tf.function, its loss fetched in a run of its own, then the train op: each run's
#: kernel starts from the seed), so draws under a defun keep drawing the global rows with a
#: kernel of their own.
_LOWERED = frozenset({"If", "StatelessIf", "While", "StatelessWhile"})


#: The suffix of a tower's copy of functions whose draws every tower draws whole ("same").
COPY_SUFFIX = "_replicate_tower"

#: Names of the two arguments every rewritten branch gains: the other towers' example count
#: (what the global batch adds to the tower's) and the tower's first row.
OTHERS_ARG, OFFSET_ARG = "replicate_other_rows", "replicate_first_row"


def streams_of(ir: IR, draw, tower: str) -> tuple[tuple[str, str, Plan], ...]:
    """The draws under call ``draw`` that tower ``tower`` (its name prefix) makes of its own
    rows only (:mod:`replicate.passes._streams`): (inner draw's name, the name of the
    tower's state of its stream, the plan). A function reaches the state by that name (a
    ``VarHandleOp`` of the shared name, on the call's device): no argument, so a loop gains
    no loop variable per draw."""
    out = []
    for d in draw.inner if draw.kind == "body" and ir.nodes[draw.name].op in _LOWERED else ():
        if d.kind != "rows" or any(c.op not in _LOWERED for outer, inner in zip(d.path, d.path[1:])
                                   for c in calls_of(ir.function(outer), inner)):
            continue
        node = next(n for n in ir.function(d.path[-1]).node_def
                    if n.name == d.name[len("/".join(d.path)) + 1:])
        p = plan(node.op, node.attr, d.axis, d.outer, d.block, d.width)
        if p is not None:
            out.append((d.name, state_name(f"{tower}/{d.name}"), p))
    return tuple(out)


def rewrite_branches(ir: IR, call: str, draw, tower: int, streams: tuple = ()) -> tuple[str, ...]:
    """The names of tower ``tower``'s rewritten functions of cond, loop or defun call ``call``,
    in the order of :data:`FUNCTION_ATTRS`. Each tower gets its own functions: a stateful
    random kernel belongs to an instantiation of its function, and calls nested in a body
    can share one instantiation between towers (then their draws interleave, in an order
    that depends on scheduling). ``streams`` (:func:`streams_of`) draw the tower's rows only."""
    node = ir.nodes[call]
    args = draw.kind == "body"          # a "same" draw's functions are only copied per tower
    suffix = f"{SUFFIX if args else COPY_SUFFIX}_{tower}"
    return tuple(_rewritten(ir, node.attr(key), draw.inner, passes_on, suffix, args, streams)
                 for key, passes_on in FUNCTION_ATTRS[node.op])


def calls_of(fdef, callee: str) -> list:
    """The nodes of function ``fdef`` that call function ``callee`` (a cond, loop or defun)."""
    return [nd for nd in fdef.node_def if nd.op in FUNCTION_ATTRS
            and any(nd.attr[key].func.name == callee for key, _ in FUNCTION_ATTRS[nd.op])]


def _rewritten(ir: IR, fname: str, draws: tuple, passes_on: bool, suffix: str,
               args: bool = True, streams: tuple = ()) -> str:
    """The name of function ``fname`` rewritten (once per ``suffix``) for the two arguments
    (``args``; else only copied under the new name): its own ``rows`` draws of ``draws``
    (Draws whose ``path`` ends at ``fname``) take the tower's rows, and its calls on the way
    to deeper draws, of any kind, call the functions rewritten likewise."""
    new = fname + suffix
    if ir.function(new) is not None:
        return new
    own = [(d.name[len("/".join(d.path)) + 1:], d) for d in draws
           if d.path[-1:] == (fname,) and d.kind == "rows"]
    deeper = [d for d in draws if fname in d.path[:-1]]
    out = _rewrite(ir.function(fname), new, own, passes_on, args, streams)
    for nd in out.node_def:
        if nd.op not in FUNCTION_ATTRS:
            continue
        called = [nd.attr[key].func.name for key, _ in FUNCTION_ATTRS[nd.op]]
        if not any(d.path[d.path.index(fname) + 1] in called for d in deeper):
            continue
        for (key, inner_passes_on), callee in zip(FUNCTION_ATTRS[nd.op], called):
            nd.attr[key].func.name = _rewritten(ir, callee, tuple(deeper), inner_passes_on,
                                                suffix, args, streams)
        if args:
            _pass_arguments(nd)
    ir.add_function(out)
    return new


def _pass_arguments(nd) -> None:
    """Call node ``nd`` (inside a rewritten function) passes that function's two arguments on."""
    loop = nd.op in ("While", "StatelessWhile")
    types = "T" if loop else "Tin"
    nd.input.extend([OTHERS_ARG, OFFSET_ARG])
    nd.attr[types].list.type.extend([dtypes.int32.as_datatype_enum] * 2)
    if loop and "output_shapes" in nd.attr:
        nd.attr["output_shapes"].list.shape.add()
        nd.attr["output_shapes"].list.shape.add()       # two scalars


def rewire_call(ir: IR, copy: str, branches: tuple[str, ...], others: str | None = None,
                offset: str | None = None, guards: tuple = ()) -> None:
    """Point tower copy ``copy`` of the cond, loop or defun call at the rewritten functions,
    passing the other towers' example count and the tower's first row (none for functions
    only copied), after the ``guards`` that set the tower's stream states."""
    node = ir.nodes[copy]
    loop = node.op in ("While", "StatelessWhile")
    types = "T" if loop else "Tin"
    extra = [others, offset] if others is not None else []
    tin = list(node.attr(types, [])) + [dtypes.int32.as_datatype_enum] * len(extra)
    inputs = list(node.inputs) + extra
    ir.remove_many([copy])
    attrs = dict(node.attrs)
    attrs[types] = make_attr(tin, "list(type)")
    if loop and extra and "output_shapes" in attrs:
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
    ir.add_node(Node(copy, node.op, inputs, list(node.control) + list(guards), node.device, attrs))


def _rewrite(fdef, name: str, draws: list, passes_on: bool, args: bool = True, streams: tuple = ()
             ) -> function_pb2.FunctionDef:
    out = function_pb2.FunctionDef()
    out.CopyFrom(fdef)
    out.signature.name = name
    for arg in (OTHERS_ARG, OFFSET_ARG) if args else ():
        new = out.signature.input_arg.add()
        new.name = arg
        new.type = dtypes.int32.as_datatype_enum
        if passes_on:                       # a loop body returns its loop variables
            result = out.signature.output_arg.add()
            result.name = f"{arg}_next"
            result.type = dtypes.int32.as_datatype_enum
            out.ret[result.name] = arg
    mine = {name: (shared, p) for name, shared, p in streams}
    for op, d in draws:
        _rows(out, op, d, mine.get(d.name))
    return out


def _rows(fdef, op: str, d, stream: tuple | None = None) -> None:
    """Replace node ``op`` of ``fdef`` by a global-shape draw and a slice of the tower's rows,
    or, with ``stream`` (the shared name of the tower's state and the plan), by a draw of the
    tower's rows only (:func:`replicate.passes._streams.in_function`).
    Inside a loop body every op runs once per iteration, so the draw costs four more: the
    global shape (the tower's, plus the other towers' rows at the axis) and where the rows
    begin, then the slice, whose size is the tower's shape tensor (so Grappler knows the rows
    have it, and the gradient of the mask's product needs no broadcast reductions)."""
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
    grow = arith("grow", "Mul", hot_ref, as_index(OTHERS_ARG))
    if stream is not None:          # the tower's rows only, from its stream state
        fdef.node_def.extend(added)
        in_function(fdef, op, stream[1], stream[0], grow, OFFSET_ARG, index)
        return
    global_shape = arith("shape", "AddV2", shape_ref, grow)
    begin = arith("begin", "Mul", hot_ref, as_index(OFFSET_ARG))
    draw = node_def_pb2.NodeDef()
    draw.CopyFrom(node)
    draw.name = base
    draw.input[0] = global_shape
    out_type = node.attr["dtype"].type
    node.op = "Slice"
    del node.input[:]
    node.input.extend([f"{base}:output:0", begin, shape_ref])
    node.ClearField("attr")
    node.attr["T"].type = out_type
    node.attr["Index"].type = shape_type
    fdef.node_def.extend(added + [draw])
