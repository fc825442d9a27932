"""Decompose a loss into batch reductions, and choose how towers' gradients are weighted.

The towers' gradients add up to the single-device gradient exactly when the loss is a linear
combination of batch reductions with batch-independent coefficients,

    L = sum_j c_j * R_j + S,

each ``R_j`` a sum, a mean (weighted by the elements each tower reduces) or a ratio of sums
(weighted by each tower's share of the denominator) over the examples, and ``S`` a term that
does not depend on the batch (a regularizer). Then weighting tower ``k``'s gradient of ``R_j``
by ``w_jk`` and of ``S`` by ``s_k`` with ``sum_k s_k = 1`` gives the exact gradient. When all
terms share one weighting, it is applied to the aggregated gradients (the *primary* weights);
a term weighted differently gets a per-tower *correction* of the gradient entering it.

A nonlinear function of batch reductions (a root mean square, the square of a mean, a
log-sum-exp over the batch, a mean over a batch standard deviation) is a term whose reductions
are *synchronized*: every tower reads the global sums, means, maxima and minima it is computed
from, so the term's value is the single-device one in every tower and it is weighed like ``S``;
the gradient flowing into each synchronized reduction reaches the tower's own examples
(:mod:`replicate.passes.sync`). Anything else — a product of a batch reduction with a
per-example value, an op that mixes examples, a reduction inside a function body — is a
reason with the op that breaks linearity.
"""

from __future__ import annotations

import dataclasses

from tensorflow.core.framework import types_pb2

from replicate.batchflow.context import Context
from replicate.batchflow.facts import Reason
from replicate.batchflow.fixes import fix_for
from replicate.batchflow.lattice import INSIDE, MIXED, PART, RED, SHARED, Sym, batch_size
from replicate.batchflow.table import behind, size_root, value_only
from replicate.graph import ops
from replicate.graph.ir import IR, node_of, parse_tensor, tensor_name

__all__ = ["Term", "decompose", "Weighting", "weigh", "ONES", "UNIFORM", "sync_sources", "with_statistics_synced",
           "vanishes_with_count", "positive_shift", "shares_suffice", "behind", "NO_GRADIENT"]

ONES = ("ones",)
#: Each tower weighs 1/N: a batch-independent term added to a sum-reduced loss.
UNIFORM = ("uniform",)

_PASS = frozenset({"Identity", "Snapshot", "Cast", "Reshape", "ExpandDims", "Squeeze",
                   "CheckNumerics", "EnsureShape", "Neg", "IdentityN"})
_ADDS = frozenset({"Add", "AddV2", "AddN", "Sub", "BiasAdd", "AccumulateNV2"})
_DIVS = frozenset({"RealDiv", "Div", "DivNoNan", "TruncateDiv"})
_LINEAR_REDUCTIONS = frozenset({"Sum", "Mean"})


@dataclasses.dataclass(frozen=True)
class Term:
    """One batch reduction (or batch-independent part) of a loss.

    Attributes:
        root: the tensor the term's gradient enters through.
        kind: ``sum``, ``mean``, ``ratio`` or ``shared``.
        spec: tower weights of the term (see :func:`replicate.passes._combine.weight`).
        cls: the batch class it reduces (None for ``shared``).
        sync: for a ``shared`` term computed from batch reductions, those reductions (nodes),
            which every tower must read as the global batch's values.
        denominator: for a ratio turned into a ``sum`` term, its denominator tensor and then
            the reductions it is computed from; the towers' gradient code reads the global
            batch's denominator (the forward pass keeps each tower's own ratio, so merges stay
            as they are).
    """

    root: str
    kind: str
    spec: tuple
    cls: int | None
    sync: tuple = ()
    denominator: tuple = ()


#: Ops through which no gradient flows back: a coefficient computed through them is a constant
#: to the optimizer.
NO_GRADIENT = frozenset({"StopGradient", "PreventGradient", "Shape", "ShapeN", "Size", "Rank",
                         "ZerosLike", "OnesLike"})


def _trainable_cone(ir: IR, ref: str, limit: int = 2000) -> str | None:
    """A variable that ``ref``'s value is differentiably computed from, if any (a coefficient
    with a gradient). Integer tensors and shape ops carry no gradient."""
    from replicate.batchflow.roles import FLOAT_TYPES

    work, seen = [ref], set()
    while work and len(seen) < limit:
        cur = work.pop()
        name = node_of(cur)
        if cur in seen or name not in ir.nodes:
            continue
        seen.add(cur)
        node = ir.nodes[name]
        if node.op in ops.VARIABLE_OPS:
            return name
        if node.op in NO_GRADIENT or ir.output_dtype(cur) not in FLOAT_TYPES \
                and node.op not in ("ReadVariableOp", "Identity"):
            continue
        work.extend(node.inputs)
    return None


