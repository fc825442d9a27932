"""Rules for elementwise ops on batch-reduced values and batch sizes (helpers of
:mod:`elementwise`).

Among batch-reduced values only linear combinations keep a known merge (a mean plus a constant
is still a mean; a sum plus a constant is not). A batch size (``tf.shape(x)[0]``) used only as
a number is read as the batch's in every tower: the sync pass adds the towers' sizes once, at
the op that makes it, and every elementwise function of it is then the same in every tower.
Integer arithmetic on symbolic sizes (``2 * B``) keeps track of the batch where it can.
"""

from __future__ import annotations

from replicate.batchflow import table as _table
from replicate.batchflow.context import Context
from replicate.batchflow.lattice import INSIDE, RED, SHARED, Fact, Sym, batch_size
from replicate.batchflow.rules.common import red, reds, shared, size_fact, taint_of
from replicate.graph.ir import Node, parse_tensor

__all__ = ["counted", "sizes_synchronized", "reduced_algebra", "arith"]

#: Sums and divisions, whose batch-reduced operands keep a known merge in some forms.
_SUMS = {"Add", "AddV2", "AddN", "AccumulateNV2", "BiasAdd", "BiasAddV1"}
_DIVS = {"RealDiv", "Div", "DivNoNan", "TruncateDiv"}


def counted(ctx: Context, node: Node, ins: list[Fact]) -> bool:
    """A per-example value combined with the batch size (``x + B``, ``loss / B`` before the
    sum, an integer ``minimum(length - 1, B)`` or ``length + B``): each tower would use its own
    count (it was claimed exact, 0.24 to 0.99 off; integers were exempt, and ``length + B``
    used as a weight was claimed exact, 0.56 off, review 16). Gradient code is exempt: a
    mean's gradient divides by the count the loss weighting accounts for."""
    if ctx.in_gradient(node):
        return False
    # a batch reduction without a source op to synchronize (a count scaled, 0.1 * B) is one
    return any(f.kind == RED and (f.merge == "size" or not f.src) for f in ins)


def sizes_synchronized(ctx: Context, refs: list[str], ins: list[Fact], others: bool = False
                        ) -> list[Fact] | None:
    """``ins`` with each batch size among them (:func:`batch_size`) read as the batch's, a
    value shared by the towers once synchronized: a coupling named after the op that gives
    it, which the sync pass synchronizes (a sum of the towers' sizes). None when another
    batch-reduced operand is no such size (unless ``others``: then they stay as they are, and
    None when there is no size), or the size is also read as a shape or a bound, or the op is
    in a function body (whose arguments, seeded, the sync pass cannot reach)."""
    if ctx.seeds:
        return None
    out, sizes = [], 0
    for ref, f in zip(refs, ins):
        if f.kind == RED and not (others and not batch_size(f)):
            root = _table.size_root(ctx.ir, ref, ctx.fact)
            if root is None:
                return None
            name, index = parse_tensor(root)
            if not batch_size(f) or index or INSIDE in name or not _table.value_only(ctx.ir, name):
                return None
            f = shared(taint=f.taint | {name})
            sizes += 1
        out.append(f)
    return out if sizes else None


def _symbolic(value: tuple | None, values: list) -> bool:
    """Whether integer arithmetic kept track of the batch: a result element the arithmetic
    could not express (``B - 1``) where an operand held a batch size is no shared value —
    each tower computes it from its own count (it was taken for shared, the same in every
    tower)."""
    if value is None:
        return False
    if None in value and any(isinstance(x, Sym) for v in values for x in (v or ())):
        return False
    return True


def reduced_algebra(ctx: Context, node: Node, refs: list[str], ins: list[Fact]) -> Fact:
    """The fact of an elementwise op whose dependent inputs are all batch-reduced."""
    rs = reds(ins)
    others = [f for f in ins if f.kind == SHARED]
    taint = taint_of(ins)
    first = rs[0]
    linear = {"sum", "mean", "ratio", "count", "size"}

    def other(why: str) -> Fact:
        return red(first.cls, "other", first.src, taint=taint).with_(why=f"'{node.name}': {why}")

    if node.op in _SUMS or node.op == "Sub":
        merges = {f.merge for f in rs}
        specs = {f.spec for f in rs}
        if len(merges) == 1:
            merge = merges.pop()
            if merge in ("mean", "ratio") and len(specs) == 1:
                return first.with_(taint=taint, value=None)
            if merge in ("sum", "count") and not others:
                return first.with_(merge="sum", taint=taint, value=None)
            if merge in ("max", "min") and len(rs) == 1 and node.op != "Sub":
                return first.with_(taint=taint)
        if all(f.merge == "size" for f in rs):
            values = [f.value for f in ins]
            value = arith(node.op, values) if all(v is not None for v in values) else None
            return size_fact(value, taint) if _symbolic(value, values) \
                else first.with_(merge="other", value=None, why=f"'{node.name}': {node.op} of the "
                                 "batch size that is no multiple of it (each tower has its own)")
        return other(f"{node.op} of values reduced differently over the batch "
                     f"({', '.join(sorted(f.merge for f in rs))}{', and a constant' if others else ''})")
    if node.op in ("Mul", "MulNoNan") or (node.op in _DIVS and ins[0].kind == RED and ins[1].kind != RED):
        if len(rs) == 1 and first.merge in linear:
            if first.merge == "size":
                values = [f.value for f in ins]
                value = arith(node.op, values) if all(v is not None for v in values) else None
                if _symbolic(value, values):
                    return size_fact(value, taint)
            return first.with_(merge="sum" if first.merge in ("count", "size") else first.merge,
                               taint=taint, value=None)
        if len(rs) == 1 and first.merge in ("max", "min"):
            scale = ctx.const(refs[1 - ins.index(first)])
            if scale is not None and scale.size == 1 and float(scale.reshape(-1)[0]) > 0:
                return first.with_(taint=taint)
        return other(f"{node.op} of batch-reduced values")
    if node.op in _DIVS and all(f.kind == RED for f in ins[:2]):
        num, den = ins[0], ins[1]
        den_shape = ctx.shape(refs[1])
        if den_shape is None or any(d != 1 for d in den_shape):
            # per-class counts: each element has its own tower shares, no scalar weight
            return other("a ratio over a non-scalar batch sum (one denominator per element)")
        if num.merge in ("sum", "count", "size") and den.merge in ("sum", "count", "size"):
            return red(den.cls, "ratio", num.src, ("value", _ref(refs[1])), taint)
        shifted = _shifted(ctx, refs[1])
        if num.merge in ("sum", "count", "size") and shifted is not None:
            return red(den.cls, "ratio", num.src, ("shifted", _ref(refs[1])) + shifted, taint)
        return other("a ratio of values that are not batch sums")
    if node.op in ("Maximum", "Minimum"):
        want = "max" if node.op == "Maximum" else "min"
        if all(f.merge == want for f in rs):
            return first.with_(taint=taint)
        if all(f.merge == "size" for f in rs) and not others and len({f.value for f in rs}) == 1:
            return first.with_(taint=taint)         # of equal sizes: that size
        if all(f.merge == "size" for f in rs):
            # max(B, 1), min(B, 4): no multiple of the batch size (the towers' max(B_k, 1) do
            # not add up to max(B, 1) with an empty tower; min(B, 4) is no size at all). Kept
            # as B, a loss divided by it and a counter of it were claimed exact (review 10)
            return first.with_(merge="other", value=None, taint=taint,
                               why=f"'{node.name}': {node.op} of the batch size and another value "
                               "(each tower has its own)")
    return other(f"{node.op} of a batch-reduced value")


