"""Rules for reductions, per-example layers and the ops that read shapes.

A reduction over a partitioned axis gives a batch-reduced (RED) value whose merge follows
the reduction (``Sum`` adds, ``Mean`` weighs each tower by its share of the reduced
elements, ``Max``/``Min`` take extremes); over other axes the partition survives on a
shifted axis. Per-example layers (convolutions, pooling, cross-entropies) keep the batch on
axis 0; filter and bias gradients sum over it. ``Shape`` and ``Size`` of a partitioned
tensor are symbolic multiples of the tower's example count.
"""

from __future__ import annotations

import numpy as np
from tensorflow.python.framework import dtypes

from replicate.batchflow import table
from replicate.batchflow.context import Context
from replicate.batchflow.lattice import MIXED, PART, RED, SHARED, Fact, Sym
from replicate.batchflow.rules.common import (
    MISALIGNED,
    couple,
    first_mixed,
    misaligned,
    mixed,
    part,
    prologue,
    red,
    shared,
    size_fact,
    taint_of,
    unite,
)
from replicate.batchflow.rules.common import rows as _rows
from replicate.batchflow.rules.index import ENTRIES
from replicate.graph.ir import Node, node_of, parse_tensor, tensor_name

__all__ = ["reduction", "l2loss", "arg_reduction", "scan", "last_axis", "rowwise", "contraction",
           "shape", "shape_n", "size", "rank", "einsum"]


def _spec_size(ref: str) -> tuple:
    return ("size", tensor_name(*parse_tensor(ref)))


def _mean_spec(ref: str, f: Fact) -> tuple:
    """Weights of a mean over the batch: each tower's share of the examples when every example
    contributes the same number of elements, else its share of the elements reduced."""
    if f.filtered or f.block is None or f.outer is None:
        return _spec_size(ref)
    return ("count", f.cls)