def decompose(ctx: Context, loss: str, statistics: frozenset = frozenset()
              ) -> tuple[list[Term], Reason | None]:
    """The terms of ``loss``, or the first reason it is not a linear combination of batch
    reductions. ``statistics``: batch statistics synchronized (``batch_norm='sync'``)."""
    terms: list[Term] = []
    failure: list[Reason] = []
    ir = ctx.ir

    def fail(node: str, what: str, fix: str) -> None:
        if not failure:
            failure.append(Reason(node, what, fix))

    def synced(ref: str, name: str) -> bool:
        """Add ``ref`` as a term read from synchronized reductions, if it can be one."""
        found = sync_sources(ctx, ref, synced=statistics)
        if found is None:
            return False
        terms.append(Term(ref, "shared", (), found[1], found[0]))
        return True

    def walk(ref: str, depth: int) -> None:
        if failure:
            return
        ref = tensor_name(*parse_tensor(ref))
        fact = ctx.fact(ref)
        name = node_of(ref)
        node = ir.nodes[name]
        if fact is None:
            fail(name, "the batch analysis did not reach the loss", "report this graph")
            return
        if fact.kind == SHARED:
            terms.append(Term(ref, "shared", (), None))
            return
        if fact.kind == MIXED:
            fail(fact.src or name, f"the loss depends on '{fact.src}': {fact.why}; towers see "
                 "only their own examples", fix_for(fact.why, fact.src or name))
            return
        if fact.kind == PART and fact.tail:
            fail(name, f"the loss sums rows that are part batch, part shared ('{ref}'): each tower "
                 "would add the shared rows again", fix_for("part batch, part shared"))
            return
        if fact.kind == PART:
            terms.append(Term(ref, "sum", ONES, ctx.classes.find(fact.cls)))   # tf.gradients sums
            return
        if depth > 200:
            fail(name, "the loss expression is too deep to analyse", "report this graph")
            return
        if fact.src == name and node.op in _LINEAR_REDUCTIONS | {"L2Loss"} and fact.merge in ("sum", "mean"):
            terms.append(Term(ref, fact.merge, ONES if fact.merge == "sum" else _canonical(ctx, fact.spec),
                              ctx.classes.find(fact.cls)))
            return
        if fact.src == name and fact.merge == "sum":
            terms.append(Term(ref, "sum", ONES, ctx.classes.find(fact.cls)))
            return
        if fact.merge == "ratio" and node.op in _DIVS:
            den = node.inputs[1]
            var = _trainable_cone(ir, den)
            if var is not None:
                fail(name, f"the loss divides by '{den}', a batch sum that depends on variable "
                     f"'{var}'", "normalize by a quantity that has no gradient (weights, masks, counts)")
                return
            terms.append(Term(ref, "ratio", fact.spec, ctx.classes.find(fact.cls)))
            return
        if node.op in _PASS or node.op == "StopGradient":
            if node.op != "StopGradient":
                walk(node.inputs[0], depth + 1)
            return
        if node.op in _ADDS:
            for r in node.inputs:
                walk(r, depth + 1)
            return
        if node.op in ("Mul", "MulNoNan") or node.op in _DIVS:
            facts = [ctx.fact(r) for r in node.inputs[:2]]
            dependent = [i for i, f in enumerate(facts) if f is not None and f.dependent]
            if len(dependent) != 1 and synced(ref, name):
                return
            if node.op in _DIVS and dependent != [0]:
                fail(name, f"the loss divides by a value that depends on the batch ('{node.inputs[1]}')",
                     "divide by a constant, a fed batch size, or a batch sum of weights")
                return
            if len(dependent) == 2 and node.op in ("Mul", "MulNoNan") and _mean_times_size(ctx, facts):
                # a mean scaled back by the batch size (legacy code's mean * B / 32): each
                # tower's is its sum, as one device's is the batch's (review 28)
                terms.append(Term(ref, "sum", ONES, ctx.classes.find(facts[0].cls)))
                return
            if len(dependent) != 1:
                fail(name, f"the loss multiplies two values that depend on the batch ('{name}')",
                     "make the loss a sum of batch means or sums")
                return
            coefficient = node.inputs[1 - dependent[0]]
            var = _trainable_cone(ir, coefficient)
            if var is not None:
                # c(s) * mean: the gradient reaching s is c'(s) times the mean, so the term's
                # tower weight must scale what enters the product, not the mean alone
                # (Kendall's uncertainty weighting exp(-s) * mean + s, review 30)
                before = len(terms)
                walk(node.inputs[dependent[0]], depth + 1)
                found = terms[before:]
                if not failure and len(found) == 1 and found[0].kind in ("mean", "sum") \
                        and not found[0].sync and not found[0].denominator:
                    terms[before] = dataclasses.replace(found[0], root=ref)
                    return
                del terms[before:]
                failure.clear()
                fail(name, f"the loss scales a batch reduction by '{coefficient}', which depends on "
                     f"variable '{var}'", "scale by a constant or a fed value")
                return
            walk(node.inputs[dependent[0]], depth + 1)
            return
        if node.op in _LINEAR_REDUCTIONS and fact.merge in ("sum", "mean", "ratio"):
            walk(node.inputs[0], depth + 1)     # a reduction over non-batch axes of a reduced value
            return
        if node.op in ops.CALL_OPS and fact.kind == RED and fact.src and INSIDE in fact.src \
                and not fact.taint and (fact.merge == "sum" or (
                    fact.merge == "mean" and fact.spec[:1] == ("count",))):
            # a body's batch sum or plain mean returned by a call or a branch chosen by a shared
            # flag (distillation on or off): its gradient goes through the body's reduction
            terms.append(Term(ref, fact.merge, ONES if fact.merge == "sum" else _canonical(ctx, fact.spec),
                              ctx.classes.find(fact.cls)))
            return
        if synced(ref, name):
            return
        what = fact.why or f"{node.op} of a value reduced over the batch"
        fix = "make the loss a linear combination of batch means or sums, or pass " \
            "batch_norm='sync' if it is a batch statistic"
        if node.op in ("If", "StatelessIf"):
            # a tf.cond choosing the loss (a multi-task flag): replicate follows the branches
            # of a TF1 cond, not of a v2 one whose branch returns something other than a
            # plain sum or mean (review 26: the fix that works was not named)
            fix = "build the model with tf.compat.v1.disable_control_flow_v2() (replicate " \
                "follows each branch of a TF1 cond), or " + fix
        fail(fact.src or name, f"the loss is not a sum, mean or ratio over the batch: {what}", fix)

    walk(loss, 0)
    return terms, (failure[0] if failure else None)


