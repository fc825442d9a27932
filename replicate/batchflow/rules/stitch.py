"""Rules for partitioning rows and stitching them back (``DynamicPartition``, ``DynamicStitch``).

Partitioning the batch by a per-example selector keeps each part per example (a subset of the
tower's rows, in order). Stitching mixes rows by position, except where it puts back what a
partition took apart: ``embedding_lookup`` of a variable on a partitioner partitions the ids
and their row numbers alike, gathers per shard, and stitches every row back to its place.
On symbolic shape vectors (the gradient of a reduction builds its output shape so) the
values are stitched.
"""

from __future__ import annotations

from replicate.batchflow.context import Context
from replicate.batchflow.lattice import PART, Fact
from replicate.batchflow.rules.common import couple, first_mixed, mixed, part, shared, size_fact, taint_of
from replicate.graph.ir import Node, parse_tensor

__all__ = ["dynamic_partition", "dynamic_stitch"]


def dynamic_partition(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    data, parts_ = ins[0], ins[1]
    n = ctx.n_outputs(node)
    bad = first_mixed(ins)
    if bad is not None:
        return [bad] * n
    if data.kind == PART and parts_.kind == PART and data.axis == 0 and parts_.axis == 0:
        ctx.classes.union(data.cls, parts_.cls, node.name)
        # the tower's own row numbers, partitioned, are still its own row numbers (some of
        # them): a partitioned embedding lookup stitches its rows back by them
        index = data.index if data.index is not None and data.index[0] == "rows" else None
        return [part(0, data.cls, None, filtered=True, index=index,
                     taint=couple(ctx, node, ins))] * n
    if not data.dependent and not parts_.dependent:
        return [shared()] * n
    return [mixed(node.name, "DynamicPartition of the batch by a shared or reduced selector",
                  taint_of(ins))] * n


def dynamic_stitch(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    """``DynamicStitch`` merges index lists; on symbolic shape vectors (the gradient of a
    reduction builds its output shape so) the values are stitched, otherwise it mixes rows."""
    n = len(ins) // 2
    indices, data = ins[:n], ins[n:]
    if all(f.value is not None for f in ins) and all(
            isinstance(i, int) for f in indices for i in f.value):
        width = max(i for f in indices for i in f.value) + 1
        out: list = [None] * width
        for idx, vals in zip(indices, data):
            if len(idx.value) != len(vals.value):
                break
            for i, v in zip(idx.value, vals.value):
                out[i] = v
        else:
            return [size_fact(tuple(out), taint_of(ins))]
    stitched = _reassembled(ctx, node, indices, data)
    if stitched is not None:
        return [stitched]
    if any(f.dependent for f in ins):
        return [mixed(node.name, "DynamicStitch interleaves rows by position", taint_of(ins))]
    return [shared(taint=taint_of(ins))]


#: Ops whose output row i comes from row i of one input (``_ROW_SOURCE``: which input), or
#: from the row its indices input names (gathers: the indices' row i).
_ROW_SOURCE = {"Identity": 0, "Snapshot": 0, "GatherV2": 1, "Gather": 1, "ResourceGather": 1}


def _reassembled(ctx: Context, node: Node, indices: list[Fact], data: list[Fact]) -> Fact | None:
    """A partitioned lookup put back together (``embedding_lookup`` of a variable on a
    partitioner): ``DynamicStitch`` of ``DynamicPartition(range(rows), p)`` with, per part,
    values computed row by row from ``DynamicPartition(ids, p)``'s same part. Every row of
    the tower returns to its own place, so the result holds the tower's rows in order, as
    the ids do. Else None."""
    ir = ctx.ir
    n = len(indices)
    refs = [parse_tensor(r) for r in node.inputs[:n]]
    split = ir.nodes.get(refs[0][0])
    if split is None or split.op != "DynamicPartition" or int(split.attr("num_partitions", 0)) != n \
            or refs != [(split.name, p) for p in range(n)]:
        return None
    numbers = ctx.fact(split.inputs[0])
    if numbers is None or numbers.kind != PART or numbers.filtered or numbers.index is None \
            or numbers.index[0] != "rows" or numbers.axis != 0:
        return None
    for p, (ref, f) in enumerate(zip(node.inputs[n:], data)):
        if f.kind != PART or f.axis != 0 or not ctx.classes.same(f.cls, numbers.cls):
            return None
        for _ in range(16):         # back to the part of the ids the values were computed from
            source = ir.nodes.get(parse_tensor(ref)[0])
            if source is None or source.op not in _ROW_SOURCE:
                break
            if source.op == "GatherV2" and (ctx.int_value(source.inputs[2]) != (0,)
                                            or int(source.attr("batch_dims", 0) or 0)):
                return None
            ref = source.inputs[_ROW_SOURCE[source.op]]
        found = ir.nodes.get(parse_tensor(ref)[0])
        if found is None or found.op != "DynamicPartition" or parse_tensor(ref)[1] != p \
                or found.inputs[1] != split.inputs[1]:
            return None
    return part(0, numbers.cls, numbers.block, ordered=True, taint=taint_of(indices + data))
