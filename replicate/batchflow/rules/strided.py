"""Row numbers and offsets into a flattened batch: ``range(batch) * stride + offset``.

``Range(0, B)`` over a batch size numbers the tower's own rows (``index = ("rows", cls, 1)``),
``Range(0, B * T, T)`` gives each example its first offset (the tag below).

Legacy programs pick one entry per example out of a tensor they flattened first:

- the last relevant RNN output, ``tf.gather(tf.reshape(out, [-1, H]), tf.range(B) * T + (length - 1))``;
- contrib's CRF sequence score, ``tf.gather(tf.reshape(scores, [-1]), reshape(offsets + tags, [-1]))``
  with ``offsets = range(B)[:, None] * T * C + range(T)[None, :] * C``.

Each tower numbers its rows from 0, and its flattened tensor holds only its own examples, so
the tower computes ``b' * stride + offset`` where one device computes ``b * stride + offset``:
the same entry, *provided* every offset stays inside its example's ``stride`` entries and the
flattened tensor holds ``stride`` entries per example. Nothing in the graph proves that (the
offsets are data: tags, lengths), so the rewrite checks it in every tower at run time
(:mod:`replicate.passes._strided`), and the analysis accepts the gather only in that form.

The fact: ``index = ("strided", cls, strides, rows, axis)`` on an integer tensor each of whose
entries is its own example's local row number times the product of the scalar tensors
``strides``, plus a value of that example (or one the same in every tower). ``rows`` is the
tensor of row numbers it started from (``tf.range`` over the batch, one per example) and
``axis`` its batch axis: its length there is the tower's number of examples.

The row numbers spread over each example's entries (``tf.repeat(tf.range(B), T)``, tiled or
broadcast: segment ids of tokens) carry ``("example", cls, 1)``: every entry holds the local
number of the example it belongs to (``("example", cls, S)`` for ``tf.range(B * S)`` spread
over S sentences per example: the local number of its sentence). Segment ops by such ids over
data whose entries pair up with theirs give one row per example (or sentence), and a gather of
a per-example tensor by them spreads each example's value over its own entries: exact, with
nothing to check at run time (the ids are the graph's own, not data).

Requires: row-number facts (``("rows", cls, 1)``, from ``Range`` over a batch size).
Produces: the offsets' tag through ``Mul`` by shared integer scalars, ``Add``/``Sub`` of
per-example or shared values, and the layout ops in :data:`KEEPS`; the example tag through
those layout ops and ``Add`` of zeros; partitioned results for ``Gather`` of a flattened batch
by offsets (and the segment sum of its gradient), for segment ops by example ids and for a
gather by them.
"""

from __future__ import annotations

from replicate.batchflow.context import Context
from replicate.batchflow.lattice import MIXED, PART, RED, SHARED, Fact, Sym
from replicate.batchflow.rules.common import mixed, part, shared, taint_of
from replicate.batchflow.rules.layout import Prod
from replicate.graph.frames import opening
from replicate.graph.ir import Node

__all__ = ["TAG", "EXAMPLE", "range_", "strided", "example_numbers", "arithmetic", "KEEPS", "kept",
           "gather", "per_example", "segment", "unchecked"]

TAG = "strided"

#: The tag of an integer tensor each of whose entries is the tower-local number of the unit it
#: belongs to, ``per`` units to an example: ``tf.range(B)`` tiled, repeated or broadcast over
#: each example's entries (segment ids of tokens, ``per`` 1), or ``tf.range(B * S)`` over each
#: sentence's words (``per`` S), ``("example", cls, per)``.
EXAMPLE = "example"

#: Ops that move, copy or relabel entries without changing their values: each entry still
#: belongs to the example the output's layout says, which is the one it belonged to, so a tag
#: about each entry's own example stays.
KEEPS = frozenset({"ExpandDims", "Reshape", "Squeeze", "Identity", "Snapshot", "StopGradient",
                   "BroadcastTo", "Cast", "Tile", "Transpose", "StridedSlice", "Slice"})

_INTS = frozenset({"int32", "int64"})


def strided(f: Fact | None) -> bool:
    """True for offsets into a flattened batch (see the module docstring)."""
    return f is not None and f.kind == PART and f.index is not None and f.index[0] == TAG


def example_numbers(f: Fact | None) -> int | None:
    """For tensors whose entries are the local numbers of their own units, ``per`` units to an
    example one after the other (``tf.range(B * per)``, and that spread over each unit's
    entries): ``per``; else None."""
    if f is None or f.kind != PART or f.index is None or f.filtered:
        return None
    if f.index[0] == EXAMPLE:
        return f.index[2]
    if f.index[0] == "rows" and isinstance(f.index[2], int) and f.index[2] >= 1 and f.ordered \
            and f.outer == 1:
        return f.index[2]
    return None


