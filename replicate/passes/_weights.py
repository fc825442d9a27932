"""Helper of the analyze pass: the gradient computations, their losses and their weights.

Every ``tf.gradients`` call the train ops depend on is a :class:`~replicate.batchflow.facts.GradScope`
with one seed per differentiated output. Each seed's loss is decomposed by the batch dataflow
(:mod:`replicate.batchflow.loss`); the terms of all of a scope's seeds decide its primary
weights and per-term corrections. A loss the dataflow cannot decompose gives a reason and the
scope keeps the count weights of its first batch class.
"""

from __future__ import annotations

import networkx as nx

from replicate.batchflow.facts import GradScope, Reason
from replicate.batchflow.lattice import PART, SHARED, Sym, batch_size
from replicate.batchflow.loss import (
    ONES,
    UNIFORM,
    Term,
    positive_shift,
    shares_suffice,
    sync_sources,
    weigh,
)
from replicate.batchflow.roles import scope_seeds, seed_sources
from replicate.batchflow.table import behind
from replicate.errors import AnalysisError
from replicate.graph.ir import IR, node_of, parse_tensor, tensor_name

__all__ = ["scopes", "losses", "assign", "weigh_in_towers", "prefer_in_towers", "DATA_SHARES"]

_THROUGH = frozenset({"Identity", "Snapshot", "CheckNumerics"})


def scopes(ir: IR, prefixes: list[str], train_ops: list[str], graph: nx.DiGraph,
           loss: str | None) -> list[GradScope]:
    """The gradient scopes the train ops depend on, with their seeds and losses.

    ``loss`` (the user's ``loss=``) names what the gradients differentiate: it replaces a seed
    whose loss cannot be recovered, and must agree with the ones that can.
    """
    if loss is not None:
        name, _ = parse_tensor(loss)
        if name not in ir.nodes:
            raise AnalysisError(f"loss '{loss}' is not a node of the graph")
        loss = tensor_name(*parse_tensor(loss))
    ancestors = ir.ancestors(train_ops, graph)
    out, fetched = [], []
    for prefix in prefixes:
        seeds = scope_seeds(ir, prefix)
        if not any(n.startswith(prefix + "/") for n in ancestors):
            # gradients a driver fetches (saliency maps, a gradient norm to log): weighed like
            # the others, else each tower's was taken for a share of a mean's (1/3 of the
            # gradient of a sum on 3 towers, claimed exact)
            if seeds:
                fetched.append((prefix, seeds))
            continue
        found = [l for _, l in seeds]
        if loss is not None:
            for (seed, l) in seeds:
                if l is None:
                    _check_fits(ir, graph, prefix, seed, loss)
            found = [loss if (l is None or _same(ir, l, loss)) else l for l in found]
        scope = GradScope(prefix, next((l for l in found if l), None), "mean",
                          seeds=[s for s, _ in seeds], losses=found)
        out.append(scope)
    if not out:
        raise AnalysisError(f"train op '{train_ops[0]}' does not depend on any gradient")
    for prefix, seeds in fetched:
        found = [l for _, l in seeds]
        out.append(GradScope(prefix, next((l for l in found if l), None), "mean",
                             seeds=[s for s, _ in seeds], losses=found, fetched=True))
    if loss is not None and not any(loss in s.losses for s in out):
        differentiated = next((l for s in out for l in s.losses if l), None)
        raise AnalysisError(f"loss '{loss}' is not what the gradients differentiate"
                            + (f" ('{differentiated}')" if differentiated else "")
                            + "; omit loss= or name that tensor")
    return out


def _nested(ir: IR, prefix: str, prefixes: list[str]) -> bool:
    """Whether gradient scope ``prefix`` reads another scope's tensors (it differentiates
    inside that scope's custom gradient)."""
    others = tuple(p + "/" for p in prefixes if p != prefix)
    inside = prefix + "/"
    return any(node_of(r).startswith(others) for name, node in ir.nodes.items()
               if name.startswith(inside) for r in node.inputs)


