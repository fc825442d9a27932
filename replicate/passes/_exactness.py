"""Helper of the analyze pass: why the replicated graph may differ from one device.

Each reason names the op, what it does across towers and what to do. The dataflow supplies
the reasons about losses and baked-in batch sizes; this module adds the ones about state and
randomness: random ops draw a stream per tower, state updates inside the towers run on tower
0's slice, batch reductions that feed per-example values (couplings) give each tower its own
slice's statistic unless synchronized, and tensors the shared graph reads that towers cannot
merge are tower 0's.
"""

from __future__ import annotations

import networkx as nx
import numpy as np
from tensorflow.core.framework import types_pb2

from replicate.batchflow.effects import describe, writes
from replicate.batchflow.facts import Analysis, Reason
from replicate.batchflow.lattice import INSIDE, PART, RED, batch_size
from replicate.batchflow.loss import NO_GRADIENT
from replicate.batchflow.reductions import FUSED_BATCH_NORM
from replicate.batchflow.roles import FLOAT_TYPES
from replicate.batchflow.table import behind, value_only
from replicate.graph.ir import IR, node_of
from replicate.graph.ops import BATCH_SOURCE_OPS, VARIABLE_OPS
from replicate.passes._frontier import SWITCHED_FIX

__all__ = ["collect", "unmergeable", "size_like", "size_coupling", "two_routes", "deciding_writes"]

#: A batch size a batch statistic is combined with into per-example values: what, then the fix.
SIZE_COUPLING = ("the batch size (tf.shape / tf.size) is combined with a batch statistic into "
                 "per-example values; each tower counts only its own examples, and replicate "
                 "synchronizes a batch size only as a single number (tf.shape(x)[0], cast or not)",
                 "count the examples as a batch sum instead, e.g. "
                 "tf.reduce_sum(tf.ones_like(labels, tf.float32))")


def size_coupling(analysis: Analysis, name: str) -> bool:
    """True when coupling ``name`` is a batch size, not a batch reduction."""
    fact = analysis.flow.fact(f"{name}:0") if analysis.flow is not None else None
    return fact is not None and fact.merge == "size"

_INTS = frozenset({types_pb2.DT_INT32, types_pb2.DT_INT64, types_pb2.DT_INT16, types_pb2.DT_INT8,
                   types_pb2.DT_UINT8, types_pb2.DT_BOOL})


def size_like(ir: IR, name: str, flow) -> bool:
    """A coupling computed on integers (the longest sequence of a batch, a count), or a batch
    size (``tf.shape(x)[0]``, cast or not): cheap and exact to synchronize, so it always is."""
    node = ir.nodes[name]
    fact = flow.fact(f"{name}:0")
    return node.op in ("Max", "Min", "Sum", "Size") and ir.output_dtype(f"{name}:0") in _INTS \
        or fact is not None and batch_size(fact) and value_only(ir, name)


def deciding_writes(ir: IR, flow, in_grad: set[str]) -> list[str]:
    """Forward batch reductions that a state write reads, a resource handle included: the
    predicate of the TF1 cond a write is in reaches it through the ``Switch`` its variable's
    handle passes. They are couplings as much as those a loss reads: each tower's value must be
    the batch's, or the write does what tower 0's slice decides (review 49 S2: ``cnt += 2`` in
    ``tf.cond(tf.shape(x)[0] > 5, ...)`` never ran with 3 towers of a batch of 7, and the
    rewrite was claimed exact). A write's inputs also feed the optimizer's kernels, whose
    gradients' own reductions are gradient code, not forward statistics."""
    found: dict[str, None] = {}
    for node in ir:
        if node.name in in_grad or not writes(ir, node):
            continue
        for ref in node.inputs:
            fact = flow.fact(ref) if node_of(ref) not in in_grad else None
            for src in sorted(fact.taint if fact is not None else ()):
                if src not in in_grad:
                    found.setdefault(src, None)
    return list(found)


