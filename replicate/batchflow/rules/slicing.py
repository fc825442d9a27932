"""Rules for ops that cut a tensor: ``Slice``, ``StridedSlice`` and its gradient.

A slice along the batch axis that keeps every example (``x[:, 1:]``, ``x[:n]`` with ``n`` the
batch size) stays partitioned; one that keeps only some examples mixes them. Begin, end and
size operands are read as symbolic values, element by element (:func:`element`), so a bound
that is the tower's example count adapts by itself.
"""

from __future__ import annotations

from replicate.batchflow.context import Context
from replicate.batchflow.lattice import MIXED, PART, Fact, Sym
from replicate.batchflow.rules.common import (couple, mixed, rows, runtime_sized, size_fact,
                                              taint_of, unless_partitioned)
from replicate.batchflow.rules.layout import strided_entries
from replicate.graph.ir import Node, node_of

__all__ = ["slice_", "strided_slice", "strided_slice_grad", "element"]


def _value_slice(value: tuple, begin: int, end: int | None, stride: int = 1) -> tuple:
    return tuple(value[begin:end:stride])


def element(ctx: Context, ref: str, value: tuple | None, i: int, depth: int = 0):
    """Element ``i`` of integer vector ``ref``: from its value, else from how the vector is
    built at run time, where the batch axis's bound is known though a time step's is not:
    the scalar packed there (``tf.stack([t, 0, 0])``), the piece concatenated there
    (``tf.concat([[0], [t], [0]], 0)``), a zero of a constant scaled at run time
    (``[0, 1, 0] * t``), through identities."""
    if value is not None:
        return value[i] if 0 <= i < len(value) else None
    node = ctx.ir.nodes.get(node_of(ref))
    if node is None or depth > 8 or i < 0:
        return None
    if node.op in ("Identity", "Cast") and node.inputs:
        return element(ctx, node.inputs[0], ctx.int_value(node.inputs[0]), i, depth + 1)
    if node.op == "Pack":
        if i >= len(node.inputs) or int(node.attr("axis", 0)):
            return None
        scalar = ctx.int_value(node.inputs[i])
        return scalar[0] if scalar is not None and len(scalar) == 1 else None
    if node.op == "ConcatV2" and ctx.int_value(node.inputs[-1]) in ((0,), (-1,)):
        for piece in node.inputs[:-1]:
            shape = ctx.shape(piece)
            if shape is None or len(shape) != 1 or not isinstance(shape[0], int):
                return None
            if i < shape[0]:
                return element(ctx, piece, ctx.int_value(piece), i, depth + 1)
            i -= shape[0]
        return None
    if node.op == "Mul" and len(node.inputs) == 2:
        for a, b in (node.inputs, node.inputs[::-1]):
            known = ctx.int_value(a)
            if known is not None and len(known) > i and known[i] == 0 \
                    and ctx.rank(b) in (0, 1) and ctx.rank(a) == 1:
                return 0
    return None