def same_entries(a: Fact, b: Fact, ctx: Context) -> bool:
    """``a`` and ``b`` hold their examples' entries in the same places (their entries pair
    up example by example)."""
    return (a.kind == PART and b.kind == PART and a.axis == b.axis and a.block == b.block
            and a.outer == b.outer and a.ordered and b.ordered and ctx.classes.same(a.cls, b.cls))


def _rows(f: Fact) -> bool:
    """Row numbers of a whole batch, one per example (``tf.range(B)``, not ``tf.where``'s)."""
    return (f.kind == PART and f.index is not None and f.index[0] == "rows" and f.index[2] == 1
            and not f.filtered and f.ordered and f.outer == 1)


def _int_dtype(ctx: Context, ref: str) -> bool:
    from tensorflow.python.framework import dtypes

    try:
        return dtypes.as_dtype(ctx.ir.output_dtype(ref)).name in _INTS
    except (KeyError, TypeError, ValueError):
        return False


def _scalar_shared(ctx: Context, ref: str, f: Fact) -> bool:
    """A shared integer scalar that no batch size decides (a stride)."""
    return (f.kind == SHARED and ctx.rank(ref) == 0 and _int_dtype(ctx, ref)
            and not (f.value is not None and any(isinstance(v, Sym) for v in f.value)))


def _plain(f: Fact) -> bool:
    """A value of the example (or of every tower alike) that is no row number."""
    return f.kind == SHARED or (f.kind == PART and f.index is None)


def arithmetic(ctx: Context, node: Node, ins: list[Fact]) -> tuple | None:
    """The tag of ``node``'s output when it keeps the form ``rows * stride + offset``, else
    None (the caller then says the op computes with row numbers)."""
    if len(ins) != 2 or not _int_dtype(ctx, f"{node.name}:0"):
        return None
    refs = node.inputs[:2]
    a, b = ins
    if node.op == "Mul":
        for (r, f), (sref, s) in (((refs[0], a), (refs[1], b)), ((refs[1], b), (refs[0], a))):
            if not _scalar_shared(ctx, sref, s):
                continue
            if _rows(f):
                return (TAG, f.index[1], (sref,), r, f.axis)
            if strided(f):
                return f.index[:2] + (f.index[2] + (sref,),) + f.index[3:]
        return None
    if node.op in ("Add", "AddV2"):
        for (f, other), ref in (((a, b), refs[1]), ((b, a), refs[0])):
            if strided(f) and _plain(other):
                return f.index
            zeros = ctx.const(ref) if other.kind == SHARED else None
            if example_numbers(f) and zeros is not None and not zeros.any():
                return (EXAMPLE, f.cls, example_numbers(f))     # broadcast over zeros: spread
        return None
    if node.op == "Sub" and strided(a) and _plain(b):
        return a.index
    return None


def kept(ctx: Context, node: Node, ins: list[Fact], out: list[Fact | None]) -> list[Fact | None] | None:
    """The outputs of a layout op of offsets or example numbers, tag kept; None when ``node``
    is no such op."""
    if node.op not in KEEPS or not ins:
        return None
    if strided(ins[0]):
        tag = ins[0].index
    elif example_numbers(ins[0]):
        tag = (EXAMPLE, ins[0].cls, example_numbers(ins[0]))
    else:
        return None
    if node.op == "Cast" and not _int_dtype(ctx, f"{node.name}:0"):
        return None
    first = out[0] if out else None
    if first is None or first.kind != PART or first.filtered or not ctx.classes.same(first.cls, ins[0].cls):
        return None
    return [first.with_(index=tag)] + list(out[1:])


def gather(ctx: Context, node: Node, p: Fact, i: Fact, axis: int, taint: frozenset) -> list[Fact] | None:
    """The fact of ``Gather(p, i)`` by example numbers or by offsets into a flattened batch;
    None when ``i`` is neither (or ``p`` does not fit it)."""
    if _by_example(ctx, p, i, axis):
        # each entry's own example's row (a value per example spread over its tokens)
        return [i.with_(index=None, value=None, taint=taint)]
    fit = _offsets_fit(ctx, p, i, axis)
    if fit is False:
        return None
    if fit is None:
        return [mixed(node.name, f"{node.op} of a flattened batch at range(batch) * stride + offset "
                      "whose stride is not proved to be the flattened tensor's entries per "
                      "example (compute the stride from that tensor's own shape, "
                      "tf.shape(out)[1], not from another's)", taint)]
    # offsets into the flattened batch, each inside its own example's entries (checked in
    # every tower at run time): the result is laid out as the offsets
    where = unchecked(ctx, node)
    if where:
        return [mixed(node.name, f"{node.op} of a flattened batch at range(batch) * stride + offset "
                      f"{where}, where no check that every offset stays within its own example "
                      "can be added", taint)]
    return [i.with_(index=None, value=None, taint=taint)]