def deciding_bodies(ir: IR, flow, in_bodies: list[str], loss_syncs) -> set[str]:
    """Batch reductions (not batch sizes) that decide a v2 cond or loop whose bodies hold
    batch reductions of their own, which cannot be synchronized: left to each tower. Read
    globally, every tower took the branch one device takes and computed it on its own slice:
    ``cond(sum(m) > 0, sum(l * m) / sum(m), 0.0)`` divided 0 by 0 in a tower without masked-in
    examples, and every variable became NaN where one device trains (review 45 C2); decided
    per tower, that tower takes the guard's branch, as the guard means it to."""
    held = {c.split(INSIDE, 1)[0] for c in in_bodies}
    for node, sources in flow.ctx.decided_by.items():
        inner = f"{node}{INSIDE}"
        facts = [flow.fact(f"{node}:{i}") for i in range(flow.ctx.n_outputs(ir.nodes[node]))] \
            if node in ir.nodes else []
        if any(f is not None and ((f.src or "").startswith(inner) or any(t.startswith(inner) for t in f.taint))
               for f in facts):
            held.add(node)
    return {src for node in held for src in flow.ctx.decided_by.get(node, ())
            if src in ir.nodes and src not in loss_syncs and not size_like(ir, src, flow)}


#: Ops a loss term's root is looked up behind: they only reshape, cast or negate it.
_PASS = frozenset({"Identity", "Snapshot", "Squeeze", "Reshape", "ExpandDims", "Cast", "Neg"})


def two_routes(ir: IR, flow, synced) -> list[Reason]:
    """Reasons for synchronized batch reductions that a loss reads on two routes: as (part of)
    a term of its own and through per-example values that take its gradient, or as the very
    reduction a term sums. A synchronized reduction's gradient code receives the towers'
    upstream gradients added, which is right for what the per-example values send it (each
    tower's part of the global sum) and for a term made once from it (each tower's share of
    it), but not for both at once, nor for a mean the towers' own weights already scale
    (review 40: ``m, v = tf.nn.moments(ce, [0]); loss = m + v`` under sync, its mean's
    gradient counted once per tower, 0.57-0.72 off; ``nrm + mean(ce / (nrm + 1))`` with
    ``nrm = tf.norm(ce)``, 0.03-0.12 off)."""
    reasons = []
    couplings = set(flow.couplings()) if synced else set()
    for loss, (terms, _) in flow.losses.items():
        roots = _roots(ir, terms)
        for name in sorted(synced):
            rooted = name in roots
            inside = any(name in t.sync for t in terms)
            if rooted and name in couplings or inside and _other_terms(ir, flow, name, roots):
                reasons.append(Reason(node_of(loss), f"the batch reduction '{name}' "
                                      f"({ir.nodes[name].op}) reaches this loss both directly and "
                                      "through per-example values; synchronized across towers, its "
                                      "gradient code adds the towers' upstream gradients, which "
                                      "weighs the two routes alike where they can need different "
                                      "weights (measured: up to 0.9 off one device), and the "
                                      "analysis does not prove which holds here",
                                      "compute the value twice (one reduction for each route), "
                                      "stop its gradient on one route (tf.stop_gradient), or "
                                      "train this graph on one device"))
    return reasons


def _roots(ir: IR, terms) -> set[str]:
    """The nodes a loss's own terms (not the shared ones) are, behind reshapes and casts."""
    return {node_of(behind(ir, t.root, _PASS)) for t in terms if t.kind != "shared"}


def _a_term_too(ir: IR, flow, name: str) -> bool:
    """Whether batch reduction ``name`` is also a term of a loss of its own (``m`` in
    ``m + tf.cond(m > 0.5, ...)``): synchronized, its two routes would be weighed alike."""
    return flow is not None and any(name in _roots(ir, terms) for terms, _ in flow.losses.values())


def _other_terms(ir: IR, flow, name: str, roots: set[str]) -> bool:
    """True when node ``name`` (in a nonlinear term) also reaches, with a gradient back to it
    (no ``tf.stop_gradient`` on the way), the root of a term of its own through per-example
    values: the second route. Per-example values that only feed the nonlinear term's own
    reductions (the squared deviations of ``tf.math.reduce_std``) are one route."""
    work, seen = [(name, False)], {name}
    while work:
        ref, through = work.pop()
        for consumer in ir.consumers(ref):
            if consumer.name in seen or consumer.op in NO_GRADIENT or flow.ctx.in_gradient(consumer):
                continue
            seen.add(consumer.name)
            fact = flow.fact(f"{consumer.name}:0")
            per_example = through or fact is not None and fact.kind == PART
            if per_example and consumer.name in roots:
                return True
            work.append((consumer.name, per_example))
    return False


