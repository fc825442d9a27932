"""Rules for batch inputs fed as a ``SparseTensor`` and the sparse ops that read them.

A sparse batch input is three tensors: ``indices`` (``[nnz, rank]``, column 0 the example
each entry belongs to), ``values`` (``[nnz]``) and ``dense_shape`` (``[rank]``, element 0 the
batch size). The split pass gives tower ``k`` the entries of its own examples, with column 0
renumbered from 0, so the facts are:

- ``indices``: partitioned along axis 0, *filtered* (a tower holds its examples' entries, not
  one row per example), and column 0 holds row numbers local to the tower (index ``cols 0``);
- ``values``: partitioned along axis 0, filtered;
- ``dense_shape``: a batch size (its element 0 is the tower's example count).

``SparseTensorDenseMatMul`` of such a tensor by a shared matrix is per example; with
``adjoint_a`` (its gradient) it sums over the examples. A sparse matrix that multiplies the
examples themselves (a graph convolution over the batch) couples every example to others:
no split can run it, and the transform refuses. ``SparseSegment*`` ops keyed by the
example rows rebuild per-example rows only when every example has an entry (after
``SparseFillEmptyRows``): otherwise their output has as many rows as the last example that
has one, a tower's step fails where one device's runs, and the transform refuses.
"""

from __future__ import annotations

from replicate.batchflow.context import Context
from replicate.batchflow.lattice import MIXED, PART, RED, Fact, Sym
from replicate.batchflow.rules.common import (
    couple,
    first_mixed,
    mixed,
    part,
    prologue,
    red,
    shared,
    size_fact,
)
from replicate.batchflow.rules.index import ENTRIES, FILLED, UNIQUE, sparse_to_dense, uncounted_rows
from replicate.graph.ir import IR, Node, parse_tensor

__all__ = ["source", "ctc_loss", "sparse_cross", "to_dense", "WIDTH", "dense_matmul", "reduce_", "reshape", "fill_empty_rows", "segment", "segment_grad", "FILLED",
           "ENTRIES"]


def source(ctx: Context, tensor: str, cls: int) -> Fact:
    """The fact of one part of a sparse batch input (see the module docstring)."""
    role = ctx.sparse[tensor]
    if role == "indices":
        return part(0, cls, None, ordered=False, filtered=True,
                    index=("cols", 0, cls, 1)).with_(handle=ENTRIES)
    if role == "values":
        return part(0, cls, None, ordered=False, filtered=True).with_(handle=ENTRIES)
    shape = ctx.shape(tensor)
    if shape and shape[0] is not None and shape[0] >= 1:
        return size_fact((Sym(1, cls),) + (None,) * (shape[0] - 1))
    return red(cls, "size", None)


def _rows_of(ctx: Context, indices: Fact, values: Fact) -> int | None:
    """The batch class of sparse operands whose indices name examples in column 0."""
    if indices.kind != PART or indices.index is None or indices.index[:2] != ("cols", 0) \
            or indices.index[3] not in (1, None):
        return None
    cls = indices.index[2]
    if values.kind == PART:
        if values.axis != 0 or not ctx.classes.same(values.cls, cls):
            return None
    elif values.dependent:
        return None
    return cls


