"""Rules for ops that index, select, deduplicate or scatter rows.

Gathering rows of a shared table by per-example ids keeps the result per example. Gathering
*examples* by position mixes them, unless the positions are the tower's own row numbers
(``Range`` over the batch size, ``Where`` over a per-example condition): then each tower
gathers its own rows, as in ``tf.boolean_mask`` and ``gather_nd`` of the last valid output.
``Unique`` deduplicates across the batch; gathering its result back by its index restores
per-example rows. Segment sums keyed by ids add over examples; keyed by local rows they
rebuild per-example rows (the gradient of a gather).
"""

from __future__ import annotations

from tensorflow.python.framework import dtypes

from replicate.batchflow.context import FED_PATH, Context
from replicate.batchflow.lattice import MIXED, PART, RED, SHARED, Fact
from replicate.batchflow.rules import strided
from replicate.batchflow.rules.common import (
    couple,
    first_mixed,
    mixed,
    prologue,
    part,
    red,
    row_numbers,
    rows,
    shared,
    size_fact,
    taint_of,
)
from replicate.batchflow.table import SHAPE_READERS, behind
from replicate.graph.ir import Node, node_of, parse_tensor, tensor_name

__all__ = ["gather", "gather_nd", "where", "unique", "segment", "sparse_to_dense",
           "scatter_nd", "candidate_sampler", "accidental_hits",
           "reverse_sequence", "uncounted_rows", "FILLED", "ENTRIES", "UNIQUE", "lookup"]

UNIQUE = "unique"
#: The handle of sparse indices in which every example has an entry (SparseFillEmptyRows).
FILLED = "sparse:filled"
#: The handle of a sparse batch input's own entries (its indices and values as fed).
ENTRIES = "sparse:entries"


def _local(index: Fact, data: Fact, ctx: Context, col: int | None = None) -> bool:
    """True when ``index`` holds the tower's own row numbers of ``data``'s partition."""
    if index.kind != PART or index.index is None or data.kind != PART:
        return False
    tag = index.index
    if col is None and tag[0] == "rows":
        cls, per = tag[1], tag[2]
    elif col is not None and tag[0] == "cols" and tag[1] == col:
        cls, per = tag[2], tag[3]
    else:
        return False
    # Rows per example must agree; unknown on both sides (a dynamic time axis merged into the
    # batch axis) is accepted: such a count is the same in every tower unless the batch decides
    # it, and then it is a coupling, synchronized or reported.
    return ctx.classes.same(cls, data.cls) and per == rows(data) and data.outer == 1


def _fed_rows(ctx: Context, node: Node, data: Fact, index: Fact) -> bool:
    """``GatherNd`` ``node`` picks rows of ``data`` (its batch on axis 0) by index tuples fed in a
    batch input, one per example (DQN's ``[[0, a0], [1, a1], ...]`` fed beside the states): their
    first column is taken to number the rows of the global batch, as one device reads them (a
    fed vector for ``gather`` is no such evidence: a graph's edges number its nodes). Recorded,
    so that each tower subtracts its first row's number and checks that its numbers stay among
    its own rows (``passes/_rows.py``). Not in gradient code, in a function body or a TF1 loop
    (where the check cannot be added), nor for numbers computed in the graph: those are values
    of the examples, which need not be row numbers."""
    if index.kind != PART or index.index is not None or index.axis != 0 or data.outer != 1 \
            or data.block != 1 or ctx.in_gradient(node) or strided.unchecked(ctx, node):
        return False            # (rows of a folded [B * T, A] batch are no examples: review 29)
    tensor, kind = behind(ctx.ir, node.inputs[1], FED_PATH), "column"
    stacked = ctx.ir.nodes.get(node_of(tensor))
    if stacked is not None and stacked.op == "Pack" and int(stacked.attr("axis", 0)) in (1, -1) \
            and ctx.rank(stacked.inputs[0]) == 1:
        # tf.stack([rows, actions], 1) of two fed vectors: the rows are the first's values
        tensor, kind = behind(ctx.ir, stacked.inputs[0], FED_PATH), "whole"
    fed = ctx.inputs.get(tensor)
    if fed is None or fed[0] != 0 or tensor in ctx.sparse:
        return False
    if not ctx.classes.same(index.cls, data.cls):
        # the numbers and the rows they number: one batch on this evidence (the split then
        # checks every step that both hold as many examples)
        ctx.classes.join_by_evidence(index.cls, data.cls, node.name)
    ctx.fed_rows[node.name] = (data.cls, tensor, kind)
    return True