def data_statistic(ir: IR, graph: nx.DiGraph, name: str, flow) -> bool:
    """A coupling computed from the inputs alone, and either from integer or boolean inputs (a
    mask divided by its batch mean, as graph convolution code normalizes its loss; a count of
    labels) or used only to scale values (a float mask divided by its mean): no variable
    reaches it, so synchronizing it costs one small reduction, changes no gradient, and gives
    every tower the single-device value. It always is. Statistics of float inputs that centre
    them (batch norm applied to the features) follow the batch_norm mode."""
    fact = flow.fact(f"{name}:0")
    if fact is None or fact.kind != "red" or fact.merge not in ("mean", "sum", "max", "min"):
        return False
    above = nx.ancestors(graph, name) & set(ir.nodes)
    if any(ir.nodes[a].op in VARIABLE_OPS for a in above):
        return False
    fed = [ref for a in above | {name} for ref in ir.nodes[a].inputs
           if node_of(ref) in above and ir.nodes[node_of(ref)].op in BATCH_SOURCE_OPS]
    if not fed:
        return False
    if all(ir.output_dtype(ref) not in FLOAT_TYPES for ref in fed):
        return True
    return _scales_only(ir, name)


#: Ops through which a statistic only scales per-example values (a normalizer, not a centre).
_SCALING = frozenset({"RealDiv", "Div", "DivNoNan", "Mul", "MulNoNan", "Reciprocal"})
_THROUGH = frozenset({"Identity", "Cast", "StopGradient", "Reshape", "ExpandDims", "Squeeze"})


def _scales_only(ir: IR, name: str) -> bool:
    """Every use of statistic ``name`` (through identities and casts) scales values: a float
    mask divided by its batch mean. Batch norm on float features subtracts its mean instead,
    and follows the batch_norm mode."""
    work, seen = [name], set()
    while work:
        cur = work.pop()
        if cur in seen:
            continue
        seen.add(cur)
        for consumer in ir.consumers(cur):
            if consumer.op in _THROUGH:
                work.append(consumer.name)
            elif consumer.op not in _SCALING:
                return False
    return True


def unmergeable(ir: IR, graph: nx.DiGraph, train_ops: list[str], tensors: list[str], region: set[str],
                warnings: list[str], fetch_only: list[str]) -> list[Reason]:
    """Tensors read by shared ops that towers cannot merge: a reason when training uses them,
    otherwise (only the fetched value is tower 0's) added to ``fetch_only`` and one warning
    naming every one of them: it changes what a driver sees."""
    if not tensors:
        return []
    training = ir.ancestors(train_ops, graph)
    reasons = []
    for t in tensors:
        readers = [c.name for c, _ in ir.data_consumers(t) if c.name not in region]
        if any(r in training for r in readers) and ir.nodes[node_of(t)].op in ("Switch", "RefSwitch"):
            reasons.append(Reason(readers[0], f"'{readers[0]}' reads a variable in a TF1 cond "
                                  "whose condition each tower decides for itself; it runs as "
                                  "tower 0's slice decides, once per step",
                                  SWITCHED_FIX + ", or move the state update out of the cond"))
        elif any(r in training for r in readers):
            reasons.append(Reason(node_of(t), f"'{t}' is read by '{readers[0]}' outside the towers "
                                  "and cannot be merged across towers; tower 0's value is used",
                                  "compute it from merged values or outside the model"))
        else:
            fetch_only.append(t)
    if fetch_only:
        # the names a driver fetches: identities of them (``loss = tf.identity(..., name=)``)
        named = list(dict.fromkeys(n for t in fetch_only for n in [t] + _identities(ir, t)))
        warnings.append("fetching " + ", ".join(f"'{t}'" for t in named) +
                        " gives tower 0's value, not the global batch's (not mergeable across "
                        "towers)")
    return reasons


