"""Helper of the analyze pass: classify the tensors that cross from towers to shared nodes.

Gradients (tensors of a ``gradients`` scope read by shared ops) are aggregated: dense
ones by a count-weighted sum, sparse ones (IndexedSlices values and indices) by
concatenation. Forward tensors (the loss, logits, anything a shared op or a driver
reads) are merged under their original names by concatenation, a count-weighted
mean, a sum, a max or a min.
"""

from __future__ import annotations

import dataclasses

import collections

from replicate.batchflow.effects import writes
from replicate.batchflow.facts import ApplyOp, Frontier, GradScope
from replicate.batchflow.merge import merge_kind, recompute_plan
from replicate.batchflow.roles import FLOAT_TYPES, sparse_roles
from replicate.errors import AnalysisError
from replicate.graph import ops
from replicate.graph.ir import IR, node_of, parse_tensor, tensor_name
from replicate.passes._synced import global_value

__all__ = ["classify", "fetch_cone"]

_MERGEABLE = frozenset({"concat", "mean", "sum", "ratio", "max", "min"})


def classify(ir: IR, region: list[str], dependent: set[str], in_grad: set[str],
             scopes: list[GradScope], apply_ops: list[ApplyOp], flow,
             losses: list[str], outputs: tuple[str, ...], merge_forward: bool,
             dead: set[str] = frozenset(), checks: tuple[str, ...] = (), syncs: frozenset = frozenset()) -> tuple[list[Frontier], list[Frontier], list[str], list[str]]:
    """Return (gradient frontier, forward outputs to merge, tensors read by shared ops that
    cannot be merged: tower 0's value stands in for them, gradient rows whose sharing between
    the towers the analysis could not establish: concatenated, which only linear updates
    add up right). ``checks``: conditions of assertions, merged or recomputed where they
    can be; ``syncs``: the reductions every tower reads synchronized."""
    inside = set(region)
    crossing: dict[str, None] = {}
    for name in region:
        for consumer in ir.consumers(name):
            if consumer.name in inside or consumer.name in dead:
                continue
            for ref in consumer.inputs:
                if node_of(ref) == name:
                    crossing.setdefault(tensor_name(*parse_tensor(ref)), None)
    crossing_sorted = _sorted(ir, crossing)
    # an update's gradient the same in every tower (a variable trained only through its L2
    # term) is aggregated too: each tower's is its weighted share (review 30: it was a reason,
    # and weighed in the towers tower 0's share alone would have been applied)
    applied = {tensor_name(*parse_tensor(a.grad)) for a in apply_ops if a.grad}
    grads = [t for t in crossing_sorted if node_of(t) in in_grad and (node_of(t) in dependent or t in applied)]
    pairs: list[tuple[str, str]] = []
    roles = sparse_roles(ir, set(grads), pairs)
    variables = _nearest_variables(ir, grads, apply_ops)
    frontier: list[Frontier] = []
    doubtful: list[tuple[str, object]] = []
    for t in grads:
        role = roles.get(t)
        if role is None:
            shape = ir.static_shape(t)
            if ir.output_dtype(t) in FLOAT_TYPES:
                role = "dense"
            elif shape is None or len(shape) == 1:
                role = "sparse_indices"
            else:
                role = "first"
        fact = flow.fact(t)
        if fact is not None and fact.kind == "mixed" and ("part batch, part shared" in fact.why
                                                          or "adds shared rows" in fact.why):
            doubtful.append((t, fact))
        tail = fact.tail[0] if fact is not None and fact.tail and fact.axis == 0 else 0
        if role == "sparse_values" and fact is not None and fact.kind == "red" and fact.merge == "sum":
            role = "dense"          # rows picked by shared ids: each tower holds its share of them
        elif role == "sparse_indices" and fact is not None and fact.kind == "shared":
            role = "first"          # the same ids in every tower
        if role == "dense" and fact is not None and fact.kind == "part":
            # per-example rows (an IndexedSlices' values after ops the role walk does not know)
            if fact.axis != 0 or not (fact.ordered or fact.tail) or fact.outer != 1:
                raise AnalysisError(f"cannot combine the towers' gradient '{t}': it has one row per "
                                    f"example on axis {fact.axis}, not in batch order")
            role = "sparse_values"
        if fact is not None and fact.tail and (not tail or role == "first"):
            raise AnalysisError(f"gradient '{t}' has rows that are part batch, part shared on axis "
                                f"{fact.axis}; replicate combines such gradients only along axis 0")
        frontier.append(Frontier(t, role, True, variables.get(t), _scope_weights(t, scopes), tail=tail))
    frontier = _pair_shared_ids(frontier, pairs)

    unmergeable: list[str] = []
    forward_only: list[str] = []
    recomputed: set[str] = set()        # nodes recomputed once from merged values, by name
    merged: dict[str, Frontier] = {}
    blocked: set[str] = set()           # nodes no recompute plan can run (shared by the plans)
    plans: dict[str, tuple | None] = {}  # by node: a plan runs nodes (a batch norm's 5 outputs)
    mergeable: dict[str, bool] = {}

    def joins(r: str) -> bool:
        """The towers' copies of ``r`` merge into the batch's value, or each holds it already
        (computed from synchronized reductions: a ratio of synchronized sums in a TF1 cond's
        branch, review 44 A2): a plan's input."""
        if r not in mergeable:
            mergeable[r] = (_untainted(flow, r, syncs) and merge_kind(ir, flow, r, syncs).kind in _MERGEABLE) \
                or bool(syncs) and global_value(flow, r, syncs)
        return mergeable[r]

    def add(t: str, required: bool, recompute: bool = False) -> None:
        if t in merged or node_of(t) not in dependent:
            return
        red = merge_kind(ir, flow, t, syncs)
        if red.kind not in _MERGEABLE:
            fact = flow.fact(t)
            summary = ir.nodes[node_of(t)].op in ops.SUMMARY_VALUE    # of the batch's values
            if red.kind != "none" and (required or recompute or summary or (fact is not None and fact.kind == "red")):
                if node_of(t) not in plans:
                    plans[node_of(t)] = recompute_plan(ir, flow, t, inside, in_grad, dependent, joins, blocked)
                plan = plans[node_of(t)]
                if plan is not None:
                    nodes, needs = plan
                    recomputed.update(nodes)
                    for ref in needs:
                        add(ref, True)
                    merged[t] = Frontier(t, "recompute", False, recompute=tuple(nodes))
                    return
            if not required:
                if red.kind != "none" and not ir.is_handle(t) and node_of(t) not in recomputed:
                    # a forward tensor a driver may fetch by name keeps it: tower 0's value
                    # (it used to vanish, and the driver's fetch failed)
                    merged[t] = Frontier(t, "first", False)
                    if fact is None or fact.kind != "shared":   # else tower 0's is everyone's
                        forward_only.append(t)
                return
            fact = flow.fact(t)
            if red.kind == "none" and fact is not None and fact.kind == "shared":
                merged[t] = Frontier(t, "first", False)     # one resource, passed through a
                return                                      # loop: every tower's is the same
            if red.kind == "none" and _switched_handle(ir, flow, t) and not _awaited(ir, t, inside):
                unmergeable.append(t)       # the variable's, switched as tower 0 decides: a reason
                merged[t] = Frontier(t, "first", False)
                return
            if red.kind == "none" and _switched_handle(ir, flow, t):
                sized = "batch size" in (fact.why or "")
                raise AnalysisError(f"'{t}' passes a variable into a TF1 cond whose condition each "
                                    f"tower decides for itself ({fact.why} at '{fact.src}'), and "
                                    "the towers wait for the state update there, which runs once: "
                                    + ("replicate synchronizes a batch size only where it is used "
                                       "as a number alone (not also as a shape, a position or in a "
                                       "function body), and not every count of selected rows: "
                                       "compute the condition from a tf.shape(x)[0] of its own, or "
                                       "count with tf.reduce_sum of a mask, "
                                       if sized else SWITCHED_FIX + ", ")
                                    + "or move the state update out of the cond")
            if red.kind == "none":
                why = f" ({fact.why} at '{fact.src}')" if fact is not None and fact.kind == "mixed" else ""
                raise AnalysisError(f"'{t}' is a handle computed per tower{why} and read by a shared "
                                    "op; it cannot be merged")
            unmergeable.append(t)
            merged[t] = Frontier(t, "first", False)
            return
        merged[t] = Frontier(t, red.kind, False, weights=red.weights, axis=red.axis, tail=red.tail,
                             outer=red.outer)

    for t in crossing_sorted:
        if node_of(t) not in in_grad:
            add(t, True)
    for t in losses:
        add(t, True)
    for name in outputs:
        for t in _resolve(ir, name):
            if node_of(t) in in_grad and node_of(t) in dependent and t not in crossing:
                frontier.append(Frontier(t, "dense", True, None, _scope_weights(t, scopes)))
            else:
                add(t, True)
    for t in checks:
        add(t, False, recompute=True)
    if merge_forward:
        updates = {n for n in region if writes(ir, ir.nodes[n])}
        for name in region:
            if name in in_grad or name in updates or name not in dependent:
                continue
            for i in range(len(ir.output_types(ir.nodes[name]))):
                add(tensor_name(name, i), False)
    if doubtful and any(f.tail for f in frontier):
        t, fact = doubtful[0]
        raise AnalysisError(f"cannot combine the towers' gradient '{t}': {fact.why} at "
                            f"'{fact.src}', while another part of it has shared rows after the "
                            "batch rows (replicate follows such rows through gathers, slices, "
                            "reshapes, concatenations and elementwise ops only). "
                            + ("Keep the variable the sampled loss reads in one piece (no "
                               "partitioner: the loss then gathers from it directly), or "
                               if "Dynamic" in fact.why else "")
                            + "train this graph on one device")
    # a node a recompute plan runs once on merged inputs gives every output the batch's value:
    # merging an output of it from the towers too replaced it by the towers' copies (a
    # defun's outputs: tower 0's rows met the batch's labels in the recomputed loss)
    merged = {t: f for t, f in merged.items() if f.role == "recompute" or node_of(t) not in recomputed}
    return (frontier, [merged[t] for t in _sorted(ir, merged)], unmergeable,
            [t for t, _ in doubtful], forward_only)


