"""Synchronize batch statistics across towers, so batch norm trains exactly as on one device.

Requires: the clone pass's tower copies (originals still present), ``ir.facts["analysis"]``
with its ``couplings`` (forward batch reductions whose result flows back into per-example
values) and ``auto_sync`` (the integer ones, the loss's nonlinear reductions, and statistics
of the inputs alone such as a mask's batch mean), and ``ir.facts["towers"]``. Synchronizes
every coupling when the transform asks for ``batch_norm="sync"``, else only those.

Produces, for each coupling:

- a plain batch reduction (the ``moments`` of non-fused batch norm, any ``reduce_mean`` or
  ``reduce_sum`` over the batch that feeds examples again): every tower reads the global
  value (the towers' values combined by example share), and each tower's gradient code for
  it receives the global upstream gradient instead of its own;
- a ``FusedBatchNormV3`` in training mode: each tower computes its slice's channel means,
  the global mean and (two-pass) variance are combined on the controller, the tower
  normalizes with them (the op in inference mode), moving averages read the global mean
  and Bessel-corrected variance, and the backward pass adds the terms through the global
  statistics: ``dx = dx_inference - gamma * rsqrt(var + eps) * (S1 + xhat * S2) / (c_k * M)``
  with ``S1``, ``S2`` the aggregated offset and scale gradients, ``c_k`` the tower's loss
  weight and ``M`` the global element count per channel.

- an integer batch reduction that feeds per-example computations (the longest sequence of the
  batch bounding a loop, a count sizing a tensor): every tower reads the global value; this
  runs in every mode, since it is cheap and makes the towers' shapes agree with one device's.

- a loss denominator computed from batch sums (a mask's count beside terms weighted
  otherwise, or alone when its numerator need not vanish where the count does):
  the gradient code of every tower reads the global denominator, computed once
  from the towers' sums (:mod:`replicate.passes._denominator`); the forward pass keeps each
  tower's own value, so fetched values merge as before.

``ir.facts["synced"]`` lists the couplings handled; others stay reasons in the report.
"""

from __future__ import annotations

import logging

from tensorflow.python.framework import dtypes

from replicate.batchflow.lattice import batch_size
from replicate.batchflow.facts import Reason
from replicate.batchflow.reductions import FUSED_BATCH_NORM
from replicate.batchflow.roles import forward_op_of
from replicate.graph.ir import IR, node_of, parse_tensor
from replicate.passes._combine import combine, weight
from replicate.passes.pipeline import PassResult

__all__ = ["Sync"]

log = logging.getLogger(__name__)

SCOPE = "replicate/sync"