def _check_fits(ir: IR, graph: nx.DiGraph, prefix: str, seed: str, loss: str) -> None:
    """Refuse a ``loss=`` that cannot be what seed ``seed`` differentiates: a shape other than
    the seed's, or a tensor that does not depend on every forward op whose gradient code reads
    the seed (a per-example residual named instead of the mean built from it was taken at its
    word, and trained 0.9 away from one device, claimed exact)."""
    want, have = ir.static_shape(seed), ir.static_shape(loss)
    if want is not None and have is not None and (len(want) != len(have) or any(
            a is not None and b is not None and a != b for a, b in zip(want, have))):
        raise AnalysisError(f"loss '{loss}' has shape {have}, but the gradients in '{prefix}' "
                            f"differentiate a tensor of shape {want}; name that tensor")
    sources = seed_sources(ir, prefix, node_of(seed))
    above = ir.ancestors([node_of(loss)], graph)
    missing = [s for s in sources if s not in above]
    if missing:
        raise AnalysisError(f"loss '{loss}' is not what the gradients in '{prefix}' "
                            f"differentiate: it does not depend on '{missing[0]}', whose gradient "
                            "the differentiation starts from; name the tensor passed to "
                            "tf.gradients or minimize")


def _same(ir: IR, a: str, b: str) -> bool:
    """True when tensors ``a`` and ``b`` are one value behind identities."""
    return behind(ir, a, _THROUGH) == behind(ir, b, _THROUGH)


def losses(grad_scopes: list[GradScope]) -> list[str]:
    """Every loss the scopes differentiate, once, in order."""
    return list(dict.fromkeys(l for s in grad_scopes for l in s.losses if l))


def drop_unweighable_fetches(grad_scopes: list[GradScope], flow) -> list[Reason]:
    """Fetched-only gradient scopes whose loss is no sum, mean or ratio of the batch, or is a
    nonlinear function of batch reductions, leave the analysis (their gradients stay each
    tower's, and the report says so): synchronizing the reductions of such a loss changed the
    training loss's own forward values (a fetched gradient of ``mean * mean(square(logits))``
    put the trained variables 1.5 off, claimed exact)."""
    reasons = []
    for scope in [s for s in grad_scopes if s.fetched]:
        entries = [flow.losses.get(l) for l in scope.losses]
        if all(l is not None for l in scope.losses) and all(
                e is not None and e[1] is None and not any(t.sync for t in e[0]) for e in entries):
            continue
        grad_scopes.remove(scope)
        kept = {l for s in grad_scopes for l in s.losses}
        for loss in scope.losses:
            if loss not in kept:
                flow.losses.pop(loss, None)
        reasons.append(Reason(scope.prefix, f"the gradients of '{scope.loss or scope.prefix}' "
                              "(fetched, applied by no train op) are not of a sum, mean or ratio "
                              "over the batch: fetched, each tower's is of its own slice",
                              "fetch gradients of a batch mean or sum, or compute them on one "
                              "device"))
    return reasons


def _given_seeds(flow, scope: GradScope) -> list[Reason]:
    """A reason for each seed given to ``tf.gradients`` (``grad_ys``, ``minimize``'s
    ``grad_loss``) that is not proved the same in every tower as on one device (a constant, a
    shared value) or per example (the action gradients a DDPG actor is fed): ``1 / n`` of the
    tower's own batch size seeded each tower's gradients with its own scale (review 33)."""
    ir, out = flow.ctx.ir, []
    for seed in scope.seeds:
        node = ir.nodes.get(node_of(seed))
        if node is None or node.op != "Identity" or not node.inputs:
            continue                    # TensorFlow's own seed: ones shaped like the loss
        given = tensor_name(*parse_tensor(node.inputs[0]))
        fact = flow.fact(given)
        if fact is not None and not fact.taint and (fact.kind == PART or fact.kind == SHARED
                                                    and not batch_size(fact)) \
                and flow.ctx.gradient.isdisjoint(ir.ancestors([node_of(given)], control=False)):
            continue        # (computed from gradient code: the gradient of a batch mean carries
                            # each tower's own 1/n, a DDPG actor seeded by its critic's, review 34)
        out.append(Reason(node_of(given), f"the gradients of '{scope.loss or scope.prefix}' start "
                          f"from '{given}' (grad_ys, or minimize's grad_loss), which is computed "
                          "from the batch: each tower starts from its own slice's value",
                          "scale the loss instead (tf.gradients(loss / n, ...): replicate "
                          "synchronizes the batch size n), or seed with ones"))
    return out


