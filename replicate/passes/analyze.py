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
from replicate.facts import Analysis, ApplyOp, GradScope, Reason
from replicate.ir import IR, node_of, parse_tensor, tensor_name
from replicate.passes import _inputs, _static
from replicate.passes._frontier import classify
from replicate.pipeline import PassResult
from replicate.reductions import FUSED_BATCH_NORM, couplings, reduction
from replicate.roles import FLOAT_TYPES, gradient_scopes, scope_loss, variable_of

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
        train_op, apply_ops = self._train_op(ir, graph, in_grad)
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
    def _train_op(self, ir: IR, graph: nx.DiGraph, in_grad: set[str]) -> tuple[str, list[ApplyOp]]:
        below = _descendants(graph, in_grad, list(ir.nodes))
        fed = _gradient_fed(ir, graph, in_grad)
        updates = [n for n in ir.nodes if n in below and n not in in_grad
                   and (ir.nodes[n].op in ops.APPLY_OPS or ir.nodes[n].op in ops.MUTATING_OPS)]
        if self.train_op is not None:
            name = node_of(self.train_op)
            if name not in ir.nodes:
                raise AnalysisError(f"train op '{self.train_op}' is not a node of the graph")
            ancestors = ir.ancestors([name], graph)
            chosen = [u for u in updates if u in ancestors]
            if not chosen:
                raise AnalysisError(f"train op '{name}' updates no variable from a gradient")
            return name, _apply_ops(ir, chosen, fed)
        reach: set[str] = set()
        for u in updates:
            if u not in reach:
                reach |= nx.descendants(graph, u) | {u}
        sinks = [n for n in ir.nodes if n in reach and graph.out_degree(n) == 0]
        if not sinks:
            raise AnalysisError("no train op found: no optimizer update consumes a gradient")
        if len(sinks) > 1:
            sinks = _widest(ir, graph, sinks, updates)
        if len(sinks) > 1:
            collected = [s for s in _collection_names(ir, "train_op") if s in sinks]
            if len(collected) == 1:
                sinks = collected
            else:
                names = ", ".join(f"'{s}'" for s in sinks[:6])
                raise AnalysisError(f"several candidate train ops ({names}); "
                                    "choose one with train_op=")
        ancestors = ir.ancestors(sinks, graph)
        return sinks[0], _apply_ops(ir, [u for u in updates if u in ancestors], fed)

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


def _descendants(graph: nx.DiGraph, starts: set[str], region: list[str]) -> set[str]:
    inside = set(region)
    out: set[str] = set()
    work = [s for n in starts for s in graph.successors(n) if s in inside]
    while work:
        name = work.pop()
        if name in out:
            continue
        out.add(name)
        work.extend(s for s in graph.successors(name) if s in inside and s not in out)
    return out


def _gradient_fed(ir: IR, graph: nx.DiGraph, in_grad: set[str]) -> set[str]:
    """Nodes computed from a gradient: data descendants of the gradient code, and reads of a
    variable that wait (by control edge) for an update of that same variable from a gradient
    (TF1 Adam's sparse path reads its slots back after scattering into them)."""
    data_only = nx.DiGraph()
    data_only.add_nodes_from(graph)
    data_only.add_edges_from((node_of(r), n.name) for n in ir for r in n.inputs)
    fed = _descendants(data_only, in_grad, list(ir.nodes)) | in_grad
    while True:
        extra = set()
        for name in fed:
            node = ir.nodes[name]
            if node.op not in ops.MUTATING_OPS or not node.inputs:
                continue
            target = variable_of(ir, node.inputs[0])
            for reader in ir.consumers(name):
                if reader.name not in fed and name in reader.control and reader.inputs \
                        and reader.op in ("ReadVariableOp", "Identity") \
                        and variable_of(ir, reader.inputs[0]) == target:
                    extra.add(reader.name)
        if not extra:
            return fed
        fed |= extra | _descendants(data_only, extra, list(ir.nodes))


def _widest(ir: IR, graph: nx.DiGraph, sinks: list[str], updates: list[str]) -> list[str]:
    """Sinks whose set of ancestor updates no other sink strictly contains; reads dropped
    when an op that is not a read remains."""
    update_set = set(updates)
    covers = {s: frozenset(ir.ancestors([s], graph) & update_set) for s in sinks}
    out = [s for s in sinks if not any(covers[s] < covers[o] for o in sinks)]
    non_reads = [s for s in out if ir.nodes[s].op not in ("ReadVariableOp", "Identity")]
    return non_reads or out


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


def _apply_ops(ir: IR, names: list[str], fed: set[str]) -> list[ApplyOp]:
    """Updates among ``names`` whose value input is computed from a gradient (in ``fed``),
    plus integer counters (the global step), which the caller separates."""
    out = []
    for name in names:
        node = ir.nodes[name]
        spec = ops.APPLY_OPS.get(node.op)
        if spec is not None:
            var_arg, grad_arg, idx_arg, family = spec.var_arg, spec.grad_arg, spec.indices_arg, spec.optimizer
        else:
            var_arg, grad_arg, idx_arg = ops.MUTATING_OPS[node.op]
            family = _family(ir, name, names)
        vpos, gpos = ir.arg_index(node, var_arg), ir.arg_index(node, grad_arg)
        ipos = ir.arg_index(node, idx_arg) if idx_arg else None
        variable = variable_of(ir, node.inputs[vpos]) if vpos is not None else None
        if variable is None or gpos is None:
            continue
        counter = node.op in ("AssignAdd", "AssignAddVariableOp") and _is_integer(ir, variable)
        if node_of(node.inputs[gpos]) not in fed and not counter:
            continue
        out.append(ApplyOp(name, node.op, family, variable, node.inputs[gpos],
                           node.inputs[ipos] if ipos is not None else None))
    return out


def _family(ir: IR, name: str, names: list[str]) -> str:
    """Optimizer family of a plain variable update: that of an optimizer kernel in the same
    top-level name scope (TF1 Adam's sparse path scatters, then assigns), else the scope."""
    top = name.split("/")[0]
    for other in names:
        spec = ops.APPLY_OPS.get(ir.nodes[other].op)
        if spec is not None and other.split("/")[0] == top:
            return spec.optimizer
    return top


def _is_integer(ir: IR, variable: str) -> bool:
    from tensorflow.python.framework import dtypes

    dtype = ir.nodes[variable].attr("dtype")
    return dtype is not None and dtypes.as_dtype(dtype).base_dtype.is_integer


def _collection_names(ir: IR, key: str) -> list[str]:
    if ir.meta is None or key not in ir.meta.collection_def:
        return []
    return [node_of(v.decode() if isinstance(v, bytes) else v)
            for v in ir.meta.collection_def[key].node_list.value]


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