def per_example(ctx: Context, node: Node, p: Fact, i: Fact, i_rank: int | None,
                taint: frozenset) -> list[Fact]:
    """``tf.gather(p, i, batch_dims=k)``, the last relevant output without flattening
    (``tf.gather(out, length - 1, batch_dims=1)``): with the batch on axis 0 of both and in
    the batch dimensions, each example's indices pick from its own rows. (Its gradient
    flattens with ``range(B) * T`` offsets, which :func:`segment` follows.)"""
    dims = int(node.attr("batch_dims", 0) or 0)
    dims = dims + i_rank if dims < 0 and i_rank is not None else dims
    found = ctx.axes(node.inputs[2], ctx.rank(node.inputs[0])) if len(node.inputs) > 2 else [dims]
    if p.kind == PART and i.kind == PART and p.axis == i.axis == 0 and dims >= 1:
        ctx.classes.union(i.cls, p.cls, node.name)     # batch dimensions of equal sizes
    if found is not None and dims >= 1 and found[0] >= dims and same_entries(p, i, ctx) \
            and p.axis == 0 and not p.filtered and not i.filtered and i.index is None:
        # (indices that are row numbers pick by each tower's own numbering: review 17)
        return [i.with_(index=None, value=None, taint=taint)]
    if i.index is not None:
        return [mixed(node.name, f"{node.op} with batch_dims by row numbers local to each tower "
                      "(they start at 0 in every tower)", taint)]
    return [mixed(node.name, f"{node.op} with batch_dims whose batch dimensions are not the "
                  "examples' of both operands", taint)]


def segment(ctx: Context, node: Node, ids: Fact, data: Fact, taint: frozenset) -> list[Fact] | None:
    """The fact of a segment op by example numbers or, in gradient code, by offsets; None
    when ``ids`` are neither."""
    per = example_numbers(ids)
    if per and same_entries(ids, data, ctx) and ids.axis == 0:
        # segment ids naming each entry's own example or sentence (tokens summed per example),
        # into as many segments as the tower has of them: a count fixed in the graph would
        # pin the batch size where one device runs any (review 17)
        count = ctx.int_value(node.inputs[2]) if len(node.inputs) > 2 else None
        static = ctx.static_batch(data.cls)
        if count is not None and len(count) == 1 and isinstance(count[0], int) and static is not None \
                and count[0] == static * per:
            ctx.position(node.inputs[2], None, data.cls, per, node)     # a static batch's count
        elif len(node.inputs) > 2 and not (count is not None and len(count) == 1 and isinstance(count[0], Sym)
                                            and count[0].coef == per and ctx.classes.same(count[0].cls, data.cls)):
            return [mixed(node.name, f"{node.op} by each entry's example into a number of segments "
                          "that is not the batch size (pass tf.shape(x)[0])", taint)]
        return [part(0, data.cls, per, taint=taint)]
    if strided(ids) and data.kind == PART and ctx.in_gradient(node) and len(node.inputs) > 2 \
            and ctx.classes.same(ids.cls, data.cls):
        # the gradient of a gather by offsets into the flattened batch: each tower's sums fall
        # in its own examples' entries (the forward gather's check covers the offsets)
        return [part(0, ids.index[1], None, taint=taint)]
    return None