#: What to do about a state update in a TF1 cond each tower decides for itself (here and in
#: the reason the analyze pass gives when nothing waits for it).
SWITCHED_FIX = ("decide the cond from a value every tower shares (a fed flag, the batch size, a "
                "batch sum under batch_norm='sync')")


def _switched_handle(ir: IR, flow, t: str) -> bool:
    """``t`` is the handle of a variable every tower shares, passed by the ``Switch`` of a TF1
    cond whose predicate each tower decides for itself (an argmax over the batch): the same
    resource in every tower, live as tower 0 decides. A shared op that reads it (a state write
    in the branch) runs as tower 0 decides, which is a reason, not a refusal (review 49 L1),
    unless the towers wait for it (:func:`_awaited`)."""
    node = ir.nodes[node_of(t)]
    data = flow.fact(node.inputs[0]) if node.op in ("Switch", "RefSwitch") else None
    return data is not None and data.kind == "shared"


def _awaited(ir: IR, t: str, region: set[str]) -> bool:
    """A tower's op waits for a shared reader of ``t``: in a tower that decides the cond
    otherwise than tower 0 it waited for an op that never ran, and the step failed ("Retval[0]
    does not have value")."""
    readers = [c.name for c, _ in ir.data_consumers(t) if c.name not in region]
    return any(c.name in region for r in readers for c in ir.consumers(r))


