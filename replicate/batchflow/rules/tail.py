"""Rules for tensors whose rows are part batch, part shared: the sampled losses.

``nce_loss`` and ``sampled_softmax_loss`` look the batch's labels and the step's sampled
classes up in one gather: ``concat([labels, sampled])`` has one row per example followed by
``S`` rows that belong to no example, and so has everything gathered by it. Two slices then
take the rows apart again — the head is per example, the tail is shared — and their gradients
(``Pad``) put each part back in place before the gather's gradient (an ``IndexedSlices`` of
the same rows) reaches the optimizer.

With the sampler run once for the whole batch (see :mod:`replicate.passes._evict`), tower
``k`` computes exactly the single-device rows of its own examples, and its gradient with
respect to the shared rows is its share of the single-device gradient: the aggregate takes
every tower's batch rows in order and then the shared rows once, summed over the towers
(:func:`replicate.passes._combine.combine`), the single-device rows in the single-device order. The fact for such a tensor is a partitioned
fact with a ``tail`` (:mod:`replicate.batchflow.lattice`). These rules are the only ones that
accept it: every other op makes the result mixed, so a reduction over all rows, a merge or a
branch can never treat the shared rows as examples.

Two obligations go to the rewrite plan, because the single-device graph folded the row count
``B + S`` into constants: a ``Reshape`` that keeps the rows gets ``-1`` for them
(``row_shapes``), and a slice's gradient ``Pad`` gets paddings computed from the tower's own
forward slice (``slice_pads``).
"""

from __future__ import annotations

import numpy as np

from replicate.batchflow import table
from replicate.batchflow.context import Context
from replicate.batchflow.lattice import PART, RED, SHARED, Fact, Sym
from replicate.batchflow.rules.common import forward_of, mixed, red, rows, shared, taint_of
from replicate.graph.ir import Node, node_of

__all__ = ["carries", "apply", "concat", "slice_grad"]

SHARED_ROWS = "shared"
GRAD_ROWS = "grad"


def carries(f: Fact | None) -> bool:
    """True for a partitioned fact with shared rows after its batch rows."""
    return f is not None and f.kind == PART and f.tail is not None


