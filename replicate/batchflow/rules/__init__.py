"""The rule registry: op type -> transfer function from input facts to output facts.

Each family lives in its own module; :data:`RULES` maps every op type the dataflow knows to
its rule, built from the tables in :mod:`replicate.batchflow.table` and the lists below.
:func:`apply` runs the rule of a node, or the default (shared if every input is shared,
else mixed: "no batch rule").
"""

from __future__ import annotations

from collections.abc import Callable

from replicate.batchflow import table
from replicate.batchflow.context import Context
from replicate.batchflow.lattice import MIXED, PART, RED, Fact, Sym, mixed, shared
from replicate.batchflow.rules import (
    control,
    elementwise,
    functional,
    gradshape,
    index,
    joins,
    lists,
    reduce,
    shape,
    slicing,
    sparse,
    spatial,
    stitch,
    strided,
    tail,
)
from replicate.batchflow.rules.common import couple, numbered, passthrough, row_numbers, runtime_sized, taint_of
from replicate.graph.ir import Node

__all__ = ["RULES", "apply", "WAITS_FOR_ALL"]

Rule = Callable[[Context, Node, list], list]


def _const(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    return [shared(ctx.int_value(f"{node.name}:0"))]


def _source(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    return [shared(taint=taint_of(ins))] * ctx.n_outputs(node)


def _identity(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    return passthrough(ins, ctx.n_outputs(node))


def _sample_rows(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    """``tf.random.categorical``: one row of samples per row of logits that hold the examples
    (row-wise); shared logits with a number of samples from the batch (one class per example,
    on axis 1) have no rule (review 24: taken as one global tensor, the rewrite failed)."""
    if ins[0].kind == PART:
        return reduce.rowwise(ctx, node, ins)
    return [ctx.no_rule(node, ins)] * ctx.n_outputs(node)


def _assign(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    return [shared(taint=taint_of(ins))] * ctx.n_outputs(node)


RULES: dict[str, Rule] = {}
RULES.update({op: elementwise.unary for op in table.UNARY})
RULES.update({op: elementwise.broadcast for op in table.BROADCAST | table.SAME_SHAPE})
RULES.update({op: reduce.reduction for op in table.REDUCTIONS})
RULES.update({op: reduce.arg_reduction for op in table.ARG_REDUCTIONS})
RULES.update({op: reduce.scan for op in table.SCANS})
RULES.update({op: reduce.last_axis for op in table.LAST_AXIS})
RULES.update({op: reduce.rowwise for op in table.ROWWISE})
RULES.update({op: reduce.inner_axes for op in table.INNER_AXES})
RULES.update({op: reduce.contraction for op in table.BATCH_CONTRACTIONS})
RULES.update({op: shape.shape_source for op in table.SHAPE_SOURCES})
RULES.update({op: _identity for op in table.PASS_THROUGH})
RULES.update({op: _source for op in table.SOURCES})
RULES.update({op: _assign for op in table.STATEFUL_PASS})
RULES.update({op: _sample_rows for op in table.PARAM_DRAWS})
RULES.update({
    "Const": _const, "HostConst": _const,
    "ClipByValue": elementwise.broadcast, "Select": elementwise.select,
    "MatMul": elementwise.matmul, "BatchMatMul": elementwise.batch_matmul,
    "BatchMatMulV2": elementwise.batch_matmul, "BatchMatMulV3": elementwise.batch_matmul,
    "L2Loss": reduce.l2loss, "Shape": reduce.shape, "ShapeN": reduce.shape_n, "Size": reduce.size,
    "Rank": reduce.rank, "Einsum": reduce.einsum,
    "Reshape": shape.reshape, "ExpandDims": shape.expand_dims, "Squeeze": shape.squeeze,
    "Transpose": shape.transpose, "ConjugateTranspose": shape.transpose,
    "ConcatV2": joins.concat, "Concat": joins.concat, "Pack": joins.pack, "Unpack": joins.unpack,
    "Split": joins.split, "SplitV": joins.split, "Slice": slicing.slice_,
    "StridedSlice": slicing.strided_slice, "StridedSliceGrad": slicing.strided_slice_grad,
    "Tile": shape.tile, "BroadcastTo": shape.broadcast_to, "Pad": shape.pad, "PadV2": shape.pad,
    "MirrorPad": shape.pad, "ReverseV2": shape.reverse, "OneHot": shape.one_hot,
    "RandomShuffle": shape.shuffle,
    "Range": strided.range_,
    "Gather": index.gather, "GatherV2": index.gather, "ResourceGather": index.gather,
    "LookupTableFindV2": index.lookup, "LookupTableFind": index.lookup,
    "GatherNd": index.gather_nd, "ResourceGatherNd": index.gather_nd, "Where": index.where,
    "Unique": index.unique, "UniqueV2": index.unique, "UniqueWithCounts": index.unique,
    "DynamicPartition": stitch.dynamic_partition,
    "DenseBincount": index.bincount, "Bincount": index.bincount,
    "UnsortedSegmentSum": index.segment, "UnsortedSegmentMax": index.segment,
    "UnsortedSegmentMin": index.segment, "UnsortedSegmentProd": index.segment,
    "SegmentSum": index.segment, "SegmentMax": index.segment, "SegmentMin": index.segment,
    "SegmentMean": index.segment, "SegmentProd": index.segment,
    "SparseToDense": sparse.to_dense, "ScatterNd": index.scatter_nd,
    **{f"TensorScatter{kind}": index.tensor_scatter for kind in ("Add", "Sub", "Update", "Max", "Min")},
    "RngReadAndSkip": shape.generator_state,
    "SpaceToBatchND": spatial.space_to_batch, "SpaceToBatch": spatial.space_to_batch,
    "BatchToSpaceND": spatial.batch_to_space, "BatchToSpace": spatial.batch_to_space,
    "CropAndResize": spatial.crop_and_resize, "CropAndResizeGradImage": spatial.crop_gradient,
    "CropAndResizeGradBoxes": spatial.crop_gradient,
    "SparseTensorDenseMatMul": sparse.dense_matmul, "SparseReduceSum": sparse.reduce_,
    "SparseReduceMax": sparse.reduce_, "SparseFillEmptyRows": sparse.fill_empty_rows,
    "SparseReshape": sparse.reshape, "CTCLoss": sparse.ctc_loss, "SparseCross": sparse.sparse_cross,
    "SparseCrossHashed": sparse.sparse_cross, "SparseCrossV2": sparse.sparse_cross,
    **{op: sparse.segment for op in (
        "SparseSegmentSum", "SparseSegmentMean", "SparseSegmentSqrtN", "SparseSegmentSumWithNumSegments",
        "SparseSegmentMeanWithNumSegments", "SparseSegmentSqrtNWithNumSegments")},
    **{op: sparse.segment_grad for op in (
        "SparseSegmentSumGrad", "SparseSegmentMeanGrad", "SparseSegmentSqrtNGrad")},
    "BroadcastGradientArgs": gradshape.broadcast_gradient_args, "BroadcastArgs": gradshape.broadcast_args,
    "ReverseSequence": index.reverse_sequence, "ComputeAccidentalHits": index.accidental_hits,
    **{op: index.candidate_sampler for op in (
        "LogUniformCandidateSampler", "UniformCandidateSampler", "LearnedUnigramCandidateSampler",
        "FixedUnigramCandidateSampler", "ThreadUnsafeUnigramCandidateSampler", "AllCandidateSampler")},
    "ConcatOffset": gradshape.concat_offset, "DynamicStitch": stitch.dynamic_stitch,
    "ParallelDynamicStitch": stitch.dynamic_stitch, "InvertPermutation": gradshape.invert_permutation,
    "Enter": _identity, "RefEnter": _identity, "Exit": _identity, "RefExit": _identity,
    "NextIteration": _identity, "RefNextIteration": _identity, "LoopCond": _identity,
    "Merge": control.merge, "RefMerge": control.merge,
    "Switch": control.switch, "RefSwitch": control.switch,
    "TensorArrayV3": control.array_new, "TensorArrayWriteV3": control.array_write,
    "TensorArrayReadV3": control.array_read, "TensorArrayGatherV3": control.array_gather,
    "TensorArrayConcatV3": control.array_concat, "TensorArrayScatterV3": control.array_scatter,
    "TensorArraySplitV3": control.array_split, "TensorArrayGradV3": control.array_grad,
    "TensorArrayGradWithShape": control.array_grad, "TensorArraySizeV3": control.array_size,
    "StackV2": control.stack_new, "Stack": control.stack_new,
    "StackPushV2": control.stack_push, "StackPush": control.stack_push,
    "StackPopV2": control.stack_pop, "StackPop": control.stack_pop,
    "While": functional.while_, "StatelessWhile": functional.while_,
    "If": functional.if_, "StatelessIf": functional.if_,
    "PartitionedCall": functional.partitioned_call,
    "StatefulPartitionedCall": functional.partitioned_call,
    "EmptyTensorList": lists.empty, "TensorListReserve": lists.empty,
    "TensorListPushBack": lists.push, "TensorListSetItem": lists.push,
    "TensorListPopBack": lists.pop, "TensorListGetItem": lists.get,
    "TensorListStack": lists.stack, "TensorListGather": lists.stack,
    "TensorListFromTensor": lists.from_tensor, "TensorListSplit": lists.from_tensor,
    "TensorListScatter": lists.from_tensor, "TensorListScatterV2": lists.from_tensor,
    "TensorListLength": lists.length, "TensorListElementShape": lists.length,
    "TensorListConcatV2": lists.concat, "TensorListConcat": lists.concat,
})

#: Ops whose rule runs while some inputs are still unknown (the loop back edge of a Merge).
WAITS_FOR_ALL = frozenset({"Merge", "RefMerge"})


def apply(ctx: Context, node: Node, ins: list[Fact | None]) -> list[Fact | None]:
    """The output facts of ``node`` given its input facts (None: not known yet)."""
    n = ctx.n_outputs(node)
    if node.op not in WAITS_FOR_ALL and any(f is None for f in ins):
        return [None] * n
    if any(tail.carries(f) for f in ins):
        out = tail.apply(ctx, node, ins)
        return (out + [out[-1]] * (n - len(out)))[:n]
    rule = RULES.get(node.op)
    if rule is None:
        return [ctx.no_rule(node, ins)] * n
    out = list(rule(ctx, node, ins))
    if len(out) < n:
        out += [out[-1] if out else shared()] * (n - len(out))
    return _sized_once(ctx, node, ins, _row_numbers_kept(ctx, node, ins, _coupled(ctx, node, ins, out[:n])))


def _sized_once(ctx: Context, node: Node, ins: list[Fact | None], out: list[Fact | None]) -> list[Fact | None]:
    """Forward results sized by an operand of :data:`table.SIZE_OPERANDS` that holds the
    batch size (``tf.shape(x)[0]``) anywhere but at the output's batch axis are mixed: each
    tower would use its own example count there, where one device uses the batch's (review
    41: ``tf.pad(h, [[0, 0], [0, B]])``, ``tf.scatter_nd(..., [B, B])``, a resize to ``B``
    were claimed exact, 0.5-1.2 off; review 42: ``top_k(h, B)``, ``tf.gather(h, [B], axis=1)``;
    the shape and slice ops' own rules check theirs)."""
    spec = table.SIZE_OPERANDS.get(node.op)
    if spec is None or ctx.in_gradient(node) or any(f is not None and f.kind == MIXED for f in out):
        return out
    positions, whole = spec
    axis = next((f.axis for f in out if f is not None and f.kind == PART), None)
    if whole == "off_axis":         # a gather: along the examples' axis it picks rows
        along = ctx.int_value(node.inputs[2]) if node.op == "GatherV2" and len(node.inputs) > 2 else (0,)
        if ins[0] is not None and ins[0].kind == PART and along is not None and along[:1] == (ins[0].axis,):
            return out
        whole = False
    for pos in (p for p in positions if p < len(ins)):
        value = ctx.int_value(node.inputs[pos])
        sized = ins[pos] is not None and ins[pos].kind == RED and ins[pos].merge == "size"
        # an operand computed from the batch (``tf.minimum(B, 5)``): the towers' own values
        computed = runtime_sized(ctx, node.inputs[pos], value, lambda j: not (whole and j == axis))
        if value is None and not sized and not computed:
            continue
        where = [j for j, v in enumerate(value or ()) if isinstance(v, Sym) and not (whole and j == axis)]
        if value is None or where or computed:
            return [mixed(node.name, f"{node.op} is sized by the batch size (operand {pos}): each "
                          "tower would use its own example count there", taint_of(ins))] * len(out)
    return out


def _coupled(ctx: Context, node: Node, ins: list[Fact | None], out: list[Fact | None]) -> list[Fact | None]:
    """Per-example results of forward code carry the couplings of every batch reduction among
    their operands, whatever their rule made of that operand (review 31: ``top_k(h, k)`` with
    ``k`` a batch maximum kept each tower's own k, claimed exact, 0.035 off)."""
    if ctx.in_gradient(node) or not any(f is not None and f.kind == RED for f in ins):
        return out
    taint = couple(ctx, node, [f for f in ins if f is not None])
    return [f.with_(taint=f.taint | taint) if f is not None and f.kind == PART and not taint <= f.taint else f
            for f in out]


#: Ops that call function bodies, which the dataflow analyses with their arguments' facts.
FUNCTIONAL = frozenset({"While", "StatelessWhile", "If", "StatelessIf", "PartitionedCall",
                        "StatefulPartitionedCall"})

#: Operand positions where a tower's row numbers are used as row numbers (to gather, scatter
#: or segment by), not as values.
ROW_NUMBER_OPERANDS = {
    "Gather": (1,), "GatherV2": (1,), "ResourceGather": (1,), "GatherNd": (1,),
    "ResourceGatherNd": (1,), "UnsortedSegmentSum": (1,), "UnsortedSegmentMax": (1,),
    "UnsortedSegmentMin": (1,), "UnsortedSegmentProd": (1,), "SegmentSum": (1,), "SegmentMax": (1,),
    "SegmentMin": (1,), "SegmentMean": (1,), "SegmentProd": (1,), "SparseToDense": (0,), "ScatterNd": (0,),
    "SparseTensorDenseMatMul": (0,), "SparseReduceSum": (0,), "SparseReduceMax": (0,),
    "SparseFillEmptyRows": (0,), "SparseReshape": (0,), "CTCLoss": (1,), "CropAndResize": (2,),
    "CropAndResizeGradImage": (2,), "CropAndResizeGradBoxes": (3,),
    **{op: (1, 2) for op in (       # the rows of the data looked up, and the segments
        "SparseSegmentSum", "SparseSegmentMean", "SparseSegmentSqrtN", "SparseSegmentSumWithNumSegments",
        "SparseSegmentMeanWithNumSegments", "SparseSegmentSqrtNWithNumSegments", "SparseSegmentSumGrad",
        "SparseSegmentMeanGrad", "SparseSegmentSqrtNGrad")},
}


def _row_numbers_kept(ctx: Context, node: Node, ins: list[Fact | None],
                      out: list[Fact | None]) -> list[Fact | None]:
    """A tower numbers its rows from 0 (``tf.range`` over the batch, ``tf.where``): those numbers
    are not values of its examples. A result computed from them as values must still say so
    (carry the row-number tag), or it is mixed: every rule that drops the tag falls here."""
    lookups = ROW_NUMBER_OPERANDS.get(node.op, ())
    if node.op in ("DynamicStitch", "ParallelDynamicStitch"):
        lookups = tuple(range(len(ins) // 2))       # the positions its rows go to
    elif node.op.startswith("SparseCross"):
        lookups = tuple(range(int(node.attr("N", 0))))     # the inputs' indices
    elif node.op in FUNCTIONAL:
        return out          # the body's own ops were held to this, each where it reads them
    if not any(row_numbers(f) for i, f in enumerate(ins) if i not in lookups):
        return out
    offsets = strided.kept(ctx, node, ins, out)
    if offsets is not None:
        return offsets
    dropped = [f is not None and (f.kind == RED or (f.kind == PART and not row_numbers(f))) for f in out]
    return [numbered(node, f.taint) if lost else f for f, lost in zip(out, dropped)]