def assign(grad_scopes: list[GradScope], flow, primary_class: int) -> list[Reason]:
    """Set each scope's kind, weights and corrections from the decomposed losses."""
    reasons: list[Reason] = []
    for scope in grad_scopes:
        terms = []
        failed = False
        reasons.extend(_given_seeds(flow, scope))
        if any(l is None for l in scope.losses) or not scope.losses:
            if _nested(flow.ctx.ir, scope.prefix, [s.prefix for s in grad_scopes]):
                # tf.recompute_grad differentiates its function again inside the custom
                # gradient (review 21: the reason blamed an unrecognized loss)
                reasons.append(Reason(scope.prefix, "this gradient computation runs inside a "
                                      "custom gradient, seeded by the outer one's gradient "
                                      "(tf.recompute_grad, or a tf.custom_gradient that "
                                      "differentiates its own function); each tower applies it "
                                      "to its own share",
                                      "drop tf.recompute_grad (it saves memory and does not "
                                      "change the values) for exact replication"))
            else:
                reasons.append(Reason(scope.prefix, "the loss this gradient computation "
                                      "differentiates was not recognized (gradients seeded by a "
                                      "given grad_ys?)",
                                      "pass loss= naming the tensor, or differentiate a loss "
                                      "tensor"))
            failed = True
        for loss in scope.losses:
            if loss is None:
                continue
            found, reason = flow.losses[loss]
            if reason is None:
                found, unproven = _global_denominators(flow, found)
                flow.losses[loss] = (found, None)
                reasons.extend(unproven)
            if reason is not None:
                if not any(r.node == reason.node and r.what == reason.what for r in reasons):
                    reasons.append(reason)
                failed = True
            terms.extend(found)
        if failed:
            scope.kind, scope.weights, scope.corrections = "other", ("count", primary_class), []
            continue
        weighting = weigh(terms)
        reasons.extend(_zero_shares(flow, terms, weighting))
        scope.kind = weighting.kind
        scope.weights = weighting.primary
        scope.corrections = weighting.corrections
    return reasons


#: Tower weights that are a tower's share of a value the data decides (a mask's sum, the size
#: of a masked selection): zero in a tower that has examples but none of them counted.
DATA_SHARES = frozenset({"value", "size", "shifted"})


def _zero_shares(flow, terms: list, weighting) -> list[Reason]:
    """A loss whose terms are weighted differently, one of them by a share the data decides,
    is exact only while no tower's share is zero: a tower with no masked-in example gets a
    0/0 weight ratio and loses its other terms (a masked mean plus a plain mean was claimed
    exact, 0.08 off). A reason until the towers divide by the global denominator."""
    if not weighting.corrections:
        return []
    data = [t for t in terms if t.kind != "shared" and t.spec and t.spec[0] in DATA_SHARES
            and not _positive_shift(flow, t.spec) and not _batch_size(flow, t.spec)]
    if not data:
        return []
    t = data[0]
    what = t.spec[1] if len(t.spec) > 1 else t.root
    return [Reason(node_of(t.root), f"the loss adds a term normalized by '{what}' (a masked count "
                   "or selection) to terms weighted otherwise; a tower where that count is zero "
                   "(no masked-in example) drops its share of the other terms",
                   "normalize every term by the same count, or keep each tower's count above "
                   "zero (tf.maximum(count, 1.0) or count + 1e-7); exact for a single term")]


