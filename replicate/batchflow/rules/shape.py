"""Rules for ops that move, join, cut or create dimensions.

Moving the batch axis (transpose, expand, squeeze, reshape) keeps a tensor partitioned on the
new axis; cutting *across* it (a slice that keeps only some examples, a split or unstack along
it, tiling it) mixes examples. Integer shape operands are read as symbolic values: an element
that is a multiple of the tower's example count adapts by itself; one that holds the static
batch size is recorded as a *position* the rewrite must change per tower.
"""

from __future__ import annotations

import math

from replicate.batchflow.context import Context
from replicate.batchflow.lattice import MIXED, PART, RED, SHARED, Fact, Sym
from replicate.batchflow.rules import tail
from replicate.batchflow.rules.common import (
    couple,
    runtime_sized,
    forward_of,
    mixed,
    part,
    rows,
    shared,
    size_fact,
    taint_of,
    unless_partitioned,
)
from replicate.batchflow.rules.joins import STACKED
from replicate.batchflow.rules.layout import map_reshape, sized_rows
from replicate.batchflow.rules.slicing import element
from replicate.batchflow.table import behind
from replicate.graph.ir import Node, node_of, parse_tensor, tensor_name
from replicate.graph.ops import GENERATOR_OPS

__all__ = ["reshape", "expand_dims", "squeeze", "transpose",
           "tile", "broadcast_to", "shape_source",
           "pad", "reverse", "one_hot"]


def _sized_twice(node: Node, value, axis: int, taint, ctx: Context | None = None,
                 ref: str | None = None) -> Fact | None:
    """Mixed when the shape ``value`` (a shape operand's entries) holds the tower's example
    count at an axis other than the batch's ``axis``: there each tower would use its own
    count, where one device uses the batch's (review 41: a ``[B, B]`` draw, ``tf.fill([B, B])``
    or ``tf.tile(h, [1, B])`` was claimed exact, 0.04-0.97 off). So does an entry computed
    from the batch (``tf.minimum(B, 5)``) of operand ``ref``, when ``ctx`` is given: the
    towers' sizes differed there, and joining their values failed at step 1."""
    other = next((j for j, v in enumerate(value or ()) if isinstance(v, Sym) and j != axis), None)
    if other is None and ctx is not None and runtime_sized(ctx, ref, value, lambda j: j != axis):
        return mixed(node.name, f"{node.op} sizes an axis other than the examples' by a value "
                     "computed from the batch: each tower would compute its own", taint)
    if other is None:
        return None
    return mixed(node.name, f"{node.op} sizes axis {other} by the batch size as well as axis "
                 f"{axis}: each tower would use its own example count there", taint)


def _sized_by(ctx: Context, node: Node, ref: str, ins: list[Fact]) -> Fact | None:
    """A shared value broadcast, tiled or reshaped to a shape that holds the tower's example
    count (``Sym``) becomes partitioned there, one uniform slice per example.

    So does a batch-reduced value: in gradient code (the gradient of a loss normalized by a
    batch count, ``Tile``d over the examples) each tower's copy holds its own count, which the
    loss's weighting accounts for; in forward code every example then depends on the others
    (a coupling through the reduction's op, as ``x - mean(x)``)."""
    first = ins[0]
    if first.kind not in (SHARED, RED) or any(f.kind == MIXED for f in ins):
        return None
    taint = taint_of(ins)
    if first.kind == RED and not ctx.in_gradient(node):
        if not first.src:
            return None
        taint = taint | {first.src}
    value = ctx.int_value(ref)
    syms = [(j, v) for j, v in enumerate(value or ()) if isinstance(v, Sym)]
    if not syms:
        return None
    j, v = syms[0]
    return _sized_twice(node, value, j, taint) or part(j, v.cls, v.coef, taint=taint)


