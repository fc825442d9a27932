"""Helper of the analyze pass: read shapeless placeholders as vectors where they broadcast.

A legacy program often declares a value without a shape (``scale = tf.placeholder(tf.float32)``)
and feeds it a float, or a vector of class weights, a feature mean. Without a rank, the ops
that read it (``x + scale * noise``, then a ``matmul``) have no layout the analysis can prove,
so the result was inexact although every step the driver runs is exact.

An elementwise op that broadcasts such a placeholder against an operand of rank 1 or more
computes the same values, of the same shape, when it reads the placeholder flattened to a
vector (a scalar becomes one entry, a vector stays as it is). With that view the analysis
knows the rank, and what it proves holds for every scalar or vector the driver feeds. A view
that lines its one axis up with the batch's (``xent * w``) must be split when fed one value
per example and must not be when fed a single value; only the feed tells, so each tower reads
its rows of the view broadcast to the batch (``batchflow/plan``, ``passes/rebatch``), which is
right both ways. The shapes a broadcasting op's gradient reads of the placeholder are read of
the view too.

Requires: an IR with static shapes and its ``tf_graph``; the analysis' placeholders that
left a layout unknown (``ctx.shapeless``, shared inputs only: a batch input is never viewed).

Produces: for each such placeholder read by broadcasting ops, ``<name>/replicate_vector``
(``Reshape(p, [-1])``) that those ops read instead, after a check that it was fed no more than
a vector (``<name>/replicate_vector/check``: a step fed a matrix stops naming it instead of
training on an unproved layout); the other readers (an optimizer's learning rate, a cond's
predicate) keep the placeholder. The static shapes (and ``ir.tf_graph``) are inferred again.
The analyze pass keeps the views only when the analysis then proves more, and names each in
a warning.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
from tensorflow.python.framework import dtypes

from replicate.batchflow import table
from replicate.batchflow.bodies import import_body
from replicate.batchflow.roles import forward_op_of
from replicate.errors import InputError
from replicate.graph import registry
from replicate.graph.ir import IR, Node, node_of, tensor_name

__all__ = ["candidates", "view_as_vectors", "warning"]

#: Suffix of the node that reads a placeholder as a vector.
SUFFIX = table.VECTOR_VIEW

#: Elementwise ops whose operands broadcast: a scalar operand and its one-entry vector give the
#: same result when another operand has rank 1 or more.
BROADCASTING = frozenset({
    "Add", "AddV2", "Sub", "Mul", "MulNoNan", "Div", "DivNoNan", "RealDiv", "FloorDiv",
    "TruncateDiv", "FloorMod", "Maximum", "Minimum", "Pow", "SquaredDifference", "Equal",
    "NotEqual", "Less", "LessEqual", "Greater", "GreaterEqual", "LogicalAnd", "LogicalOr",
    "SelectV2",     # (``tf.where`` broadcasts its condition too; v1 ``Select`` does not)
})

#: Elementwise ops of one operand (``Cast``, ``Square``, ...): their result is a scalar or a
#: one-entry vector as their input is, so they read a view alike when their readers do.
ONE_OPERAND = frozenset(op for op in table.UNARY if op not in ("ClipByValue",))

def candidates(ir: IR, analysis) -> list[str]:
    """Shared placeholders without a static rank that left an op's layout unknown, when the
    analysis has reasons (nothing to gain otherwise)."""
    if not analysis.reasons or analysis.flow is None:
        return []
    shared = set(analysis.shared_inputs)
    return sorted(n for n in analysis.flow.ctx.shapeless
                  if tensor_name(n) in shared and ir.static_shape(tensor_name(n)) is None)


def _readers(ir: IR, name: str) -> list[str]:
    """The ops that read ``name``'s output and may read it as a vector instead, and the shape
    reads of broadcasting gradients (``BroadcastGradientArgs`` must see the shape the view
    has in each tower; only the placeholder's own gradient, which nothing reads, changes)."""
    out = [c.name for c, pos in ir.data_consumers(tensor_name(name))
           if _widens_alike(ir, c, pos, name) or _shape_read(ir, c)]
    return list(dict.fromkeys(out))


def _shape_read(ir: IR, node) -> bool:
    """A ``Shape`` in the gradient code of a broadcasting op that reads the same value, read
    only by ``BroadcastGradientArgs`` and the ``Reshape`` back to the operand's shape: a
    variable's gradient gets the same values whether the operand is a scalar or its one-entry
    vector. (A user's ``tf.reshape(t, tf.shape(w))`` is no such read: it takes the view's
    rank, review 15.)"""
    return node.op == "Shape" and _in_gradient_of_alike(ir, node, 0) and all(
        r.op in _GRADIENT_SHAPE_READERS for r, _ in ir.data_consumers(f"{node.name}:0"))


def _readers_alike(ir: IR, ref: str, name: str, depth: int) -> bool:
    """Every reader of ``ref`` (a value that is a scalar, or a one-entry vector under the
    view) gives the same values either way."""
    readers = ir.data_consumers(ref)
    return bool(readers) and all(
        _widens_alike(ir, c, i, name, depth + 1) or _shape_read(ir, c) for c, i in readers)


#: Readers of a shape in a broadcasting op's gradient.
_GRADIENT_SHAPE_READERS = frozenset({"BroadcastGradientArgs", "Reshape"})


#: Calls -> (their function attributes, how many leading inputs are no arguments).
CALLS = {"If": (("then_branch", "else_branch"), 1), "StatelessIf": (("then_branch", "else_branch"), 1),
         "PartitionedCall": (("f",), 0), "StatefulPartitionedCall": (("f",), 0)}


def _widens_alike(ir: IR, node, pos: int, name: str, depth: int = 0) -> bool:
    """``node`` gives the same values of the same shape when its input ``pos`` is a vector of
    one entry instead of a scalar: it broadcasts it against an operand of rank 1 or more, or
    against scalars into ops that all do so in turn (``1 + (pos_weight - 1) * labels``), or
    it is a call whose functions all read that argument so (a dropout's ``keep_prob`` in a
    ``tf.cond`` branch)."""
    if node.op in CALLS:
        return depth < 4 and (_calls_widen_alike(ir, node, pos, depth)
                              or _gradient_of_alike_call(ir, node, pos, depth))
    if node.op == "OptionalFromValue":
        return True     # a branch's value kept for its gradient, whose ops broadcast it alike
    if node.op in ONE_OPERAND:
        return depth < 4 and _readers_alike(ir, f"{node.name}:0", name, depth)
    if node.op not in BROADCASTING:
        return False
    others = [r for i, r in enumerate(node.inputs) if i != pos]
    if any(node_of(r) == name for r in others):
        return False
    ranks = [len(s) if s is not None else None for s in map(ir.static_shape, others)]
    if any(r is not None and r >= 1 for r in ranks):
        return True
    if None in ranks and _in_gradient_of_alike(ir, node, pos):
        return True
    if depth >= 4 or None in ranks:
        return False
    return _readers_alike(ir, f"{node.name}:0", name, depth)


def _forward(ir: IR, node) -> str | None:
    """The forward op whose gradient code holds ``node`` (``.../<op>_grad/...``), if any."""
    parts = node.name.split("/")
    for j in range(1, len(parts) - 1):
        forward = forward_op_of(ir, "/".join(parts[:j]), node.name)
        if forward is not None:
            return forward
    return None


def _gradient_of_alike_call(ir: IR, node, pos: int, depth: int) -> bool:
    """``node`` is the gradient call of a call that reads the same value as its functions
    read it alike (a ``tf.cond`` branch's ``c * p``): the gradient functions are those ops'
    gradients, which multiply it by gradients of the forward ops' output shapes and read its
    shape only to reduce its own gradient, which nothing reads."""
    forward = _forward(ir, node)
    op = ir.nodes.get(forward) if forward else None
    if op is None or op.op not in CALLS or node.inputs[pos] not in op.inputs:
        return False
    return _calls_widen_alike(ir, op, op.inputs.index(node.inputs[pos]), depth)


def _in_gradient_of_alike(ir: IR, node, pos: int) -> bool:
    """``node`` belongs to the gradient code of a forward op that broadcasts the same input
    against an operand of rank 1 or more (``grad * w`` in ``c * w``'s gradient): the operand
    of unknown rank beside it is that op's output gradient, of the op's output shape, so of
    rank 1 or more too."""
    forward = _forward(ir, node)
    op = ir.nodes[forward] if forward else None
    if op is None or op.op not in BROADCASTING or node.inputs[pos] not in op.inputs:
        return False
    return any(r != node.inputs[pos] and (s := ir.static_shape(r)) is not None and len(s) >= 1
               for r in op.inputs)


def _calls_widen_alike(ir: IR, node, pos: int, depth: int) -> bool:
    """Every function ``node`` may call reads its argument at input ``pos`` as
    :func:`_widens_alike` asks (the bodies imported with the call's input shapes)."""
    attrs, skip = CALLS[node.op]
    host = getattr(ir, "tf_graph", None)
    if pos < skip or host is None:
        return False
    shapes = [ir.static_shape(r) for r in node.inputs[skip:]]
    for attr in attrs:
        fdef = ir.function(node.attr(attr)) if node.attr(attr) else None
        if fdef is None or pos - skip >= len(fdef.signature.input_arg):
            return False
        body, args, _ = import_body(host, fdef, shapes, [None] * len(shapes))
        arg = args[pos - skip]
        if not all(_widens_alike(body, c, i, node_of(arg), depth + 1) for c, i in body.data_consumers(arg)):
            return False        # (a branch that does not read it is no obstacle)
    return True


def view_as_vectors(ir: IR, names: list[str]) -> tuple[dict[str, str], Callable[[], None]] | None:
    """Make the broadcasting readers of ``names`` read them as vectors and infer the shapes
    again; return placeholder -> view, and a function that undoes all of it. None, with nothing
    changed, when no placeholder has such readers or the graph does not import so."""
    saved_shapes, saved_graph = dict(ir.static_shapes), ir.tf_graph
    views: dict[str, tuple[str, list[str]]] = {}
    copies: list[tuple[str, str]] = []

    def undo() -> None:
        for copy, original in copies:
            ir.replace_uses(tensor_name(copy), tensor_name(original))
        ir.remove_many([copy for copy, _ in copies])
        for name, (view, added) in views.items():
            ir.replace_uses(tensor_name(view), tensor_name(name))
            ir.remove_many(added)
        ir.static_shapes = saved_shapes
        ir.tf_graph = saved_graph

    for _ in range(8):  # a view gives its readers a rank, which may qualify more: (x - mu) / (mu + 1)
        ready = [(n, r, s) for n in names for r, s in [(_readers(ir, n), _shared_steps(ir, n))] if r or s]
        if not ready:
            break
        for name, readers, steps in ready:
            if name in views:
                ir.replace_uses(tensor_name(name), tensor_name(views[name][0]), only=readers)
            else:
                views[name] = _view(ir, name, readers)
            copies.extend(_copy_for(ir, step, name, views[name][0], alike) for step, alike in steps)
        try:
            graph = registry.import_checked(ir.to_graph_def(), "shapeless inputs read as vectors")
        except InputError:
            undo()
            return None
        ir.load_static_shapes(graph)
        ir.tf_graph = graph
    if not views:
        return None
    return {name: view for name, (view, _) in views.items()}, undo


def _shared_steps(ir: IR, name: str) -> list[tuple[str, list[str]]]:
    """Casts and scalar arithmetic of ``name`` (``w = tf.cast(mask)``) that some readers read
    alike (``xent * w``) and others do not (a count ``tf.reduce_sum(w)``): (the op, the readers
    that may read it of the view). Those readers get a copy of the op that reads the view; the
    others keep reading it of the placeholder, whole in every tower, as before."""
    out = []
    for node, pos in ir.data_consumers(tensor_name(name)):
        if node.op in ONE_OPERAND:
            pass
        elif node.op in BROADCASTING:
            others = [r for i, r in enumerate(node.inputs) if i != pos]
            if any(node_of(r) == name or ir.static_shape(r) != [] for r in others):
                continue
        else:
            continue
        readers = ir.data_consumers(f"{node.name}:0")
        alike = [r.name for r, i in readers if _widens_alike(ir, r, i, name, 1) or _shape_read(ir, r)]
        if alike and len(alike) < len(readers):
            out.append((node.name, list(dict.fromkeys(alike))))
    return out


def _copy_for(ir: IR, step: str, name: str, view: str, readers: list[str]) -> tuple[str, str]:
    """A copy of op ``step`` that reads ``view`` where it read ``name``, for ``readers``."""
    node = ir.nodes[step]
    copy = ir.unique_name(f"{step}/{SUFFIX}_copy")
    inputs = [tensor_name(view) if node_of(r) == name else r for r in node.inputs]
    ir.add_node(Node(copy, node.op, inputs, list(node.control), node.device, dict(node.attrs)))
    ir.replace_uses(f"{step}:0", f"{copy}:0", only=readers)
    return copy, step


def _view(ir: IR, name: str, readers: list[str]) -> tuple[str, list[str]]:
    """Add ``name``'s checked vector view, read by ``readers``: (the view, the nodes added)."""
    node = ir.nodes[name]
    dev, ref = node.device, tensor_name(name)
    view = ir.unique_name(f"{name}/{SUFFIX}")
    i32 = {"T": dtypes.int32}
    rank = ir.add(f"{view}/rank", "Rank", [ref], device=dev, attrs={"T": node.attrs["dtype"]}).name
    ok = ir.add(f"{view}/at_most_one", "LessEqual",
                [rank, ir.const(f"{view}/one", 1, dtypes.int32, dev)], device=dev, attrs=i32).name
    text = (f"replicate: input '{ref}' was declared without a shape and is read as a scalar or a "
            "vector (the analysis proved the rewrite for those); it was fed a value of the rank "
            "that follows: give the placeholder its shape and transform again")
    check = ir.add(f"{view}/check", "Assert",
                   [ok, ir.const(f"{view}/message", text, dtypes.string, dev), rank], device=dev,
                   attrs={"T": [dtypes.string, dtypes.int32], "summarize": 3}).name
    ir.add(view, "Reshape", [ref, ir.const(f"{view}/shape", np.array([-1], np.int32), dtypes.int32,
                                           dev)], [check], device=dev,
           attrs={"T": node.attrs["dtype"], "Tshape": dtypes.int32})
    ir.replace_uses(ref, tensor_name(view), only=readers)
    return view, [f"{view}/rank", f"{view}/one", f"{view}/at_most_one", f"{view}/message",
                  f"{view}/check", f"{view}/shape", view]


def warning(name: str, view: str) -> str:
    """What the report says about a view."""
    return (f"input '{tensor_name(name)}' has no static shape: the ops that broadcast it "
            f"against the batch's tensors read it as a vector ('{view}'; a scalar is one entry), "
            "which proves the rewrite for any scalar or vector fed; a step fed more dimensions "
            f"stops at '{view}/check'; give the placeholder a shape to say otherwise")
