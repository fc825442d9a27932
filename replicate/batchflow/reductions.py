"""How values that summarize the batch combine across towers, and where towers must agree.

A loss or an output that reduces the batch (``reduce_mean``, ``reduce_sum``, the
``tf.compat.v1.losses`` reductions) is rebuilt from per-tower values with weights that make
it equal the single-device value: a mean over a tower's examples weighs by the tower's
share of the examples, a sum weighs 1, and a ratio of two batch sums (``SUM_BY_NONZERO_WEIGHTS``,
``MEAN`` with weights) weighs by the tower's share of the denominator. A batch reduction that
feeds per-example computations again (batch-norm statistics, a ``tf.cond`` on a batch sum)
couples the towers: replicated naively, each tower sees its own slice's value.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from replicate.batchflow.effects import writes
from replicate.graph import ops
from replicate.graph.ir import IR, node_of, parse_tensor, tensor_name

__all__ = ["Reduction", "reduction", "merge_kind", "reduces_batch_axis", "couplings",
           "FUSED_BATCH_NORM"]

FUSED_BATCH_NORM = frozenset({"FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3"})
_DIVISIONS = frozenset({"RealDiv", "DivNoNan", "Div", "TrueDiv"})
_SUMS = frozenset({"Add", "AddV2", "AddN", "Sub"})
_PASS = frozenset({"Identity", "Cast", "Snapshot", "StopGradient", "CheckNumerics", "EnsureShape",
                   "Reshape", "Squeeze", "ExpandDims", "Neg"})
#: Ops that drop or reorder examples: a mean after them is not over a fixed share of the batch.
ROW_FILTERS = frozenset({"Where", "DynamicPartition", "Unique", "UniqueV2", "UniqueWithCounts"})


@dataclasses.dataclass(frozen=True)
class Reduction:
    """How a batch-reduced tensor combines across towers.

    Attributes:
        kind: ``mean``, ``sum``, ``ratio``, ``max``, ``min`` or ``other``.
        weights: ``("count",)`` for each tower's share of the examples, ``("ones",)``,
            ``("size", t)`` for each tower's share of the elements of tensor ``t``, or
            ``("value", t)`` for each tower's share of the value of tensor ``t``.
        note: why the combination may be inexact ('' when exact).
    """

    kind: str
    weights: tuple = ("count",)
    note: str = ""


def reduces_batch_axis(ir: IR, node) -> bool:
    """True when reduction ``node`` reduces axis 0 (its reduction indices include 0)."""
    if node.op == "Size" or len(node.inputs) < 2:
        return True
    axes = ir.const_value(node_of(node.inputs[1]))
    if axes is None:
        return True
    shape = ir.static_shape(node.inputs[0])
    rank = len(shape) if shape is not None else None
    return any(a == 0 or (rank is not None and a == -rank) for a in np.atleast_1d(axes).tolist())


def _filtered(ir: IR, ref: str, dependent: set[str], limit: int = 400) -> bool:
    """True when a row-filtering op lies between the batch inputs and ``ref``."""
    work, seen = [node_of(ref)], set()
    while work and len(seen) < limit:
        name = work.pop()
        if name in seen or name not in dependent:
            continue
        seen.add(name)
        if ir.nodes[name].op in ROW_FILTERS:
            return True
        work.extend(node_of(r) for r in ir.nodes[name].inputs)
    return False


def reduction(ir: IR, ref: str, dependent: set[str], depth: int = 0) -> Reduction:
    """The :class:`Reduction` of batch-dependent tensor ``ref``."""
    name, idx = parse_tensor(ref)
    node = ir.nodes[name]
    if node.op in FUSED_BATCH_NORM:
        return Reduction("mean") if idx == 1 else Reduction("other", note="batch variance")
    kind = ops.REDUCTION_KINDS.get(node.op)
    if kind is not None and reduces_batch_axis(ir, node):
        if kind == "mean":
            data = tensor_name(*parse_tensor(node.inputs[0]))
            return Reduction("mean", ("size", data)) if _filtered(ir, data, dependent) else Reduction("mean")
        return Reduction(kind, ("ones",)) if kind == "sum" else Reduction(kind)
    if depth > 64:
        return Reduction("other", note="expression too deep")
    bd = [r for r in node.inputs if node_of(r) in dependent]
    if node.op in _DIVISIONS and len(bd) == 2 and node.inputs[0] == bd[0]:
        num, den = (reduction(ir, r, dependent, depth + 1) for r in bd)
        if num.kind == "sum" and den.kind == "sum":
            return Reduction("ratio", ("value", tensor_name(*parse_tensor(bd[1]))))
        return Reduction("other", note="ratio of values that are not batch sums")
    if node.op in ("Mul",) + tuple(_DIVISIONS) and len(bd) == 1 and (
            node.op == "Mul" or node.inputs[0] == bd[0]):
        return reduction(ir, bd[0], dependent, depth + 1)
    if node.op in _PASS and bd:
        return reduction(ir, bd[0], dependent, depth + 1)
    if node.op in _SUMS and bd:
        terms = [reduction(ir, r, dependent, depth + 1) for r in bd]
        kinds = {t.kind for t in terms}
        if len(kinds) == 1 and len({t.weights for t in terms}) == 1:
            return terms[0]
        if kinds <= {"mean", "ratio"}:
            return Reduction("mean", ("count",), note="terms average over different examples; "
                             "exact only if each is a mean over the whole batch")
        return Reduction("other", note=f"adds terms reduced differently ({', '.join(sorted(kinds))})")
    return Reduction("other", note=f"{node.op} of a batch-reduced value")


def merge_kind(ir: IR, ref: str, dependent: set[str], static_batch: int | None) -> Reduction:
    """How tower copies of forward tensor ``ref`` merge under its original name:
    ``concat`` for per-example tensors, else the tensor's :class:`Reduction`."""
    if ir.is_handle(ref):
        return Reduction("none")
    shape = ir.static_shape(ref)
    if shape and (shape[0] is None or shape[0] == static_batch):
        return Reduction("concat")
    red = reduction(ir, ref, dependent)
    from replicate.batchflow.roles import FLOAT_TYPES

    if red.kind in ("mean", "ratio") and ir.output_dtype(ref) not in FLOAT_TYPES:
        return Reduction("other", note="a mean of a non-float value")
    return red


