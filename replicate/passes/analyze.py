"""Find the roles of a training graph's nodes: what to replicate, share, split and aggregate.

Requires: an IR of a single-device training graph with static shapes loaded; the
optimizer's gradients computed by ``tf.gradients`` (``minimize`` or
``compute_gradients``), so they live under a ``gradients`` name scope.

Produces: ``ir.facts["analysis"]``, an :class:`~replicate.facts.Analysis`: the train op,
variables, batch inputs, loss and its reduction, optimizer updates, the tower region
(ancestors of the gradient frontier and the loss, minus variables and input sources),
the gradient and forward frontier with how each tensor combines across towers, and
the reasons the result may not be exact. The graph itself is not changed.
"""

from __future__ import annotations

import logging

import networkx as nx

from replicate import ops
from replicate.errors import AnalysisError
from replicate.facts import Analysis, GradScope, Reason
from replicate.ir import IR, node_of, parse_tensor, tensor_name
from replicate.passes import _inputs, _static
from replicate.passes._frontier import classify
from replicate.passes._updates import descendants as _descendants
from replicate.passes._updates import find_train_op
from replicate.pipeline import PassResult
from replicate.reductions import FUSED_BATCH_NORM, couplings, reduction
from replicate.roles import FLOAT_TYPES, gradient_scopes, scope_loss

__all__ = ["Analyze"]

log = logging.getLogger(__name__)

#: Constants above this size are shared by all towers instead of copied into each.
LARGE_CONST_BYTES = 1 << 20


