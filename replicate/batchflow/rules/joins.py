"""Rules for ops that join or cut tensors along an axis: ``ConcatV2``, ``Pack``, ``Unpack``,
``Split``, ``SplitV``.

Joining tensors along the batch axis makes copies of the batch one after the other (each tower
holds its rows of every copy) or a batch of several classes; along another axis it keeps the
batch. Stacking each example's own row number beside other indices makes index tuples whose
column names the example. Cutting along the batch axis mixes examples; cutting a shape vector
keeps each piece's symbolic value.
"""

from __future__ import annotations

import math

from replicate.batchflow.context import Context
from replicate.batchflow.lattice import PART, RED, SHARED, Fact
from replicate.batchflow.rules import tail
from replicate.batchflow.rules.common import (
    combine_parts,
    couple,
    first_mixed,
    mixed,
    part,
    shared,
    size_fact,
    taint_of,
    unless_partitioned,
)
from replicate.batchflow.rules.layout import value_pieces
from replicate.batchflow.rules.strided import EXAMPLE
from replicate.graph.ir import Node

__all__ = ["concat", "pack", "unpack", "split", "STACKED"]


def _join_along(ctx: Context, node: Node, refs: list[str], ins: list[Fact], axis: int | None,
                out_shift: int) -> Fact:
    """Concatenate or stack ``ins`` along ``axis`` (input coordinates)."""
    bad = first_mixed(ins)
    if bad is not None:
        return bad
    ps = [f for f in ins if f.kind == PART]
    taint = couple(ctx, node, ins)
    if not ps:
        if any(f.kind == RED for f in ins):
            # the first reduced operand's fact: a shared first operand (the zero padding
            # before a slice's bounds, ``concat([begin], shape - begin - size)``) made the
            # whole shared, a global value the rewrite then cut into the towers' rows
            first = next(f for f in ins if f.kind == RED)
            merges = {f.merge for f in ins if f.kind == RED}
            if merges == {"size"} or (all(f.kind == RED for f in ins) and len(merges) == 1):
                values = [f.value for f in ins]
                if all(v is not None for v in values) and merges == {"size"}:
                    return size_fact(tuple(x for v in values for x in v), taint)
                return first.with_(value=None, taint=taint) if merges != {"size"} else \
                    first.with_(value=None, merge="other", taint=taint)
            # named by the reduction it holds, which can be synchronized (a Pack of [1, max]
            # named itself, and the sync pass could not synchronize a Pack)
            return first.with_(merge="other", value=None, taint=taint,
                               why=f"{node.op} of reduced and shared values")
        values = [f.value for f in ins]
        value = tuple(x for v in values for x in v) if all(v is not None for v in values) else None
        return shared(value, taint)
    axes = {f.axis for f in ps}
    if len(axes) > 1:
        return mixed(node.name, f"{node.op} of tensors with the batch on different axes", taint)
    batch_axis = axes.pop()
    if axis is None:
        return mixed(node.name, f"{node.op} along an axis known only at run time", taint)
    if batch_axis == axis and node.op not in ("Pack",):
        if any(f.kind != PART for f in ins):
            rows_after = tail.concat(ctx, node, refs, ins, axis)
            if rows_after is not None:
                return rows_after
            return mixed(node.name, f"{node.op} adds shared rows to the batch", taint)
        if len(ps) == 1:
            return ps[0].with_(taint=taint)
        stacked = _stacked_copies(ctx, ps)
        if stacked is not None:
            return stacked.with_(taint=taint)
        cls = ctx.classes.compose([f.cls for f in ps])
        return part(axis, cls, None, ordered=False, filtered=any(f.filtered for f in ps), taint=taint)
    out = combine_parts(ctx, node, ps, batch_axis + (out_shift if axis <= batch_axis else 0))
    first = ins[0]
    if not out_shift and axis == 1 and first.kind == PART and first.index is not None \
            and first.index[0] == "rows" and ctx.rank(refs[0]) == 2:
        out = out.with_(index=("cols", 0) + first.index[1:])   # [rows, ...] coordinates
    for ref, f in zip(refs, ins):
        if f.kind == SHARED:
            ctx.demand(ref, batch_axis, out, node)
    return out.with_(taint=taint)


def _stacked_copies(ctx: Context, ps: list[Fact]) -> Fact | None:
    """Copies of one batch joined along its axis (``concat(split(q, heads, 2), 0)``, a batch
    and its augmented copy): tower ``k`` holds its own rows of each copy, one copy after the
    other, as a time-major merge does, so the copies are the fact's ``outer`` blocks."""
    first = ps[0]
    if any(not ctx.classes.same(f.cls, first.cls) or f.block != first.block
           or not isinstance(f.block, int) or not isinstance(f.outer, int) or f.filtered
           or f.tail or not f.ordered for f in ps):
        return None
    return first.with_(outer=sum(f.outer for f in ps), value=None, index=None)