def couplings(ir: IR, region: list[str], dependent: set[str], in_grad: set[str],
              static_batch: int | None) -> list[str]:
    """Forward batch reductions whose result flows back into per-example values.

    Such an op (batch-norm moments, a cond on a batch sum) makes each example's result depend
    on the rest of its batch; each tower sees only its slice.
    """
    inside = set(region)
    out = []
    for name in region:
        node = ir.nodes[name]
        if name in in_grad or name not in dependent:
            continue
        is_reduction = (node.op in FUSED_BATCH_NORM and node.attr("is_training", True)) or (
            node.op in ops.REDUCTION_KINDS and reduces_batch_axis(ir, node)
            and _per_example(ir, node.inputs[0], static_batch))
        if not is_reduction:
            continue
        if node.op in FUSED_BATCH_NORM or _reaches_per_example(ir, name, inside, in_grad, dependent,
                                                              static_batch):
            out.append(name)
    return out


def _per_example(ir: IR, ref: str, static_batch: int | None) -> bool:
    shape = ir.static_shape(ref)
    return bool(shape) and (shape[0] is None or shape[0] == static_batch)


def _reaches_per_example(ir: IR, start: str, inside: set[str], in_grad: set[str],
                         dependent: set[str], static_batch: int | None) -> bool:
    work, seen = [c.name for c in ir.consumers(start)], {start}
    while work:
        name = work.pop()
        if name in seen or name not in inside or name in in_grad:
            continue
        seen.add(name)
        node = ir.nodes[name]
        if writes(ir, node):
            continue
        if any(_per_example(ir, f"{name}:{i}", static_batch) for i in range(len(ir.output_types(node)))):
            return True
        work.extend(c.name for c in ir.consumers(name))
    return False