class Analyze:
    """Configuration of the analysis.

    Args:
        train_op: name of the train op; found automatically when None.
        loss: name of the loss tensor; recovered from the gradient seed when None.
        outputs: extra tensor or node names to keep fetchable under their names.
        merge_forward: also merge every per-example forward tensor under its name.
        external: node names referenced from outside the graph (collections, saver).
    """

    name = "analyze"

    def __init__(self, train_op: str | None = None, loss: str | None = None,
                 outputs: tuple[str, ...] = (), merge_forward: bool = True,
                 external: frozenset[str] = frozenset()):
        self.train_op = train_op
        self.loss = loss
        self.outputs = tuple(outputs)
        self.merge_forward = merge_forward
        self.external = external

    def run(self, ir: IR) -> PassResult:
        scopes = gradient_scopes(ir)
        if not scopes:
            raise AnalysisError("no train op found: the graph has no gradient computation "
                                "(build it with optimizer.minimize or compute_gradients)")
        in_grad = {n for n in ir.nodes if any(n.startswith(p + "/") for p in scopes)}
        graph = ir.to_networkx()
        train_op, apply_ops = find_train_op(ir, graph, in_grad, self.train_op)
        grad_scopes = self._scopes(ir, scopes, train_op, graph)
        losses = [s.loss for s in grad_scopes if s.loss]
        seeds = [tensor_name(n, parse_tensor(r)[1]) for n in in_grad for c in ir.consumers(n)
                 if c.name not in in_grad for r in c.inputs if node_of(r) == n]
        seeds = list(dict.fromkeys(sorted(seeds, key=_order(ir))))
        region, sources = self._region(ir, graph, [node_of(t) for t in seeds + losses])
        batch_inputs, shared_inputs, static_batch, warnings = _inputs.find(ir, region, sources)
        if not batch_inputs:
            raise AnalysisError("no batch input found: no placeholder or iterator of rank >= 1 "
                                "feeds the loss")
        dependent = _descendants(graph, {node_of(b.tensor) for b in batch_inputs}, region)
        inside = set(region)
        rebatch, reasons = self._static_batch(ir, graph, region, dependent, grad_scopes, static_batch,
                                              {node_of(b.tensor) for b in batch_inputs})
        updates = [n for n in region if ir.nodes[n].op in ops.MUTATING_OPS]
        outside = {n for n in region for c in ir.consumers(n) if c.name not in inside}
        needed = self._needed(ir, graph, region, updates, [node_of(t) for t in seeds + losses]
                              + sorted(outside - set(updates), key=_order(ir)))
        keep_targets = {n for n in region if n not in dependent and (n in outside or n in self.external)}
        keep = ir.ancestors(keep_targets, graph) & inside
        reasons += _loss_kinds(ir, grad_scopes, dependent, inside)
        dead = _dead_gradient_code(ir, in_grad - inside)
        frontier, outputs, unmergeable = classify(ir, region, dependent, in_grad, grad_scopes,
                                                  apply_ops, static_batch, losses, self.outputs,
                                                  self.merge_forward, dead)
        reasons += _unmergeable(ir, graph, train_op, unmergeable, inside, warnings)
        step = _inputs.global_step(ir, apply_ops)
        controls: dict[str, list[str]] = {}
        for consumer in {c.name for n in region for c in ir.consumers(n)} - inside:
            waits = [x for x in ir.nodes[consumer].control if x in inside]
            if waits:
                controls[consumer] = waits
        order = _order(ir)
        controls = dict(sorted(controls.items(), key=lambda kv: order(kv[0])))
        analysis = Analysis(
            train_op=train_op,
            variables=_inputs.variables(ir, region, apply_ops),
            batch_inputs=batch_inputs,
            shared_inputs=shared_inputs,
            scopes=grad_scopes,
            loss=tensor_name(*parse_tensor(self.loss)) if self.loss else (losses[0] if losses else None),
            apply_ops=apply_ops,
            optimizers=list(dict.fromkeys(a.optimizer for a in apply_ops)),
            global_step=step,
            region=region,
            needed=needed,
            batch_dependent=dependent,
            keep=keep,
            update_ops=updates,
            random_ops=[n for n in region if ir.nodes[n].op in ops.RANDOM_OPS],
            frontier=frontier,
            outputs=outputs,
            external_controls=controls,
            static_batch=static_batch,
            couplings=couplings(ir, region, dependent, in_grad, static_batch),
            rebatch=rebatch,
            dead=dead,
            reasons=reasons,
            warnings=warnings,
        )
        _exactness(ir, analysis)
        ir.facts["analysis"] = analysis
        return PassResult(ir, False)

    # ------------------------------------------------------------------ pieces
    def _scopes(self, ir: IR, scopes: list[str], train_op: str, graph: nx.DiGraph) -> list[GradScope]:
        if self.loss is not None:
            name, _ = parse_tensor(self.loss)
            if name not in ir.nodes:
                raise AnalysisError(f"loss '{self.loss}' is not a node of the graph")
        ancestors = ir.ancestors([train_op], graph)
        out = []
        for prefix in scopes:
            if not any(n.startswith(prefix + "/") for n in ancestors):
                continue
            loss = scope_loss(ir, prefix)
            if loss is None and self.loss is not None:
                loss = tensor_name(*parse_tensor(self.loss))
            out.append(GradScope(prefix, loss, "mean"))
        if not out:
            raise AnalysisError(f"train op '{train_op}' does not depend on any gradient")
        return out

    def _region(self, ir: IR, graph: nx.DiGraph, targets: list[str]) -> tuple[list[str], set[str]]:
        stop: set[str] = set()
        for name, node in ir.nodes.items():
            if node.op in ops.VARIABLE_OPS or node.op in ops.INPUT_SOURCE_OPS or _large_const(ir, node):
                stop.add(name)
        seen = ir.ancestors(targets, graph, stop=stop)
        applies = [n for n in seen if ir.nodes[n].op in ops.APPLY_OPS]
        if applies:
            raise AnalysisError(f"optimizer update '{applies[0]}' runs before a gradient is "
                                "computed; sequential optimizers cannot be replicated")
        # A v1 loop's unused exits and switches belong with the rest of the loop.
        work = [n for n in seen if n not in stop]
        while work:
            for consumer in ir.consumers(work.pop()):
                if consumer.name not in seen and consumer.op in ops.CONTROL_FLOW_OPS:
                    seen.add(consumer.name)
                    work.append(consumer.name)
        region = [n for n in ir.nodes if n in seen and n not in stop]
        return region, {n for n in seen if n in stop}

    @staticmethod
    def _static_batch(ir: IR, graph: nx.DiGraph, region: list[str], dependent: set[str],
                      scopes: list[GradScope], batch: int | None, sources: set[str]
                      ) -> tuple[dict[str, str], list[Reason]]:
        """Constants baking a static batch size; they (and what they feed) depend on the batch."""
        if batch is None:
            return {}, []
        prefixes = [s.prefix for s in scopes]
        plan, unexplained = _static.plan(ir, region, dependent | sources, prefixes, batch)
        dependent |= set(plan) | _descendants(graph, set(plan), region)
        plan, unexplained = _static.plan(ir, region, dependent | sources, prefixes, batch)
        return plan, [Reason(name, f"constant holds the static batch size {batch} where a tower "
                             "sees fewer examples", "give the batch input a dynamic batch dimension "
                             "(None)") for name in unexplained]

    def _needed(self, ir: IR, graph: nx.DiGraph, region: list[str], updates: list[str],
                targets: list[str]) -> set[str]:
        """Region nodes every tower needs; the rest only feed update ops (tower 0's job).

        Walks back from ``targets`` inside the region, not following control edges into update
        ops (an op that merely waits for a batch-norm update does not need it in every tower).
        """
        inside, skip = set(region), set(updates)
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


