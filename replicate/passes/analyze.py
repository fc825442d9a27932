"""Find the roles of a training graph's nodes: what to replicate, share, split and aggregate.

Requires: an IR of a single-device training graph with static shapes loaded; the
optimizer's gradients computed by ``tf.gradients`` (``minimize`` or
``compute_gradients``), so they live under a ``gradients`` name scope.

Produces: ``ir.facts["analysis"]``, an :class:`~replicate.batchflow.facts.Analysis`: the train ops,
variables, batch inputs (decided by the batch dataflow, :mod:`replicate.batchflow`), the
losses and how each is weighted across towers, optimizer updates, the tower region
(ancestors of the gradient frontier and the losses, minus variables and input sources,
stopping at the barriers of earlier phases of the step: :mod:`replicate.passes._phases`),
the gradient and forward frontier with how each tensor combines across towers, the rewrite
plan for batch sizes baked into the graph, and the reasons the result may not be exact.
The graph itself is not changed, except that placeholders declared without a shape may be read
through checked vector views where that proves more (:mod:`replicate.passes._shapeless`).
"""

from __future__ import annotations

import logging
import math

import networkx as nx

from replicate.batchflow import inputs as _inputs
from replicate.batchflow.analysis import analyze as settle, moved
from replicate.batchflow.context import Demand
from replicate.batchflow.effects import draws, writes
from replicate.batchflow.facts import Analysis, BatchInput, Reason
from replicate.batchflow.loss import with_statistics_synced
from replicate.batchflow.roles import gradient_scopes
from replicate.batchflow.lattice import INSIDE
from replicate.errors import AnalysisError
from replicate.graph import ops
from replicate.graph.ir import IR, node_of, parse_tensor, tensor_name
from replicate.passes import _asserts, _custom, _draws, _evict, _exactness, _phases, _races, _refusals, _rows, _shapeless, _strided, _synced, _weights
from replicate.passes._frontier import classify, fetch_cone
from replicate.passes._updates import find_train_ops
from replicate.passes.pipeline import PassResult

__all__ = ["Analyze"]

log = logging.getLogger(__name__)

#: Constants above this size are shared by all towers instead of copied into each.
LARGE_CONST_BYTES = 1 << 20


