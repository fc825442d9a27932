"""Helpers shared by the rule families."""

from __future__ import annotations

from replicate.batchflow.context import Context
from replicate.batchflow.lattice import MIXED, PART, RED, Fact, Sym, mixed, part, red, shared
from replicate.graph.ir import Node, node_of
from replicate.batchflow.table import size_root

__all__ = ["taint_of", "first_mixed", "parts", "reds", "couple", "data_refs", "shift", "combine_parts",
           "passthrough", "value_or_none"]


def taint_of(facts: list[Fact]) -> frozenset:
    """The couplings carried by any of ``facts``."""
    out: frozenset = frozenset()
    for f in facts:
        out |= f.taint
    return out


def first_mixed(facts: list[Fact]) -> Fact | None:
    """The first mixed fact, without any special marking (``handle``)."""
    found = next((f for f in facts if f.kind == MIXED), None)
    return None if found is None else found.with_(taint=taint_of(facts), handle=None)


def parts(facts: list[Fact]) -> list[Fact]:
    return [f for f in facts if f.kind == PART]


def reds(facts: list[Fact]) -> list[Fact]:
    return [f for f in facts if f.kind == RED]


def couple(ctx: Context, node: Node, facts: list[Fact]) -> frozenset:
    """Taint for a per-example result computed from the RED facts among ``facts``: each
    forward batch reduction (not a size, not gradient code) becomes a coupling."""
    taint = taint_of(facts)
    if ctx.in_gradient(node):
        return taint
    for f in reds(facts):
        if f.merge not in ("size",) and f.src:
            taint |= {f.src}
    for ref in node.inputs:
        f = ctx.fact(ref)
        if f is not None and f.kind == RED and f.merge != "size":
            taint |= reductions_of(ctx, ref)
    return taint


def prologue(ctx: Context, node: Node, ins: list[Fact], n: int = 1
             ) -> tuple[frozenset, list[Fact] | None]:
    """The taint of ``node``'s result and, when its inputs settle it already, its ``n``
    output facts: the first mixed input, or shared when nothing depends on the batch."""
    taint = couple(ctx, node, ins)
    bad = first_mixed(ins)
    if bad is not None:
        return taint, [bad] * n
    if not any(f.dependent for f in ins):
        return taint, [shared(taint=taint)] * n
    return taint, None


#: Operands that only size a batch reduction's output, where its rule proved the size fixed
#: (``bincount``'s size clamped by ``minlength == maxlength``): not sources of its value.
_OUTPUT_SIZES = {"DenseBincount": (1,), "Bincount": (1,)}


def reductions_of(ctx: Context, ref: str, limit: int = 200) -> frozenset:
    """Every forward batch reduction a batch-reduced value is computed from. A fact names one
    source; a segment mean (a sum over a count), a ratio or a normalized value has several,
    and synchronizing only the named one left the others per tower (claimed exact with
    ``batch_norm='sync'``, 0.1 off). A batch *size* it is computed from (``tf.shape(x)[0]``
    over a count: class weights ``n / count_c``) is named too: each tower counts its own
    examples, and a synchronized count beside a tower's own size was claimed exact (0.6 off).
    No batch reduction is the source of a size, so the sync pass gives the reason."""
    cache = ctx.__dict__.setdefault("_reductions_of", {})
    if ref in cache:
        return cache[ref]
    found: set[str] = set()
    work, seen = [ref], set()
    while work and len(seen) < limit:
        cur = work.pop()
        if cur in seen:
            continue
        seen.add(cur)
        fact = ctx.fact(cur)
        if fact is None or fact.kind != RED:
            continue
        name = cur.split(":")[0].lstrip("^")
        if fact.src == name and fact.merge != "size":
            found.add(name)
        elif fact.merge == "size" and cur != ref:
            found.add(node_of(size_root(ctx.ir, cur, ctx.fact) or cur))    # where it is made
            continue
        node = ctx.ir.nodes.get(name)
        if node is not None:
            work.extend(r for i, r in enumerate(node.inputs) if i not in _OUTPUT_SIZES.get(node.op, ()))
    cache[ref] = frozenset(found)
    return cache[ref]


def data_refs(node: Node) -> list[str]:
    return list(node.inputs)


def shift(fact: Fact, axis: int, **changes) -> Fact:
    """``fact`` with its partitioned axis moved to ``axis``."""
    return fact.with_(axis=axis, value=None, **changes)


#: Why a branch or loop whose condition reads the batch size (``i < tf.shape(x)[0]``) is mixed.
SIZE_DECIDES = ("a branch or loop condition decided by the batch size (or another batch value "
                "that cannot be synchronized): each tower decides with its own count")

#: Why rows of the batch in two orders (see :func:`misaligned`) are mixed.
MISALIGNED = "pairs rows of the batch kept in two different orders"


