"""How the towers' copies of a forward tensor combine into the single-device value.

Read from the tensor's fact: a partitioned tensor whose towers hold its rows in order is
concatenated along its batch axis; a batch reduction combines by its merge (a weighted mean,
a sum, an extreme); anything else cannot be merged (a shape, a mixed value, rows out of
order), and fetching it gives tower 0's value.
"""

from __future__ import annotations

import dataclasses

from tensorflow.core.framework import types_pb2

from replicate.batchflow.lattice import MIXED, PART, RED, Sym
from replicate.batchflow.loss import UNNORMALIZED, shares_suffice
from replicate.graph.ir import IR, node_of, parse_tensor, tensor_name

__all__ = ["Merge", "merge_kind", "recompute_plan", "batch_multiple"]


@dataclasses.dataclass(frozen=True)
class Merge:
    """``kind`` is ``concat``, ``mean``, ``ratio``, ``sum``, ``max``, ``min``, ``other`` (not
    mergeable) or ``none`` (a handle); ``weights`` as in :func:`replicate.passes._combine.weight`."""

    kind: str
    weights: tuple = ("count",)
    axis: int = 0
    note: str = ""
    tail: int = 0
    #: copies of the batch one after the other along ``axis`` (a time-major ``[T*B, H]``):
    #: an int, or a named dimension ``"tensor#dim"`` whose size it is
    outer: int | str = 1


def merge_kind(ir: IR, flow, ref: str, synced: frozenset | None = None) -> Merge:
    """How tower copies of forward tensor ``ref`` merge under its original name. With
    ``synced`` (the reductions every tower reads synchronized), a batch reduction of values
    that another, unsynchronized batch reduction reaches (a variance: the mean of squares
    around the batch mean) does not merge: each tower's value is around its own mean, and
    their mean is not the batch's (review 43: 0.43 fetched for 4.0)."""
    if ir.is_handle(ref):
        return Merge("none")
    if ir.output_dtype(ref) == types_pb2.DT_VARIANT:
        return Merge("other", note="a TensorList or other variant")
    fact = flow.fact(ref)
    if fact is None or fact.kind == MIXED:
        return Merge("other", note=fact.why if fact is not None else "not analysed")
    if fact.kind == PART:
        if fact.tail:
            if fact.tail[1] == "shared" and fact.ordered and fact.outer == 1 and fact.index is None:
                return Merge("concat", axis=fact.axis, tail=fact.tail[0])   # heads, then tower 0's tail
            return Merge("other", note="rows that are part batch, part shared")
        if fact.index is not None:
            return Merge("other", note="row numbers local to each tower")
        if fact.ordered and fact.outer == 1:
            return Merge("concat", axis=fact.axis)
        if fact.ordered and fact.index is None and isinstance(fact.block, int) and (
                (isinstance(fact.outer, int) and fact.outer > 1) or _named(fact.outer)):
            return Merge("concat", axis=fact.axis, outer=fact.outer)   # each copy's rows joined
        return Merge("other", note="the towers hold its rows in another order")
    if fact.kind == RED and synced is not None and fact.taint - synced:
        return Merge("other", note="a batch reduction of values another batch reduction reaches "
                     f"('{sorted(fact.taint - synced)[0]}'; recomputed from the batch's values)")
    if fact.kind == RED:
        spec = fact.spec
        if spec and spec[0] == "count":
            spec = ("count", flow.classes.find(spec[1]))
        if _weights_in_branch(ir, spec, ref):
            return Merge("other", note="weighted by a count taken inside a TF1 cond's branch, "
                         "which a step may not run")
        if fact.merge in ("sum", "count") or batch_multiple(fact):
            return Merge("sum", ("ones",))
        if fact.merge in ("mean", "ratio"):
            from replicate.batchflow.roles import FLOAT_TYPES

            if ir.output_dtype(ref) not in FLOAT_TYPES:
                return Merge("other", note="a mean of a non-float value")
            numerator = f"{fact.src}:0" if fact.src in ir.nodes else None
            if fact.merge == "ratio" and spec and spec[0] in UNNORMALIZED:
                return Merge("other", note="a ratio over a shifted count (maximum(S, c)), whose "
                             "towers' shares need not add up to one: a term added to it would "
                             "not (recomputed from the batch's sums)")
            if fact.merge == "ratio" and not shares_suffice(flow.ctx, spec, numerator):
                return Merge("other", note="a ratio whose numerator need not vanish where its "
                             "count does (recomputed from the batch's sums)")
            return Merge(fact.merge, spec)
        if fact.merge in ("max", "min"):
            return Merge(fact.merge)
        return Merge("other", note=fact.why or f"a batch-dependent {fact.merge} value")
    return Merge("other", note="shared")


def _named(outer) -> bool:
    """``outer`` is a dimension of a tensor, named ``"tensor#dim"`` (not an anonymous one)."""
    return isinstance(outer, str) and "#" in outer and not outer.startswith("?")


