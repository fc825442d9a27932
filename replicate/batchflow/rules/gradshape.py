"""Rules for the shape arithmetic of gradient code: ``BroadcastGradientArgs``, ``BroadcastArgs``,
``ConcatOffset``, ``InvertPermutation``.

Their operands are shapes (symbolic values: the batch size as a ``Sym``, named unknown
dimensions as strings); their results are axes, offsets and shapes, the same in every tower
where the shapes are known symbolically, and a tower's own example count where they hold it.
"""

from __future__ import annotations

from replicate.batchflow.context import Context
from replicate.batchflow.lattice import Fact, Sym
from replicate.batchflow.rules.common import mixed, shared, size_fact, taint_of
from replicate.graph.ir import Node

__all__ = ["broadcast_gradient_args", "broadcast_args", "concat_offset", "invert_permutation"]


def _values(ins: list[Fact]) -> list[tuple] | None:
    values = [f.value for f in ins]
    return None if any(v is None for v in values) else values


def broadcast_gradient_args(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    """The axes each operand of a broadcast was expanded along: dimension indices, the same in
    every tower when the shapes are known symbolically."""
    values = _values(ins)
    if values is None:
        return [shared(taint=taint_of(ins))] * 2 if not any(f.dependent for f in ins) else \
            [mixed(node.name, "BroadcastGradientArgs of unknown shapes", taint_of(ins))] * 2
    a, b = values
    _static_partners(ctx, node, values)
    width = max(len(a), len(b))
    a = (1,) * (width - len(a)) + tuple(a)
    b = (1,) * (width - len(b)) + tuple(b)
    ra, rb = [], []
    for i, (x, y) in enumerate(zip(a, b)):
        if x is None or y is None:
            return [mixed(node.name, "BroadcastGradientArgs of unknown dimensions", taint_of(ins))] * 2
        if x == y:
            continue        # equal (a named unknown dimension matches itself)
        if x == 1 and y != 1:
            ra.append(i)
        elif y == 1 and x != 1:
            rb.append(i)
        elif x == 1 and y == 1:
            ra.append(i)
            rb.append(i)
    return [shared(tuple(ra), taint_of(ins)), shared(tuple(rb), taint_of(ins))]


def _static_partners(ctx: Context, node: Node, values: list[tuple]) -> None:
    """Two shapes broadcast together agree where one holds the tower's example count: the
    other's static batch size there (a folded ``Shape`` next to a dynamic one) is a position."""
    width = max(len(v) for v in values)
    for j, (mine, ref) in enumerate(zip(values, node.inputs)):
        pad = width - len(mine)
        for other in values[:j] + values[j + 1:]:
            opad = width - len(other)
            for i in range(width):
                x = mine[i - pad] if i >= pad else 1
                y = other[i - opad] if i >= opad else 1
                if isinstance(y, Sym) and isinstance(x, int) and x != 1:
                    batch = ctx.static_batch(y.cls)
                    if batch is not None and y.coef is not None and x == y.coef * batch:
                        ctx.position(ref, i - pad, y.cls, y.coef, node)


def broadcast_args(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    values = _values(ins)
    if values is None:
        return [mixed(node.name, "BroadcastArgs of unknown shapes", taint_of(ins))] \
            if any(f.dependent for f in ins) else [shared()]
    a, b = values
    _static_partners(ctx, node, values)
    width = max(len(a), len(b))
    a = (1,) * (width - len(a)) + tuple(a)
    b = (1,) * (width - len(b)) + tuple(b)
    return [size_fact(tuple(y if x == 1 else x for x, y in zip(a, b)), taint_of(ins))]


def concat_offset(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    shapes = ins[1:]
    n = ctx.n_outputs(node)
    values = _values(shapes)
    axis = ctx.int_value(node.inputs[0])
    if values is None or axis is None or not isinstance(axis[0], int):
        return [mixed(node.name, "ConcatOffset of unknown shapes", taint_of(ins))] * n \
            if any(f.dependent for f in ins) else [shared()] * n
    out, offset = [], 0
    for value in values:
        vec = [0] * len(value)
        vec[axis[0]] = offset
        out.append(size_fact(tuple(vec), taint_of(ins)))
        step = value[axis[0]]
        if isinstance(offset, int) and isinstance(step, int):
            offset = offset + step
        elif isinstance(step, Sym) and offset == 0:
            offset = step
        elif isinstance(step, Sym) and isinstance(offset, Sym) and step.cls == offset.cls \
                and None not in (step.coef, offset.coef):
            offset = Sym(step.coef + offset.coef, step.cls)
        else:
            offset = None
    return out[:n]


def invert_permutation(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    value = ins[0].value
    if value is not None and all(isinstance(v, int) for v in value) and sorted(value) == list(range(len(value))):
        inverse = [0] * len(value)
        for i, v in enumerate(value):
            inverse[v] = i
        return [shared(tuple(inverse), ins[0].taint)]
    return [ins[0].with_(value=None)]