def _offsets_fit(ctx: Context, p: Fact, i: Fact, axis: int) -> bool | None:
    """``Gather(p, i)`` along ``axis`` picks, for every entry of ``i``, an entry of its own
    example, once the run-time check holds: ``p`` is flattened with its examples one after
    the other along the gathered axis, ``i`` has every example's offsets one after the other
    along axis 0, as many for each (not filtered by a mask: the check counts them so). None
    when only the stride is not proved."""
    if not (strided(i) and p.kind == PART and p.axis == axis == 0 and p.outer == 1 and p.ordered
            and not p.filtered and i.axis == 0 and i.outer == 1 and i.ordered and not i.filtered
            and ctx.classes.same(i.index[1], p.cls) and ctx.classes.same(i.cls, p.cls)):
        return False
    # a stride known here must be the flattened tensor's entries per example (else the
    # run-time check would stop every step: the offsets are no such offsets)
    stride = _product(ctx, i.index[2])
    if stride is None or p.block is None:
        return True                     # a fed stride: the check compares them at run time
    # a stride of dimensions must be the flattened tensor's entries per example, proved: T
    # against the 2 * T rows of a concat of two [B, T] passed the analysis and stopped every
    # step at the check (review 16)
    block = Prod.of([p.block], "block")
    if stride.symbols == block.symbols:         # T against T * 4: other offsets, no gap in the proof
        return stride.value == block.value
    return None


def _product(ctx: Context, refs: tuple) -> Prod | None:
    """The stride as integers and named dimensions (``tf.shape(t)[k]``), or None."""
    out = Prod()
    for ref in refs:
        value = ctx.int_value(ref)
        if value is not None and len(value) == 1 and isinstance(value[0], int):
            out = out.times(value[0])
            continue
        read = ctx.shape_dimension(ref)       # tf.shape(t)[k]: named as reshapes name it
        if read is None:
            return None
        out = out.times(ctx.dim_token(*read))
    return out


def _by_example(ctx: Context, p: Fact, i: Fact, axis: int) -> bool:
    """``Gather(p, i)``: every entry of ``i`` names its own unit (example or sentence) and
    ``p`` holds one row per unit along ``axis`` (a per-example value spread over the
    example's tokens)."""
    per = example_numbers(i)
    return (per is not None and p.kind == PART and p.axis == axis == 0 and p.block == per
            and p.outer == 1 and p.ordered and not p.filtered and ctx.classes.same(i.cls, p.cls))


def unchecked(ctx: Context, node: Node) -> str:
    """Where ``node`` runs if the run-time check cannot be added there (a function body, a
    TF1 loop frame: its constants would need the frame's plumbing), else ``""``."""
    if ctx.seeds:
        return "inside a function body (a tf.cond branch, a while loop, a defun)"
    if opening(ctx.ir, node.name) is not None:
        return "inside a TF1 while loop"
    return ""


def range_(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    """``Range(0, n, 1)`` over a batch size numbers the tower's own rows."""
    start, limit, delta = (ctx.int_value(r) for r in node.inputs[:3])
    if limit is not None and isinstance(limit[0], Sym) and start == (0,) and delta == (1,):
        sym = limit[0]
        return [part(0, sym.cls, sym.coef, index=("rows", sym.cls, sym.coef))]
    if limit is not None and isinstance(limit[0], Sym) and start == (0,) and delta is not None \
            and isinstance(delta[0], int) and delta[0] > 1 and limit[0].coef == delta[0]:
        # range(0, B * T, T): one offset per example, its first of T entries
        sym = limit[0]
        return [part(0, sym.cls, 1, index=(TAG, sym.cls, (node.inputs[2],), node.name, 0))]
    if limit is not None and isinstance(limit[0], Sym):
        return [mixed(node.name, "Range over a multiple of the batch size with another start or "
                      "step (its length differs from tower to tower)", taint_of(ins))]
    if any(f.kind in (PART, MIXED) for f in ins):
        return [mixed(node.name, "Range over values that depend on the batch", taint_of(ins))]
    reds = [f for f in ins if f.kind == RED]
    if any(f.src is None and f.merge == "other" for f in reds):
        return [mixed(node.name, "Range up to a length computed from the tower's own batch size "
                      "(the batch size minus a constant)", taint_of(ins))]
    if any(f.src is None and f.merge == "size" for f in reds):
        # tf.range(tf.size(x)) where the size has no symbolic value (a dynamic axis beside
        # the batch): each tower numbers its own elements; taken for shared, a loss term of
        # those numbers was claimed exact (review of review 26's cases)
        return [mixed(node.name, "Range up to the count of the tower's own elements", taint_of(ins))]
    if reds:        # a length computed from the batch (the longest sequence): a coupling
        taint = taint_of(ins) | ({f.src for f in reds if f.src} if not ctx.in_gradient(node) else set())
        return [shared(taint=taint)]
    if start and limit and delta and all(isinstance(v[0], int) for v in (start, limit, delta)) \
            and delta[0] != 0 and 0 <= (limit[0] - start[0]) // delta[0] <= 64:
        return [shared(tuple(range(start[0], limit[0], delta[0])), taint_of(ins))]
    return [shared(taint=taint_of(ins))]