def _identities(ir: IR, ref: str, depth: int = 3) -> list[str]:
    """Outputs of ``Identity`` ops that pass tensor ``ref`` on (review 44: the warning named
    ``add_1:0`` where the driver fetches the loss ``loss:0``)."""
    out = []
    for reader, _ in ir.data_consumers(ref):
        if reader.op == "Identity" and depth:
            out += [f"{reader.name}:0"] + _identities(ir, f"{reader.name}:0", depth - 1)
    return out


def collect(ir: IR, analysis: Analysis) -> None:
    """Add the reasons about state updates, couplings and gradient types (random draws: _draws)."""
    reasons = analysis.reasons
    for name in analysis.update_ops[:8]:
        effect = writes(ir, ir.nodes[name])[0]
        where = "" if not effect.inner else f" ({describe(effect)})"
        if name in analysis.needed:     # every tower copies it: its value feeds the loss
            reasons.append(Reason(name, f"state update{where} in the replicated region runs in "
                                  "every tower, once per tower and micro-batch, each on its own "
                                  "slice of the batch; one device runs it once per step",
                                  "move the update out of the function or loop, or make it "
                                  "depend on merged values only"))
            continue
        fix = ("it sees 1/N of the examples: run it beside the train op (tf.group(train_op, "
               "update), which replicate runs once on the whole batch) instead of making the "
               "train op wait for it (a center loss's centers), or compute it outside the model "
               "from values fetched for the whole batch" if "Scatter" in ir.nodes[name].op else
               "pass batch_norm='sync' if it averages a batch statistic (moving averages), or "
               "compute it outside the model from values fetched for the whole batch")
        reasons.append(Reason(name, f"state update{where} in the replicated region runs on tower "
                              "0's slice of the batch only", fix))
    inner = tuple(s.prefix + "/" for s in analysis.scopes)
    of_losses = set(analysis.flow.couplings()) if analysis.flow is not None else set()
    for name in analysis.couplings:
        if size_coupling(analysis, name):
            reasons.append(Reason(name, *SIZE_COUPLING))
            continue
        if name not in of_losses:       # :func:`deciding_writes`
            reasons.append(Reason(name, f"batch reduction ({ir.nodes[name].op}) decides a state "
                                  "update (the value written, or the cond the write is in); "
                                  "each tower sees its own slice's value",
                                  "use batch_norm='sync' (--batch-norm sync) to compute it over "
                                  "the global batch"))
            continue
        if name.startswith(inner):
            # a gradient computed in the model and used there (MAML's adaptation step): sync
            # mode synchronizes forward statistics, not this sum (review 28: it was the fix
            # given, and was further off)
            reasons.append(Reason(name, f"a gradient computed in the model sums over the batch "
                                  f"({ir.nodes[name].op}) and feeds per-example values; each tower "
                                  "differentiates its own slice (batch_norm='sync' does not change "
                                  "that)", "train this graph on one device (a gradient with "
                                  "respect to the inputs, of a sum over the examples, would be "
                                  "per example)"))
            continue
        if ir.nodes[name].op in ("Max", "Min") and _differentiated(ir, inner, name):
            # synchronizing the value would not help (review 33: the advice given was sync)
            op = ir.nodes[name].op.lower()
            reasons.append(Reason(name, f"the gradient of a batch {op}imum goes to the example that "
                                  "attains it, which one tower holds; it cannot be synchronized "
                                  "across towers", "stop its gradient (tf.stop_gradient) or use a "
                                  "mean or sum"))
            continue
        what = ("batch norm normalizes each tower by its own slice's statistics"
                if ir.nodes[name].op in FUSED_BATCH_NORM or "moments" in name
                else f"batch reduction ({ir.nodes[name].op}) feeds per-example values; each tower "
                     "sees its own slice's value")
        fix = ("use batch_norm='sync' (--batch-norm sync) to compute it over the global batch"
               if not _a_term_too(ir, analysis.flow, name) else
               "compute what it feeds from a reduction of its own (a predicate from "
               "tf.reduce_mean(tf.stop_gradient(...))) and use batch_norm='sync' (--batch-norm "
               "sync): synchronized, a reduction the loss also reads directly has its two routes "
               "weighed alike")
        reasons.append(Reason(name, what, fix))
    for f in analysis.frontier:
        if f.gradient and f.role == "dense" and ir.output_dtype(f.tensor) not in FLOAT_TYPES:
            reasons.append(Reason(node_of(f.tensor), "non-float gradient", "check the gradient"))
    reasons.extend(_unproven_gradients(ir, analysis))
    reasons.extend(_gradients_in_the_forward(ir, analysis))
    reasons.extend(_half_precision_sums(ir, analysis))
    analysis.warnings.extend(_shareable_hint(analysis))