def condition(ctx: Context, node: Node, pred: Fact, ref: str | None = None) -> tuple[Fact | None, frozenset]:
    """What a branch or loop condition ``pred`` (tensor ``ref``, if known) that is not per
    example does to the values it decides: ``(mixed, taint)`` when a batch value no tower can
    synchronize decides (the batch size), else ``(None, taint)`` with the taint they gain:
    every batch reduction it is computed from, each a coupling (a fact keeps one reduction as
    its source: review 47, ``mean > 0.5 and sum > 3`` under sync synchronized the mean only,
    claimed exact, 2.4 off)."""
    taint = pred.taint
    if pred.kind == RED and not ctx.in_gradient(node):
        if not pred.src:
            return mixed(node.name, SIZE_DECIDES, taint), taint
        taint = taint | {pred.src} | (reductions_behind(ctx, ref) if ref else frozenset())
    return None, taint


def reductions_behind(ctx: Context, ref: str, limit: int = 2000) -> frozenset:
    """The batch reductions (nodes whose own output is the reduction's source) that the
    reduced value ``ref`` is computed from, found walking back through reduced values."""
    found, seen, work = set(), set(), [node_of(ref)]
    while work and len(seen) < limit:
        name = work.pop()
        if name in seen or name not in ctx.ir.nodes:
            continue
        seen.add(name)
        fact = ctx.fact(f"{name}:0")
        if fact is None or fact.kind != RED:
            continue
        if fact.src == name:
            found.add(name)
            continue
        work.extend(node_of(r) for r in ctx.ir.nodes[name].inputs)
    return frozenset(found)


def misaligned(facts: list[Fact]) -> bool:
    """Rows of one batch as fed (one per example, in order) beside rows of it in another order
    (regrouped by ``dynamic_partition``, reversed): each tower would pair other examples than
    one device. Entries of sparse inputs and other filtered rows pair by their own rules."""
    plain = [f for f in facts if f.block == 1 and f.outer == 1 and f.ordered and not f.filtered
             and f.handle is None]
    moved = [f for f in facts if not f.ordered and f.handle is None and f.tail is None]
    if plain and moved:
        return True
    # as many rows per example laid out differently: T copies of the batch one after the
    # other (``tf.tile(y, [T])``) beside each example's T rows together (logits ``[B, T, C]``
    # reshaped to ``[-1, C]``) pair row i with another example in each tower (claimed exact,
    # 1.08 off in an independent review)
    layouts = {(f.block, f.outer) for f in facts if isinstance(f.block, int)
               and isinstance(f.outer, int) and f.handle is None and not f.filtered}
    if len(layouts) > 1 and len({b * o for b, o in layouts}) == 1:
        return True
    # the same with a dynamic number of steps: each example's steps together (block T)
    # beside T copies of the batch (outer T), whatever the names of T (a batch-major input
    # transposed to time-major and flattened, against flattened batch-major labels: claimed
    # exact with a dynamic T, 0.5 off; review 10)
    laid = [f for f in facts if f.handle is None and not f.filtered]
    together = any(f.block not in (1, None) and f.outer == 1 for f in laid)
    copies = any(f.outer not in (1, None) and f.block == 1 for f in laid)
    return together and copies


def combine_parts(ctx: Context, node: Node, facts: list[Fact], axis: int) -> Fact:
    """One partitioned fact on ``axis`` from several partitioned inputs: their classes unite.
    Rows kept in two different orders (a batch regrouped by ``dynamic_partition``, or reversed,
    against the batch as fed) pair other examples in each tower than on one device: mixed."""
    first = facts[0]
    if misaligned(facts):
        return mixed(node.name, MISALIGNED, taint_of(facts))
    for other in facts[1:]:
        unite(ctx, first, other, node)
    blocks = {f.block for f in facts}
    outers = {f.outer for f in facts}
    return part(axis, first.cls, blocks.pop() if len(blocks) == 1 else None,
                ordered=all(f.ordered for f in facts), filtered=any(f.filtered for f in facts),
                outer=outers.pop() if len(outers) == 1 else None)


#: The end of a conflict's description when two batches hold their examples in different
#: numbers of rows (:func:`unite`; the analysis refuses it within one class).
ROWS_CONFLICT = "rows per example"


def unite(ctx: Context, a: Fact, b: Fact, node: Node) -> bool:
    """Make the classes of partitioned ``a`` and ``b``, whose rows ``node`` pairs one to one,
    one batch -- unless they hold their examples in different numbers of rows (labels fed
    flattened with their time steps, ``[B*T]``, against logits reshaped to ``[-1, C]``): then
    they are no one batch, a conflict (united, the labels were split by the other's example
    counts, and the rewrite failed at step 1). False on a conflict."""
    if not ctx.classes.same(a.cls, b.cls) and rows(a) is not None and rows(b) is not None \
            and rows(a) != rows(b):
        ctx.classes.conflicts.append((a.cls, b.cls, node.name,
                                      f"{rows(a)} and {rows(b)} {ROWS_CONFLICT}"))
        return False
    ctx.classes.union(a.cls, b.cls, node.name)
    return True