def _refuse_fed_positions(ctx: Context, node: Node, index: Fact, column: int = 0) -> None:
    """Positions fed in a batch input that are not the examples' own row numbers (rows of a
    folded ``[B * T, A]`` batch): each tower holds other rows than those numbers name, and the
    step would fail on TensorFlow's "does not index into param shape" (review 29)."""
    start = behind(ctx.ir, node.inputs[1], FED_PATH)
    stacked = ctx.ir.nodes.get(node_of(start))
    if stacked is not None and stacked.op == "Pack" and int(stacked.attr("axis", 0)) in (1, -1) \
            and column < len(stacked.inputs):
        start = stacked.inputs[column]      # the column that numbers the rows ([rows, actions])
    tensor, how = ctx.fed(start), "fed in"
    if tensor is None:      # computed from fed numbers (a TF1 cond's Merge of idx and idx * [1, 0])
        tensor, how = _fed_under(ctx, start), "computed from numbers fed in"
    if index.kind not in (PART, MIXED) or tensor is None or ctx.in_gradient(node):
        return
    where = strided.unchecked(ctx, node)
    if where:
        # a tower's numbers cannot be shifted and checked there (review 29: the rewrite of a
        # DQN pick in a tf.cond branch failed at step 1)
        ctx.refuse(node.name, f"{node.op} picks rows of a batch tensor at positions fed in "
                   f"'{tensor}' {where}, where a tower cannot read them as its own rows",
                   "move the pick out of the branch or loop (tf.cond can choose between the "
                   "picked values instead), or train this graph on one device")
        return
    ctx.refuse(node.name, f"{node.op} picks rows of a batch tensor at positions {how} '{tensor}' "
               "that do not number its examples (each tower holds other rows)",
               "pick with the fed tuples as they are and compute with the picked values "
               "(tf.cond or tf.where can choose between two picks), or train this graph on "
               "one device" if how != "fed in" else
               "feed one index tuple per example with its own row number first ([[i, a_i]]), "
               "compute the positions in the graph, or train this graph on one device")


def _fed_under(ctx: Context, ref: str) -> str | None:
    """A batch input whose integers reach ``ref`` through integer tensors (a TF1 cond's
    ``Merge`` of ``idx`` and ``idx * [1, 0]``, a reshape, a cond_v2 or a defun returning them,
    ``tf.where``, ``tf.reverse``, columns unstacked and stacked again: review 31, 32). Numbers
    computed from float values (an ``argmax``) are the examples' values, not fed ones."""
    work, seen = [tensor_name(*parse_tensor(ref))], set()
    while work and len(seen) < 48:
        tensor = work.pop()
        fed = ctx.fed(tensor)
        if fed is not None:
            return fed
        node = ctx.ir.nodes.get(node_of(tensor))
        if node is None or ctx.in_gradient(node) or node.op in SHAPE_READERS:
            continue        # (a shape carries no fed numbers: range(tf.shape(a)[0]))
        seen.add(tensor)
        for r in node.inputs:
            r = tensor_name(*parse_tensor(r))
            if r not in seen and dtypes.as_dtype(ctx.ir.output_dtype(r)).is_integer:
                work.append(r)
    return None


def _rows_of_another(index: Fact, data: Fact, ctx: Context) -> bool:
    """``index`` holds row numbers (``("rows", cls, per)``) of a batch class other than
    ``data``'s, with ``data``'s rows per example."""
    if index.kind != PART or index.index is None or index.index[0] != "rows" or data.kind != PART:
        return False
    return (not ctx.classes.same(index.index[1], data.cls) and index.index[2] == rows(data)
            and data.outer == 1)