#: Denominators ``op(S, c)`` of a batch sum ``S`` and a scalar ``c`` the same in every tower
#: whose global value is ``op(sum of the towers' S, c)``: ``sum(w * ce) / (sum(w) + 1e-7)``,
#: ``/ tf.maximum(sum(w), 1.0)``.
_SHIFTS = frozenset({"Add", "AddV2", "Maximum"})


def _shifted(ctx: Context, ref: str) -> tuple[str, str, str] | None:
    """(op, S, c) when ``ref`` is a batch sum shifted by a shared scalar, else None."""
    node = ctx.ir.nodes[ref.split(":")[0]]
    if node.op not in _SHIFTS or len(node.inputs) != 2:
        return None
    facts = [ctx.fact(r) for r in node.inputs]
    if any(f is None for f in facts):
        return None
    for i in (0, 1):
        s, c = facts[i], facts[1 - i]
        shape = ctx.shape(node.inputs[1 - i])
        if s.kind == RED and s.merge in ("sum", "count", "size") and c.kind == SHARED and \
                shape is not None and len(shape) == 0:
            return node.op, _ref(node.inputs[i]), _ref(node.inputs[1 - i])
    return None


def _ref(ref: str) -> str:
    from replicate.graph.ir import parse_tensor, tensor_name

    return tensor_name(*parse_tensor(ref))


def arith(op: str, values: list[tuple]) -> tuple | None:
    """Elementwise integer arithmetic on symbolic values (None where unknown)."""
    if not values or any(v is None for v in values):
        return None
    width = max(len(v) for v in values)
    if any(len(v) not in (1, width) for v in values):
        return None
    out = []
    for i in range(width):
        items = [v[0] if len(v) == 1 else v[i] for v in values]
        out.append(_scalar(op, items))
    return tuple(out)


def _scalar(op: str, items: list):
    items = [None if isinstance(x, str) else x for x in items]      # named unknown dimensions
    if op == "Mul" and len(items) == 2 and sum(isinstance(x, Sym) for x in items) == 1 and \
            any(x is None for x in items):
        return next(x for x in items if isinstance(x, Sym)).scaled(None)
    if any(x is None for x in items):
        return None
    if all(isinstance(x, int) for x in items):
        try:
            if op in ("Add", "AddV2", "AddN"):
                return sum(items)
            if op == "Sub":
                return items[0] - items[1]
            if op == "Mul":
                return items[0] * items[1]
            if op in ("FloorDiv", "Div", "TruncateDiv"):
                return items[0] // items[1]
            if op == "Maximum":
                return max(items)
            if op == "Minimum":
                return min(items)
            if op in ("FloorMod", "Mod", "TruncateMod"):
                return items[0] % items[1]
        except ZeroDivisionError:
            return None
        return None
    if op == "Mul" and len(items) == 2:
        syms = [x for x in items if isinstance(x, Sym)]
        ints = [x for x in items if isinstance(x, int)]
        if len(syms) == 1 and len(ints) == 1 and ints[0] >= 0:
            return syms[0].scaled(ints[0])
    if op in ("FloorDiv", "Div") and isinstance(items[0], Sym) and isinstance(items[1], int) \
            and items[1] > 0 and items[0].coef is not None and items[0].coef % items[1] == 0:
        return Sym(items[0].coef // items[1], items[0].cls)
    if op in ("Add", "AddV2", "Sub") and all(isinstance(x, Sym) for x in items) \
            and items[0].cls == items[1].cls and None not in (items[0].coef, items[1].coef):
        coef = items[0].coef + (items[1].coef if op != "Sub" else -items[1].coef)
        return Sym(coef, items[0].cls) if coef else 0
    if op == "Maximum" and any(x == 1 for x in items):
        syms = [x for x in items if isinstance(x, Sym)]
        return syms[0] if len(syms) == 1 else None
    return None