def reshape(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    f = ins[0]
    if f.kind != PART:
        sized = _sized_by(ctx, node, node.inputs[1], ins)
        if sized is not None:
            return [sized]
        out = unless_partitioned(ctx, node, ins)
        if f.kind == SHARED and f.value is not None and ins[1].kind == SHARED:
            return [shared(f.value, taint_of(ins))]
        if f.kind == RED and f.merge == "size" and f.value is not None and len(f.value) == 1 \
                and ins[1].kind == SHARED:
            return [size_fact(f.value, taint_of(ins))]     # one element, as a scalar or vector
        return out
    target = ctx.int_value(node.inputs[1]) or ()
    out_dims = ctx.shape(f"{node.name}:0")
    if f.axis == 0 and ctx.rank(node.inputs[0]) == 1 and out_dims is not None and len(out_dims) == 2 \
            and out_dims[1] == 1 and len(target) == 2 and target[0] == -1:
        return [f.with_(value=None, taint=couple(ctx, node, ins))]     # rows to a column: [-1, 1]
    in_shape = ctx.shape(node.inputs[0])
    if f.axis == 0 and in_shape is not None and len(in_shape) == 2 and in_shape[1] == 1 \
            and tuple(target) == (-1,):             # a column to rows (tf.where's coordinates)
        index = ("rows",) + f.index[2:] if f.index is not None and f.index[:2] == ("cols", 0) else None
        return [f.with_(value=None, index=index, taint=couple(ctx, node, ins))]
    in_dims = ctx.named_shape(node.inputs[0], skip=f.axis)
    syms = [j for j, v in enumerate(target) if isinstance(v, Sym) and ctx.classes.same(v.cls, f.cls)]
    twice = _sized_twice(node, target, syms[0], f.taint, ctx, node.inputs[1]) if syms else None
    if twice is not None:
        return [twice]
    if syms and sized_rows(f, in_dims, target, syms[0], out_dims):
        j = syms[0]
        return [part(j, f.cls, target[j].coef, taint=couple(ctx, node, ins), ordered=f.ordered,
                     filtered=f.filtered)]
    if out_dims is None and target:
        out_dims = [None] * len(target)
    if in_dims is None or out_dims is None:
        return [mixed(node.name, "Reshape of unknown rank", f.taint)]
    if len(target) == len(out_dims):      # the target's known sizes where inference gave none
        out_dims = [o if o is not None else (t if (isinstance(t, int) and t >= 0) or isinstance(t, str)
                                             else None) for o, t in zip(out_dims, target)]
    found = map_reshape(in_dims, f.axis, f.outer, f.block, ctx.static_batch(f.cls), out_dims)
    if found is None and _pin_by_target(ctx, node, f, in_dims, target):
        found = map_reshape(in_dims, f.axis, f.outer, f.block, ctx.static_batch(f.cls), out_dims)
    if found is None:
        undone = _undo_reshape(ctx, node, f)
        if undone is not None:
            return [undone]
        _regroups(ctx, node, f, in_dims, target)
        return [mixed(node.name, "Reshape that splits or scatters the examples", f.taint)]
    j, outer, inner = found
    if j < len(target) and isinstance(target[j], int) and target[j] != -1 and outer and inner:
        ctx.position(node.inputs[1], j, f.cls, outer * inner, node)
    elif not target and outer and inner and j < len(out_dims) and isinstance(out_dims[j], int):
        # a target computed from constants the values do not follow (a tile's gradient
        # transposes its multiples): the static batch there is still a position
        ctx.position(node.inputs[1], j, f.cls, outer * inner, node)
    # a time-major flattening ([T, B] -> [T*B]) is T copies of the batch one after the other,
    # each in batch order: the layout of copies joined along the axis, which stays ordered
    # (it was marked unordered, so reshaping back to [T, B] could not be merged any more)
    return [part(j, f.cls, inner, ordered=f.ordered, filtered=f.filtered,
                 taint=couple(ctx, node, ins), outer=outer)]


def _regroups(ctx: Context, node: Node, f: Fact, in_dims: list, target: tuple) -> None:
    """A reshape that regroups the examples (``[B, d]`` to ``[-1, 2, d]``: pairs) runs only
    on a multiple of some count of them; the split gives each tower such a multiple, so the
    rewrite runs (it stays inexact: the groups are not examples the analysis can follow)."""
    if ctx.in_gradient(node) or not target or not isinstance(f.block, int) \
            or not isinstance(f.outer, int) \
            or not all(isinstance(t, int) and (t > 0 or t == -1) for t in target) \
            or not all(isinstance(d, int) for i, d in enumerate(in_dims) if i != f.axis):
        return
    per = f.block * f.outer * math.prod(d for i, d in enumerate(in_dims) if i != f.axis)
    total = math.prod(t for t in target if t > 0)
    if per > 0:
        ctx.classes.granule(f.cls, total // math.gcd(total, per), node.name)


def _pin_by_target(ctx: Context, node: Node, f: Fact, in_dims: list, target: tuple) -> bool:
    """A dynamic batch reshaped to a target of constants only (``[8, 2, 3]`` from ``[B, 6]``,
    a Python batch size baked into the code): the target's element count decides the batch
    size, which one device needs too (its reshape fails with any other). The class is pinned
    to it, and the report states the assumption; the rewrite then resizes the target per
    tower (it was "splits or scatters the examples", and the rewrite did not run)."""
    if ctx.static_batch(f.cls) is not None or not target or ctx.in_gradient(node) \
            or not all(isinstance(t, int) and t >= 0 for t in target) \
            or not isinstance(f.block, int) or not isinstance(f.outer, int) \
            or not all(isinstance(d, int) for i, d in enumerate(in_dims) if i != f.axis):
        return False
    per = f.block * f.outer * math.prod(d for i, d in enumerate(in_dims) if i != f.axis)
    total = math.prod(target)
    if per <= 0 or total % per or total // per == 0:
        return False
    ctx.classes.pin(f.cls, total // per, node.name)
    return True


def _undo_reshape(ctx: Context, node: Node, f: Fact) -> Fact | None:
    """The gradient of a forward reshape (``X_grad/Reshape`` back to ``shape(X's input)``) has
    the forward input's layout, element for element, even where shape inference lost the
    dimensions of the gradient (a static batch meeting run-time shapes): None otherwise."""
    forward = forward_of(ctx, node, ("Reshape", "ExpandDims", "Squeeze"))
    if forward is None:
        return None
    before, after = ctx.fact(forward.inputs[0]), ctx.fact(f"{forward.name}:0")
    if before is None or after is None or before.kind != PART or after.kind != PART or before.tail \
            or f.axis != after.axis or not ctx.classes.same(f.cls, after.cls) or rows(f) != rows(after):
        return None
    target = node.inputs[1]
    producer = ctx.ir.nodes.get(node_of(target))
    static = ctx.shape(forward.inputs[0])
    if producer is not None and producer.op == "Shape" and producer.inputs \
            and _same_tensor(producer.inputs[0], forward.inputs[0]):
        pass                                            # shape(X's input) at run time
    elif ctx.const(target) is not None and static is not None and rows(before) \
            and _folded_shape(list(ctx.const(target).reshape(-1)), static, before.axis):
        if static[before.axis] is not None:
            ctx.position(target, before.axis, before.cls, rows(before), node)
    else:
        return None
    return before.with_(taint=f.taint, value=None, index=None, ordered=f.ordered and before.ordered,
                        filtered=f.filtered or before.filtered)


def _same_tensor(a: str, b: str) -> bool:
    return tensor_name(*parse_tensor(a)) == tensor_name(*parse_tensor(b))


def _folded_shape(target: list, static: list, axis: int) -> bool:
    """True when constant ``target`` is the static shape ``static`` folded by ``tf.gradients``
    (``-1`` where the batch axis has no static size)."""
    return len(target) == len(static) and all(
        t == d if d is not None else (i == axis and t == -1) for i, (t, d) in enumerate(zip(target, static)))


def expand_dims(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    f = ins[0]
    if f.kind != PART:
        if f.kind == SHARED and f.value is not None:
            return [shared(f.value, f.taint)] if len(f.value) == 1 else [shared(taint=f.taint)]
        if f.kind == RED and f.merge == "size":
            return [f]
        return unless_partitioned(ctx, node, ins)
    dim = ctx.axes(node.inputs[1], (ctx.rank(node.inputs[0]) or 0) + 1)
    if dim is None:
        return [mixed(node.name, "ExpandDims at an axis known only at run time", f.taint)]
    return [f.with_(axis=f.axis + (dim[0] <= f.axis), value=None, index=None)]


def squeeze(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    f = ins[0]
    if f.kind != PART:
        return unless_partitioned(ctx, node, ins)
    dims = node.attr("squeeze_dims", []) or []
    shape = ctx.shape(node.inputs[0])
    if shape is None:
        return [mixed(node.name, "Squeeze of unknown rank", f.taint)]
    rank = len(shape)
    gone = sorted({d + rank if d < 0 else d for d in dims}) if dims else [
        i for i, d in enumerate(shape) if d == 1 and i != f.axis]
    if f.axis in gone:
        return [mixed(node.name, "Squeeze of the batch axis", f.taint)]
    index = f.index
    if index is not None and index[0] == "cols" and rank - 1 in gone and rank == 2:
        index = ("rows",) + index[2:]       # Where's [n, 1] coordinates squeezed to row numbers
    return [f.with_(axis=f.axis - sum(1 for d in gone if d < f.axis), value=None, index=index)]


def transpose(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    f = ins[0]
    if f.kind != PART:
        return unless_partitioned(ctx, node, ins)
    perm = ctx.int_value(node.inputs[1])
    if perm is None or any(not isinstance(p, int) for p in perm):
        return [mixed(node.name, "Transpose by a permutation known only at run time", f.taint)]
    index = ("cols",) + f.index[1:] if f.index is not None and f.index[0] == STACKED \
        and tuple(perm) == (1, 0) else None
    return [f.with_(axis=list(perm).index(f.axis), value=None, index=index)]


def tile(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    f = ins[0]
    if f.kind != PART:
        sized = _sized_by(ctx, node, node.inputs[1], ins)
        if sized is not None:
            # B copies of the input one after the other: each example holds a whole copy,
            # the input's rows along that axis (tf.tile(tf.range(d), [B]) holds d per example;
            # taken for one, review 28's case)
            dims = ctx.shape(node.inputs[0])
            rows_in = dims[sized.axis] if dims is not None and sized.axis < len(dims) else None
            if not isinstance(rows_in, int) or not isinstance(sized.block, int):
                return [mixed(node.name, "Tile repeats a tensor of unknown size once per example", sized.taint)]
            return [sized.with_(block=sized.block * rows_in)]
        return [unless_partitioned(ctx, node, ins)[0]]
    multiples = ctx.int_value(node.inputs[1])
    twice = _sized_twice(node, multiples, f.axis, f.taint, ctx, node.inputs[1])
    if twice is not None:
        return [twice]
    if multiples is None and element(ctx, node.inputs[1], None, f.axis) == 1:
        # once along the batch, other axes a number known at run time (labels tiled to the
        # batch's longest sequence, ``tf.tile(y[:, None], [1, tf.reduce_max(lengths)])``)
        return [f.with_(value=None, index=None, taint=couple(ctx, node, ins))]
    if multiples is None or f.axis >= len(multiples) or not isinstance(multiples[f.axis], int):
        return [mixed(node.name, "Tile repeats the examples of the batch", f.taint)]
    times = multiples[f.axis]
    if times == 1:
        return [f.with_(value=None, index=None)]
    if times < 1 or not isinstance(f.outer, int) or f.filtered or f.tail:
        return [mixed(node.name, "Tile repeats the examples of the batch", f.taint)]
    # m copies of the batch one after the other (a mask tiled over attention heads folded
    # into the batch): tower k holds its rows of each copy, the fact's outer blocks
    return [f.with_(outer=f.outer * times, value=None, index=None)]


def broadcast_to(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    f = ins[0]
    if f.kind != PART:
        return [_sized_by(ctx, node, node.inputs[1], ins) or unless_partitioned(ctx, node, ins)[0]]
    out_rank, rank = ctx.rank(f"{node.name}:0"), ctx.rank(node.inputs[0])
    if out_rank is None or rank is None:
        return [mixed(node.name, "BroadcastTo of unknown rank", f.taint)]
    axis = f.axis + out_rank - rank
    twice = _sized_twice(node, ctx.int_value(node.inputs[1]), axis, f.taint, ctx, node.inputs[1])
    if twice is not None:
        return [twice]
    ctx.position(node.inputs[1], axis, f.cls, rows(f), node)
    return [f.with_(axis=axis, value=None, index=None)]


def shape_source(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    """``Fill``, random ops and others that make a tensor of a given shape."""
    from replicate.batchflow.table import SHAPE_SOURCES

    pos = SHAPE_SOURCES[node.op]
    dims = ins[pos]
    others = [f for i, f in enumerate(ins) if i != pos]
    taint = couple(ctx, node, others) | dims.taint
    bad = next((f for f in others if f.kind == MIXED), None)
    if bad is not None:
        return [bad]            # its own reason (a generator's unordered draws)
    if any(f.kind == PART for f in others):
        return [mixed(node.name, f"{node.op} with per-example parameters", taint)]
    if not ctx.in_gradient(node) and any(f.kind == RED and f.merge == "size" for f in others):
        return [mixed(node.name, f"{node.op} with the batch size as its value: each tower fills "
                      "in its own count", taint)]
    value = dims.value or ctx.int_value(node.inputs[pos])
    if value is not None:
        syms = [(j, v) for j, v in enumerate(value) if isinstance(v, Sym)]
        if syms:
            j, v = syms[0]
            if len(syms) > 1:
                return [_sized_twice(node, value, j, taint)]
            if v.outer > 1 and isinstance(v.coef, int) and v.coef % v.outer == 0:
                return [part(j, v.cls, v.coef // v.outer, taint=taint, outer=v.outer)]
            if _copies_read(ctx, node, j, v, pos):
                # [k * B, ...] read back as [k, B, ...] (two samples per example drawn as one
                # tensor, review 28): k copies of the batch one after the other
                return [part(j, v.cls, 1, taint=taint, outer=v.coef)]
            return [part(j, v.cls, v.coef, taint=taint)]
    if dims.kind == RED and dims.merge != "size":      # a size computed from the batch: a coupling
        taint = taint | ({dims.src} if dims.src and not ctx.in_gradient(node) else set())
    fill = ctx.int_value(node.inputs[1]) if node.op == "Fill" else None
    if value is not None and fill is not None and isinstance(fill[0], int):
        if not value:
            return [shared(fill, taint)]                     # an integer scalar
        if len(value) == 1 and isinstance(value[0], int) and 0 <= value[0] <= 64:
            return [shared(fill * value[0], taint)]          # a small integer vector, e.g. ones
    return [shared(taint=taint)]


#: Ops through which a tensor keeps its layout when every other operand is a scalar.
_SCALED = frozenset({"Identity", "Cast", "Neg", "Mul", "Add", "AddV2", "Sub", "RealDiv"})


def generator_state(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    """``RngReadAndSkip(state, alg, delta)``: a ``tf.random.Generator``'s state before it skips
    ``delta`` numbers. The value read does not depend on how many are skipped, so it is the
    same wherever the op runs once (the analyze pass evicts it, a state write, and it skips
    the batch's count: each tower then draws its rows of the batch's draw) -- unless another
    draw of the same generator is in the graph. With no order between the two, one device's
    numbers depend on which runs first (claimed exact, 0.06 off); with one, the order is not
    kept once the reads run outside the towers (review 31: a batch-shaped draw, then a fixed
    one under a control edge, claimed exact, 0.12 off)."""
    handle = behind(ctx.ir, node.inputs[0])
    other = next((n for n in ctx.ir.nodes.values() if n.op in GENERATOR_OPS and n.name != node.name
                  and n.inputs and behind(ctx.ir, n.inputs[0]) == handle), None)
    if other is not None and not _ordered(ctx, node.name, other.name):
        return [mixed(node.name, f"{node.op} draws from a tf.random.Generator that "
                      f"'{other.name}' also draws from with no order between them (one "
                      "device's numbers depend on which runs first)", taint_of(ins))]
    if other is not None:
        return [mixed(node.name, f"{node.op} draws from a tf.random.Generator that "
                      f"'{other.name}' also draws from: replicate keeps the draws of a "
                      "generator drawn from once per step only", taint_of(ins))]
    return [shared(taint=taint_of(ins))]


def _ordered(ctx: Context, a: str, b: str) -> bool:
    """One of ops ``a`` and ``b`` runs before the other (data or control edges)."""
    for first, second in ((a, b), (b, a)):
        work, seen = [second], {second}
        while work:
            node = ctx.ir.nodes.get(work.pop())
            for ref in (node.inputs + list(node.control)) if node is not None else ():
                name = node_of(ref)
                if name == first:
                    return True
                if name not in seen:
                    seen.add(name)
                    work.append(name)
    return False


def _copies_read(ctx: Context, node: Node, axis: int, size: Sym, pos: int) -> bool:
    """``node`` makes ``k * n`` rows on ``axis`` (its shape operand, input ``pos``, packs
    ``k * n`` there) and is read, through scalings, only by reshapes to ``[..., k, n, ...]``:
    it holds ``k`` copies of the batch one after the other, whatever it draws or fills (its
    values do not tell an example's rows apart). Proved on the graph's structure, since the
    reshapes' facts come later in the order."""
    k = size.coef
    if not isinstance(k, int) or k < 2:
        return False
    n = _scaled_by(ctx, _packed(ctx, node.inputs[pos], axis), k)
    if n is None:
        return False
    readers, seen = list(ctx.ir.data_consumers(f"{node.name}:0")), set()
    while readers:
        reader, position = readers.pop()
        if reader.name in seen:
            continue
        seen.add(reader.name)
        if reader.op in _SCALED and all(ctx.rank(r) == 0 for i, r in enumerate(reader.inputs) if i != position):
            # random_normal's ``* stddev + mean``
            readers.extend(ctx.ir.data_consumers(f"{reader.name}:0"))
            continue
        if reader.op != "Reshape" or position != 0:
            return False
        copies, rows_ = _packed(ctx, reader.inputs[1], axis), _packed(ctx, reader.inputs[1], axis + 1)
        if copies is None or ctx.const(copies) is None or int(ctx.const(copies)) != k or rows_ != n:
            return False
    return bool(seen)


def _packed(ctx: Context, ref: str, i: int) -> str | None:
    """Element ``i`` of the ``Pack`` behind ``ref`` (``tf.stack([...])``), else None."""
    found = ctx.ir.nodes.get(node_of(behind(ctx.ir, ref)))
    if found is None or found.op != "Pack" or i >= len(found.inputs):
        return None
    return behind(ctx.ir, found.inputs[i])


def _scaled_by(ctx: Context, ref: str | None, k: int) -> str | None:
    """``n`` when ``ref`` is ``k * n`` (``Mul`` by the constant ``k``), else None."""
    found = ctx.ir.nodes.get(node_of(ref)) if ref is not None else None
    if found is None or found.op != "Mul":
        return None
    for i, j in ((0, 1), (1, 0)):
        value = ctx.const(found.inputs[i])
        if value is not None and value.size == 1 and int(value) == k:
            return behind(ctx.ir, found.inputs[j])
    return None


def pad(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    made = tail.slice_grad(ctx, node, ins)
    if made is not None:
        return made
    f = ins[0]
    if f.kind != PART:
        if f.kind != MIXED and ins[1].dependent:
            # padded by the tower's count (the gradient of ``tf.slice(loss, [1], [1])``): the
            # values land at positions of each tower's own rows
            return [mixed(node.name, f"{node.op} puts values at positions of each tower's rows",
                          taint_of(ins))]
        return unless_partitioned(ctx, node, ins)
    pads = ctx.const(node.inputs[1])
    if pads is not None:
        row = tuple(pads[f.axis].tolist()) if pads.shape[0] > f.axis else None
    else:       # paddings stacked at run time ([[0, 0], [0, max_len - T]]): the batch axis' row
        stacked = ctx.ir.nodes.get(node_of(node.inputs[1]))
        row = ctx.int_value(stacked.inputs[f.axis]) if stacked is not None and stacked.op == "Pack" \
            and int(stacked.attr("axis", 0)) == 0 and f.axis < len(stacked.inputs) else None
    if row != (0, 0):
        return [mixed(node.name, f"{node.op} adds rows to the batch" if row is not None else
                      f"{node.op} by paddings known only at run time", f.taint)]
    # paddings computed from a batch reduction (to the batch's longest sequence): a coupling
    return [f.with_(value=None, index=None, taint=couple(ctx, node, ins))]


def reverse(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    f = ins[0]
    if f.kind != PART:
        return unless_partitioned(ctx, node, ins)
    axes = ctx.axes(node.inputs[1], ctx.rank(node.inputs[0]))
    if axes is None:
        return [mixed(node.name, "ReverseV2 along axes known only at run time", f.taint)]
    if f.axis in axes:
        # each tower reverses its own slice: its rows then meet other examples' rows than on
        # one device (a reversed prediction against its labels was claimed exact, 1.46 off)
        return [mixed(node.name, "ReverseV2 along the batch reverses the order of the examples",
                      f.taint)]
    return [f.with_(value=None, index=None)]


def shuffle(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    """``RandomShuffle`` permutes its first axis."""
    f = ins[0]
    if f.kind != PART:
        return unless_partitioned(ctx, node, ins)
    if f.axis == 0:
        return [mixed(node.name, "random_shuffle permutes the examples of the batch (each tower "
                      "shuffles its own slice)", f.taint)]
    return [mixed(node.name, "random_shuffle of per-example values (each tower draws its own "
                  "permutation)", f.taint)]


def one_hot(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    f = ins[0]
    if f.kind != PART:
        return unless_partitioned(ctx, node, ins)
    rank = ctx.rank(node.inputs[0])
    axis = int(node.attr("axis", -1))
    axis = rank if axis < 0 and rank is not None else axis
    return [f.with_(axis=f.axis + (axis <= f.axis), value=None, index=None,
                    taint=couple(ctx, node, ins))]