def with_statistics_synced(ctx: Context, losses: dict) -> dict:
    """``losses`` (loss -> its terms and reason) decomposed again where they failed, with the
    batch statistics they depend on read as synchronized: under ``batch_norm='sync'`` every one
    is, and a loss computed from a batch sum of normalized activations (Barlow twins' own
    normalization) can then read that sum as the batch's (review 30)."""
    out = {}
    for loss, (_, reason) in losses.items():
        fact = ctx.fact(loss)
        if reason is not None and fact is not None and fact.taint:
            terms, again = decompose(ctx, loss, frozenset(fact.taint))
            if again is None:
                out[loss] = (terms, None)
    return out


#: Batch reductions every tower can read as the global batch's value (sync pass); an extreme's
#: gradient goes to one example, so the sync pass refuses a Max or Min that has gradient code.
#: A MatMul is one when it contracts the batch (``z1^T z2``, Barlow twins' cross-correlation).
_SYNCABLE = {"Sum": ("sum", "mean"), "Mean": ("mean",), "L2Loss": ("sum",), "MatMul": ("sum",),
             "Max": ("max",), "Min": ("min",)}


def sync_sources(ctx: Context, ref: str, limit: int = 400, synced: frozenset = frozenset()
                 ) -> tuple[tuple[str, ...], int | None] | None:
    """The batch reductions ``ref`` is computed from (and the batch class of the first), when
    reading their global values makes ``ref`` the single-device value in every tower; None
    when it cannot be proven: a
    batch-dependent input that is no reduction, a reduction of an unsupported kind or inside
    a function body, a stateful or random op on the way. Reductions in ``synced`` (batch norm
    under ``batch_norm='sync'``), and the per-example values they flow into, are the batch's
    already."""
    from replicate.batchflow.effects import effects

    ir = ctx.ir
    work, seen, sources, cls = [ref], set(), [], None
    while work:
        cur = tensor_name(*parse_tensor(work.pop()))
        if cur in seen:
            continue
        seen.add(cur)
        if len(seen) > limit:
            return None
        fact = ctx.fact(cur)
        if fact is None or fact.kind not in (SHARED, RED):
            return None
        if fact.kind == SHARED and not fact.taint:
            continue
        if fact.kind == SHARED and fact.taint <= synced:
            # the same in every tower once they are synchronized: a TF1 cond's Merge of
            # constants that a synchronized batch size chooses (review 50: a write of it was
            # inexact, tower 0's value used), whose predicate no data edge leads back to
            sources.extend(sorted(fact.taint))
            continue
        name = node_of(cur)
        node = ir.nodes.get(name)
        if node is None or INSIDE in name:
            return None
        if fact.kind == RED and name in synced:
            sources.append(name)        # synchronized already (batch norm under 'sync')
            continue
        root = size_root(ir, cur, ctx.fact) if fact.kind == RED and batch_size(fact) else None
        root = node_of(root) if root is not None else None
        if root is not None and root in ir.nodes and value_only(ir, root):
            sources.append(root)        # a batch size (tf.shape(x)[0]): the towers' sizes add up
            if cls is None:
                cls = ctx.classes.find(fact.cls) if fact.cls is not None else None
            continue
        if fact.kind == RED and fact.src == name and fact.merge in _SYNCABLE.get(node.op, ()):
            sources.append(name)
            if cls is None:
                cls = ctx.classes.find(fact.cls) if fact.cls is not None else None
            below = [ctx.fact(r) for r in node.inputs[:2 if node.op == "MatMul" else 1]]
            for src in sorted(set().union(*(f.taint for f in below if f is not None))):
                if src in sources or src in synced or INSIDE in src or src not in ir.nodes:
                    continue
                if ir.nodes[src].op not in _SYNCABLE or "moments" in src:
                    size = ctx.fact(f"{src}:0")
                    if size is not None and size.kind == RED and batch_size(size) and value_only(ir, src):
                        work.append(f"{src}:0")     # a batch size deciding the branch the
                        continue                    # reduction is in: the towers' sizes add up
                    return None     # batch norm's statistics follow the batch_norm option
                work.append(f"{src}:0")
            continue
        if effects(ir, node) or ir.function(node.op) is not None:
            return None
        work.extend(node.inputs)
    return (tuple(dict.fromkeys(sources)), cls) if sources else None