class Sync:
    """Synchronized batch statistics.

    Args:
        controller: device of the combined statistics.
        full: synchronize every coupling (``batch_norm="sync"``); otherwise only the integer
            ones (the longest sequence of a batch, a count), which are cheap and always exact.
    """

    name = "sync"

    def __init__(self, controller: str, full: bool = True):
        self.controller = controller
        self.full = full

    def run(self, ir: IR) -> PassResult:
        analysis = ir.facts["analysis"]
        names = list(analysis.auto_sync) + (list(analysis.couplings) if self.full else [])
        if not names and not analysis.denominators:
            ir.facts["synced"] = []
            return PassResult(ir, False)
        grad_ops, in_grad = _gradient_ops(ir, names, [s.prefix for s in analysis.scopes])
        synced, left = [], []
        for name in names:
            node = ir.nodes[name]
            if node.op == "FusedBatchNormV3":
                _FusedSync(ir, self.controller, name, grad_ops.get(name, [])).run()
                synced.append(name)
            elif node.op in FUSED_BATCH_NORM:
                left.append(name)
            elif self._reduction(ir, name, grad_ops.get(name, []), in_grad):
                synced.append(name)
            else:
                left.append(name)
        handled = set(synced)
        elsewhere = _numerator_couplings(analysis.flow)
        for den, sources in analysis.denominators.items():
            if not set(sources) <= set(synced):
                synced.extend(s for s in sources if s not in synced)
                made = _GlobalDenominator(ir, self.controller, den, sources, in_grad)
                made.run()
                ir.facts.setdefault("global_denominators", []).extend(made.built)
            # synchronized for the denominator only: a reduction the numerators read too (a
            # weight ``ce > mean(ce)`` in ``sum(ce * w) / sum(w)``) is each tower's there
            # (review 43: its reason was dropped, claimed exact, 0.26-1.5 off)
            handled.update(s for s in sources if s not in elsewhere)
        analysis.reasons[:] = [r for r in analysis.reasons if r.node not in handled]
        for name in left:
            op = ir.nodes[name].op
            if op in ("Max", "Min"):
                analysis.reasons.append(Reason(name, f"the gradient of a batch {op.lower()}imum goes to "
                                               "the example that attains it, which one tower holds; "
                                               "it cannot be synchronized across towers",
                                               "stop its gradient (tf.stop_gradient) or use a mean or sum"))
            elif size_coupling(analysis, name) and _divides_a_loss(ir, analysis, name):
                analysis.reasons.append(Reason(
                    name, f"the batch size '{name}' is read both as a value the examples need "
                    "the batch's of and as a loss's divisor, which each tower needs its own of "
                    "(its share of the batch weighs the term)", "divide by a second "
                    "tf.shape(x)[0] (or a count of ones), so that each reads the size it needs"))
            elif size_coupling(analysis, name):
                if not any(r.node == name and r.what == SIZE_COUPLING[0] for r in analysis.reasons):
                    analysis.reasons.append(Reason(name, *SIZE_COUPLING))
            else:
                analysis.reasons.append(Reason(name, f"{op} cannot be synchronized across towers",
                                               "use FusedBatchNormV3 or a mean/sum"))
        _drop_covered_update_reasons(ir, analysis, handled)
        ir.facts["synced"] = synced
        log.info("sync: %d batch statistics synchronized across towers", len(synced))
        return PassResult(ir, bool(synced))

    def _reduction(self, ir: IR, name: str, grad_nodes: list[str], in_grad: set[str]) -> bool:
        analysis, towers = ir.facts["analysis"], ir.facts["towers"]
        copies = ir.facts["copies"]
        fact = analysis.flow.fact(f"{name}:0")
        if fact is not None and batch_size(fact):
            if _divides_a_loss(ir, analysis, name):
                return False        # a loss's divisor, weighed as each tower's share: its own
            fact = fact.with_(merge="sum")      # tf.shape(x)[0]: the towers' sizes add up
        if fact is None or fact.merge not in ("mean", "sum", "max", "min"):
            return False
        if fact.merge in ("max", "min") and grad_nodes:
            return False              # the gradient of an extreme goes to one tower's example
        spec = fact.spec
        if spec and spec[0] == "count":
            spec = ("count", analysis.flow.classes.find(spec[1]))
        n = len(towers.devices)
        dtype = ir.output_dtype(f"{name}:0")
        parts = [copies[k][name] for k in range(n)]
        total = combine(ir, towers, f"{SCOPE}/{name}", parts, fact.merge, dtype, self.controller,
                        self.controller, spec if fact.merge == "mean" else ("ones",))
        helpers = {node_of(r) for r in ir.nodes[total].inputs} | {total}
        for k in range(n):
            for consumer, _ in ir.data_consumers(parts[k]):
                if consumer.name not in helpers and not consumer.name.startswith(f"{SCOPE}/"):
                    ir.replace_uses(parts[k], total, only=[consumer.name])
        forward_w = spec if fact.merge == "mean" else ("ones",)
        for scope in analysis.scopes:       # each gradient computation has its own upstream
            mine = [g for g in grad_nodes if g.startswith(scope.prefix + "/")]
            if not mine:
                continue
            upstream = _upstream(ir, mine, in_grad)
            if upstream is None:
                analysis.reasons.append(Reason(name, "the gradient flowing into this synchronized "
                                               "batch statistic cannot be found", "report this graph"))
                continue
            self._global_upstream(ir, towers, name, scope, upstream, mine, forward_w)
        return True

    def _global_upstream(self, ir: IR, towers, name: str, scope, upstream: str, grad_nodes: list[str],
                         forward_w: tuple) -> None:
        """Each tower's gradient code of a synchronized statistic reads the upstream gradient
        of the whole batch (the towers' upstreams combined with the scope's weights), scaled by
        the tower's forward weight over its loss weight."""
        n = len(towers.devices)
        tag = f"{name}_grad" if scope.prefix == "gradients" else f"{name}_grad/{scope.prefix}"
        grads = [f"{towers.prefixes[k]}/{upstream}" for k in range(n)]
        if not any(node_of(g) in ir.nodes for g in grads):
            return      # no tower computes this gradient (a count of ones: nothing flows back)
        if not all(node_of(g) in ir.nodes for g in grads):
            ir.facts["analysis"].reasons.append(Reason(
                name, "the gradient flowing into this synchronized batch statistic is computed "
                "in some towers only", "report this graph"))
            return
        global_grad = combine(ir, towers, f"{SCOPE}/{tag}", grads, "dense",
                              ir.output_dtype(upstream), self.controller, self.controller, scope.weights)
        for k in range(n):
            readers = [f"{towers.prefixes[k]}/{g}" for g in grad_nodes]
            source = global_grad
            if forward_w != scope.weights:
                ratio = _ratio(ir, towers, k, ir.output_dtype(upstream), forward_w, scope.weights,
                               self.controller, f"{SCOPE}/{tag}/ratio_{k}")
                source = ir.add(f"{SCOPE}/{tag}/tower_{k}", "Mul", [global_grad, ratio],
                                device=towers.devices[k],
                                attrs={"T": dtypes.as_dtype(ir.output_dtype(upstream))}).name
            ir.replace_uses(grads[k], source, only=[r for r in readers if r in ir.nodes])