class Analyze:
    """Configuration of the analysis.

    Args:
        train_op: name of the train op that comes first; every train op is found and replicated.
        loss: name of the loss the gradients differentiate, when it cannot be recovered.
        outputs: extra tensor or node names to keep fetchable under their names.
        merge_forward: also merge every per-example forward tensor under its name.
        external: node names referenced from outside the graph (collections, saver).
        batch_inputs: the tensors to split (``x:0``, ``x:0@1`` for axis 1) instead of the ones
            the dataflow finds.
        sync: batch statistics will be synchronized (``batch_norm="sync"``), so values computed
            from them are the same in every tower as on one device.
    """

    name = "analyze"

    def __init__(self, train_op: str | None = None, loss: str | None = None,
                 outputs: tuple[str, ...] = (), merge_forward: bool = True,
                 external: frozenset[str] = frozenset(), batch_inputs=None, sync: bool = False,
                 shared_inputs=None):
        self.train_op = train_op
        self.loss = loss
        self.outputs = tuple(outputs)
        self.merge_forward = merge_forward
        self.external = external
        self.batch_inputs = batch_inputs
        self.shared_inputs = shared_inputs
        self.sync = sync

    def run(self, ir: IR) -> PassResult:
        _refusals.refuse_replicated(ir)
        self._settle(ir)
        first = ir.facts["analysis"]
        shapeless = _shapeless.candidates(ir, first)
        if not shapeless:
            return PassResult(ir, False)
        # placeholders without a rank left layouts unknown: where ops broadcast them, read
        # them as vectors, checked at run time, and keep that only if it proves more
        viewed = _shapeless.view_as_vectors(ir, shapeless)
        if viewed is None:
            return PassResult(ir, False)
        views, undo = viewed
        try:
            self._settle(ir)
            better = len(ir.facts["analysis"].reasons) < len(first.reasons)
        except AnalysisError:
            better = False
        if not better:
            undo()
            ir.facts["analysis"] = first
            return PassResult(ir, False)
        analysis = ir.facts["analysis"]
        analysis.warnings = [w for w in analysis.warnings if not any(     # said better below
            w.startswith(f"input '{tensor_name(n)}' has unknown rank") for n in views)]
        analysis.warnings.extend(_shapeless.warning(n, v) for n, v in views.items())
        return PassResult(ir, True)

    def _settle(self, ir: IR) -> None:
        pulled = self._analyze(ir, set())
        if pulled:      # fetch-only ops that met tower 0's stand-ins and the whole batch
            first = ir.facts["analysis"]
            try:
                self._analyze(ir, pulled)
            except AnalysisError as exc:    # they cannot run in the towers either: as before
                log.info("analyze: fetch-only ops left outside the towers (%s)", exc)
                ir.facts["analysis"] = first

    def _analyze(self, ir: IR, pulled: set[str]) -> set[str]:
        """Analyse with the ops ``pulled`` into the towers; set ``ir.facts["analysis"]`` and
        return the ops that should have been (see :func:`fetch_cone`)."""
        prefixes = gradient_scopes(ir)
        if not prefixes:
            raise AnalysisError("no train op found: the graph has no gradient computation "
                                "(build it with optimizer.minimize or compute_gradients)")
        in_grad = {n for n in ir.nodes if any(n.startswith(p + "/") for p in prefixes)}
        graph = ir.to_networkx()
        train_ops, apply_ops = find_train_ops(ir, graph, in_grad, self.train_op)
        grad_scopes = _weights.scopes(ir, prefixes, train_ops, graph, self.loss)
        losses = _weights.losses(grad_scopes)
        crossing = [tensor_name(n, parse_tensor(r)[1]) for n in in_grad for c in ir.consumers(n)
                    if c.name not in in_grad for r in c.inputs if node_of(r) == n]
        crossing = list(dict.fromkeys(sorted(crossing, key=_order(ir))))
        barriers = _phases.barriers(ir, graph, apply_ops, in_grad)
        forced = _inputs.forced(ir, self.batch_inputs) if self.batch_inputs is not None else None
        region, sources = self._region(ir, graph, [node_of(t) for t in crossing + losses]
                                       + sorted(pulled, key=_order(ir)), barriers,
                                       _inputs.interior(ir, forced or {}))
        phases, phase_reads = _phases.phases(ir, graph, region, barriers, apply_ops)
        candidates, shared_inputs, warnings = _inputs.candidates(ir, region, sources)
        named: list[str] = []
        if self.shared_inputs:       # never split what the user says every tower reads whole
            named = _inputs.named_shared(ir, self.shared_inputs, forced)
            candidates = [t for t in candidates if t not in named]
            shared_inputs = list(dict.fromkeys(shared_inputs + named))
        triples = _inputs.sparse_triples(ir, region, candidates + list(forced or ()))
        followers = {t for triple in triples for t in triple[1:] if t is not None}
        candidates = [t for t in candidates if t not in followers]
        candidates += [t[0] for t in triples if t[0] not in candidates and not forced]
        if forced:
            shared_inputs = [t for t in candidates + shared_inputs if t not in forced]
            candidates = []
        flow = settle(ir, region, candidates, in_grad, [s.prefix for s in grad_scopes], losses, forced,
                      sparse=triples, whole=frozenset(named))
        _refusals.refuse_batch_arithmetic_ranges(ir, flow, region)
        if forced:
            _refusals.refuse_inconsistent_override(ir, graph, flow, apply_ops, forced)
        classes = flow.classes
        roles = flow.ctx.sparse
        whole = {part_: triple for triple in triples for part_ in triple if part_ in roles}
        batch_inputs = [BatchInput(t, axis, None if t in roles else _static(ir, t, axis),
                                   ir.nodes[node_of(t)].op, cls, whole.get(t))
                        for t, (axis, cls) in flow.inputs.items()]
        batch_inputs.sort(key=lambda b: _order(ir)(b.tensor))
        if not batch_inputs:
            chooser = _inputs.fed_in_a_call(ir, region)
            if chooser is not None:     # tf.cond(is_training, train.get_next, val.get_next)
                raise AnalysisError(
                    f"no batch input found: the batch comes out of '{chooser}', a function call "
                    "(a tf.cond built with control flow v2) that reads it from an iterator or a "
                    "placeholder inside its branches, where replicate cannot split it; build "
                    "the graph with tf.compat.v1.disable_control_flow_v2(), or choose the "
                    "iterator with a string handle (tf.data.Iterator.from_string_handle)")
            # say which candidates were set aside and why (review 12), and a loss not found
            lost = next((s.prefix for s in grad_scopes if not s.fetched and not s.loss), None)
            raise AnalysisError("no batch input found: no placeholder or iterator output whose "
                                "examples the loss reduces (name them with batch_inputs=)"
                                + (f"; the loss the gradients in '{lost}' differentiate was not "
                                   "recognized: name it with loss=" if lost else "")
                                + _inputs.set_aside(ir, flow.demoted))
        shared_inputs = [t for t in dict.fromkeys(shared_inputs + candidates + sorted(followers))
                         if t not in flow.inputs]
        primary = batch_inputs[0].cls
        reasons = _weights.drop_unweighable_fetches(grad_scopes, flow)
        if self.sync:       # every batch statistic is read synchronized: so can a loss's
            flow.losses.update(with_statistics_synced(flow.ctx, flow.losses))
        reasons += _weights.assign(grad_scopes, flow, primary)
        reasons += _custom.settle(ir, flow, region, grad_scopes)
        couplings = list(dict.fromkeys(flow.couplings() + _exactness.deciding_writes(ir, flow, in_grad)))
        in_bodies = [c for c in couplings if INSIDE in c]     # reasons once eviction is known
        couplings = [c for c in couplings if INSIDE not in c]
        looped = [c for c in couplings if flow.depths.get(c, 0)]
        reasons += [Reason(c, "a batch reduction inside a TF1 while loop feeds per-example values "
                           "(batch statistics in an RNN cell); each tower sees its own slice's "
                           "value, and it cannot be synchronized inside the loop's frame",
                           "compute the statistics outside the loop, or train this graph on one "
                           "device") for c in looped]
        loss_syncs = flow.loss_syncs()
        local = _exactness.deciding_bodies(ir, flow, in_bodies, loss_syncs)
        couplings = [c for c in couplings if c not in looped and c not in local]
        auto = [c for c in couplings if _exactness.size_like(ir, c, flow) or c in loss_syncs
                or _exactness.data_statistic(ir, graph, c, flow)]
        synced = frozenset(couplings if self.sync else auto)
        reasons += _exactness.two_routes(ir, flow, synced | loss_syncs)
        if synced:
            for scope in grad_scopes:       # a zero share must not drop a coupled tower's gradient
                if scope.weights and scope.weights[0] in _weights.DATA_SHARES \
                        and not _weights.weigh_in_towers(flow, scope, synced):
                    reasons.append(Reason(scope.loss or scope.prefix, f"the loss is weighted by each "
                                          f"tower's share of '{scope.weights[1]}' (a mask's count), "
                                          "which is zero in a tower without masked-in examples, yet "
                                          "that tower's examples still reach the synchronized batch "
                                          "statistics: its gradient would be dropped",
                                          "normalize by a plain batch sum of weights, or by "
                                          "tf.maximum(count, 1.0)"))
        _weights.prefer_in_towers(ir, flow, grad_scopes, region, in_grad, synced)
        evicted = _evict.evictable(ir, flow, region, set(couplings) if self.sync else set(auto))
        _refusals.state_written_per_tower(ir, flow, region, evicted)
        evicted_reads = _evict.reads_before(ir, graph, evicted, region, flow.depths)
        reasons += [_refusals.coupled_in_body(ir, c) for c in in_bodies
                    if c.split(INSIDE)[0] not in evicted]   # once: whole batch
        if evicted:
            region = [n for n in region if n not in evicted]
            _split_outputs(ir, flow, evicted, set(region))
        inside = set(region)
        dependent = _reach(ir, flow.order, {n for n in region
                                             if flow.dependent(n, len(ir.output_types(ir.nodes[n])))})
        updates = [n for n in region if writes(ir, ir.nodes[n])]
        outside = {n for n in region for c in ir.consumers(n) if c.name not in inside}
        waits = _forwarding(ir, region, updates)
        needed = self._needed(ir, region, waits, [node_of(t) for t in crossing + losses]
                              + sorted((outside | pulled) - waits, key=_order(ir)))
        once = {u for u in updates if u not in needed and not flow.depths.get(u, 0)}     # tower 0's
        evicted_reads.update(_evict.reads_before(ir, graph, once, region, flow.depths))
        keep_targets = {n for n in region if n not in dependent and (n in outside or n in self.external)}
        keep_targets |= {node_of(t) for t in flow.plan.splits}
        keep = ir.ancestors(keep_targets, graph) & inside
        dead = _dead_gradient_code(ir, in_grad - inside)
        checks = _asserts.whole_batch(ir, flow, region, dependent)
        frontier, outputs, unmergeable, doubtful, forward_only = classify(
            ir, region, dependent, in_grad, grad_scopes, apply_ops, flow, losses, self.outputs,
            self.merge_forward, dead, tuple(t for refs in checks.values() for t in refs.values()),
            frozenset(loss_syncs | synced))
        reasons += _refusals.unaggregated_updates(ir, apply_ops, inside, frontier, dependent)
        syncs = loss_syncs | synced
        if syncs:
            outputs = [_synced.global_after_sync(flow, f, syncs) for f in outputs]
            frontier = [_synced.global_after_sync(flow, f, syncs) for f in frontier]
            unmergeable = [t for t in unmergeable if not _synced.global_value(flow, t, syncs)]
        if self.sync:
            outputs = _synced.synchronized_statistics(ir, outputs, couplings)
        tower0_values: list[str] = []
        reasons += _exactness.unmergeable(ir, graph, train_ops, unmergeable, inside, warnings,
                                          tower0_values)
        # a node the shared graph keeps (it computes on the whole batch) keeps its own value
        kept = {t for t in forward_only if node_of(t) in keep}
        outputs = [f for f in outputs if f.tensor not in kept]
        settled, unchecked = _asserts.unchecked(ir, checks, outputs, flow)
        warnings += _asserts.logged_per_tower(ir, checks, settled)
        checks = settled
        inner, bodies = _asserts.in_bodies(ir, flow, checks)
        reasons += unchecked + inner
        once = _asserts.checked_once(ir, checks)
        forward_only = [t for t in forward_only if t not in kept and node_of(t) not in once
                        and not (syncs and _synced.global_value(flow, t, syncs))]
        if forward_only:        # intermediates: a warning, not the report's NOT MERGED line
            # every name: a driver fetching one sees tower 0's value (the list was cut at 4,
            # and the fetched logits a review looked for were past the cut)
            warnings.append(f"{len(forward_only)} forward tensors cannot be merged across towers; "
                            "fetching one by its name gives tower 0's value (" + ", ".join(
                                f"'{t}'" for t in forward_only) + ")")
        reasons += [Reason(node_of(t), f"gradient rows '{t}' join rows shared by every tower with "
                           "the batch's in an order replicate does not follow; they are "
                           "concatenated, which a sum over rows adds up but row-wise processing "
                           "(clipping) would not", "look the shared rows up after the batch's")
                    for t in doubtful[:1]]
        step = _inputs.global_step(ir, apply_ops)
        random_ops = [n for n in region if draws(ir, ir.nodes[n])]
        reproduced, draw_reasons = _draws.reproducible(ir, flow, random_ops)
        reasons += draw_reasons + _draws.unseeded_once(ir, sorted(evicted))
        controls: dict[str, list[str]] = {}
        for consumer in {c.name for n in region for c in ir.consumers(n)} - inside:
            waits = [x for x in ir.nodes[consumer].control if x in inside]
            if waits:
                controls[consumer] = waits
        order = _order(ir)
        controls = dict(sorted(controls.items(), key=lambda kv: order(kv[0])))
        fed = {classes.find(b.cls) for b in batch_inputs}
        warnings += [f"{moved(t, why)}; if it is fed batch-major, say so with batch_inputs={{'{t}': 0}}"
                     for t, why in flow.guessed.items() if t in flow.inputs]
        warnings += [f"input '{t}' is taken to be read whole by every tower ({why}); if it holds "
                     f"examples, say so with batch_inputs=" for t, why in flow.unsplit.items()]
        warnings += [f"the batch size is taken to be {classes.static(c)} from '{where}', whose "
                     "shape bakes it in: feed exactly that many examples per step (one device "
                     "needs that too)" for c, where in sorted(classes.pinned.items())
                     if where and classes.static(c) is not None and classes.find(c) in fed]
        # every class is split alike: a class the op regroups may hold the same examples as
        # one it is not tied to any more (labels beside inputs regrouped in ghost batches)
        granules = [classes.granularity(c) for c in sorted(fed)]
        granule = math.lcm(*(g for g, _ in granules)) if granules else 1
        warnings += [f"each tower gets a multiple of {granule} examples: '{where}' groups them "
                     f"by {g} (feed a multiple of {granule} examples per step)"
                     for g, where in granules if g > 1][:1]
        warnings += _strided.warnings(ir, flow, region)
        warnings += _rows.warnings(ir, flow) + _races.warnings(ir, graph, train_ops)
        analysis = Analysis(
            train_op=train_ops[0],
            variables=_inputs.variables(ir, region, apply_ops),
            batch_inputs=batch_inputs,
            shared_inputs=shared_inputs,
            scopes=grad_scopes,
            loss=losses[0] if losses else None,
            apply_ops=apply_ops,
            optimizers=list(dict.fromkeys(a.optimizer for a in apply_ops)),
            global_step=step,
            region=region,
            needed=needed,
            batch_dependent=dependent,
            keep=keep,
            update_ops=updates,
            random_ops=random_ops,
            frontier=frontier,
            outputs=outputs,
            external_controls=controls,
            static_batch=classes.static(primary),
            couplings=[c for c in couplings if c not in auto],
            plan=flow.plan,
            dead=dead,
            reasons=_refusals.advice_for(reasons + list(flow.plan.reasons), self.sync),
            warnings=warnings,
            tower0_values=tower0_values,
            train_ops=train_ops,
            classes={classes.find(b.cls): classes.static(b.cls) for b in batch_inputs},
            granule=granule,
            demoted=dict(flow.demoted),
            auto_sync=auto,
            denominators=flow.denominators(),
            flow=flow,
            draws=reproduced,
            phases=phases,
            phase_reads=phase_reads,
            evicted_reads=evicted_reads,
            checks=checks,
            unchecked=bodies,
        )
        _exactness.collect(ir, analysis)
        analysis.reasons[:] = _refusals.advice_for(analysis.reasons, self.sync)
        ir.facts["analysis"] = analysis
        return set() if pulled else fetch_cone(ir, forward_only + unmergeable, inside, dependent,
                                               in_grad, flow.inputs)

    # ------------------------------------------------------------------ pieces
    def _region(self, ir: IR, graph: nx.DiGraph, targets: list[str], barriers: set[str],
                cut: set[str]) -> tuple[list[str], set[str]]:
        stop: set[str] = set(barriers) | cut
        for name, node in ir.nodes.items():
            if node.op in ops.VARIABLE_OPS or node.op in ops.INPUT_SOURCE_OPS or _large_const(ir, node):
                stop.add(name)
        seen = ir.ancestors(targets, graph, stop=stop)
        applies = [n for n in seen if ir.nodes[n].op in ops.APPLY_OPS and n not in barriers]
        read = [node_of(r) for n in seen if n not in stop for r in ir.nodes[n].inputs
                if node_of(r) in barriers and not _phases.variable_read(ir, node_of(r))]
        if applies or read:
            first = applies[0] if applies else read[0]
            raise AnalysisError(f"'{first}' runs after an optimizer update and the towers' "
                                "gradient computation reads its value: the towers would wait "
                                "for an update that itself waits for them. Chain the phases "
                                "by control edges only (tf.control_dependencies around the "
                                "later compute_gradients), reading variables after the update")
        # A v1 loop's unused exits and switches belong with the rest of the loop (not a TF1
        # cond's switches of the gradients: an apply_gradients inside tf.cond, which then
        # read each tower's gradient through its switch, unaggregated -- claimed exact, 1.2 off)
        work = [n for n in seen if n not in stop]
        frames = {ir.nodes[n].attr("frame_name") for n in seen if ir.nodes[n].op in ("Enter", "RefEnter")}
        while work:
            for consumer in ir.consumers(work.pop()):
                if consumer.name not in seen and consumer.op in ops.CONTROL_FLOW_OPS \
                        and _of_a_loop(ir, consumer, seen, frames):
                    seen.add(consumer.name)
                    work.append(consumer.name)
        region = [n for n in ir.nodes if n in seen and n not in stop]
        return region, {n for n in seen if n in stop}

    @staticmethod
    def _needed(ir: IR, region: list[str], waits: set[str], targets: list[str]) -> set[str]:
        """Region nodes every tower needs; the rest only feed update ops (tower 0's job).

        Walks back from ``targets`` inside the region, not following control edges into update
        ops (an op that merely waits for a batch-norm update does not need it in every tower).
        """
        inside, skip = set(region), waits
        seen = {t for t in targets if t in inside}
        work = list(seen)
        while work:
            node = ir.nodes[work.pop()]
            producers = [node_of(r) for r in node.inputs]
            waits = [c for c in node.control if c not in skip or c in producers]
            for name in producers + waits:
                if name in inside and name not in seen:
                    seen.add(name)
                    work.append(name)
        return seen