def ctc_loss(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    """``CTCLoss(inputs [T, B, C], labels_indices, labels_values, sequence_length [B])`` -> the
    loss per example and its gradient ``[T, B, C]``: each example's loss reads its own time
    steps, its own labels (the sparse entries whose column 0 names it) and its own length,
    so the towers compute their examples' losses exactly (review 28: "no batch rule")."""
    logits, ind, val, lengths = ins[:4]
    taint, settled = prologue(ctx, node, ins)
    if settled is not None:
        return settled
    cls = _rows_of(ctx, ind, val)
    if cls is None or logits.kind != PART or logits.axis != 1 or logits.outer != 1 or logits.block != 1 \
            or lengths.kind != PART or lengths.axis != 0 or lengths.block != 1:
        return [mixed(node.name, "CTCLoss of inputs whose examples are not on the batch axis "
                      "of its time-major inputs, labels and lengths", taint)] * 2
    for other in (logits.cls, lengths.cls):
        ctx.classes.union(cls, other, node.name)
    return [part(0, cls, taint=taint), part(1, cls, taint=taint)]


def sparse_cross(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    """``SparseCross(indices * N, values * N, shapes * N, dense_inputs)`` -> a SparseTensor of
    each example's crosses of its own features (``crossed_column``): row ``b`` of the output
    crosses row ``b`` of every input, so its entries name the examples like the inputs' do
    (review 28: "no batch rule for SparseCross"). Its dense width is the most crosses of any
    row, which a tower counts over its own rows: kept unknown, it only sizes the sparse rows."""
    n = int(node.attr("N", 0))
    taint, settled = prologue(ctx, node, ins, 3)
    if settled is not None:
        return settled
    classes = [_rows_of(ctx, ins[i], ins[n + i]) for i in range(n)]
    dense, shapes = ins[3 * n:], ins[2 * n:3 * n]
    # (the shapes hold the batch size, a row count, not values: review 30's vocabulary column
    # crossed with a bucketized one, two batch inputs, was mixed on its shapes)
    if None in classes or any(f.kind == PART and f.axis != 0 for f in dense) \
            or any(f.kind == RED for f in ins[:2 * n] + dense) \
            or any(f.kind == RED and f.merge != "size" for f in shapes):
        return [mixed(node.name, "SparseCross of inputs whose rows are not the examples", taint)] * 3
    cls = classes[0] if classes else next(f.cls for f in dense if f.kind == PART)
    for other in classes[1:] + [f.cls for f in dense if f.kind == PART]:
        ctx.classes.union(cls, other, node.name)
    indices = part(0, cls, None, ordered=False, filtered=True, index=("cols", 0, cls, 1), taint=taint)
    values = part(0, cls, None, ordered=False, filtered=True, taint=taint)
    return [indices.with_(handle=ENTRIES), values.with_(handle=ENTRIES),
            size_fact((Sym(1, cls), None), taint)]


#: Ops whose sparse result's dense width (output 2, element 1: the most entries of any
#: example) each tower counts over its own examples.
WIDTH = frozenset({"SparseCross", "SparseCrossV2", "SparseCrossHashed", "StringSplit", "StringSplitV2"})

#: Why a dense tensor padded to such a width is mixed.
WIDTH_WHY = ("the dense width of a sparse result (the most entries of any example) is each "
             "tower's own, and a dense tensor padded to it differs from one device's")


def to_dense(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    """``SparseToDense`` (``tf.sparse.to_dense``), unless its dense shape comes from a width
    each tower counts (:data:`WIDTH`): crossed features made dense with a default value and
    summed were claimed exact, 0.069 off (found after review 37, whose StringSplit case was
    the same)."""
    if _from_a_width(ctx.ir, node.inputs[1]):
        return [mixed(node.name, WIDTH_WHY, couple(ctx, node, ins))]
    return sparse_to_dense(ctx, node, ins)


def _from_a_width(ir: IR, ref: str) -> bool:
    """Whether tensor ``ref`` is computed from the dense shape of a :data:`WIDTH` op's result
    (the whole ancestry: a search cut short would take a width for none)."""
    work, seen = [ref], set()
    while work:
        name, index = parse_tensor(work.pop())
        node = ir.nodes.get(name)
        if node is None or (name, index) in seen:
            continue
        seen.add((name, index))
        if node.op in WIDTH and index == 2:
            return True
        work.extend(node.inputs)
    return False


def dense_matmul(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    """``SparseTensorDenseMatMul(a_indices, a_values, a_shape, b)``."""
    ind, val, _, b = ins
    taint, settled = prologue(ctx, node, ins)
    if settled is not None:
        return settled
    cls = _rows_of(ctx, ind, val)
    adj_a, adj_b = bool(node.attr("adjoint_a", False)), bool(node.attr("adjoint_b", False))
    if cls is not None and not adj_a and not b.dependent:
        return [part(0, cls, taint=taint)]
    contracted = b.kind == PART and b.axis == (1 if adj_b else 0)
    if cls is not None and adj_a and contracted and b.block == 1:
        ctx.classes.union(cls, b.cls, node.name)      # the gradient: a sum over the examples
        return [red(cls, "sum", node.name, taint=taint)]
    if contracted and cls is not None and not ctx.classes.same(cls, b.cls):
        # the matrix's rows are examples and its columns index the other tensor's rows: that
        # tensor is no batch of other examples but a table every tower reads whole (all the
        # nodes' features beside a batch of nodes' adjacency rows)
        ctx.classes.conflicts.append((cls, b.cls, node.name, "matrix product"))
        return [mixed(node.name, "a sparse matrix whose rows are examples multiplies another "
                      "batch along its examples", taint)]
    if contracted and not ctx.in_gradient(node):
        what = ("a sparse matrix over the examples multiplies them together (a graph "
                "convolution): every output row adds rows of other examples, so no tower can "
                "compute its rows from its own examples")
        ctx.refuse(node.name, what, "train it on one device, or feed minibatches of nodes with "
                   "their sampled neighbourhoods as separate inputs")
        return [mixed(node.name, what, taint)]
    return [mixed(node.name, "SparseTensorDenseMatMul of the batch in an unsupported layout", taint)]


def reduce_(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    """``SparseReduceSum/Max(indices, values, shape, axes)`` (dense output)."""
    ind, val, shp = ins[0], ins[1], ins[2]
    taint, settled = prologue(ctx, node, ins)
    if settled is not None:
        return settled
    cls = _rows_of(ctx, ind, val)
    axes = ctx.int_value(node.inputs[3])
    rank = len(shp.value) if shp.value is not None else None
    if cls is None or axes is None or rank is None or any(not isinstance(a, int) for a in axes):
        return [mixed(node.name, f"{node.op} of the batch over axes known only at run time", taint)]
    axes = {a + rank if a < 0 else a for a in axes}
    keep = bool(node.attr("keep_dims", False))
    ctx.refine(f"{node.name}:0", [1 if d in axes else None for d in range(rank) if keep or d not in axes])
    if 0 not in axes:
        return [part(0, cls, taint=taint)]
    return [red(cls, "max" if "Max" in node.op else "sum", node.name, taint=taint)]


def reshape(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    """``SparseReshape(indices, shape, new_shape)`` -> (indices, shape): the batch stays the
    rows when both shapes are ``[batch, d]`` (``safe_embedding_lookup_sparse`` flattens ids of
    any rank to two dimensions)."""
    ind = ins[0]
    taint, settled = prologue(ctx, node, ins, 2)
    if settled is not None:
        return settled
    old, new = ins[1].value, ctx.int_value(node.inputs[2])
    cls = _rows_of(ctx, ind, shared())
    if cls is not None and old is not None and new is not None and len(old) == len(new) == 2 \
            and old[0] == new[0] == Sym(1, cls):
        return [ind.with_(taint=taint), size_fact(tuple(new), taint)]
    return [mixed(node.name, "SparseReshape of the batch that moves its examples", taint)] * 2


def fill_empty_rows(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    """``SparseFillEmptyRows``: (indices, values, empty-row indicator, reverse index map); every
    example then has an entry."""
    ind, val = ins[0], ins[1]
    taint, settled = prologue(ctx, node, ins, 4)
    if settled is not None:
        return settled
    cls = _rows_of(ctx, ind, val)
    if cls is None:
        return [mixed(node.name, "SparseFillEmptyRows of the batch in an unsupported layout", taint)] * 4
    entries = part(0, cls, None, ordered=False, filtered=True, taint=taint)
    return [entries.with_(index=("cols", 0, cls, 1), handle=FILLED), entries,
            part(0, cls, taint=taint), entries]


def _per_entry(ctx: Context, data: Fact, ids: Fact) -> bool:
    """True when ``data`` gathered at ``ids`` is one row per sparse entry: a shared table, or
    the rows of a ``Unique`` gathered back by its index."""
    if ids.kind != PART:
        return False
    if data.kind == MIXED:
        return data.handle == UNIQUE and ids.index == (UNIQUE, data.src)
    return not data.dependent


def segment(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    """``SparseSegmentSum/Mean/SqrtN[WithNumSegments](data, indices, segment_ids[, n])``."""
    data, ids, seg = ins[0], ins[1], ins[2]
    taint = couple(ctx, node, ins)
    if not any(f.dependent for f in ins):
        return [shared(taint=taint)]
    local = seg.kind == PART and seg.index is not None and seg.index[0] == "rows" \
        and seg.index[2] in (1, None)
    if local and _per_entry(ctx, data, ids):
        cls = seg.index[1]
        if len(node.inputs) > 3:
            count = ctx.fact(node.inputs[3])
            if count is not None and count.value and count.value[0] == Sym(1, cls):
                return [part(0, cls, taint=taint)]
        if seg.handle == FILLED:
            return [part(0, cls, taint=taint)]
        return [uncounted_rows(ctx, node, taint)]
    bad = first_mixed(ins)
    if bad is not None:
        return [bad]
    return [mixed(node.name, f"{node.op} of the batch in an unsupported layout", taint)]


def segment_grad(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    """``SparseSegment*Grad(grad, indices, segment_ids, output_dim0)``: each entry's upstream
    row added at its table row, a sum over the examples."""
    grad, ids, seg = ins[0], ins[1], ins[2]
    taint = couple(ctx, node, ins)
    bad = first_mixed([grad, seg])
    if bad is not None:
        return [bad]
    if grad.kind == PART and grad.axis == 0 and seg.kind == PART and seg.index is not None \
            and seg.index[0] == "rows" and ctx.classes.same(seg.index[1], grad.cls):
        if ids.kind == PART and ids.index is not None and ids.index[0] == UNIQUE:
            return [mixed(node.name, "rows of the table per unique id of each tower", taint)]
        if not ids.dependent or ids.kind == PART:
            return [red(grad.cls, "sum", node.name, taint=taint)]
    if not any(f.dependent for f in ins):
        return [shared(taint=taint)]
    return [mixed(node.name, f"{node.op} of the batch in an unsupported layout", taint)]