def reduction(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    f = ins[0]
    merge = table.REDUCTIONS[node.op]
    keep = bool(node.attr("keep_dims", False))
    if f.kind == MIXED:
        return [f.with_(handle=None)]
    if f.kind == SHARED:
        folded = _fold(node.op, f.value) if f.value is not None and ctx.rank(node.inputs[0]) == 1 else None
        return [shared((folded,) if folded is not None else None, f.taint)]
    rank = ctx.rank(node.inputs[0])
    axes = ctx.axes(node.inputs[1], rank)
    if axes is None:
        return [mixed(node.name, f"{node.op} over axes known only at run time", f.taint)]
    dims = ctx.shape(node.inputs[0])
    if dims is not None:
        ctx.refine(f"{node.name}:0", [1 if i in axes else d for i, d in enumerate(dims)] if keep
                   else [d for i, d in enumerate(dims) if i not in axes])
    if f.kind == RED and f.merge == "size" and f.value is not None:
        value = _fold(node.op, f.value)
        if value is not None:
            return [size_fact((value,), f.taint)]
    if f.kind == RED:
        linear = merge in ("sum", "mean") and f.merge in ("sum", "mean", "ratio", "count", "size")
        if linear or (merge in ("max", "min") and f.merge == merge):
            return [f.with_(merge=f.merge if f.merge != "size" else "sum", value=None)]
        return [red(f.cls, "other", f.src, taint=f.taint).with_(
            why=f"'{node.name}': {node.op} of a value already reduced over the batch ({f.merge})")]
    if f.axis in axes:
        spec = _mean_spec(node.inputs[0], f) if merge == "mean" else ()
        if merge in ("min", "max") and node.op in ("All", "Any"):
            merge = "min" if node.op == "All" else "max"
        return [red(f.cls, merge, node.name, spec, f.taint).with_(
            why="" if merge != "other" else f"{node.op} over the batch")]
    axis = f.axis if keep else f.axis - sum(1 for a in axes if a < f.axis)
    return [f.with_(axis=axis, value=None, index=None)]


def _fold(op: str, values: tuple):
    """Reduce a symbolic shape vector to one value (``Prod`` of a shape is its size)."""
    values = tuple(None if isinstance(v, str) else v for v in values)   # named unknown dimensions
    syms = [v for v in values if isinstance(v, Sym)]
    ints = [v for v in values if isinstance(v, int)]
    if op == "Prod" and len(syms) == 1 and all(i >= 0 for i in ints):
        unknown = any(v is None for v in values)        # a dynamic dimension merged with the batch
        return syms[0].scaled(None if unknown else int(np.prod(ints)) if ints else 1)
    if any(v is None for v in values):
        return None
    if op == "Prod" and not syms and all(i >= 0 for i in ints):
        return int(np.prod(ints)) if ints else 1
    if op == "Sum" and not syms:
        return sum(ints)
    return None


def l2loss(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    f = ins[0]
    if f.kind == PART:
        return [red(f.cls, "sum", node.name, taint=f.taint)]
    if f.kind == RED:
        return [red(f.cls, "other", f.src, taint=f.taint).with_(why=f"'{node.name}': L2Loss of a reduced value")]
    return [f.with_(handle=None)]


def arg_reduction(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    f = ins[0]
    if f.kind != PART:
        return [f if f.kind != RED else red(f.cls, "other", f.src, taint=f.taint)]
    rank = ctx.rank(node.inputs[0])
    axes = ctx.axes(node.inputs[1], rank)
    if axes is None:
        return [mixed(node.name, f"{node.op} over an axis known only at run time", f.taint)]
    if axes[0] == f.axis:
        return [mixed(node.name, f"{node.op} over the batch picks an example's position", f.taint)]
    return [f.with_(axis=f.axis - (axes[0] < f.axis), value=None, index=None)]


def scan(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    f = ins[0]
    if f.kind != PART:
        return [f if f.kind != RED else red(f.cls, "other", f.src, taint=f.taint)]
    axes = ctx.axes(node.inputs[1], ctx.rank(node.inputs[0]))
    if axes is None or axes[0] == f.axis:
        fed = ctx.fed(node.inputs[0])
        flat = _counted_rows(ctx, node, fed) if node.op == "Cumsum" and fed is not None \
            and not ctx.in_gradient(node) else None
        if flat is not None:
            # lengths fed per example, summed into offsets (RaggedTensor.from_row_lengths):
            # offsets into rows fed flat for the whole batch, which no tower's slice of those
            # rows pairs with (review 29: the step failed on RaggedTensor's own check)
            ctx.refuse(node.name, f"{node.op} of the counts fed per example in '{fed}' makes "
                       f"offsets into the rows of '{flat}', fed flat for the whole batch (tokens "
                       "with their examples' lengths), which no tower's slice of those rows pairs with",
                       "feed the rows padded per example ([batch, length] with the lengths or a "
                       "mask), or train this graph on one device")
        return [mixed(node.name, f"{node.op} accumulates across the examples of the batch", f.taint)]
    return [f]


def _counted_rows(ctx: Context, node: Node, fed: str, hops: int = 8) -> str | None:
    """The batch input other than ``fed`` whose row count the running sum ``node`` of fed
    integer counts is compared with or offsets, within ``hops`` ops downstream (RaggedTensor's
    check ``nrows(values) == row_splits[-1]``), else None. Counts of rows the graph computes
    from the examples (``RaggedTensor.from_tensor(x, lengths)``) name no such input."""
    if not dtypes.as_dtype(ctx.ir.output_dtype(node.inputs[0])).is_integer:
        return None
    frontier, seen = [node.name], {node.name}
    for _ in range(hops):
        reached = []
        for name in frontier:
            for reader, _ in ctx.ir.data_consumers(f"{name}:0"):
                if reader.name in seen or ctx.in_gradient(reader):
                    continue            # (a gradient reads the shapes of every input: review 31)
                seen.add(reader.name)
                reached.append(reader.name)
                params = ctx.fed(reader.inputs[0]) if reader.op in ("GatherV2", "Gather", "GatherNd") else None
                if params is not None and params != fed:
                    return params           # the rows looked up at the offsets
                for ref in reader.inputs:
                    rows_of = _rows_counted(ctx, ref)
                    if rows_of is not None and rows_of != fed:
                        return rows_of
        frontier = reached
    return None


def _rows_counted(ctx: Context, ref: str) -> str | None:
    """The batch input whose row count ``ref`` is (``tf.shape(values)[0]``, cast), else None."""
    for _ in range(6):
        node = ctx.ir.nodes.get(node_of(ref))
        if node is None:
            return None
        if node.op in ("Shape", "Size"):
            rows_of = _rows_source(ctx, node.inputs[0])
            return rows_of if rows_of in ctx.inputs else None
        if node.op not in ("Identity", "Cast", "StridedSlice", "Squeeze", "Reshape") or not node.inputs:
            return None
        ref = node.inputs[0]
    return None


def _rows_source(ctx: Context, ref: str) -> str:
    """The tensor whose rows ``ref``'s rows are: through identities and lookups (an embedding
    of token ids fed flat has a row per id)."""
    for _ in range(8):
        node = ctx.ir.nodes.get(node_of(ref))
        if node is None or node.op not in ("Identity", "GatherV2", "ResourceGather", "Gather") \
                or (node.op == "GatherV2" and ctx.const(node.inputs[2]) is not None and int(ctx.const(node.inputs[2])) != 0):
            break
        ref = node.inputs[0] if node.op == "Identity" else node.inputs[1]
    return tensor_name(*parse_tensor(ref))


def last_axis(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    kind = table.LAST_AXIS[node.op]
    f = ins[0]
    n = ctx.n_outputs(node)
    bad = first_mixed(ins)
    if bad is not None:
        return [bad] * n
    if kind == "drop":       # InTopK(predictions [B, C], targets [B])
        parts_ = [x for x in ins if x.kind == PART]
        if any(x.axis != 0 for x in parts_):
            return [mixed(node.name, f"{node.op} with the batch on a class axis", taint_of(ins))]
        return [parts_[0].with_(value=None, index=None)] if parts_ else [shared(taint=taint_of(ins))]
    if f.kind != PART:
        return [f.with_(handle=None) if f.kind == SHARED else
                red(f.cls, "other", f.src, taint=f.taint).with_(why=f"'{node.name}': {node.op} of a reduced value")] * n
    rank = ctx.rank(node.inputs[0])
    if rank is None or f.axis == rank - 1:
        what = "selects examples across the batch" if kind == "topk" else "normalizes across the batch"
        return [mixed(node.name, f"{node.op} {what}", f.taint)] * n
    # (top_k's k from a batch reduction, the longest count of a batch: a coupling, each
    # tower's own k otherwise; review 31: claimed exact, 0.035 off)
    return [f.with_(value=None, index=None, taint=couple(ctx, node, ins))] * n


def inner_axes(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    """An op over the innermost axes (:data:`replicate.batchflow.table.INNER_AXES`): per
    example when every batch operand holds its examples on one of the other axes."""
    k, params = table.INNER_AXES[node.op]
    n = ctx.n_outputs(node)
    bad = first_mixed(ins)
    if bad is not None:
        return [bad] * n
    taint = taint_of(ins)
    if any(ins[i].kind not in (SHARED,) for i in params if i < len(ins)):
        return [mixed(node.name, f"{node.op} with per-example sizes", taint)] * n
    parts_ = [(i, f) for i, f in enumerate(ins) if f.kind == PART and i not in params]
    if not parts_:
        reds = [f for f in ins if f.kind == RED]
        return [red(reds[0].cls, "other", reds[0].src, taint=taint) if reds else shared(taint=taint)] * n
    for i, f in parts_:
        rank = ctx.rank(node.inputs[i])
        if rank is None or f.axis >= rank - k or f.axis != parts_[0][1].axis \
                or not ctx.classes.same(f.cls, parts_[0][1].cls):
            return [mixed(node.name, f"{node.op} over axes that hold the examples", taint)] * n
    if any(f.kind == RED for f in ins):
        return [mixed(node.name, f"{node.op} of per-example and batch-reduced values", taint)] * n
    return [parts_[0][1].with_(value=None, index=None, taint=taint)] * n


def rowwise(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    spec = table.ROWWISE[node.op]
    n = ctx.n_outputs(node)
    bad = first_mixed(ins)
    if bad is not None:
        return [bad] * n
    per_example = _examples_as_channels(ctx, node, ins, n)
    if per_example is not None:
        return per_example
    data = [ins[i] for i in spec.data if i < len(ins)]
    parts_ = [f for f in data if f.kind == PART]
    taint = couple(ctx, node, ins)
    for i in spec.params:
        if i < len(ins) and ins[i].kind == PART:
            return [mixed(node.name, f"input {i} of {node.op} depends on the examples", taint)] * n
    if not parts_:
        if any(f.kind == RED for f in ins):
            return [red(None, "other", node.name, taint=taint).with_(why=f"{node.op} of reduced values")] * n
        return [shared(taint=taint)] * n
    if any(f.axis != 0 for f in parts_):
        return [mixed(node.name, f"{node.op} expects the examples on axis 0", taint)] * n
    first = parts_[0]
    if misaligned(parts_):                      # see common.combine_parts
        return [mixed(node.name, MISALIGNED, taint)] * n
    for other in parts_[1:]:
        unite(ctx, first, other, node)
    for i in spec.data:
        if i < len(ins) and ins[i].kind == SHARED and (ctx.rank(node.inputs[i]) or 0) > 0:
            ctx.demand(node.inputs[i], 0, first, node)
    for i in spec.sizes:
        ctx.position(node.inputs[i], 0, first.cls, _rows(first), node)
    out_part = first.with_(value=None, index=None, taint=taint)
    training = node.op.startswith("FusedBatchNorm") and "Grad" not in node.op and \
        bool(node.attr("is_training", True))
    if training:
        out_part = out_part.with_(taint=taint | ({node.name} if not ctx.in_gradient(node) else set()))
    outs: list[Fact] = []
    stats = dict(spec.stats)
    for i in range(n):
        if i in spec.reduced:
            outs.append(red(first.cls, "sum", node.name, taint=taint))
        elif i in stats:
            if training:
                merge = stats[i]
                outs.append(red(first.cls, merge, node.name,
                                _spec_size(node.inputs[0]) if merge == "mean" else (), taint))
            else:
                outs.append(ins[i + 2] if i + 2 < len(ins) and i in (1, 2) else shared())
        else:
            outs.append(out_part)
    return outs


#: Batch norm ops -> (inputs that hold the examples on the channel axis, per-channel inputs,
#: per-channel outputs) when the examples are the channels.
_CHANNEL_NORMS = {
    **{op: ((0,), (1, 2), (1, 2, 3, 4)) for op in ("FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3")},
    **{op: ((0, 1), (2, 3, 4), (1, 2)) for op in ("FusedBatchNormGrad", "FusedBatchNormGradV2",
                                                 "FusedBatchNormGradV3")},
}


def _examples_as_channels(ctx: Context, node: Node, ins: list[Fact], n: int) -> list[Fact] | None:
    """A training-mode batch norm whose *channels* are the examples (Keras
    ``LayerNormalization`` reshapes ``[B, H]`` to ``[1, B, H, 1]``, NCHW, with a scale of ones
    per example): its per-channel statistics are per-example ones, so its outputs keep the
    examples (on the channel axis, and on axis 0 of the per-channel outputs). It was "input 1
    depends on the examples": inexact, though it trains exactly. None when not that case."""
    if node.op not in _CHANNEL_NORMS or not bool(node.attr("is_training", True)):
        return None
    data, channels, outputs = _CHANNEL_NORMS[node.op]
    fmt = node.attr("data_format", "NHWC")
    fmt = fmt.decode() if isinstance(fmt, bytes) else fmt
    rank = ctx.rank(node.inputs[data[0]])
    if rank is None:
        return None
    axis = 1 if fmt.startswith("NC") else rank - 1
    xs = [ins[i] for i in data]
    per = [ins[i] for i in channels if i < len(ins)]
    if not all(f.kind == PART and f.axis == axis for f in xs) or \
            not all(f.kind == PART and f.axis == 0 and _rows(f) == _rows(xs[0]) for f in per):
        return None
    for f in xs[1:] + per:
        if not unite(ctx, xs[0], f, node):
            return None
    taint = couple(ctx, node, ins)
    out = []
    for i in range(n):
        if i == 0:
            out.append(xs[0].with_(value=None, index=None, taint=taint))
        elif i in outputs:
            out.append(part(0, xs[0].cls, xs[0].block, taint=taint, outer=xs[0].outer))
        else:
            out.append(shared(taint=taint))     # reserve spaces the kernel leaves empty
    return out


def einsum(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    """``Einsum`` with an explicit output: the batch axis is one subscript letter; kept in the
    output it stays partitioned there, summed away it is a sum over the examples. A shared
    operand carrying that letter (its axis would be the batch's size) mixes examples."""
    taint, settled = prologue(ctx, node, ins)
    if settled is not None:
        return settled
    equation = node.attr("equation", "")
    equation = (equation.decode() if isinstance(equation, bytes) else str(equation)).replace(" ", "")
    if "->" not in equation or "." in equation:
        return [mixed(node.name, "Einsum with an implicit output or an ellipsis", taint)]
    lhs, out = equation.split("->")
    subs = lhs.split(",")
    if len(subs) != len(ins) or any(f.kind == RED for f in ins):
        return [mixed(node.name, "Einsum of a batch-reduced value", taint)]
    letter, first = None, None
    for f, sub in zip(ins, subs):
        if f.kind != PART:
            continue
        if f.axis >= len(sub) or (letter is not None and sub[f.axis] != letter):
            return [mixed(node.name, "Einsum of two batch axes", taint)]
        if letter is None:
            letter, first = sub[f.axis], f
        else:
            ctx.classes.union(first.cls, f.cls, node.name)
    if any(f.kind == SHARED and letter in sub for f, sub in zip(ins, subs)):
        return [mixed(node.name, "Einsum pairs the examples with an axis of a shared operand", taint)]
    if letter in out:
        return [first.with_(axis=out.index(letter), value=None, index=None, taint=taint)]
    return [red(first.cls, "sum", node.name, taint=taint)]


def contraction(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    spec = table.BATCH_CONTRACTIONS[node.op]
    bad = first_mixed(ins)
    if bad is not None:
        return [bad]
    parts_ = [ins[i] for i in spec.data if i < len(ins) and ins[i].kind == PART]
    taint = couple(ctx, node, ins)
    if not parts_:
        return [shared(taint=taint) if not any(f.kind == RED for f in ins)
                else red(None, "other", node.name, taint=taint)]
    if any(f.axis != 0 for f in parts_):
        return [mixed(node.name, f"{node.op} expects the examples on axis 0", taint)]
    return [red(parts_[0].cls, "sum", node.name, taint=taint)]


def _shape_value(ctx: Context, ref: str, f: Fact) -> tuple | None:
    """The symbolic value of ``Shape(ref)``: the batch size as a ``Sym``, known sizes as ints,
    unknown ones as named dimensions (strings)."""
    dims = ctx.named_shape(ref, skip=f.axis if f.kind == PART else None)
    if dims is None:
        return None
    out: list = list(dims)
    if f.kind == PART:
        outer = f.outer if isinstance(f.outer, int) and isinstance(f.block, int) else 1
        out[f.axis] = Sym(_rows(f), f.cls, outer)
    return tuple(out)


def shape(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    f = ins[0]
    if f.kind == MIXED:
        return [f.with_(handle=None)]
    value = _shape_value(ctx, node.inputs[0], f)
    if f.kind != PART:
        return [shared(value, f.taint)]
    if value is None:
        return [red(f.cls, "size", None, taint=f.taint)]
    return [size_fact(value, f.taint if _coupled_dims(value, f) else frozenset())]


def _coupled_dims(value: tuple, f) -> bool:
    """A shape may carry a coupling (a batch statistic) in its dimensions other than the
    batch's; when they are all static, only the tower's own count is left, which no batch
    statistic decides (``ones_like(losses)`` of batch-normalized logits)."""
    return any(not isinstance(v, int) for i, v in enumerate(value) if i != f.axis)


def shape_n(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    return [shape(ctx, node.__class__(node.name, "Shape", [ref], [], "", {}), [f])[0]
            for ref, f in zip(node.inputs, ins)]


def rank(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    """The rank: the same in every tower, and known where the dataflow knows the shape (a
    reduction TensorFlow could not infer, whose ``Mean`` then reads ``range(rank)``)."""
    r = ctx.rank(node.inputs[0])
    return [shared((r,) if r is not None else None)]


def _entry_count(node: Node, f: Fact) -> Fact | None:
    """The number of a SparseTensor's entries: a tower's count is no share of the examples (a
    tower whose examples have no entry counts zero), so nothing may weigh towers by it (a
    loss divided by it was claimed exact and dropped such a tower's share)."""
    if f.kind == PART and f.handle == ENTRIES:
        return red(f.cls, "other", node.name, taint=f.taint).with_(
            why="the number of a SparseTensor's entries, which is no share of the examples")
    return None


def size(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    f = ins[0]
    if f.kind == MIXED:
        return [f.with_(handle=None)]
    counted = _entry_count(node, f)
    if counted is not None:
        return [counted]
    dims = ctx.shape(node.inputs[0])
    if f.kind != PART:
        total = int(np.prod(dims)) if dims is not None and None not in dims else None
        return [shared((total,) if total is not None else None, f.taint)]
    rest = [d for i, d in enumerate(dims or []) if i != f.axis] if dims is not None else None
    if rest is None or None in rest or _rows(f) is None:
        if f.filtered or f.tail:                # a selection's count: the data decides it
            return [red(f.cls, "size", None, taint=f.taint)]
        # every other dimension is the same in every tower (a dynamic time axis): a multiple
        # of the batch size the same in every tower (review 28 P7: tf.size of a [B, T] loss)
        return [size_fact((Sym(None, f.cls),), f.taint)]
    return [size_fact((Sym(int(np.prod(rest)) * _rows(f), f.cls),), f.taint)]