def _canonical(ctx: Context, spec: tuple) -> tuple:
    """A weights spec with its batch class replaced by the class representative."""
    if spec and spec[0] == "count":
        return ("count", ctx.classes.find(spec[1]))
    return spec


@dataclasses.dataclass
class Weighting:
    """How the towers' gradients of one gradient computation are weighted.

    Attributes:
        primary: weights applied to every aggregated gradient of the scope.
        corrections: (term root, weights) pairs: the gradient entering ``root`` in tower ``k``
            is scaled by ``w_k / primary_k``.
        kind: a label for the report (``mean``, ``sum``, ``ratio``, ``mixed``).
        classes: the batch classes the loss reduces.
    """

    primary: tuple
    corrections: list[tuple[str, tuple]]
    kind: str
    classes: set[int]


#: Weights whose towers' shares need not add up to one: a shifted denominator's
#: ``maximum(S_k, c)`` (or ``S_k + c``) over ``maximum(S, c)`` (a regularizer beside
#: ``sum(ce * m) / maximum(sum(m), 1)`` was weighed 5/3 with tower counts 3, 0, 0: claimed
#: exact, 1e-2 off in an independent review).
UNNORMALIZED = frozenset({"shifted"})


def weigh(terms: list[Term]) -> Weighting:
    """Primary weights and per-term corrections for ``terms`` (see the module docstring)."""
    batch = [t for t in terms if t.kind != "shared"]
    shared_terms = [t for t in terms if t.kind == "shared"]
    classes = {t.cls for t in batch if t.cls is not None}
    if not batch:
        return Weighting(UNIFORM, [], "shared", set())
    specs = list(dict.fromkeys(t.spec for t in batch))
    kinds = list(dict.fromkeys(t.kind for t in batch))
    primary = specs[0] if len(classes) <= 1 else ONES
    corrections = [(t.root, t.spec) for t in batch if t.spec != primary]
    if primary == ONES or primary[0] in UNNORMALIZED:
        # the towers' primary weights do not add up to one: a term every tower computes
        # alike (a regularizer) is weighed 1/N in each instead
        corrections += [(t.root, UNIFORM) for t in shared_terms]
    kind = kinds[0] if len(kinds) == 1 and len(specs) == 1 else "mixed"
    return Weighting(primary, corrections, kind, classes)