def passthrough(facts: list[Fact], n: int) -> list[Fact]:
    """Output i carries input i's fact (identities)."""
    out = list(facts[:n])
    while len(out) < n:
        out.append(shared())
    return out


def value_or_none(values: list) -> tuple | None:
    return tuple(values) if values else None


def runtime_sized(ctx: Context, ref: str, value: tuple | None, other) -> bool:
    """Integer operand ``ref`` (a shape, a slice bound, paddings; its static entries ``value``)
    has an entry ``j`` that ``other(j)`` accepts, known only at run time and computed from the
    batch size (``tf.minimum(B, 5)``): each tower would compute its own there. The entries of
    a ``Pack`` are told apart; of another op, any one counts. Not a batch reduction of the
    data (``tf.reduce_max(lengths)``): a coupling, which the sync pass may make the batch's."""
    pack = ctx.ir.nodes.get(ref.split(":")[0])
    pack = pack if pack is not None and pack.op == "Pack" else None
    if value is None:
        value = (None,) * (len(pack.inputs) if pack is not None else 1)
    for j, v in enumerate(value):
        if v is not None or not (other(j) or pack is None):
            continue
        found = ctx.fact(pack.inputs[j] if pack is not None and j < len(pack.inputs) else ref)
        # (a shape's other entries, merge "size", are the same in every tower: a sparse
        # input's fed dense width)
        if found is not None and (found.kind == MIXED or found.kind == RED and found.src is None
                                  and found.merge != "size"):
            return True
    return False


def is_sym(v) -> bool:
    return isinstance(v, Sym)


def size_fact(value: tuple, taint: frozenset = frozenset()) -> Fact:
    """The fact of an integer tensor with symbolic elements: shared when none depends on the
    batch, else a batch *size* (a RED whose merge is ``size``)."""
    syms = [v for v in value if isinstance(v, Sym)]
    if not syms:
        return shared(value, taint)
    return red(syms[0].cls, "size", None, taint=taint, value=value)


def rows(fact: Fact) -> int | None:
    """Rows per example along a partitioned fact's axis (None when not a known integer)."""
    if not isinstance(fact.block, int) or not isinstance(fact.outer, int):
        return None
    return fact.block * fact.outer


def reduced(ctx: Context, node: Node, merge: str, cls: int | None, spec: tuple, taint: frozenset,
            why: str = "") -> Fact:
    """A RED fact created by ``node``."""
    return red(cls, merge, node.name, spec, taint).with_(why=why)


def forward_of(ctx: Context, node: Node, op_types: tuple[str, ...]) -> Node | None:
    """The forward op (of one of ``op_types``) whose gradient code holds gradient node
    ``node``: ``tf.gradients`` names it ``<scope>/<forward op>_grad/...``."""
    if not ctx.in_gradient(node):
        return None
    parts = node.name.split("/")
    for i, piece in enumerate(parts[:-1]):
        if not piece.endswith("_grad"):
            continue
        for j in range(i + 1):
            found = ctx.ir.nodes.get("/".join(parts[j:i] + [piece[:-len("_grad")]]))
            if found is not None and found.op in op_types and found.name != node.name:
                return found
    return None


def row_numbers(f: Fact | None) -> bool:
    """True for row numbers local to a tower (``tf.range`` over the batch, ``tf.where``, the
    positions ``tf.unique`` numbers its values by, in the order the tower meets them), and
    for offsets computed from them (:mod:`replicate.batchflow.rules.strided`): they start at 0
    in every tower, so they are no values of its examples."""
    return f is not None and f.kind == PART and f.index is not None and f.index[0] in (
        "rows", "cols", "strided", "example", "stacked", "unique")


def numbered(node: Node, taint: frozenset) -> Fact:
    """The mixed result of ``node`` computing with a tower's row numbers as values."""
    return mixed(node.name, f"{node.op} computes with row numbers local to each tower (they start "
                 "at 0 in every tower)", taint)


__all__ += ["runtime_sized", "unless_partitioned", "prologue", "is_sym", "size_fact", "reduced", "rows", "mixed", "shared", "part", "red", "forward_of",
            "row_numbers", "numbered", "unite", "ROWS_CONFLICT"]


def unless_partitioned(ctx: Context, node: Node, ins: list[Fact], n: int = 1) -> list[Fact] | None:
    """Outputs for inputs that are not partitioned on the data operand (None if it is)."""
    bad = first_mixed(ins)
    if bad is not None:
        return [bad] * n
    if ins[0].kind == PART:
        return None
    if ins[0].kind == RED:
        return [ins[0].with_(value=None)] * n
    return [shared(taint=taint_of(ins))] * n