def _no_rule(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    return [mixed(node.name, f"{node.op} of rows that are part batch, part shared (the sampled "
                  "classes of a sampled loss)", taint_of(ins))] * ctx.n_outputs(node)


def concat(ctx: Context, node: Node, refs: list[str], ins: list[Fact], axis: int) -> Fact | None:
    """``concat([batch rows, shared rows...])`` along the batch axis: the batch first, one row
    per example, then shared tensors of static length. None when it is not that shape."""
    head, rest = ins[0], ins[1:]
    if head.kind != PART or head.tail or head.axis != axis or head.outer != 1 or not rest:
        return None
    count, kind = 0, SHARED_ROWS
    for ref, f in zip(refs[1:], rest):
        shape = ctx.shape(ref)
        if shape is None or len(shape) <= axis or shape[axis] is None:
            return None
        if f.kind == RED and f.merge == "sum" and ctx.in_gradient(node):
            kind = GRAD_ROWS        # gradient rows of shared ids: each tower's share
        elif f.kind != SHARED:
            return None
        count += shape[axis]
    return head.with_(tail=(count, kind), value=None, index=None, taint=taint_of(ins))


def _concat(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    """Batch rows, then rows with a tail (two sparse gradients of one table joined, as
    ``tf.gradients`` joins a lookup's and a sampled loss's): the batch rows of both come
    first, out of single-device order, and the shared rows stay last."""
    n = int(node.attr("N", len(node.inputs) - 1))
    refs, facts = (node.inputs[1:n + 1], ins[1:n + 1]) if node.op == "Concat" else (node.inputs[:n], ins[:n])
    last = facts[-1]
    axis = ctx.axes(node.inputs[0] if node.op == "Concat" else node.inputs[n], ctx.rank(refs[-1]))
    if not carries(last) or axis is None or axis[0] != last.axis or len(facts) < 2 or any(
            f.kind != PART or f.tail or f.axis != last.axis for f in facts[:-1]):
        return _no_rule(ctx, node, ins)
    cls = ctx.classes.compose([f.cls for f in facts])
    return [last.with_(cls=cls, block=None, ordered=False, value=None, index=None, taint=taint_of(ins))]


def _segment_sum(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    """``UnsortedSegmentSum`` of gradient rows by their ids (an ``IndexedSlices`` made dense
    to be added to a dense gradient): each tower's dense share of the gradient."""
    data, ids = ins[0], ins[1]
    if not carries(data) or data.tail[1] != GRAD_ROWS or not carries(ids) or ids.tail[0] != data.tail[0] \
            or ins[2].kind != SHARED or not ctx.in_gradient(node):
        return _no_rule(ctx, node, ins)
    return [red(data.cls, "sum", node.name, taint=taint_of(ins))]


def _same(fact: Fact) -> list[Fact]:
    return [fact.with_(value=None, index=None)]


def _passthrough(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    if node.op == "IdentityN":
        return [f.with_(value=None, index=None) for f in ins]
    return _same(ins[0])


#: Elementwise ops linear in one operand (position; None: either), with the other operands
#: as factors: a tower's share of a gradient times a shared factor is its share of the product.
_LINEAR_IN = {"Neg": 0, "Cast": 0, "Mul": None, "MulNoNan": None, "RealDiv": 0, "Div": 0,
              "DivNoNan": 0, "TanhGrad": 1, "SigmoidGrad": 1, "RsqrtGrad": 1, "SqrtGrad": 1,
              "ReciprocalGrad": 1, "InvGrad": 1, "ReluGrad": 0, "Relu6Grad": 0, "EluGrad": 0,
              "SeluGrad": 0, "SoftplusGrad": 0, "SoftsignGrad": 0, "LeakyReluGrad": 0}
_ADDITIVE = frozenset({"Add", "AddV2", "AddN", "Sub", "AccumulateNV2"})


def _elementwise(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    """An elementwise op of tensors with the same rows (the shared rows stay shared: any
    function of them is the same in every tower) and shared operands broadcast along the
    other dimensions. Each tower's share of a gradient (``grad`` rows) may only be added to
    other shares, or scaled by factors: anything else would not add up across towers."""
    carried = [f for f in ins if carries(f)]
    first = carried[0]
    shape = ctx.shape(f"{node.name}:0")
    for ref, f in zip(node.inputs, ins):
        if carries(f):
            if f.axis != first.axis or f.tail[0] != first.tail[0] or not ctx.classes.same(f.cls, first.cls) \
                    or not _compatible(ctx.shape(ref), shape):
                return _no_rule(ctx, node, ins)
        elif f.kind != SHARED or not _broadcasts_beside(ctx, ref, shape, first.axis):
            return _no_rule(ctx, node, ins)
    grads = [i for i, f in enumerate(ins) if carries(f) and f.tail[1] == GRAD_ROWS]
    if not grads:
        kind = SHARED_ROWS
    elif node.op in _ADDITIVE and len(grads) == len(ins):
        kind = GRAD_ROWS                                # shares added to shares
    elif node.op in _LINEAR_IN and len(grads) == 1 and _LINEAR_IN[node.op] in (None, grads[0]):
        kind = GRAD_ROWS                                # a share times shared factors
    else:
        return _no_rule(ctx, node, ins)
    return [first.with_(tail=(first.tail[0], kind), value=None, index=None, taint=taint_of(ins))]


def _compatible(a: list | None, b: list | None) -> bool:
    """Same rank and no two known dimensions that differ."""
    return a is not None and b is not None and len(a) == len(b) and all(
        x is None or y is None or x == y for x, y in zip(a, b))


def _broadcasts_beside(ctx: Context, ref: str, shape: list | None, axis: int) -> bool:
    """True when shared operand ``ref`` broadcasts without a dimension along ``axis``."""
    mine = ctx.shape(ref)
    if mine is None or shape is None:
        return False
    dim = axis - (len(shape) - len(mine))
    return dim < 0 or mine[dim] == 1


def _gather(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    """Rows of a shared table picked by ids that are part batch, part shared."""
    params, ids = ins[0], ins[1]
    axis = 0
    if node.op == "GatherV2":
        found = ctx.axes(node.inputs[2], ctx.rank(node.inputs[0]))
        axis = found[0] if found else None
    if params.kind != SHARED or carries(params) or not carries(ids) or axis != 0 \
            or int(node.attr("batch_dims", 0) or 0):
        return _no_rule(ctx, node, ins)
    return [ids.with_(value=None, index=None, taint=taint_of(ins))]


def _batch_rows(ctx: Context, f: Fact, v) -> bool:
    """True when symbolic element ``v`` is the tower's row count of ``f``'s batch rows."""
    return isinstance(v, Sym) and v.coef == rows(f) and ctx.classes.same(v.cls, f.cls)


def _static_rows(ctx: Context, f: Fact, v) -> bool:
    """True when integer ``v`` is the single-device row count of ``f``'s batch rows (a
    position the rewrite makes the tower's)."""
    static, per = ctx.static_batch(f.cls), rows(f)
    return static is not None and per is not None and isinstance(v, int) and v == static * per


def _refine(ctx: Context, node: Node, f: Fact, begin: tuple, size: tuple, count: int | None) -> None:
    """The static shape of a slice that keeps every other dimension whole (inference gives up
    when the bounds are computed at run time)."""
    dims = ctx.shape(node.inputs[0])
    if dims is None or len(begin) != len(dims) or len(size) != len(dims):
        return
    out = [count if i == f.axis else (d if begin[i] == 0 and size[i] == -1 else None)
           for i, d in enumerate(dims)]
    ctx.refine(f"{node.name}:0", out)


def _slice(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    """The head (the examples' rows) or the tail (the shared rows), as the sampled losses cut."""
    f = ins[0]
    if not carries(f) or carries(ins[1]) or carries(ins[2]):
        return _no_rule(ctx, node, ins)
    begin, size = ctx.int_value(node.inputs[1]), ctx.int_value(node.inputs[2])
    if begin is None or size is None or f.axis >= len(begin) or f.axis >= len(size):
        return [mixed(node.name, "Slice of rows that are part batch, part shared by bounds known "
                      "only at run time", f.taint)]
    b, s = begin[f.axis], size[f.axis]
    taint = taint_of(ins)
    if b == 0 and (_batch_rows(ctx, f, s) or _static_rows(ctx, f, s)):
        if not _batch_rows(ctx, f, s):
            ctx.position(node.inputs[2], f.axis, f.cls, rows(f), node)
        _refine(ctx, node, f, begin, size, None)
        return [f.with_(tail=None, value=None, index=None, taint=taint)]
    count = f.tail[0]
    if (_batch_rows(ctx, f, b) or _static_rows(ctx, f, b)) and s in (-1, count):
        if f.tail[1] != SHARED_ROWS:
            return _no_rule(ctx, node, ins)
        if not _batch_rows(ctx, f, b):
            ctx.position(node.inputs[1], f.axis, f.cls, rows(f), node)
        _refine(ctx, node, f, begin, size, count)
        return [shared(taint=taint)]
    return [mixed(node.name, "Slice that mixes the batch rows and the shared rows of a sampled "
                  "loss", f.taint)]


def _reshape(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    """A reshape that keeps every row (``[B + S, 1, d] -> [B + S, d]``, the gather's gradient):
    the rewrite gives it ``-1`` for the row count the single-device graph may have folded."""
    f = ins[0]
    if not carries(f) or f.axis != 0 or carries(ins[1]):
        return _no_rule(ctx, node, ins)
    in_dims, out_dims = ctx.shape(node.inputs[0]), ctx.shape(f"{node.name}:0")
    if in_dims is None or out_dims is None or not out_dims or None in in_dims[1:] \
            or None in out_dims[1:] or int(np.prod(in_dims[1:])) != int(np.prod(out_dims[1:])):
        return [mixed(node.name, "Reshape of rows that are part batch, part shared into another "
                      "row layout", f.taint)]
    ctx.row_shapes[node.name] = tuple(int(d) for d in out_dims[1:])
    return _same(f)


def _shape(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    return [mixed(node.name, "the row count of rows that are part batch, part shared (B + S)",
                  taint_of(ins))] * ctx.n_outputs(node)


def slice_grad(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact] | None:
    """The gradient of a tail-aware slice (``Pad`` of the slice's gradient by its bounds): the
    gradient with respect to the rows that are part batch, part shared. None when ``node`` is
    not such a gradient."""
    if node.op != "Pad":
        return None
    forward = _forward_slice(ctx, node)
    if forward is None:
        return None
    whole, cut = ctx.fact(forward.inputs[0]), ctx.fact(f"{forward.name}:0")
    g = ins[0]
    if not carries(whole) or cut is None or not _compatible(ctx.shape(node.inputs[0]),
                                                            ctx.shape(f"{forward.name}:0")):
        return None
    if cut.kind == PART and not cut.tail and g.kind == PART and not g.tail and g.axis == whole.axis \
            and ctx.classes.same(g.cls, whole.cls):
        pass                                        # the head's gradient, zeros below it
    elif cut.kind == SHARED and g.kind in (SHARED, RED):
        pass                                        # the shared rows' gradient, zeros above it
    else:
        return None
    ctx.slice_pads[node.name] = forward.name
    return [whole.with_(tail=(whole.tail[0], GRAD_ROWS), value=None, index=None,
                        taint=taint_of(ins))]


def _forward_slice(ctx: Context, node: Node) -> Node | None:
    """The forward ``Slice`` whose gradient ``node`` is (``.../<slice>_grad/Pad``), checked by
    structure: the paddings are computed from the slice's own begin operand."""
    found = forward_of(ctx, node, ("Slice",))
    if found is not None and _reads(ctx, node.inputs[1], node_of(found.inputs[1])):
        return found
    return None


def _reads(ctx: Context, ref: str, target: str, depth: int = 6) -> bool:
    """True when ``ref`` is computed from node ``target`` within ``depth`` ops."""
    work, seen = [(node_of(ref), 0)], set()
    while work:
        name, d = work.pop()
        if name == target:
            return True
        if name in seen or d >= depth or name not in ctx.ir.nodes:
            continue
        seen.add(name)
        work.extend((node_of(r), d + 1) for r in ctx.ir.nodes[name].inputs)
    return False


RULES = {
    **{op: _passthrough for op in table.PASS_THROUGH},
    **{op: _elementwise for op in (table.UNARY | table.BROADCAST | table.SAME_SHAPE)
       - {"ZerosLike", "OnesLike", "BiasAdd", "BiasAddV1"}},
    "Gather": _gather, "GatherV2": _gather, "ResourceGather": _gather,
    "Slice": _slice, "Reshape": _reshape, "ConcatV2": _concat, "Concat": _concat,
    "UnsortedSegmentSum": _segment_sum,
    "Shape": _shape, "ShapeN": _shape, "Size": _shape,
}


def apply(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    """The outputs of ``node``, one of whose inputs has shared rows after its batch rows."""
    rule = RULES.get(node.op, _no_rule)
    return list(rule(ctx, node, ins))