def slice_(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    f = ins[0]
    begin, size = ctx.int_value(node.inputs[1]), ctx.int_value(node.inputs[2])
    if f.kind != PART:
        if f.value is not None and begin and size and isinstance(begin[0], int) and isinstance(size[0], int):
            end = None if size[0] == -1 else begin[0] + size[0]
            return [size_fact(_value_slice(f.value, begin[0], end), taint_of(ins))]
        return unless_partitioned(ctx, node, ins)
    off = _off_axis_size(ctx, node, node.inputs[1:3], (begin, size), lambda j: j != f.axis, f)
    if off is not None:
        return [off]
    b, s = element(ctx, node.inputs[1], begin, f.axis), element(ctx, node.inputs[2], size, f.axis)
    if b is None or s is None:
        return [mixed(node.name, "Slice by bounds known only at run time", f.taint)]
    full = ctx.batch_dim(f)
    if b == 0 and (s == -1 or isinstance(s, Sym) and _copies(ctx, f, s) == f.outer
                   or (full is not None and s == full)):
        if isinstance(s, int) and s != -1:
            ctx.position(node.inputs[2], f.axis, f.cls, rows(f), node)
        _refine_slice(ctx, node, begin, size)
        return [f.with_(value=None, index=None, taint=couple(ctx, node, ins))]
    return [mixed(node.name, "Slice keeps only some of the examples", f.taint)]


def _refine_slice(ctx: Context, node: Node, begin, size) -> None:
    """The static shape of a ``Slice`` whose bounds are built at run time: a dimension whose
    begin and size elements are known (a size of -1 takes the rest) though inference, not
    seeing the vector's value, left it unknown (a reshape reading it needs it)."""
    shape, rank = ctx.shape(node.inputs[0]), ctx.rank(node.inputs[0])
    if shape is None or rank is None:
        return
    out = []
    for j in range(rank):
        b, s = element(ctx, node.inputs[1], begin, j), element(ctx, node.inputs[2], size, j)
        if isinstance(s, int) and s >= 0:
            out.append(s)
        elif s == -1 and isinstance(b, int) and isinstance(shape[j], int) and 0 <= b <= shape[j]:
            out.append(shape[j] - b)
        else:
            out.append(None)
    ctx.refine(f"{node.name}:0", out)


def _masks(node: Node) -> tuple[int, int, int, int, int]:
    return tuple(int(node.attr(k, 0)) for k in ("begin_mask", "end_mask", "ellipsis_mask",
                                                  "new_axis_mask", "shrink_axis_mask"))


def strided_slice(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    f = ins[0]
    begin, end, strides = (ctx.int_value(r) for r in node.inputs[1:4])
    bm, em, ell, new, shrink = _masks(node)
    if f.kind != PART:
        out = unless_partitioned(ctx, node, ins)
        if f.value is not None and begin and end and strides and not ell and not new \
                and all(isinstance(v, int) for v in begin + end + strides):
            lo = None if bm & 1 else begin[0]
            hi = None if em & 1 else end[0]
            if shrink & 1:
                picked = f.value[begin[0]:begin[0] + 1] if begin[0] >= 0 else f.value[begin[0]:][:1]
            else:
                picked = f.value[lo:hi:strides[0]]
            return [size_fact(tuple(picked), taint_of(ins))]
        return out
    rank = ctx.rank(node.inputs[0])
    # bounds computed from a batch reduction (x[:, :tf.reduce_max(lengths)], padding trimmed to
    # the batch's longest sequence): each tower cuts by its own, a coupling (review 29: the
    # taint was dropped, and a softmax over the trimmed axis was claimed exact, 1.6 off)
    f = f.with_(taint=couple(ctx, node, ins))
    if rank is None:
        return [mixed(node.name, "StridedSlice of unknown rank", f.taint)]
    if begin is None or end is None or strides is None:
        return [_runtime_bounds(ctx, node, f, rank, strides)]
    entries = strided_entries(rank, len(begin), ell, new, shrink)
    others = {i for din, _, i in entries if i is not None and din is not None and din != f.axis}
    off = _off_axis_size(ctx, node, node.inputs[1:3], (begin, end), lambda i: i in others, f)
    if off is not None:
        return [off]
    for din, dout, i in entries:
        if din != f.axis:
            continue
        if i is None:
            return [f.with_(axis=dout, value=None, index=None)]
        if dout is None:
            return [mixed(node.name, "StridedSlice picks one example", f.taint)]
        lo = 0 if (bm >> i) & 1 else _copies(ctx, f, begin[i])
        hi = f.outer if (em >> i) & 1 else _copies(ctx, f, end[i])
        if lo == 0 and hi == f.outer and strides[i] == 1:
            return [f.with_(axis=dout, value=None, index=_column(f, rank, begin, ell, new, shrink))]
        if isinstance(lo, int) and isinstance(hi, int) and 0 <= lo < hi <= f.outer and strides[i] == 1:
            # whole copies of the batch (``both[:B]`` of ``concat([a, b])``): each tower's
            # slice holds its rows of the same copies
            return [f.with_(axis=dout, outer=hi - lo, value=None, index=None)]
        return [mixed(node.name, "StridedSlice keeps only some of the examples", f.taint)]
    return [mixed(node.name, "StridedSlice with an unexpected layout", f.taint)]


def keeps_axis(ctx: Context, node: Node) -> bool:
    """``Slice`` ``node`` keeps all of its input's examples: it begins at 0 on their axis and
    takes -1 or the batch's size there (``crop_to_bounding_box`` takes ``tf.shape(image)[0]``)."""
    f = ctx.fact(node.inputs[0])
    if f is None or f.kind != PART:
        return False
    b = element(ctx, node.inputs[1], ctx.int_value(node.inputs[1]), f.axis)
    s = element(ctx, node.inputs[2], ctx.int_value(node.inputs[2]), f.axis)
    return b == 0 and (s == -1 or isinstance(s, Sym) and _copies(ctx, f, s) == f.outer)


def _off_axis_size(ctx: Context, node: Node, refs: list[str], bounds: tuple, other,
                   f: Fact) -> Fact | None:
    """Mixed when a slice's bound on an axis other than the examples' (spec entries ``other``
    accepts) holds the batch size: each tower would cut at its own count (review 42:
    ``h[:, :B]``, ``tf.slice(h, [0, B], ...)`` were claimed exact, 0.5-1.3 off), or a value
    computed from it (``crop_to_bounding_box(img, 0, 0, 2, tf.minimum(B, 3))``: the towers'
    widths differed, and joining them failed at step 1)."""
    if any(isinstance(v, Sym) for values in bounds for j, v in enumerate(values or ()) if other(j)):
        return mixed(node.name, f"{node.op} cuts an axis other than the examples' at the batch "
                     "size: each tower would cut at its own example count", f.taint)
    if any(runtime_sized(ctx, ref, values, other) for ref, values in zip(refs, bounds)):
        return mixed(node.name, f"{node.op} cuts an axis other than the examples' at a value "
                     "computed from the batch: each tower would cut at its own", f.taint)
    return None


def _copies(ctx: Context, f: Fact, bound) -> int | None:
    """How many of ``f``'s copies of the batch along its axis lie before slice bound ``bound``
    (``f.outer`` for all of them), or None when the bound does not fall between two copies. A
    bound of the batch size counts its multiple of the examples: ``x[:B]`` of a ``[2 * B]``
    axis keeps one copy, not all (review 41: any batch-sized bound was taken for the whole
    axis, and a fetched merge of ``both[:B]`` read two copies where there was one)."""
    if bound == 0:
        return 0
    if isinstance(bound, Sym):
        if bound.coef is None:
            return f.outer                  # a multiple the same in every tower: the axis' own
        if not isinstance(f.block, int) or not isinstance(f.outer, int) \
                or not ctx.classes.same(bound.cls, f.cls) or bound.coef % f.block:
            return None
        return bound.coef // f.block if bound.coef <= f.block * f.outer else None
    full = ctx.batch_dim(f)
    return f.outer if full is not None and isinstance(bound, int) and bound >= full else None


def _spec_length(ctx: Context, node: Node) -> int | None:
    """How many entries a strided slice's spec has (the static length of ``begin``)."""
    shape = ctx.shape(node.inputs[1])
    return shape[0] if shape is not None and len(shape) == 1 and isinstance(shape[0], int) else None


def _runtime_bounds(ctx: Context, node: Node, f: Fact, rank: int, strides) -> Fact:
    """A strided slice whose bounds are computed at run time (``xs[t]`` of a time-major batch
    in a loop over time steps): the batch's rows stay whole when the spec does not reach the
    batch axis, or takes all of it by its masks; the spec's length and masks say so without
    the bounds' values."""
    n = _spec_length(ctx, node)
    bm, em, ell, new, shrink = _masks(node)
    if n is not None:
        entries = strided_entries(rank, n, ell, new, shrink)
        others = {i for din, _, i in entries if i is not None and din is not None and din != f.axis}
        off = _off_axis_size(ctx, node, node.inputs[1:3], (None, None), lambda i: i in others, f)
        if off is not None:
            return off
        for din, dout, i in entries:
            if din != f.axis:
                continue
            whole = i is None or ((bm >> i) & 1 and (em >> i) & 1 and strides is not None
                                  and strides[i] == 1)
            if whole and dout is not None:
                return f.with_(axis=dout, value=None, index=None)
            break
    return mixed(node.name, "StridedSlice by bounds known only at run time", f.taint)


def _column(f: Fact, rank: int, begin: list, ell: int, new: int, shrink: int) -> tuple | None:
    """``coords[:, c]`` of index tuples whose column ``c`` holds local rows (the indices of a
    sparse batch input, ``tf.where``'s coordinates): the row numbers themselves."""
    if f.index is None or f.index[0] != "cols" or rank != 2 or f.axis != 0 or ell or new \
            or shrink != 2 or len(begin) != 2 or begin[1] != f.index[1]:
        return None
    return ("rows",) + f.index[2:]


def strided_slice_grad(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    """``StridedSliceGrad(shape, begin, end, strides, dy)``: dy scattered into ``shape``."""
    dy = ins[4]
    if dy.kind != PART:
        shape = ctx.int_value(node.inputs[0])
        if dy.kind != MIXED and shape and any(isinstance(v, Sym) for v in shape):
            # the gradient of an example picked by position (``loss[-1]``): each tower puts
            # it at that position of its own rows (it was taken for a shared value of the
            # global batch's size, and cut into the towers' rows: the rewrite did not run)
            return [mixed(node.name, "StridedSliceGrad puts the gradient of an example picked "
                          "by position into each tower's own rows", taint_of(ins))]
        return unless_partitioned(ctx, node, [dy] + ins[:4])
    shape = ctx.int_value(node.inputs[0])
    begin = ctx.int_value(node.inputs[1])
    n = len(begin) if begin is not None else _spec_length(ctx, node)
    if shape is None or n is None:
        return [mixed(node.name, "StridedSliceGrad of unknown shape", dy.taint)]
    bm, em, ell, new, shrink = _masks(node)
    for din, dout, _ in strided_entries(len(shape), n, ell, new, shrink):
        if dout == dy.axis and din is not None:
            ctx.position(node.inputs[0], din, dy.cls, rows(dy), node)
            return [dy.with_(axis=din, value=None)]
    return [mixed(node.name, "StridedSliceGrad with an unexpected layout", dy.taint)]
