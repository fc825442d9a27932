"""Rules for elementwise ops (unary and broadcasting) and matrix products.

Broadcasting aligns operands by their trailing dimensions. A partitioned operand makes the
output partitioned on the aligned axis; a shared operand whose aligned dimension is not 1
must then be tower-sized (a *demand*); a batch-reduced operand couples the result (each tower
would use its own slice's statistic). Batch-reduced values and batch sizes among the operands
follow :mod:`reduced`.
"""

from __future__ import annotations

from replicate.batchflow.context import Context
from replicate.batchflow.lattice import EMPTY_LIST, LIST, PART, RED, SHARED, Fact, join
from replicate.batchflow.rules.common import (
    combine_parts,
    couple,
    first_mixed,
    mixed,
    numbered,
    parts,
    red,
    reds,
    row_numbers,
    shared,
    size_fact,
    taint_of,
)
from replicate.graph.ir import Node

__all__ = ["unary", "broadcast", "select", "matmul", "batch_matmul", "arith"]

from replicate.batchflow import table as _table  # noqa: E402
from replicate.batchflow.rules import strided as _strided  # noqa: E402
from replicate.batchflow.rules.reduced import (  # noqa: E402
    arith, counted, reduced_algebra, sizes_synchronized)

UNARY_OR_BROADCAST = _table.UNARY | _table.BROADCAST | _table.SAME_SHAPE | {"Select", "SelectV2"}

_LINEAR_UNARY = {"Identity", "Cast", "Neg", "Snapshot", "StopGradient"}
_VALUE_UNARY = {"Cast", "Identity", "Snapshot", "StopGradient"}