def _untainted(flow, ref: str, syncs: frozenset) -> bool:
    """No unsynchronized batch reduction reaches ``ref``: the towers' copies joined are the
    batch's values (a variance recomputed once must start from the rows, not from each tower's
    squares around its own mean)."""
    fact = flow.fact(ref)
    return fact is None or not (fact.taint - syncs)


def fetch_cone(ir: IR, stand_ins: list[str], inside: set[str], dependent: set[str],
               in_grad: set[str], batch_inputs) -> set[str]:
    """Ops outside the towers that a driver may fetch and that would combine tower 0's
    stand-in for an unmergeable tensor with the whole batch's values: an accuracy of logits
    that mix the examples (mixup, a batch-centred layer, a recursion the analysis cannot
    follow) against the fed labels. Run once outside the towers, such an op met tower 0's rows
    and the batch's, and the rewrite failed where one device runs. Returned when there is such
    a conflict: every op downstream of a stand-in up to a state write, an update or gradient
    code; the analysis then puts them in the towers, whose values it merges (or, unmergeable
    in turn, warns of), so they run."""

    def pure(node) -> bool:
        op_def = ir.op_def(node.op)
        return node.name not in inside and node.name not in in_grad and op_def is not None \
            and not op_def.is_stateful and node.op not in ops.VARIABLE_OPS and not writes(ir, node)

    stand = set(stand_ins)
    cone: set[str] = set()
    work = [c.name for t in stand_ins for c, _ in ir.data_consumers(t) if pure(c)]
    while work:
        name = work.pop()
        if name not in cone:
            cone.add(name)
            work.extend(c.name for c in ir.consumers(name) if pure(c))
    # the whole batch's values outside the towers: the fed inputs and what reads them there
    batch = {node_of(t) for t in batch_inputs}
    work = list(batch)
    while work:
        for c in ir.consumers(work.pop()):
            if c.name not in inside and c.name not in batch and c.name not in cone:
                batch.add(c.name)
                work.append(c.name)
    for name in cone:
        refs = ir.nodes[name].inputs
        stood = any(tensor_name(*parse_tensor(r)) in stand or node_of(r) in cone for r in refs)
        whole = any(node_of(r) in batch or (node_of(r) in dependent and
                                            tensor_name(*parse_tensor(r)) not in stand) for r in refs)
        if stood and whole:
            return cone
    return set()