def _forwarding(ir: IR, region: list[str], updates: list[str]) -> set[str]:
    """The update ops and the identities that only forward their results (``cond/Identity`` of
    a state update built inside ``tf.cond``, which ``UPDATE_OPS`` holds instead of the update):
    a control edge to one of them is a wait for the update."""
    out, inside = set(updates), set(region)
    changed = True
    while changed:
        changed = False
        for name in region:
            node = ir.nodes[name]
            if name in out or node.op not in ("Identity", "IdentityN", "NoOp"):
                continue
            sources = [node_of(r) for r in node.inputs] + list(node.control)
            if sources and all(s in out or s not in inside for s in sources) and \
                    any(s in out for s in sources):
                out.add(name)
                changed = True
    return out


def _reach(ir: IR, order: list[str], dependent: set[str]) -> set[str]:
    """Region nodes that run after a batch-dependent one (by data or control edge): their values
    may be shared, but an original kept outside the towers would recompute the towers' work."""
    out = set(dependent)
    for name in order:
        if name in out:
            continue
        node = ir.nodes[name]
        if any(node_of(r) in out for r in node.inputs) or any(c in out for c in node.control):
            out.add(name)
    return out


def _split_outputs(ir: IR, flow, evicted: set[str], region: set[str]) -> None:
    """Per-example outputs of ops evicted from the towers (computed once for the whole batch)
    are split: each tower reads its own rows."""
    for name in sorted(evicted):
        for i in range(len(ir.output_types(ir.nodes[name]))):
            tensor = f"{name}:{i}"
            fact = flow.fact(tensor)
            if fact is None or fact.kind != "part":
                continue
            if any(c.name in region for c, _ in ir.data_consumers(tensor)):
                flow.plan.splits[tensor] = Demand(tensor, fact.axis, fact.cls, fact.block, fact.outer, name)