def unary(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    f = ins[0]
    if node.op in ("ZerosLike", "OnesLike"):
        if f.kind == PART:
            return [f.with_(taint=frozenset(), value=None, index=None, ordered=True)]
        return [shared()] if f.kind != "mixed" else [f]
    if f.kind == "mixed":
        return [f if node.op in _VALUE_UNARY or f.handle == "unique" else f.with_(handle=None)]
    if f.kind == PART:
        keep = node.op in _VALUE_UNARY
        if not keep and row_numbers(f):
            return [numbered(node, f.taint)]
        return [f.with_(value=f.value if keep else None, index=f.index if keep else None)]
    if f.kind == RED:
        if node.op in _LINEAR_UNARY:
            merge = {"max": "min", "min": "max"}.get(f.merge, f.merge) if node.op == "Neg" else f.merge
            return [f.with_(merge=merge)]
        synced = sizes_synchronized(ctx, node.inputs[:1], ins)
        if synced is not None:          # sqrt(B): of the batch's B, which every tower reads
            return [shared(None, synced[0].taint)]
        return [f.with_(merge="other", why=f"'{node.name}': {node.op} of a batch-reduced value")]
    return [shared(f.value if node.op in _VALUE_UNARY else None, f.taint)]


def _plus_zero(ctx: Context, node: Node, ins: list[Fact]) -> Fact | None:
    """The fact of ``x`` for ``0.0 + x`` and ``x - 0.0`` with a scalar zero (the ``loss = 0.0;
    loss += term`` habit: the sum was taken for another value, and a batch mean over it
    reported inexact, review 30), else None."""
    if node.op not in ("Add", "AddV2", "Sub") or len(ins) != 2:
        return None
    for zero, other in ((1, 0), (0, 1)) if node.op != "Sub" else ((1, 0),):
        value = ctx.const(node.inputs[zero])
        if value is not None and value.ndim == 0 and value == 0 and ins[zero].kind == SHARED:
            return ins[other]
    return None


def _bias_rank_offset(ctx: Context, node: Node, out_rank: int, pos: int, rank: int) -> int:
    """Where operand ``pos`` of rank ``rank`` starts in the output's dimensions."""
    if node.op in ("BiasAdd", "BiasAddV1") and pos == 1 and node.attr("data_format", "NHWC").startswith("NC"):
        return 1
    return out_rank - rank


def _lists(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    """``AddN`` of TensorLists (a gradient loop accumulating the gradients of list elements):
    elementwise sums of the elements, per example when every list's elements are per example
    or shared."""
    known = [f for f in ins if f is not None and f.handle != EMPTY_LIST]
    if all(f.kind in (SHARED, PART) for f in known):
        out = join(known, ctx.classes)
        return [out if out is not None else ins[0]]
    bad = first_mixed(known)
    return [bad if bad is not None else
            mixed(node.name, f"{node.op} of lists whose elements are reduced over the batch",
                  taint_of(ins))]


def broadcast(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    refs = node.inputs[:len(ins)]
    if any(f is not None and f.handle in (LIST, EMPTY_LIST) for f in ins):
        return _lists(ctx, node, ins)
    bad = first_mixed(ins)
    if bad is not None:
        keep = bad.handle == "unique" and all(f.kind in (SHARED, "mixed") for f in ins)
        return [bad.with_(handle="unique") if keep else bad]
    kept = _plus_zero(ctx, node, ins)
    if kept is not None:
        return [kept]
    ps = parts(ins)
    if any(row_numbers(f) for f in ps):
        tag = _strided.arithmetic(ctx, node, ins)
        if tag is None:
            return [numbered(node, taint_of(ins))]
        out = broadcast(ctx, node, [f.with_(index=None) if row_numbers(f) else f for f in ins])
        return [f.with_(index=tag) if f.kind == PART else numbered(node, taint_of(ins)) for f in out]
    if ps and counted(ctx, node, ins):
        synced = sizes_synchronized(ctx, refs, ins)
        if synced is not None:          # (``loss / B`` before the sum)
            return broadcast(ctx, node, synced)
        return [mixed(node.name, "the batch size used as a value in per-example arithmetic: each "
                      "tower reads its own count", taint_of(ins))]
    if not ps:
        synced = sizes_synchronized(ctx, refs, ins) if reds(ins) else None
        if synced is not None:
            # ``n > 4``, ``B % 2``, ``min(B, 5)``, ``B - 1``: each tower reads the batch's B,
            # a value only (review 48 L1: a cond on it was inexact, 0.17-0.56 off; review 50
            # F2: a state update that wrote ``B - 1`` ran as tower 0's count)
            return broadcast(ctx, node, synced)
        if reds(ins):
            out = reduced_algebra(ctx, node, refs, ins)
            mixes = sizes_synchronized(ctx, refs, ins, others=True) if out.merge == "other" else None
            if mixes is not None:
                # a batch size beside another reduction (``B * mean(x)``, ``B + sum``): the
                # batch's B, and what the other one is (review 50 F3: refused even under sync)
                return [reduced_algebra(ctx, node, refs, mixes)]
            return [out]
        values = [f.value for f in ins]
        value = arith(node.op, values) if all(v is not None for v in values) else None
        return [size_fact(value, taint_of(ins)) if value is not None else shared(None, taint_of(ins))]
    if any(f.kind == SHARED and ctx.rank(ref) is None for ref, f in zip(refs, ins)):
        # a shared operand of unknown rank may line up with the batch (a mask fed one value
        # per example): nothing proves it does not, whatever the output's rank (v1 Select's
        # is its values', review 15)
        return [mixed(node.name, ctx.unknown_rank(node), taint_of(ins))]
    out_rank = ctx.rank(f"{node.name}:0")
    if out_rank is None:
        out_rank = _bounded_rank(ctx, node, refs)
        if out_rank is None:
            return [mixed(node.name, ctx.unknown_rank(node), taint_of(ins))]
        ctx.refine(f"{node.name}:0", [None] * out_rank)
    placed: list[tuple[int, Fact]] = []
    out_shape = ctx.shape(f"{node.name}:0") or [None] * out_rank
    for pos, (ref, f) in enumerate(zip(refs, ins)):
        if f.kind == PART:
            rank = ctx.rank(ref)
            if rank is None:
                return [mixed(node.name, ctx.unknown_rank(node), taint_of(ins))]
            axis = f.axis + _bias_rank_offset(ctx, node, out_rank, pos, rank)
            if len(out_shape) != out_rank:
                out_shape = [None] * out_rank
            if ctx.shape(ref)[f.axis] == 1 and out_shape[axis] != 1:
                others = [g for g in ps if g is not f]
                if others:
                    ctx.classes.conflicts.append((others[0].cls, f.cls, node.name, "broadcast"))
                return [mixed(node.name, "broadcasts one example against many", taint_of(ins))]
            placed.append((axis, f))
    axes = {a for a, _ in placed}
    if len(axes) > 1:
        placed.sort(key=lambda item: item[0])
        ctx.classes.conflicts.append((placed[0][1].cls, placed[-1][1].cls, node.name, "two batch axes"))
        return [mixed(node.name, "combines examples of two batch axes", taint_of(ins))]
    axis = axes.pop()
    out = combine_parts(ctx, node, ps, axis)
    for pos, (ref, f) in enumerate(zip(refs, ins)):
        if f.kind == PART:
            continue
        rank = ctx.rank(ref)
        if rank is None:
            continue
        dim = axis - _bias_rank_offset(ctx, node, out_rank, pos, rank)
        if 0 <= dim < rank and ctx.shape(ref)[dim] != 1:
            ctx.demand(ref, dim, out, node)     # shared, or a batch reduction tiled back
    return [out.with_(taint=couple(ctx, node, ins))]


#: Ops whose data inputs must have exactly this rank (a bound for an elementwise producer).
_RANK_OF_INPUTS = {"MatMul": 2, "Conv2D": 4, "MaxPool": 4, "AvgPool": 4, "Conv3D": 5,
                   "SoftmaxCrossEntropyWithLogits": 2, "DepthwiseConv2dNative": 4}


def _upper_rank(ctx: Context, ref: str, depth: int = 0) -> int | None:
    """An upper bound of the rank of ``ref`` from what reads it: an elementwise consumer's
    output has at least its inputs' rank; a matrix product wants rank 2."""
    if depth > 6:
        return None
    best = None
    name = ref.split(":")[0]
    for consumer in ctx.ir.consumers(name):
        bound = _RANK_OF_INPUTS.get(consumer.op)
        if bound is None and (consumer.op in UNARY_OR_BROADCAST):
            out = f"{consumer.name}:0"
            bound = ctx.rank(out)
            if bound is None:
                bound = _upper_rank(ctx, out, depth + 1)
        if bound is not None:
            best = bound if best is None else min(best, bound)
    return best


def _bounded_rank(ctx: Context, node: Node, refs: list[str]) -> int | None:
    """The output rank of a broadcast whose static rank is unknown (a reduced operand of
    unknown rank; a shared one of unknown rank is a reason before this is asked, since it may
    line up with the batch): at least every known operand's rank, at most what its readers
    accept; known when the two meet."""
    known = [ctx.rank(r) for r in refs if ctx.rank(r) is not None]
    if not known:
        return None
    lower = max(known)
    if len(known) == len(refs):
        return lower            # a broadcast has the largest rank of its operands
    upper = _upper_rank(ctx, f"{node.name}:0")
    return lower if upper == lower else None


def select(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    """``Select``: a rank-1 condition picks whole rows of higher-rank operands (axis 0)."""
    cond_rank, val_rank = ctx.rank(node.inputs[0]), ctx.rank(node.inputs[1])
    if cond_rank == 1 and val_rank is not None and val_rank > 1:
        cond = ins[0]
        values = ins[1:]
        bad = first_mixed(ins)
        if bad is not None:
            return [bad]
        ps = parts(values)
        if cond.kind == PART and cond.axis != 0:
            return [mixed(node.name, "a condition on a non-batch axis", taint_of(ins))]
        if cond.kind == PART:
            ps = ps + [cond.with_(axis=0)]
        if not ps:
            return [shared(taint=taint_of(ins)) if not reds(ins) else
                    red(None, "other", node.name, taint=taint_of(ins)).with_(why="Select of reduced values")]
        if any(f.axis != ps[0].axis for f in ps):
            return [mixed(node.name, "combines examples of two batch axes", taint_of(ins))]
        out = combine_parts(ctx, node, ps, ps[0].axis)
        for ref, f in zip(node.inputs, ins):
            if f.kind == SHARED and out.axis == 0 and (ctx.shape(ref) or [1])[0] != 1:
                ctx.demand(ref, 0, out, node)
        return [out.with_(taint=couple(ctx, node, ins))]
    return broadcast(ctx, node, ins)


def _mm_dims(transpose: bool) -> tuple[int, int]:
    """(free axis, contracted axis) of the left operand; (contracted, free) of the right one."""
    return (1, 0) if transpose else (0, 1)


def matmul(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    a, b = ins[0], ins[1]
    bad = first_mixed(ins)
    if bad is not None:
        return [bad]
    ta = bool(node.attr("transpose_a", False) or node.attr("adj_x", False))
    tb = bool(node.attr("transpose_b", False) or node.attr("adj_y", False))
    a_free, a_k = _mm_dims(ta)
    b_k, b_free = _mm_dims(tb)   # b is [k, n]: the same pair read the other way
    taint = couple(ctx, node, ins)
    if a.kind != PART and b.kind != PART:
        if RED in (a.kind, b.kind):
            lin = [f for f in ins if f.kind == RED]
            if len(lin) == 1 and lin[0].merge in ("sum", "mean", "ratio"):
                return [lin[0].with_(taint=taint)]
            return [red(lin[0].cls, "other", lin[0].src, taint=taint).with_(
                why=f"'{node.name}': MatMul of reduced values")]
        return [shared(taint=taint)]
    if a.kind == PART and b.kind == PART:
        if a.axis == a_k and b.axis == b_k:
            ctx.classes.union(a.cls, b.cls, node.name)
            return [red(a.cls, "sum", node.name, taint=taint)]
        if not ctx.classes.same(a.cls, b.cls):
            ctx.classes.conflicts.append((a.cls, b.cls, node.name, "matrix product"))
        return [mixed(node.name, "a matrix product that mixes examples of its two operands", taint)]
    p, other_ref, other = (a, node.inputs[1], b) if a.kind == PART else (b, node.inputs[0], a)
    free, k = (a_free, a_k) if a.kind == PART else (b_free, b_k)
    other_k = b_k if a.kind == PART else a_k
    if p.axis == free:
        return [p.with_(axis=0 if a.kind == PART else 1, value=None, index=None, taint=taint)]
    if p.axis == k:
        if other.kind == SHARED:
            ctx.demand(other_ref, other_k, p, node)
            return [red(p.cls, "sum", node.name, taint=taint)]
        return [mixed(node.name, "contracts the batch against a batch-reduced value", taint)]
    return [mixed(node.name, "MatMul of a tensor with the batch on an unexpected axis", taint)]


def batch_matmul(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    """``BatchMatMul``: leading dimensions broadcast elementwise, the last two multiply."""
    ranks = [ctx.rank(r) for r in node.inputs[:2]]
    out_rank = ctx.rank(f"{node.name}:0")
    if None in ranks or out_rank is None:
        return [mixed(node.name, ctx.unknown_rank(node), taint_of(ins))] if any(
            f.dependent for f in ins) else [shared()]
    leading = [f for f, r in zip(ins, ranks) if f.kind == PART and f.axis < r - 2]
    if not leading:
        trailing = [f.with_(axis=f.axis - (r - 2)) if f.kind == PART else f for f, r in zip(ins, ranks)]
        out = matmul(ctx, node, trailing)[0]
        if out.kind == PART:
            return [out.with_(axis=out.axis + out_rank - 2)]
        return [out]
    fake = [f if f.kind != PART or f.axis < r - 2 else f.with_(kind=SHARED) for f, r in zip(ins, ranks)]
    if any(f.kind == PART and f.axis >= r - 2 for f, r in zip(ins, ranks)):
        return [mixed(node.name, "BatchMatMul with the batch on a matrix axis of one operand", taint_of(ins))]
    return broadcast(ctx, node, fake)