def concat(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    n = int(node.attr("N", len(node.inputs) - 1))
    if node.op == "Concat":
        axis_ref, refs, facts = node.inputs[0], node.inputs[1:n + 1], ins[1:n + 1]
    else:
        axis_ref, refs, facts = node.inputs[n], node.inputs[:n], ins[:n]
    rank = next((ctx.rank(r) for r in refs if ctx.rank(r) is not None), None)
    axis = ctx.axes(axis_ref, rank)
    return [_join_along(ctx, node, refs, facts, axis[0] if axis else None, 0)]


def pack(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    rank = next((ctx.rank(r) for r in node.inputs if ctx.rank(r) is not None), None)
    axis = int(node.attr("axis", 0))
    if axis < 0 and rank is not None:
        axis += rank + 1
    if rank == 0 and all(f.kind != PART for f in ins):
        values = [f.value for f in ins]
        if all(v is not None and len(v) == 1 for v in values):
            return [size_fact(tuple(v[0] for v in values), taint_of(ins))]
    out = _join_along(ctx, node, node.inputs, ins, axis, 1)
    if out.kind == PART:
        index = _pack_index(ins, axis, rank)
        return [out.with_(index=index)]
    return [out]


def _pack_index(ins: list[Fact], axis: int, rank: int | None) -> tuple | None:
    """Stacking row numbers with other indices along the last axis makes index tuples whose
    column ``c`` holds local rows (for ``GatherNd``); so does stacking each entry's example
    number (``tf.tile(tf.range(B)[:, None], [1, k])``: feature columns' and a pointer
    network's indices), one row per example. Stacked along axis 0 instead (``[2, N]``), the
    tuples are the transpose's columns (``STACKED``)."""
    for c, f in enumerate(ins):
        if f.kind != PART or f.index is None:
            continue
        if f.index[0] == "rows":
            found = f.index[1:]
        elif f.index[0] == EXAMPLE and f.index[2] == 1:
            found = (f.index[1], 1)
        else:
            continue
        if rank is not None and axis == rank:
            return ("cols", c) + found
        if rank == 1 and axis == 0:
            return (STACKED, c) + found
    return None


#: Index tag of row numbers stacked as row ``c`` of a ``[k, N]`` tensor: ``(STACKED, c, cls,
#: per)``; transposed to ``[N, k]``, column ``c`` (``("cols", c, cls, per)``).
STACKED = "stacked"


def unpack(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    n = ctx.n_outputs(node)
    if ins[0].kind != PART and ins[0].value is not None and len(ins[0].value) == n \
            and (ctx.rank(node.inputs[0]) or 0) == 1:      # a shape vector's elements, each kept
        return [size_fact((v,), ins[0].taint) for v in ins[0].value]
    out = unless_partitioned(ctx, node, ins, n)
    if out is not None:
        return out
    f = ins[0]
    rank = ctx.rank(node.inputs[0]) or 1
    axis = int(node.attr("axis", 0))
    axis = axis + rank if axis < 0 else axis
    if axis == f.axis:
        return [mixed(node.name, "Unpack along the batch gives one tensor per example", f.taint)] * n
    return [f.with_(axis=f.axis - (axis < f.axis), value=None)] * n


def split(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    n = ctx.n_outputs(node)
    data, axis_ref = (1, node.inputs[0]) if node.op == "Split" else (0, node.inputs[2])
    f = ins[data]
    pieces = value_pieces(ctx, node, f, n)
    if pieces is not None:
        return [size_fact(p, taint_of(ins)) for p in pieces]
    out = unless_partitioned(ctx, node, [f] + [x for i, x in enumerate(ins) if i != data], n)
    if out is not None:
        return out
    axis = ctx.axes(axis_ref, ctx.rank(node.inputs[data]))
    if axis is not None and axis[0] == f.axis and node.op == "Split" and isinstance(f.outer, int) \
            and f.outer % n == 0 and f.outer > 1:
        # the copies of a batch joined along its axis, taken apart again: each piece holds
        # outer/n whole copies, in every tower as on one device
        return [f.with_(outer=f.outer // n, value=None, index=None)] * n
    if axis is None or axis[0] == f.axis:
        if axis is not None and node.op == "Split" and isinstance(f.block, int) \
                and isinstance(f.outer, int) and not ctx.in_gradient(node):
            ctx.classes.granule(f.cls, n // math.gcd(n, f.block * f.outer), node.name)
        return [mixed(node.name, f"{node.op} along the batch", f.taint)] * n
    return [f.with_(value=None, index=None)] * n
