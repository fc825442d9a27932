"""Rules for TensorLists, the accumulators of TF2 (functional) loops and their gradients.

A list's fact is the fact of its elements, marked with the ``list`` handle; an empty list is
the bottom (nothing pushed yet), so the first push decides. Stacking the elements adds a
leading axis; building a list from a tensor unstacks its leading axis, which mixes examples
when that axis is the batch.
"""

from __future__ import annotations

from replicate.batchflow.context import Context
from replicate.batchflow.lattice import (
    EMPTY_LIST,
    LIST,
    MIXED,
    PART,
    RED,
    ROWS,
    SHARED,
    Fact,
    Sym,
    join,
    mixed,
    red,
    shared,
)
from replicate.batchflow.rules.common import taint_of
from replicate.graph.ir import Node

#: Why an element of a list of the batch's rows, read outside a loop over them, is mixed.
PICKED = "an example of the batch picked by its position in a list of the batch's rows"

__all__ = ["empty", "push", "pop", "get", "stack", "from_tensor", "length", "concat"]


def _as_list(fact: Fact) -> Fact:
    return fact.with_(handle=LIST, value=None, index=None)


def _element(fact: Fact, src: str | None = None) -> Fact | None:
    if fact.handle == EMPTY_LIST:
        return None
    if fact.handle == ROWS:
        return mixed(src, PICKED, fact.taint)
    return fact.with_(handle=None)


def empty(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    """``EmptyTensorList``, ``TensorListReserve(shape, n)``: a list reserved with one slot per
    example (``tf.map_fn``'s results) is the batch's rows; one sized by another batch value
    is mixed (each tower's is its own size)."""
    if node.op == "TensorListReserve" and len(ins) > 1 and ins[1].kind != SHARED:
        n = ins[1]
        if n.kind == RED and n.value and len(n.value) == 1 and isinstance(n.value[0], Sym) \
                and n.value[0].coef == 1:
            return [Fact(PART, axis=0, cls=n.value[0].cls, handle=ROWS, taint=n.taint)]
        return [mixed(node.name, "a list sized by a batch value", taint_of(ins))]
    return [shared(handle=EMPTY_LIST, taint=taint_of(ins))]


def push(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    """``TensorListPushBack(list, tensor)``, ``TensorListSetItem(list, index, item)``."""
    lst, item = ins[0], ins[-1]
    element = _element(lst, node.name)
    out = join([element, item.with_(handle=None)], ctx.classes)
    if out is not None and out.kind == PART and item.kind == SHARED:
        ctx.demand(node.inputs[-1], out.axis, out, node)
    return [_as_list(out) if out is not None else lst]


def pop(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact | None]:
    """``TensorListPopBack(list, element_shape)`` -> (list, element)."""
    return [ins[0], _element(ins[0], node.name)]


def get(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact | None]:
    """``TensorListGetItem(list, index, element_shape)``."""
    element = _element(ins[0], node.name)
    return [None if element is None else element.with_(taint=element.taint | taint_of(ins[1:]))]


def stack(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact | None]:
    """``TensorListStack`` and ``TensorListGather``: the elements along a new leading axis."""
    if ins[0].handle == ROWS and node.op == "TensorListStack":
        return [ins[0].with_(handle=None)]
    element = _element(ins[0], node.name)
    if element is None or element.kind != PART:
        return [element]
    return [element.with_(axis=element.axis + 1)]


def from_tensor(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    """``TensorListFromTensor(tensor, shape)``, ``TensorListSplit``, ``TensorListScatter*``: the
    tensor's leading axis becomes the list."""
    value = ins[0]
    if value.kind == PART and value.axis == 0 and node.op == "TensorListFromTensor" and \
            value.block == 1 and value.outer == 1 and value.ordered and not value.filtered \
            and value.tail is None and value.handle is None:
        return [value.with_(handle=ROWS, value=None, index=None)]      # the batch's rows
    if value.kind == PART and value.axis == 0:
        return [mixed(node.name, f"{node.op} along the batch axis", value.taint)]
    if value.kind == PART:
        return [_as_list(value.with_(axis=value.axis - 1))]
    if value.kind == MIXED:
        return [value]
    return [_as_list(value)]


def length(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    if ins[0].handle == ROWS and node.op == "TensorListLength":
        return [red(ins[0].cls, "size", None, value=(Sym(1, ins[0].cls),), taint=ins[0].taint)]
    return [shared(taint=taint_of(ins))]


def concat(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact | None]:
    """``TensorListConcatV2``: elements joined along their leading axis."""
    element = _element(ins[0], node.name)
    if element is not None and element.kind == PART and element.axis == 0:
        element = element.with_(outer=None, ordered=False)
    return [element, shared()]
