"""Rules for TensorLists, the accumulators of TF2 (functional) loops and their gradients.

A list's fact is the fact of its elements, marked with the ``list`` handle; an empty list is
the bottom (nothing pushed yet), so the first push decides. Stacking the elements adds a
leading axis; building a list from a tensor unstacks its leading axis, which mixes examples
when that axis is the batch.
"""

from __future__ import annotations

from replicate.batchflow.context import Context
from replicate.batchflow.lattice import EMPTY_LIST, LIST, MIXED, PART, SHARED, Fact, join, mixed, shared
from replicate.batchflow.rules.common import taint_of
from replicate.ir import Node

__all__ = ["empty", "push", "pop", "get", "stack", "from_tensor", "length", "concat"]


def _as_list(fact: Fact) -> Fact:
    return fact.with_(handle=LIST, value=None, index=None)


def _element(fact: Fact) -> Fact | None:
    if fact.handle == EMPTY_LIST:
        return None
    return fact.with_(handle=None)


def empty(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    return [shared(handle=EMPTY_LIST, taint=taint_of(ins))]


def push(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    """``TensorListPushBack(list, tensor)``, ``TensorListSetItem(list, index, item)``."""
    lst, item = ins[0], ins[-1]
    element = _element(lst)
    out = join([element, item.with_(handle=None)], ctx.classes)
    if out is not None and out.kind == PART and item.kind == SHARED:
        ctx.demand(node.inputs[-1], out.axis, out, node)
    return [_as_list(out) if out is not None else lst]


def pop(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact | None]:
    """``TensorListPopBack(list, element_shape)`` -> (list, element)."""
    return [ins[0], _element(ins[0])]


def get(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact | None]:
    """``TensorListGetItem(list, index, element_shape)``."""
    element = _element(ins[0])
    return [None if element is None else element.with_(taint=element.taint | taint_of(ins[1:]))]


def stack(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact | None]:
    """``TensorListStack`` and ``TensorListGather``: the elements along a new leading axis."""
    element = _element(ins[0])
    if element is None or element.kind != PART:
        return [element]
    return [element.with_(axis=element.axis + 1)]


def from_tensor(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    """``TensorListFromTensor(tensor, shape)``, ``TensorListSplit``, ``TensorListScatter*``: the
    tensor's leading axis becomes the list."""
    value = ins[0]
    if value.kind == PART and value.axis == 0:
        return [mixed(node.name, f"{node.op} along the batch axis", value.taint)]
    if value.kind == PART:
        return [_as_list(value.with_(axis=value.axis - 1))]
    if value.kind == MIXED:
        return [value]
    return [_as_list(value)]


def length(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact]:
    return [shared(taint=taint_of(ins))]


def concat(ctx: Context, node: Node, ins: list[Fact]) -> list[Fact | None]:
    """``TensorListConcatV2``: elements joined along their leading axis."""
    element = _element(ins[0])
    if element is not None and element.kind == PART and element.axis == 0:
        element = element.with_(outer=None, ordered=False)
    return [element, shared()]