def _divides_a_loss(ir: IR, analysis, name: str) -> bool:
    """A loss term weighed by each tower's share of a denominator computed from ``name``
    (``reduce_sum(ce * n) / n``: review 32, one size read both ways was claimed exact and
    trained 0.5-0.9 off)."""
    dens = [node_of(t.spec[1]) for terms, _ in analysis.flow.losses.values() for t in terms
            if t.spec and t.spec[0] in ("value", "size", "shifted") and len(t.spec) > 1]
    return name in ir.ancestors(dens)


def _ratio(ir: IR, towers, k: int, dtype: int, top: tuple, bottom: tuple, device: str, name: str) -> str:
    """a_k / c_k for forward weights a and loss weights c (ones when a weight spec is ones)."""
    tf_dtype = dtypes.as_dtype(dtype)
    one = f"{name}/one"
    ir.const(one, 1.0, tf_dtype, device)
    a = one if top == ("ones",) else weight(ir, towers, k, dtype, device, top)
    c = one if bottom == ("ones",) else weight(ir, towers, k, dtype, device, bottom)
    return ir.add(name, "DivNoNan", [a, c], device=device, attrs={"T": tf_dtype}).name


def _gradient_ops(ir: IR, couplings: list[str], prefixes: list[str]
                  ) -> tuple[dict[str, list[str]], set[str]]:
    """Coupling -> the nodes of its gradient code (``<scope>/<op>_grad/...``); and all
    gradient-scope nodes."""
    wanted = set(couplings)
    out: dict[str, list[str]] = {}
    in_grad: set[str] = set()
    for prefix in prefixes:
        for name in ir.nodes:
            if name.startswith(prefix + "/"):
                in_grad.add(name)
                if "_grad/" in name:
                    op = forward_op_of(ir, prefix, name)
                    if op in wanted:
                        out.setdefault(op, []).append(name)
    return out, in_grad


def _upstream(ir: IR, grad_nodes: list[str], in_grad: set[str]) -> str | None:
    """The gradient flowing into a reduction: the one gradient tensor its gradient code reads
    from outside itself."""
    inside = set(grad_nodes)
    found: list[str] = []
    for g in grad_nodes:
        for ref in ir.nodes[g].inputs:
            producer = node_of(ref)
            if producer in inside or producer not in in_grad:
                continue
            name, idx = parse_tensor(ref)
            tensor = f"{name}:{idx}"
            if tensor not in found and ir.output_dtype(tensor) in _FLOATS:
                found.append(tensor)
    return found[0] if len(found) == 1 else None


_FLOATS = frozenset({dtypes.float16.as_datatype_enum, dtypes.bfloat16.as_datatype_enum,
                     dtypes.float32.as_datatype_enum, dtypes.float64.as_datatype_enum})


def _numerator_couplings(flow) -> set[str]:
    """Batch reductions whose per-tower values reach a loss other than through its
    denominator: the numerators' couplings and those of terms without a denominator."""
    if flow is None:
        return set()
    found: set[str] = set()
    for terms, _ in flow.losses.values():
        for term in terms:
            fact = flow.fact(term.root)
            if fact is None:
                continue
            if term.denominator and fact.src:
                fact = flow.fact(f"{fact.src}:0") or fact
            found.update(fact.taint)
    return found


def _drop_covered_update_reasons(ir: IR, analysis, synced: set[str]) -> None:
    """Update ops whose batch-dependent inputs all pass through synchronized statistics are exact."""
    covered = set()
    batch_readers = {c.name for b in analysis.batch_inputs for c, _ in ir.data_consumers(b.tensor)}
    for update in analysis.update_ops:
        work, seen, ok = list(ir.nodes[update].inputs), set(), True
        while work and ok:
            name, idx = parse_tensor(work.pop())
            if (name, idx) in seen or name in synced or name not in analysis.batch_dependent:
                continue
            seen.add((name, idx))
            if name in batch_readers:
                ok = False
            node = ir.nodes[name]
            if node.op in FUSED_BATCH_NORM and idx in (1, 2) and not node.attr("is_training", True):
                work.append(node.inputs[idx + 2])   # inference mode passes the moving average on
            else:
                work.extend(node.inputs)
        if ok:
            covered.add(update)
    analysis.reasons[:] = [r for r in analysis.reasons if r.node not in covered]


from replicate.passes._denominator import GlobalDenominator as _GlobalDenominator  # noqa: E402
from replicate.passes._exactness import SIZE_COUPLING, size_coupling  # noqa: E402
from replicate.passes._fused_sync import FusedSync as _FusedSync  # noqa: E402