def _weights_in_branch(ir: IR, spec: tuple, ref: str) -> bool:
    """A merge weighed by a tensor inside a TF1 cond's branch (the size of rows a branch masks),
    for a value after the cond: in a step that skips the branch the weight is dead, and so was
    the merged value (review 44: "Retval[0] does not have value")."""
    if len(spec) < 2 or not isinstance(spec[1], str) or node_of(spec[1]) not in ir.nodes:
        return False
    return _switched(ir, node_of(spec[1])) and not _switched(ir, node_of(ref))


def _switched(ir: IR, name: str, limit: int = 2000) -> bool:
    """A ``Switch`` feeds node ``name`` (by data) with no ``Merge`` closing it on the way: it
    runs in a branch of a TF1 cond."""
    seen, work = {name}, [name]
    while work and len(seen) < limit:
        node = ir.nodes[work.pop()]
        if node.op in ("Switch", "RefSwitch"):
            return True
        if node.op in ("Merge", "RefMerge"):
            continue
        for ref in node.inputs:
            producer = node_of(ref)
            if producer in ir.nodes and producer not in seen:
                seen.add(producer)
                work.append(producer)
    return False


def _resized_by(plan) -> tuple[frozenset, frozenset]:
    """(tensors and nodes whose values, nodes whose attributes) the rewrite resizes to each
    tower's batch (a static batch size baked into a shape)."""
    if plan is None:
        return frozenset(), frozenset()
    planned = set(plan.consts) | set(plan.substitutes) | set(plan.resized) | set(plan.promote) \
        | {key[0] for key in plan.elements}
    return frozenset(planned), frozenset(key[0] for key in plan.attrs)


def _rebatched(resized: tuple[frozenset, frozenset], node) -> bool:
    """``node`` reads a value or has an attribute the rewrite resizes to each tower's batch
    (``resized`` from :func:`_resized_by`): run once on the merged values it would not fit."""
    planned, attrs = resized
    if node.name in attrs:
        return True
    if not planned:
        return False
    for ref in node.inputs:
        ref = tensor_name(*parse_tensor(ref))
        if ref in planned or node_of(ref) in planned:   # the plan names some by node (elements)
            return True
    return False


def batch_multiple(fact) -> bool:
    """``fact`` is a size that is a known multiple of the batch size (``tf.size`` of the
    labels, a metric's example count): the towers' sizes add up to the batch's. Not a size
    only computed from the batch (a padded length of a dynamic axis beside it, the same in
    every tower: summed it was N times too long)."""
    return fact.kind == RED and fact.merge == "size" and fact.value is not None \
        and len(fact.value) == 1 and isinstance(fact.value[0], Sym) and isinstance(fact.value[0].coef, int)


#: The most ops a recomputed output may need (it runs once, on the controller).
MAX_RECOMPUTE = 64


def recompute_plan(ir: IR, flow, ref: str, region: set[str], gradient: set[str], dependent: set[str],
                   mergeable, blocked: set[str] | None = None) -> tuple[list[str], list[str]] | None:
    """The ops that compute ``ref`` from values available once for the whole batch: merged
    tensors (``mergeable(t)``), shared values (tower 0's copies) and nodes outside the towers.
    Running them once on those inputs is the single-device computation itself, so the result is
    exact. None when an op on the way is stateful, random, control flow or gradient code.

    ``blocked``: nodes that no plan can recompute, shared by the calls of one analysis (found by
    one call, never walked again by the next: a ResNet asks for hundreds of plans)."""
    from replicate.graph import ops

    blocked = set() if blocked is None else blocked
    resized = _resized_by(flow.plan)
    nodes: list[str] = []
    needs: dict[str, None] = {}
    state: dict[str, bool] = {}
    failed: list[str] = []          # nodes that failed for what they are or read, not for size
    overflow: list[bool] = []

    def visit(name: str) -> bool:
        if name in state:
            return state[name]
        state[name] = False
        if name in blocked:
            return False
        if len(nodes) >= MAX_RECOMPUTE:
            overflow.append(True)
            return False
        node = ir.nodes[name]
        op_def = ir.op_def(node.op)
        if name in gradient or node.op in ops.CONTROL_FLOW_OPS or op_def is None or \
                op_def.is_stateful and node.op not in ops.NUMERIC_CHECK_OPS or \
                _rebatched(resized, node):       # a size the rewrite makes the tower's
            blocked.add(name)
            return False
        for inp in node.inputs:
            producer = node_of(inp)
            if producer not in region or producer not in dependent:
                continue
            if mergeable(inp):
                needs.setdefault(tensor_name(*parse_tensor(inp)), None)
                continue
            if not visit(producer):
                if producer in blocked:
                    failed.append(name)
                return False
        nodes.append(name)
        state[name] = len(nodes) <= MAX_RECOMPUTE
        if not state[name]:
            overflow.append(True)
        return state[name]

    found = visit(node_of(ref))
    blocked.update(failed)          # each reads a blocked node: no plan can run it either
    if not found and overflow and not failed:
        blocked.add(node_of(ref))   # needs more ops than a plan may run, whatever else it has
    return (nodes, list(needs)) if found else None