def _sorted(ir: IR, tensors) -> list[str]:
    index = {name: i for i, name in enumerate(ir.nodes)}
    return sorted(tensors, key=lambda t: (index[node_of(t)], parse_tensor(t)[1]))


def _scope_weights(t: str, scopes: list[GradScope]) -> tuple:
    for scope in scopes:
        if t.startswith(scope.prefix + "/"):
            return scope.weights
    return ("count",)


def _resolve(ir: IR, name: str) -> list[str]:
    node, idx = parse_tensor(name)
    if node not in ir.nodes:
        raise AnalysisError(f"output '{name}' is not a node of the graph")
    if ":" in name:
        return [tensor_name(node, idx)]
    return [tensor_name(node, i) for i in range(max(1, len(ir.output_types(ir.nodes[node]))))]


def _nearest_variables(ir: IR, grads: list[str], apply_ops: list[ApplyOp]) -> dict[str, str]:
    """The variable of the optimizer update nearest (breadth-first) to each gradient."""
    target = {a.name: a.variable for a in apply_ops}
    out: dict[str, str] = {}
    for t in grads:
        queue, seen = collections.deque([node_of(t)]), {node_of(t)}
        while queue:
            name = queue.popleft()
            if name in target:
                out[t] = target[name]
                break
            for consumer in ir.consumers(name):
                if consumer.name not in seen:
                    seen.add(consumer.name)
                    queue.append(consumer.name)
    return out


def _pair_shared_ids(frontier: list[Frontier], pairs: list[tuple[str, str]]) -> list[Frontier]:
    """Ids every tower shares are taken once (tower 0's) only where their values are summed
    across the towers; where each tower's values are concatenated, so are its copies of the
    ids, and the update adds the duplicates. In-batch negatives (every tower scores all the
    batch's items: each tower's rows for the same ids) took the ids once beside N copies of
    the rows, and the update failed (review 19). Ids the update reads outside the towers (a
    shared input's) have their rows summed."""
    role = {f.tensor: f.role for f in frontier}
    tails = {f.tensor: f.tail for f in frontier}
    # values whose rows the flow cannot follow (examples mixed upstream, an inexact rewrite)
    # still end with the shared rows their ids end with: taken without them, a tower's rows
    # outnumbered the ids and the update failed at step 1 (nce_loss after tf.reverse, review 26)
    adopt = {v: tails[i] for v, i in pairs if i is not None and role.get(v) == "sparse_values"
             and tails.get(i) and not tails.get(v)}
    frontier = [dataclasses.replace(f, tail=adopt[f.tensor]) if f.tensor in adopt else f
                for f in frontier]
    concatenated = {i for v, i in pairs if role.get(v) == "sparse_values" and role.get(i) == "first"}
    # ids read whole by the update, outside the towers: each tower's rows for them are summed
    summed = {v for v, i in pairs if i is None and role.get(v) == "sparse_values"} - \
        {v for v, i in pairs if i is not None}
    return [dataclasses.replace(f, role="sparse_indices") if f.tensor in concatenated else
            dataclasses.replace(f, role="dense") if f.tensor in summed else f for f in frontier]