def _global_denominators(flow, terms: list[Term]) -> tuple[list[Term], list[Reason]]:
    """Terms normalized by a batch sum the data decides (a mask's count) divide by the
    synchronized global sum instead, where weighing each tower's own ratio by its share of the
    count is not proven exact:

    - beside terms weighted otherwise: each tower's term is then its exact share, a plain sum
      over its examples, and a tower whose count is zero adds zero instead of losing its share
      of the other terms (a denominator that cannot be synchronized stays a reason,
      :func:`_zero_shares`);
    - alone, when its numerator need not vanish where the count does (``sum(loss) /
      sum(mask)``: a tower whose mask is all zero has a nonzero numerator over a zero count,
      and its share, zero, dropped it: 0.36 off in an independent review). A numerator proven
      to vanish with the count (:func:`~replicate.batchflow.loss.shares_suffice`) keeps the
      towers' shares, which need no synchronization and keep accumulation's memory savings.
      A denominator that cannot be synchronized is then a reason."""
    batch = [t for t in terms if t.kind != "shared"]
    mixed = len({t.spec for t in batch}) >= 2
    out, reasons = [], []
    for t in terms:
        # (beside other terms, a batch size keeps the towers' shares: it is zero only in a
        # tower without examples, whose every term is zero too)
        if _data_ratio(t) and not _positive_shift(flow, t.spec) and not (mixed and _batch_size(flow, t.spec)) \
                and (mixed or not shares_suffice(flow.ctx, t.spec, _numerator(flow.ctx.ir, t))):
            converted = _over_global_denominator(flow, t)
            if converted is None and not mixed:
                reasons.append(Reason(node_of(t.root), f"the loss divides by '{t.spec[1]}', a count "
                                      "the data decides, and its numerator does not vanish where "
                                      "that count does: a tower whose count is zero would drop its "
                                      "examples", "multiply the summed values by the same mask "
                                      "(sum(loss * mask) / sum(mask)), or keep the count above "
                                      "zero (tf.maximum(count, 1.0))"))
            t = converted or t
        out.append(t)
    return out, reasons


def _numerator(ir: IR, t: Term) -> str | None:
    """The numerator of ratio term ``t``, when its division reads ``t``'s count."""
    ratio = ir.nodes[node_of(t.root)]
    if len(ratio.inputs) >= 2 and _same(ir, ratio.inputs[1], t.spec[1]):
        return ratio.inputs[0]
    return None


def _data_ratio(t: Term) -> bool:
    """A ratio weighted by each tower's share of a denominator the data decides."""
    return t.kind == "ratio" and bool(t.spec) and t.spec[0] in ("value", "shifted")


def _over_global_denominator(flow, t: Term, synced: frozenset = frozenset()) -> Term | None:
    """Ratio term ``t`` as a plain sum whose gradient code divides by the batch's denominator
    (synchronized), or None when the denominator cannot be synchronized."""
    found = sync_sources(flow.ctx, t.spec[1], synced=synced)
    if found is None:
        return None
    return Term(t.root, "sum", ONES, t.cls, denominator=(t.spec[1],) + found[0])


def _positive_shift(flow, spec: tuple) -> bool:
    return positive_shift(flow.ctx, spec)


def _batch_size(flow, spec: tuple) -> bool:
    """True when a term's tower weight is its share of a multiple of the batch size
    (``sum(kl) / tf.cast(tf.shape(x)[0], tf.float32)``, KL divergence's "batchmean"), or of
    the batch size times a length the same in every tower (``tf.size`` of a ``[B, T]`` loss with
    a dynamic ``T``: a Sym of no known coefficient, review 28 P7): zero only in a tower without
    examples, whose every term is zero too (or, T being 0, on one device as well)."""
    fact = flow.fact(spec[1]) if spec[0] in ("value", "size") and len(spec) > 1 else None
    return fact is not None and fact.merge == "size" and bool(fact.value) \
        and all(isinstance(v, Sym) and v.coef != 0 for v in fact.value)