def _shareable_hint(analysis: Analysis) -> list[str]:
    """A hint when the result is not exact and reading one batch input whole in every tower
    would leave nothing unproven (``Flow.shareable``): an input of its own split as examples
    (a few-shot program's support set) or values an op couples across the batch (rewards
    summed into discounted returns by a ``tf.scan``), where ``shared_inputs=`` makes each
    tower compute what depends on it from the whole batch and take its rows (review 36: the
    reasons only blamed the op that mixed its rows)."""
    if not analysis.reasons or analysis.flow is None or not analysis.flow.shareable:
        return []
    names = analysis.flow.shareable
    return [f"{', '.join(repr(t) for t in names)} is split as a batch of examples, and is what keeps "
            f"the result from being exact: read whole by every tower (shared_inputs={names!r}, "
            "--shared-inputs), each tower computes what depends on it from the whole batch and "
            "keeps its own rows, and the analysis finds nothing left to object to (at the cost of "
            "repeating that work in every tower; right also for an input that holds no examples, "
            "such as a support set)"]


def _differentiated(ir: IR, scopes: tuple[str, ...], name: str) -> bool:
    """Whether gradient code (of the scopes ``scopes``) reads forward op ``name``'s output, as
    a maximum's gradient does to find the examples that attain it."""
    return any(c.name.startswith(scopes) for c in ir.consumers(name))


#: Types whose rounding is coarser than the exactness the report promises (1e-5 relative).
HALF_TYPES = frozenset({types_pb2.DT_HALF, types_pb2.DT_BFLOAT16})


def _half_precision_sums(ir: IR, analysis: Analysis) -> list[Reason]:
    """A sum over the examples computed in float16 (a mixed-precision weight gradient, a
    loss averaged in half precision): each tower rounds its part to float16 and the parts are
    added, where one device rounds the whole batch's sum once; the results differ by float16's
    precision (measured: 1.5e-5 to 3.2e-5 after 3 steps), beyond what "exact" promises."""
    flow = analysis.flow
    if flow is None:
        return []
    for name in analysis.region:
        node = ir.nodes[name]
        for i, (dtype, _) in enumerate(ir.output_types(node)):
            fact = flow.fact(f"{name}:{i}")
            if dtype in HALF_TYPES and fact is not None and fact.kind == RED:
                return [Reason(name, f"'{name}' ({node.op}) sums over the examples in "
                               f"{'bfloat16' if dtype == types_pb2.DT_BFLOAT16 else 'float16'}: "
                               "each tower rounds its part before the parts are added, where one "
                               "device rounds once; results agree to half precision only",
                               "compute the sums over the batch in float32 for exact replication")]
    return []


def _gradients_in_the_forward(ir: IR, analysis: Analysis) -> list[Reason]:
    """Forward code of a loss that reads a gradient (adversarial examples ``x + eps * dL/dx``):
    a tower's gradient is of its own loss, so unless that loss adds per-example terms
    unweighted (the gradient of a sum of outputs, as a gradient penalty takes it) its rows are
    scaled by the tower's share of the batch, not the single device's."""
    prefixes = tuple(s.prefix + "/" for s in analysis.scopes)
    averaged = tuple(s.prefix + "/" for s in analysis.scopes if s.weights != ("ones",))
    if not averaged:
        return []
    inside = set(analysis.region)
    work = [node_of(s.loss) for s in analysis.scopes if s.loss]
    seen: set[str] = set()
    while work:                                 # the forward code the losses depend on
        name = work.pop()
        if name in seen or name not in inside or name.startswith(prefixes):
            continue
        seen.add(name)
        for ref in ir.nodes[name].inputs:
            if node_of(ref).startswith(averaged) and ir.output_dtype(ref) in FLOAT_TYPES:
                if _sign_of_a_mean(ir, analysis, ref, name):
                    continue
                return [Reason(name, f"forward code reads gradient '{ref}' of a loss averaged over "
                               "the batch: each tower's is of its own slice's average",
                               "differentiate a sum over the examples there")]
            work.append(node_of(ref))
    return []