#: Ops whose output is never negative (a 0/1 mask made from a comparison, squares, norms).
_NONNEGATIVE = frozenset({"Relu", "Relu6", "Square", "Abs", "Exp", "Sigmoid", "Softplus",
                          "OnesLike", "ZerosLike", "Size", "Shape"})
def _mean_times_size(ctx, facts) -> bool:
    """One of ``facts`` is a plain mean over a batch class's rows, the other that class's
    example count (times a constant)."""
    for mean, size in (facts, facts[::-1]):
        if mean is not None and size is not None and mean.kind == RED and mean.merge == "mean" \
                and mean.spec[:1] == ("count",) and not mean.taint and size.kind == RED \
                and size.merge == "size" and size.value is not None and len(size.value) == 1 \
                and isinstance(size.value[0], Sym) and isinstance(size.value[0].coef, int) \
                and size.value[0].coef > 0 and ctx.classes.same(size.value[0].cls, mean.cls):
            return True
    return False


def _nonnegative(ir: IR, ref: str) -> bool:
    """``ref`` has no negative entry: a cast of booleans (``sequence_mask``, ``not_equal``) or
    of another such value, an op in :data:`_NONNEGATIVE`, a non-negative constant."""
    for _ in range(16):
        node = ir.nodes[node_of(behind(ir, ref))]
        if node.op == "Cast":
            if node.attr("SrcT") == types_pb2.DT_BOOL:
                return True
            ref = node.inputs[0]
            continue
        if node.op in _NONNEGATIVE:
            return True
        value = ir.const_value(node.name) if node.op == "Const" else None
        return value is not None and bool((value >= 0).all())
    return False


def vanishes_with_count(ctx: Context, numerator: str, denominator: str) -> bool:
    """True when the batch sum ``numerator`` is proven zero wherever the batch count
    ``denominator`` is, so that a tower whose count is zero may be weighed by its share of the
    count, zero, without dropping anything: ``sum(x * m) / sum(m)`` with ``m`` non-negative
    (where the count is zero every ``m`` is), the size of per-example values (zero only in a
    tower without examples, whose sums are zero too: ``SUM_OVER_BATCH_SIZE``), or
    ``sum(s) / size(s)`` of one selection ``s``. ``sum(loss) / sum(mask)`` is not: a tower
    whose mask is all zero still has a loss."""
    ir = ctx.ir
    den = ctx.fact(denominator)
    if den is not None and den.kind == RED and den.merge == "size" and den.value \
            and any(isinstance(v, Sym) for v in den.value):
        return True                     # a multiple of the batch size: zero only without examples

    def reduced(ref: str, ops_: tuple[str, ...]) -> tuple[str, str] | None:
        node = ir.nodes[node_of(behind(ir, ref))]
        if node.op == "Cast" and node.inputs:
            node = ir.nodes[node_of(behind(ir, node.inputs[0]))]
        if node.op not in ops_ or not node.inputs:
            return None
        return node.op, behind(ir, node.inputs[0])

    summed, counted = reduced(numerator, ("Sum",)), reduced(denominator, ("Sum", "Size"))
    if summed is None or counted is None:
        return False
    if counted[0] == "Size":
        sized = ctx.fact(counted[1])
        unfiltered = sized is not None and sized.kind == PART and not sized.filtered
        return unfiltered or summed[1] == counted[1]
    if not _nonnegative(ir, counted[1]):
        return False
    product = ir.nodes[node_of(summed[1])]
    return product.op in ("Mul", "MulNoNan") and any(behind(ir, f) == counted[1]
                                                     for f in product.inputs[:2])


def positive_shift(ctx: Context, spec: tuple) -> bool:
    """A shifted denominator ``count + c`` or ``maximum(count, c)`` with a constant ``c > 0``:
    never zero in a tower."""
    if not spec or spec[0] != "shifted":
        return False
    value = ctx.const(spec[4])
    return value is not None and value.size == 1 and float(value.reshape(-1)[0]) > 0


def shares_suffice(ctx: Context, spec: tuple, numerator: str | None) -> bool:
    """Weighing each tower's ratio by its share of the count ``spec`` names gives the batch's
    ratio: the count is never zero in a tower (no data share, or a positive shift), or the
    batch sum ``numerator`` is zero where it is (:func:`vanishes_with_count`)."""
    if not spec or spec[0] not in ("value", "shifted") or positive_shift(ctx, spec):
        return True
    return numerator is not None and vanishes_with_count(ctx, numerator, spec[1])
