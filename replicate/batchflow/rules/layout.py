"""Where the examples go when a tensor is reshaped or strided-sliced.

Both questions are answered in the flattened element order. A partitioned tensor with static
dimensions ``S`` and the batch on axis ``a`` stores example ``i``'s rows at flat positions
``((p * outer + o) * B + i) * inner * post + ...``: ``P = prod(S[:a]) * outer`` elements of
index space come before the example index and ``Q = inner * prod(S[a+1:])`` after it. The
output axis ``j`` holds the examples when ``prod(O[j+1:])`` divides ``Q`` and ``prod(O[:j])``
divides ``P``; the quotients are the output's own ``inner`` and ``outer``. Dimensions unknown
statically are kept as symbols, so a ``[batch, time, hidden] -> [-1, hidden]`` reshape with a
dynamic time axis still maps (with an unknown number of rows per example).
"""

from __future__ import annotations

import collections
from typing import Iterable

from replicate.batchflow.lattice import PART, Fact, Sym

__all__ = ["Prod", "map_reshape", "sized_rows", "strided_entries", "value_pieces"]


class Prod:
    """A product of known integers and symbols: named unknown dimensions (a token such as
    ``"rnn/concat:0#1"`` is the same dimension wherever it appears) or anonymous ones. A
    product of named dimensions and an integer is written ``"a#1*b#2*4"`` (names sorted), and
    read back into its factors (node names never hold a ``*``)."""

    def __init__(self, value: int = 1, symbols: Iterable[str] = ()):
        self.value = value
        self.symbols = collections.Counter(symbols)

    @classmethod
    def of(cls, dims: Iterable, tag: str) -> Prod:
        out = cls()
        for i, d in enumerate(dims):
            if d is None:
                out.symbols[f"?{tag}{i}"] += 1
            else:
                out._multiply(d)
        return out

    def _multiply(self, factor) -> None:
        if isinstance(factor, str):
            for piece in factor.split("*"):
                if piece.isdigit():
                    self.value *= int(piece)
                else:
                    self.symbols[piece] += 1
        else:
            self.value *= int(factor)

    def times(self, factor) -> Prod:
        out = Prod(self.value, self.symbols.elements())
        out._multiply(factor)
        return out

    def divides(self, other: Prod) -> Prod | None:
        """``other / self`` when it is a product of the same kind, else None."""
        if self.value == 0 or other.value % self.value:
            return None
        rest = other.symbols.copy()
        rest.subtract(self.symbols)
        if any(v < 0 for v in rest.values()):
            return None
        out = Prod(other.value // self.value)
        out.symbols = +rest
        return out

    @property
    def known(self) -> int | str | None:
        """An int, a single named dimension, or None (anything else)."""
        if not self.symbols:
            return self.value
        names = list(self.symbols.elements())
        if self.value == 1 and len(names) == 1 and not names[0].startswith("?"):
            return names[0]
        return None

    @property
    def written(self) -> int | str | None:
        """As :attr:`known`, and a product of named dimensions written out (``"a#1*4"``)."""
        names = sorted(self.symbols.elements())
        if not names or any(n.startswith("?") for n in names):
            return self.known
        return "*".join(names + ([str(self.value)] if self.value != 1 else []))


def map_reshape(in_dims: list, axis: int, outer, inner, batch: int | None,
                out_dims: list) -> tuple[int, int | str | None, int | str | None] | None:
    """The output axis that holds the examples after a reshape, with its (outer, inner).

    Args:
        in_dims: input shape: ints, named unknown dimensions (str) or None;
            ``in_dims[axis]`` is ignored (it is ``outer*batch*inner``).
        axis: the partitioned input axis.
        outer, inner: the input's interleave and rows per example along ``axis`` (an int, a
            named dimension, or None: unknown).
        batch: the static number of examples, or None.
        out_dims: output shape, as ``in_dims``.

    Returns:
        ``(j, outer_out, inner_out)`` or None when the examples do not stay on one axis.
    """
    if outer is None or inner is None:
        return None
    pre = Prod.of(in_dims[:axis], "in").times(outer)
    post = Prod.of(in_dims[axis + 1:], "post").times(inner)
    suffix = Prod()
    for j in range(len(out_dims) - 1, -1, -1):
        inner_out = suffix.divides(post)
        prefix = Prod.of(out_dims[:j], "out")
        outer_out = prefix.divides(pre) if inner_out is not None else None
        if inner_out is not None and outer_out is not None:
            d = out_dims[j]
            io, oo = inner_out.written, outer_out.known
            if io is not None and oo is not None and (d is None or (
                    batch is not None and isinstance(io, int) and isinstance(oo, int)
                    and d == oo * batch * io)):
                return j, oo, io
        if out_dims[j] is None:
            return None
        suffix = suffix.times(out_dims[j])
    return None


def sized_rows(f: Fact, in_dims: list | None, target: tuple, j: int, out_dims: list | None) -> bool:
    """A target whose dimension ``j`` is ``coef`` times the batch size holds ``coef`` rows of
    each example there when what follows it is what follows each example's rows in the input:
    ``coef * prod(target[j+1:]) == block * prod(in_dims[axis+1:])``. What comes before is then
    as many copies of the batch as the input holds (the reshape's own size check sees to
    that): ``[B, T, H]`` to ``[T * B, H]`` rows of each example, a time-major ``[T * B]``
    back to ``[T, B]``. A time-major ``[T, B, H]`` to ``[T * B, H]`` is not that (T copies of
    the batch): taken as T rows of each example, it paired with example-major labels as if they
    were one device's (claimed exact, 0.27 off); the layout mapping finds it."""
    coef = target[j].coef
    if in_dims is None or f.outer is None:
        return False

    def dims(indices) -> list | None:
        out = []
        for i in indices:
            t = target[i]
            if isinstance(t, int) and t == -1:
                t = out_dims[i] if out_dims is not None and i < len(out_dims) else None
            if t is None or isinstance(t, (bool, Sym)):
                return None
            out.append(t)
        return out

    def same(a: Prod, b: Prod) -> bool:
        return a.value == b.value and a.symbols == b.symbols and not any(s.startswith("?") for s in a.symbols)

    # either side suffices: the reshape's size check makes the other equal too
    before, after = dims(range(j)), dims(range(j + 1, len(target)))
    if before is not None and None not in in_dims[:f.axis] and \
            same(Prod.of(before, "t"), Prod.of(in_dims[:f.axis], "i").times(f.outer)):
        return True
    return after is not None and None not in in_dims[f.axis + 1:] and coef is not None \
        and f.block is not None \
        and same(Prod.of(after, "t").times(coef), Prod.of(in_dims[f.axis + 1:], "i").times(f.block))


def strided_entries(rank: int, n: int, ellipsis: int, new_axis: int, shrink: int
                    ) -> list[tuple[int | None, int | None, int | None]]:
    """TensorFlow's sparse-to-dense expansion of a strided slice spec.

    Returns one ``(input dim, output dim, spec index)`` per dimension touched: ``input dim``
    None for a new axis, ``output dim`` None for a shrunk axis, ``spec index`` None for
    dimensions covered by an ellipsis or left implicit at the end.
    """
    consumed = sum(1 for i in range(n) if not (ellipsis >> i) & 1 and not (new_axis >> i) & 1)
    entries: list[tuple[int | None, int | None, int | None]] = []
    din = dout = 0
    for i in range(n):
        if (ellipsis >> i) & 1:
            for _ in range(max(0, rank - consumed)):
                entries.append((din, dout, None))
                din += 1
                dout += 1
        elif (new_axis >> i) & 1:
            entries.append((None, dout, i))
            dout += 1
        elif (shrink >> i) & 1:
            entries.append((din, None, i))
            din += 1
        else:
            entries.append((din, dout, i))
            din += 1
            dout += 1
    while din < rank:
        entries.append((din, dout, None))
        din += 1
        dout += 1
    return entries


def value_pieces(ctx, node, f: Fact, n: int) -> list[tuple] | None:
    """The symbolic values of the pieces of a shape vector ``f`` split by constant sizes (the
    outer dimensions, the frame axis and the inner ones of ``tf.signal.frame``): each keeps
    its elements, so a piece without the batch size is a shared value (it was a batch
    reduction, and a range over a signal's frames was refused as one over the batch)."""
    if f.kind == PART or f.value is None or (ctx.rank(f"{node.name}:0") or 0) > 1:
        return None
    value = list(f.value)
    if node.op == "Split":
        if n <= 0 or len(value) % n:
            return None
        sizes = [len(value) // n] * n
    else:
        sizes = ctx.int_value(node.inputs[1])
        if sizes is None or len(sizes) != n or not all(isinstance(s, int) for s in sizes):
            return None
        sizes = list(sizes)
        if sizes.count(-1) == 1:
            sizes[sizes.index(-1)] = len(value) - (sum(sizes) + 1)
        if any(s < 0 for s in sizes) or sum(sizes) != len(value):
            return None
    starts = [sum(sizes[:i]) for i in range(n)]
    return [tuple(value[s:s + k]) for s, k in zip(starts, sizes)]