#: Ops that pass a value through unchanged on the way to its sign.
_SIGN_PASS = frozenset({"Identity", "StopGradient", "Snapshot"})


def _sign_of_a_mean(ir: IR, analysis: Analysis, ref: str, reader: str) -> bool:
    """True when ``reader`` only takes the sign of gradient ``ref`` (FGSM's
    ``x + eps * tf.sign(dL/dx)``) and that gradient is of a plain mean over the examples: a
    tower's rows are then one device's times ``B / n_k > 0``, which the sign does not see."""
    scope = next((s for s in analysis.scopes if node_of(ref).startswith(s.prefix + "/")), None)
    if scope is None or scope.corrections or not scope.weights or scope.weights[0] != "count" \
            or not scope.losses or analysis.flow is None:
        return False
    for loss in scope.losses:     # every term a plain mean (a sum beside it scales unalike)
        terms, reason = analysis.flow.losses.get(loss, ([], True))
        if reason is not None or not terms or not all(
                (t.kind == "mean" and t.spec[:1] == ("count",) and not t.denominator)
                or (t.kind == "shared" and not t.sync) for t in terms):
            return False
    work, seen = [reader], set()
    while work:
        name = work.pop()
        if name in seen:
            continue
        seen.add(name)
        node = ir.nodes[name]
        if node.op == "Sign":
            continue
        if node.op not in _SIGN_PASS:
            return False
        readers = [c.name for c, _ in ir.data_consumers(name)]
        if not readers:
            return False
        work.extend(readers)
    return True


def _unproven_gradients(ir: IR, analysis: Analysis) -> list[Reason]:
    """Gradient code whose batch semantics the dataflow could not establish (a reshape to a
    shape inference could not relate to the batch, an op with no rule) and that reads an
    integer constant holding a multiple of a static batch size: no rule located that constant,
    so nothing rewrites it per tower and nothing proves the towers' copies compute their share
    of the gradient. Shapes computed at run time need no rewrite; a graph with no static batch
    size has no such constant."""
    statics = {s for s in analysis.classes.values() if s}
    if not statics:
        return []
    plan = analysis.plan
    planned = {name for name, _ in plan.elements} | {node_of(t) for t in plan.consts} | set(plan.factors)
    prefixes = tuple(s.prefix + "/" for s in analysis.scopes)
    found: dict[str, str] = {}
    for name in analysis.region:
        if not name.startswith(prefixes) or name not in analysis.batch_dependent:
            continue
        node = ir.nodes[name]
        facts = [analysis.flow.fact(f"{name}:{i}") for i in range(max(1, len(ir.output_types(node))))]
        bad = next((f for f in facts if f is not None and f.kind == "mixed"), None)
        if bad is None:
            continue
        for ref in node.inputs:
            const = _int_const(ir, ref)
            if const is None or const in planned:
                continue
            values = np.atleast_1d(ir.const_value(const)).reshape(-1)
            if values.size <= 64 and any(v > 0 and v % s == 0 for v in values.tolist() for s in statics):
                found.setdefault(name, f"gradient code reads constant '{const}' "
                                 f"({values.tolist()}), which may hold the batch size, where the "
                                 f"analysis could not follow the batch ({bad.why})")
    return [Reason(node, what, "give the batch inputs a dynamic batch dimension")
            for node, what in list(found.items())[:3]]


def _int_const(ir: IR, ref: str) -> str | None:
    """The integer Const behind ``ref`` (through identities and casts), if any."""
    for _ in range(4):
        node = ir.nodes.get(node_of(ref))
        if node is None:
            return None
        if node.op == "Const":
            return node.name if ir.output_dtype(f"{node.name}:0") in _INTS else None
        if node.op not in ("Identity", "Cast", "Snapshot") or not node.inputs:
            return None
        ref = node.inputs[0]
    return None