def weigh_in_towers(flow, scope: GradScope, synced: frozenset = frozenset()) -> bool:
    """Set ``scope`` to weigh the loss in the towers: weights ``ones``, every term a correction
    scaled by its own tower weight where its gradient enters, a ratio's denominator read as
    the batch's by the gradient code. False (scope unchanged) when a ratio's denominator
    cannot be synchronized.

    Needed where weighing the towers' gradients afterwards is wrong: a custom gradient that
    is not linear in its upstream (passes/_custom.py), and a loss weighted by data shares
    beside synchronized batch statistics (a tower whose share is zero still passes gradient
    to its examples through the batch's statistics; weighed by zero, it was dropped)."""
    terms: list[Term] = []
    converted: dict[str, list[Term]] = {}
    for loss in scope.losses:
        found, reason = flow.losses[loss]
        if reason is not None or any(_scaled_by_a_variable(flow, t) for t in found):
            return False
        mine = []
        for t in found:
            size = flow.fact(t.spec[1]) if _data_ratio(t) else None
            if _data_ratio(t) and not (size is not None and size.merge == "size"):
                t = _over_global_denominator(flow, t, synced)   # a tower's own count stays:
                if t is None:                                    # zero only without examples
                    return False
            mine.append(t)
        converted[loss] = mine
        terms.extend(mine)
    flow.losses.update({loss: (mine, None) for loss, mine in converted.items()})
    batch = [t for t in terms if t.kind != "shared"]
    scope.weights = ONES
    scope.corrections = ([(t.root, t.spec) for t in batch if t.spec != ONES]
                         + [(t.root, UNIFORM) for t in terms if t.kind == "shared"])
    return True


def _scaled_by_a_variable(flow, t: Term) -> bool:
    """A term whose gradient enters through a product with a coefficient computed from a
    variable (``exp(-s) * mean``): weighed in the towers, an empty tower's mean (NaN) reaches
    the coefficient's gradient through the product; weighed after aggregation, ``MulNoNan``
    drops it."""
    node = flow.ctx.ir.nodes.get(node_of(t.root))
    return node is not None and node.op in ("Mul", "MulNoNan") and t.kind in ("mean", "sum")


def prefer_in_towers(ir: IR, flow, scopes_: list[GradScope], region: list[str], gradient: set[str],
                     synced: frozenset = frozenset()) -> int:
    """Weigh each scope's loss in the towers wherever nothing forbids it; returns how many.

    Weighing the aggregated gradients multiplies every parameter's gradient in every tower by
    the tower's weight; weighing the loss multiplies one scalar per term per tower (where its
    gradient enters), so the towers' gradients only add: 1-6% less step time for a 20M
    parameter MLP (benchmarks/weigh_loss.py). A scope keeps the aggregated weights when a
    term's gradient entry cannot be found, or when forward code reads its gradients (their
    rows would then carry the tower's weight before the loss reads them), or when a term is
    weighted by a share of data (a mask's count: weighing it in the towers would need that
    count synchronized across the towers)."""
    from replicate.passes.weigh import entries

    done = 0
    for scope in scopes_:
        if not scope.weights or scope.weights == ONES or scope.kind == "other":
            continue
        terms = [t for loss in scope.losses if loss is not None for t in flow.losses[loss][0]]
        if not terms or any(t.spec and t.spec[0] in DATA_SHARES for t in terms):
            continue                # a data share would need its denominator synchronized
        if any(not entries(ir, scope.prefix, t.root) for t in terms):
            continue
        inside = scope.prefix + "/"
        if any(node_of(ref).startswith(inside) for name in region if name not in gradient
               for ref in ir.nodes[name].inputs):
            continue
        done += bool(weigh_in_towers(flow, scope, synced))
    return done