def _static(ir: IR, tensor: str, axis: int) -> int | None:
    shape = ir.static_shape(tensor)
    return shape[axis] if shape and axis < len(shape) else None


def _order(ir: IR):
    index = {name: i for i, name in enumerate(ir.nodes)}
    return lambda ref: (index.get(node_of(ref), 0), ref)


def _dead_gradient_code(ir: IR, candidates: set[str]) -> set[str]:
    """Gradient-scope nodes outside the region whose results nothing outside them reads
    (e.g. the gradient with respect to the labels): removed by the rewrite."""
    dead = set(candidates)
    changed = True
    while changed:
        changed = False
        for name in list(dead):
            if any(c.name not in dead for c in ir.consumers(name)):
                dead.discard(name)
                changed = True
    return dead


def _of_a_loop(ir: IR, node, seen: set[str], frames: set) -> bool:
    """Whether control-flow op ``node`` belongs to a TF1 while loop already in ``seen``: a
    ``Switch`` on its ``LoopCond``, a ``Merge`` of its ``Enter`` or ``NextIteration``, an
    ``Enter`` of one of its ``frames``, an ``Exit`` or ``NextIteration``. Not a cond's ``Switch`` and
    ``Merge`` (an apply_gradients in a tf.cond), nor a loop that only reads the region's
    values (gradients post-processed in a tf.while_loop: half of it was pulled into the
    towers, and the rewrite mixed frames)."""
    if node.op in ("Switch", "RefSwitch"):
        pred = node_of(node.inputs[1]) if len(node.inputs) > 1 else ""
        return ir.nodes[pred].op == "LoopCond" and pred in seen
    if node.op in ("Merge", "RefMerge"):
        return any(ir.nodes[node_of(r)].op in ("Enter", "RefEnter", "NextIteration",
                                                 "RefNextIteration") and node_of(r) in seen
                   for r in node.inputs)
    if node.op in ("Enter", "RefEnter"):
        return node.attr("frame_name") in frames     # the frames of the Enters in ``seen``
    return True


def _large_const(ir: IR, node) -> bool:
    if node.op != "Const":
        return False
    value = node.attrs.get("value")
    return value is not None and value.ByteSize() > LARGE_CONST_BYTES