def gather(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    p, i = ins[0], ins[1]
    taint = couple(ctx, node, ins)
    if p.kind == MIXED and p.handle == UNIQUE and i.kind == PART and i.index == (UNIQUE, p.src):
        return [i.with_(index=None, value=None, taint=taint)]
    if p.kind == SHARED and i.kind == MIXED and i.handle == UNIQUE:
        return [i]
    bad = first_mixed(ins)
    if bad is not None:
        return [bad]
    p_rank, i_rank = ctx.rank(node.inputs[0]), ctx.rank(node.inputs[1])
    if int(node.attr("batch_dims", 0) or 0) and (p.dependent or i.dependent):
        return strided.per_example(ctx, node, p, i, i_rank, taint)
    axis = 0
    if node.op == "GatherV2":
        found = ctx.axes(node.inputs[2], p_rank)
        if found is None:
            return [mixed(node.name, "GatherV2 along an axis known only at run time", taint)] \
                if p.dependent or i.dependent else [shared()]
        axis = found[0]
    if p.kind == PART:
        if p.axis == axis:
            if _rows_of_another(i, p, ctx):
                # row numbers of another hypothetical batch with as many rows per example
                # (``tf.where(sequence_mask(lengths))`` gathering from ``ids``): evidence
                # that both are one batch, as for an elementwise op, not that ``p`` is a
                # table (shared, its lookups by each tower's own row numbers failed to run)
                ctx.classes.join_by_evidence(i.index[1], p.cls, node.name)
            spread = strided.gather(ctx, node, p, i, axis, taint)
            if spread is not None:      # by example numbers, or offsets into a flattened batch
                return spread
            if _local(i, p, ctx):      # a tower's own rows: row numbers among them stay so
                return [part(axis + i.axis, p.cls, None, ordered=i.ordered, filtered=True, taint=taint,
                             index=p.index if axis == 0 and i.axis == 0 else None)]
            if i.kind == PART and not ctx.classes.same(p.cls, i.cls):
                # one hypothetical batch looked up by another's values: evidence that the
                # table (a [3] class-weights placeholder fed with a batch of 3) is no batch
                ctx.classes.conflicts.append((i.cls, p.cls, node.name, "lookup"))
            if p.filtered and i.kind == SHARED:
                # entries (of a SparseTensor) picked at positions the same in every tower, a
                # dropout mask drawn over all of them: evidence that they are no batch
                ctx.classes.conflicts.append((None, p.cls, node.name, "entries"))
            return [mixed(node.name, f"{node.op} picks examples of the batch by position", taint)]
        if i.kind == PART or i_rank is None:
            return [mixed(node.name, f"{node.op} of two batch axes", taint)]
        return [p.with_(axis=p.axis if p.axis < axis else p.axis + i_rank - 1, value=None, taint=taint)]
    if i.kind == PART:
        if row_numbers(i):
            return [mixed(node.name, f"{node.op} looks a shared table up by row numbers local to "
                          "each tower (they start at 0 in every tower)", taint)]
        return [i.with_(axis=axis + i.axis, value=None, index=None, taint=taint)]
    if p.kind == RED and i.kind == SHARED:
        picked = _pick(ctx, p, node.inputs[1])
        return [size_fact(picked, taint) if picked is not None else p.with_(value=None, taint=taint)]
    if i.kind == RED or p.kind == RED:
        return [red(None, "other", node.name, taint=taint).with_(why=f"{node.op} by a batch-reduced index")]
    picked = _pick(ctx, p, node.inputs[1])
    return [size_fact(picked, taint) if picked is not None else shared(taint=taint)]


def _pick(ctx: Context, p: Fact, indices: str) -> tuple | None:
    """Elements of a symbolic value picked by constant indices."""
    if p.value is None:
        return None
    picks = ctx.int_value(indices)
    if picks is None or not all(isinstance(k, int) and -len(p.value) <= k < len(p.value) for k in picks):
        return None
    return tuple(p.value[k] for k in picks)


def gather_nd(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    p, i = ins[0], ins[1]
    taint = couple(ctx, node, ins)
    bad = first_mixed(ins)
    i_shape = ctx.shape(node.inputs[1])
    if bad is not None:
        if p.kind == PART and i.kind == MIXED and i_shape and i_shape[-1] is not None and p.axis < i_shape[-1]:
            _refuse_fed_positions(ctx, node, i, p.axis)     # fed rows reordered: review 32
        return [bad]
    if i_shape is None or i_shape[-1] is None:
        return [mixed(node.name, "GatherNd with index tuples of unknown length", taint)] \
            if p.dependent or i.dependent else [shared()]
    depth, i_rank = i_shape[-1], len(i_shape)
    if p.kind == PART:
        if p.axis < depth:
            tag = i.index if i.kind == PART else None
            if tag is not None and tag[0] == "cols" and tag[1] == p.axis and p.outer == 1 \
                    and not ctx.classes.same(tag[2], p.cls) and tag[3] == rows(p):
                # row numbers of another hypothetical batch in the index tuples (DQN's
                # gather_nd(q, stack([range(tf.shape(a)[0]), a], 1))): evidence that both are
                # one batch, as for gather
                ctx.classes.join_by_evidence(tag[2], p.cls, node.name)
            local = _local(i, p, ctx, col=p.axis)
            if local and i.axis < i_rank - 1 and not i.filtered and isinstance(i.block, int):
                # index tuples stacked per example (DQN's stack([range(B), a], 1)): one pick
                # per tuple, as many per example as tuples; a mean over them is a batch mean
                # (review 28: it was taken for a masked selection, "a count the data decides")
                return [part(i.axis, p.cls, i.block, ordered=i.ordered, taint=taint)]
            if i.kind == PART and i.axis < i_rank - 1 and (local or (p.axis == 0 and _fed_rows(ctx, node, p, i))):
                return [part(i.axis, p.cls, None, ordered=i.ordered, filtered=True, taint=taint)]
            _refuse_fed_positions(ctx, node, i, p.axis)
            return [mixed(node.name, "GatherNd picks examples of the batch by position", taint)]
        if i.kind == PART:
            return [mixed(node.name, "GatherNd of two batch axes", taint)]
        return [p.with_(axis=p.axis - depth + i_rank - 1, value=None, taint=taint)]
    if i.kind == PART:
        if i.axis >= i_rank - 1:
            return [mixed(node.name, "GatherNd with examples inside an index tuple", taint)]
        return [i.with_(value=None, index=None, taint=taint)]
    if RED in (p.kind, i.kind):
        return [red(None, "other", node.name, taint=taint).with_(why="GatherNd of reduced values")]
    return [shared(taint=taint)]


def where(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    f = ins[0]
    if f.kind != PART:
        bad = first_mixed(ins)
        return [bad] if bad is not None else [shared(taint=taint_of(ins)) if f.kind == SHARED else
                                              red(f.cls, "other", node.name, taint=f.taint)]
    return [part(0, f.cls, None, ordered=f.ordered and f.axis == 0 and f.outer == 1, filtered=True,
                 taint=f.taint, index=("cols", f.axis, f.cls, rows(f)))]


def unique(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    f = ins[0]
    n = ctx.n_outputs(node)
    if f.kind != PART:
        return [f.with_(value=None)] * n
    ids = mixed(node.name, f"{node.op} deduplicates values across the examples of the batch",
                f.taint).with_(handle=UNIQUE)
    idx = f.with_(index=(UNIQUE, node.name), value=None)
    # the tower's counts: gathered back by ``idx`` no example's value (review 34)
    counts = mixed(node.name, f"{node.op} counts values across the examples of the batch", f.taint)
    return [ids, idx] + [counts] * (n - 2)


def bincount(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    """``tf.math.bincount`` of per-example values (class counts of the labels): a sum over the
    batch of one-hot rows (of the weights, if given), or their maximum with
    ``binary_output``. A rank-2 input counts each row alone."""
    values, size, weights = ins[0], ins[1], ins[2]
    taint = couple(ctx, node, ins)
    if _clamped(ctx, node.inputs[1]) is not None:
        # minlength == maxlength: the batch's largest value does not size the counts
        size = shared()
        ins = [values, size, weights]
        taint = taint_of([values, weights])
    bad = first_mixed(ins)
    if bad is not None:
        return [bad]
    if not any(f.dependent for f in ins):
        return [shared(taint=taint)]
    rank = ctx.rank(node.inputs[0])
    aligned = not weights.dependent or (weights.kind == PART and weights.axis == values.axis)
    if values.kind == PART and values.axis == 0 and not size.dependent and aligned:
        if weights.kind == PART:
            ctx.classes.union(values.cls, weights.cls, node.name)
        if rank == 2:
            return [part(0, values.cls, values.block, taint=taint)]
        if rank == 1:
            merge = "max" if node.attr("binary_output", False) else "sum"
            return [red(values.cls, merge, node.name, taint=taint)]
    return [mixed(node.name, f"{node.op} of batch values it cannot follow", taint)]


def _clamped(ctx: Context, ref: str) -> int | None:
    """The constant ``a`` when ``ref`` is ``minimum(a, maximum(b, anything))`` with constants
    ``b >= a`` (``tf.math.bincount(..., minlength=C, maxlength=C)`` sizes its output so from
    the largest value of the batch), else None."""
    def const(r):
        value = ctx.const(r)
        return int(value.reshape(-1)[0]) if value is not None and value.size == 1 else None

    def through_cast(r):
        node = ctx.ir.nodes.get(r.split(":")[0])
        while node is not None and node.op in ("Cast", "Identity") and node.inputs:
            node = ctx.ir.nodes.get(node.inputs[0].split(":")[0])
        return node

    low = through_cast(ref)
    if low is None or low.op != "Minimum":
        return None
    for i in (0, 1):
        a, high = const(low.inputs[i]), through_cast(low.inputs[1 - i])
        if a is None or high is None or high.op != "Maximum":
            continue
        if any(const(high.inputs[j]) is not None and const(high.inputs[j]) >= a for j in (0, 1)):
            return a
    return None


def segment(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    data, ids = ins[0], ins[1]
    taint = couple(ctx, node, ins)
    bad = first_mixed(ins)
    if bad is not None:
        return [bad]
    if not data.dependent and not ids.dependent:
        if len(ins) > 2 and ins[2].dependent:
            # values put at fixed rows of a tower-sized result (the dense gradient of
            # ``tf.gather(loss, [1])``): each tower puts them in its own rows
            what = f"{node.op} puts values at positions of each tower's rows"
            if ctx.const(node.inputs[1]) is None and not ctx.in_gradient(node):
                # segment ids fed or computed whole (tokens fed flat with their examples'
                # numbers): they name the batch's rows, beyond a tower's count (the rewrite
                # failed at step 1 with "segment_ids out of range")
                ctx.refuse(node.name, f"{node.op} numbers the batch's examples with segment ids "
                           "given whole to every tower (tokens fed flat with their examples' "
                           "ids), beyond each tower's count of rows",
                           "feed the tokens padded per example ([batch, length] with a mask), "
                           "or train this graph on one device")
            return [mixed(node.name, what, taint)]
        return [shared(taint=taint)]
    if ids.kind == PART and ids.index is None and len(node.inputs) == 2 and not ctx.in_gradient(node) \
            and ctx.fed(node.inputs[1]) is not None:
        # ids fed for the whole batch (graphs batched by their nodes, tokens fed flat with
        # their examples' numbers): each tower's slice holds numbers of rows beyond its own,
        # and the step failed on TensorFlow's errors (review 29: the sorted segment_sum)
        what = (f"{node.op} sums by segment ids fed in '{ctx.fed(node.inputs[1])}', "
                "numbers of the whole batch's rows that no tower's slice pairs with")
        ctx.refuse(node.name, what, "feed the items padded per example ([batch, items] with a mask), "
                   "or train this graph on one device")
        return [mixed(node.name, what, taint)]
    merge = {"UnsortedSegmentSum": "sum", "SegmentSum": "sum", "UnsortedSegmentMax": "max",
             "UnsortedSegmentMin": "min", "SegmentMax": "max", "SegmentMin": "min"}.get(node.op, "other")
    spread = strided.segment(ctx, node, ids, data, taint)
    if spread is not None:              # by example numbers, or offsets into a flattened batch
        return spread
    if ids.kind == PART and ids.index is not None and ids.index[0] == "rows" and data.kind == PART:
        cls, per = ids.index[1], ids.index[2]
        if len(node.inputs) > 2:
            ctx.position(node.inputs[2], None, cls, per, node)
        elif ids.filtered and ids.handle != FILLED:
            # rows of selected examples (a SparseTensor's entries, tf.where)
            return [uncounted_rows(ctx, node, taint, ", or pass num_segments (unsorted_segment_sum)")]
        return [part(0, cls, per, taint=taint)]
    if row_numbers(ids):
        return [mixed(node.name, f"{node.op} by row numbers local to each tower that do not pair "
                      "with the data's examples", taint)]
    if ids.kind == PART and data.kind == PART and ids.axis == data.axis == 0:
        ctx.classes.union(ids.cls, data.cls, node.name)
        return [red(data.cls, merge, node.name, taint=taint)]
    if ids.kind == PART and ids.axis == 0 and data.kind in (SHARED, RED) and (ctx.rank(node.inputs[0]) or 0) \
            and not ctx.in_gradient(node):
        # the rows of a tensor every tower holds whole, paired with a tower's slice of the ids
        # (graphs batched by concatenating their nodes: the nodes' states by graph ids split
        # as a batch of their own); the op needs as many of each, which no tower has (review
        # 28: the step failed with TensorFlow's "data.shape does not start with segment_ids")
        what = (f"{node.op} pairs the rows of '{node.inputs[0]}', which every tower holds whole, "
                f"with segment ids split by example ('{node.inputs[1]}')")
        ctx.refuse(node.name, what, "name with batch_inputs= the inputs whose rows are the examples "
                   "those ids number (and with shared_inputs= the ids if they are no batch), or "
                   "train this graph on one device")
        return [mixed(node.name, what, taint)]
    return [mixed(node.name, f"{node.op} of per-example values by shared segment ids", taint)]


def _placed(ctx: Context, node: Node, ins: list[Fact], shape_at: int) -> list[Fact]:
    """Values placed at indices whose column 0 names the example (``SparseToDense``,
    ``ScatterNd``): partitioned like the indices, the dense shape operand (input
    ``shape_at``) holding the batch size at axis 0."""
    idx = ins[0]
    taint = couple(ctx, node, ins)
    bad = first_mixed(ins)
    if bad is not None:
        return [bad]
    if idx.kind == PART and idx.index is not None and idx.index[0] == "cols" and idx.index[1] == 0:
        ctx.position(node.inputs[shape_at], 0, idx.index[2], idx.index[3] or 1, node)
        return [part(0, idx.index[2], idx.index[3], taint=taint)]
    if any(f.dependent for f in ins):
        return [mixed(node.name, f"{node.op} places values at batch-dependent positions", taint)]
    return [shared(taint=taint)]


def sparse_to_dense(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    return _placed(ctx, node, ins, 1)


def scatter_nd(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    return _placed(ctx, node, ins, 2)


def uncounted_rows(ctx: Context, node: Node, taint: frozenset, fix: str = "") -> Fact:
    """A segment op keyed by the example rows of selected entries, without a segment count:
    its result has as many rows as the last example with an entry, so a tower whose last
    examples have none gets fewer rows than examples and fails where one device runs. The
    transform refuses."""
    what = (f"{node.op} keyed by the examples has as many rows as the last example with an "
            "entry: a tower whose last examples have none gets fewer rows than examples, and "
            "its step fails where one device's runs")
    ctx.refuse(node.name, what, "fill empty rows first (tf.nn.safe_embedding_lookup_sparse, or "
               "tf.sparse.fill_empty_rows before the lookup)" + fix)
    return mixed(node.name, what, taint)


def candidate_sampler(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    """A candidate sampler draws classes independently of the examples; only the expected
    count of each example's true classes (output 1) is per example."""
    true = ins[0]
    if true.kind == MIXED:
        return [true] * 3
    if true.kind == PART and true.axis != 0:
        return [mixed(node.name, f"{node.op} with the examples on axis {true.axis}", true.taint)] * 3
    per_example = true.with_(value=None, index=None) if true.kind == PART else shared(taint=true.taint)
    return [shared(taint=true.taint), per_example, shared(taint=true.taint)]


def accidental_hits(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    """``ComputeAccidentalHits(true_classes, sampled)``: rows where a sampled class is a true
    one; output 0 holds the tower's own row numbers."""
    true, sampled = ins[0], ins[1]
    if sampled.kind != SHARED or true.kind not in (PART, SHARED):
        return [mixed(node.name, "ComputeAccidentalHits of per-tower samples", taint_of(ins))] * 3
    if true.kind == SHARED:
        return [shared(taint=taint_of(ins))] * 3
    rows = part(0, true.cls, None, filtered=True, taint=taint_of(ins),
                index=("rows", true.cls, true.block))
    return [rows, rows.with_(index=None), rows.with_(index=None)]


def reverse_sequence(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    """``ReverseSequence``: each example's first ``seq_lengths[i]`` steps reversed."""
    data, lengths = ins[0], ins[1]
    bad = first_mixed(ins)
    if bad is not None:
        return [bad]
    batch_dim = int(node.attr("batch_dim", 0))
    if data.kind != PART:
        return [mixed(node.name, "ReverseSequence by per-example lengths of a shared value",
                      taint_of(ins))] if lengths.dependent else [shared(taint=taint_of(ins))]
    if data.axis != batch_dim:
        return [mixed(node.name, "ReverseSequence with the examples off its batch_dim", data.taint)]
    if lengths.kind == PART:
        ctx.classes.union(data.cls, lengths.cls, node.name)
    elif lengths.kind == SHARED:
        ctx.demand(node.inputs[1], 0, data, node)
    return [data.with_(taint=couple(ctx, node, ins), value=None)]


def lookup(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    """``LookupTableFindV2(table, keys, default)``: one value per key, from a table every
    tower shares (a vocabulary), its values' dimensions after the keys'."""
    table, keys, default = ins[0], ins[1], ins[2]
    if table.kind == SHARED and default.kind == SHARED and keys.kind in (PART, SHARED):
        return [keys.with_(value=None, index=None, handle=None)]
    return [ctx.no_rule(node, ins)]


def tensor_scatter(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    """``TensorScatter{Add,Sub,Update,Max,Min}(tensor, indices, updates)``: ``updates`` placed
    in ``tensor`` at index tuples into its leading axes. With shared tuples into axes before
    the batch's (TF2's ``ctc_loss_dense`` writes time steps of ``[T, B, L]``), every example's
    values stay in its own column: per example. Anything else mixes the examples."""
    tensor, index, updates = ins[:3]
    taint, settled = prologue(ctx, node, ins)
    if settled is not None:
        return settled
    shape = ctx.shape(node.inputs[1])
    depth = shape[-1] if shape else None
    if index.kind == SHARED and tensor.kind == PART and updates.kind == PART and depth is not None \
            and tensor.axis >= depth and updates.axis == tensor.axis - depth + len(shape) - 1 \
            and ctx.classes.same(tensor.cls, updates.cls) and rows(tensor) == rows(updates) \
            and tensor.outer == updates.outer:
        return [tensor.with_(value=None, index=None, taint=taint)]
    return [mixed(node.name, f"{node.op} places values at batch-dependent positions", taint)]