def _large_const(ir: IR, node) -> bool:
    if node.op != "Const":
        return False
    value = node.attrs.get("value")
    return value is not None and value.ByteSize() > LARGE_CONST_BYTES


def _loss_kinds(ir: IR, scopes: list[GradScope], dependent: set[str], region: set[str]) -> list[Reason]:
    """Set each scope's reduction and tower weights; say where that choice is inexact."""
    reasons: list[Reason] = []
    for scope in scopes:
        if scope.loss is None:
            continue
        red = reduction(ir, scope.loss, dependent)
        scope.kind = red.kind if red.kind in ("mean", "sum", "ratio") else "mean"
        scope.weights = red.weights if red.kind in ("mean", "sum", "ratio") else ("count",)
        if red.kind == "sum":
            terms = _inputs.independent_terms(ir, scope.loss, dependent, region)
            if terms:
                reasons.append(Reason(terms[0], "a term that does not depend on the batch is added to "
                                      "a sum-reduced loss, so its gradient would count once per tower",
                                      "reduce the data loss with a mean, or scale the term by 1/N"))
        elif red.kind not in ("mean", "ratio"):
            reasons.append(Reason(node_of(scope.loss), "the loss is not a mean, sum or normalized sum "
                                  f"over the batch ({red.note}); tower gradients are averaged by "
                                  "example count", "make the loss a batch mean or pass loss="))
        elif red.note:
            reasons.append(Reason(node_of(scope.loss), red.note, "average every term over the batch"))
    return reasons


def _unmergeable(ir: IR, graph: nx.DiGraph, train_op: str, tensors: list[str], region: set[str],
                 warnings: list[str]) -> list[Reason]:
    """Tensors read by shared ops that towers cannot merge: a reason when training uses them,
    otherwise one warning (only the fetched value is tower 0's)."""
    if not tensors:
        return []
    training = ir.ancestors([train_op], graph)
    reasons, fetch_only = [], []
    for t in tensors:
        readers = [c.name for c, _ in ir.data_consumers(t) if c.name not in region]
        if any(r in training for r in readers):
            reasons.append(Reason(node_of(t), f"'{t}' is read by '{readers[0]}' outside the towers "
                                  "and cannot be merged across towers; tower 0's value is used",
                                  "compute it from merged values or outside the model"))
        else:
            fetch_only.append(t)
    if fetch_only:
        more = f" and {len(fetch_only) - 3} more" if len(fetch_only) > 3 else ""
        warnings.append("fetching " + ", ".join(f"'{t}'" for t in fetch_only[:3]) + more +
                        " gives tower 0's value (not mergeable across towers)")
    return reasons


def _exactness(ir: IR, analysis: Analysis) -> None:
    """Record why the replicated graph may differ from single-device training."""
    reasons = analysis.reasons
    for name in analysis.random_ops[:8]:
        reasons.append(Reason(name, f"random op ({ir.nodes[name].op}) draws a separate stream in "
                              "each tower", "results match single-device training in distribution only"))
    for name in analysis.update_ops[:8]:
        reasons.append(Reason(name, "state update in the replicated region runs on tower 0's slice "
                              "of the batch only", "statistics come from 1/N of the batch"))
    for name in analysis.couplings:
        what = ("batch norm normalizes each tower by its own slice's statistics"
                if ir.nodes[name].op in FUSED_BATCH_NORM or "moments" in name
                else f"batch reduction ({ir.nodes[name].op}) feeds per-example values; each tower "
                     "sees its own slice's value")
        reasons.append(Reason(name, what, "use batch_norm='sync' (--sync-batch-norm) to compute it "
                              "over the global batch"))
    for f in analysis.frontier:
        if f.gradient and f.role == "dense" and ir.output_dtype(f.tensor) not in FLOAT_TYPES:
            reasons.append(Reason(node_of(f.tensor), "non-float gradient", "check the gradient"))
