"""One op of the graph IR (:class:`Node`), tensor names, and attribute values.

:class:`~replicate.graph.ir.IR` holds the nodes; this module is what a node is and how tensor
references are spelled (``"name:k"``; GraphDef writes output 0 as ``"name"``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from tensorflow.core.framework import attr_value_pb2
from tensorflow.python.framework import dtypes, tensor_util

__all__ = ["Node", "parse_tensor", "tensor_name", "node_of", "make_attr"]


@functools.lru_cache(maxsize=1 << 20)
def parse_tensor(ref: str) -> tuple[str, int]:
    """Split ``"name:k"`` (or ``"name"``) into ``(name, k)``."""
    name, sep, idx = ref.rpartition(":")
    if sep and idx.isdigit():
        return name, int(idx)
    return ref, 0


def tensor_name(node: str, index: int = 0) -> str:
    """The canonical ``name:k`` form of an output."""
    return f"{node}:{index}"


@functools.lru_cache(maxsize=1 << 20)
def node_of(ref: str) -> str:
    """The node name of a tensor reference or control input."""
    return parse_tensor(ref.lstrip("^"))[0]


def _input_ref(node: str, index: int) -> str:
    """How GraphDef spells an input: output 0 without its index."""
    return node if index == 0 else f"{node}:{index}"


@dataclasses.dataclass(eq=False)
class Node:
    """One op of the graph.

    Attributes:
        name: unique node name.
        op: op type (or the name of a library function called as an op).
        inputs: data inputs as ``"name"`` or ``"name:k"``, in order.
        control: names of control inputs (without ``^``), in order.
        device: requested device string ('' for none).
        attrs: attribute name -> ``AttrValue``. Values are shared between clones:
            replace them, never mutate them in place.
    """

    name: str
    op: str
    inputs: list[str]
    control: list[str]
    device: str
    attrs: dict[str, attr_value_pb2.AttrValue]

    def attr(self, key: str, default: Any = None) -> Any:
        """The Python value of attribute ``key`` (str, int, float, bool, DType enum, list, ndarray)."""
        value = self.attrs.get(key)
        if value is None:
            return default
        kind = value.WhichOneof("value")
        if kind == "s":
            return value.s.decode("utf-8", "replace")
        if kind in ("i", "f", "b", "type"):
            return getattr(value, kind)
        if kind == "shape":
            return _shape_to_list(value.shape)
        if kind == "tensor":
            return tensor_util.MakeNdarray(value.tensor)
        if kind == "list":
            lst = value.list
            if lst.s:
                return [s.decode("utf-8", "replace") for s in lst.s]
            for field in ("i", "f", "b", "type"):
                items = getattr(lst, field)
                if items:
                    return list(items)
            if lst.shape:
                return [_shape_to_list(s) for s in lst.shape]
            return []
        if kind == "func":
            return value.func.name
        return default

    def colocation(self) -> list[str]:
        """Node names this node is colocated with (``_class: loc:@name``)."""
        return [c[len("loc:@"):] for c in self.attr("_class", []) if c.startswith("loc:@")]

    def input_tensor(self, i: int) -> tuple[str, int]:
        """(producer, output index) of data input ``i``."""
        return parse_tensor(self.inputs[i])


def _shape_to_list(shape: Any) -> list[int | None] | None:
    if shape.unknown_rank:
        return None
    return [d.size if d.size >= 0 else None for d in shape.dim]


def make_attr(value: Any, kind: str | None = None) -> attr_value_pb2.AttrValue:
    """Build an AttrValue from a Python value.

    Args:
        value: the value; a ``tf.DType`` or DataType enum gives a type attr.
        kind: force ``"type"``, ``"int"``, ``"list(type)"``, ``"list(int)"``,
            ``"list(string)"``, ``"string"``, ``"bool"`` or ``"float"``.
    """
    out = attr_value_pb2.AttrValue()
    if kind == "type" or isinstance(value, dtypes.DType):
        out.type = dtypes.as_dtype(value).as_datatype_enum
    elif kind == "list(type)":
        out.list.type.extend(dtypes.as_dtype(v).as_datatype_enum for v in value)
    elif kind == "list(int)":
        out.list.i.extend(int(v) for v in value)
    elif kind == "list(string)":
        out.list.s.extend(v.encode() for v in value)
    elif isinstance(value, bool) or kind == "bool":
        out.b = bool(value)
    elif isinstance(value, int) or kind == "int":
        out.i = int(value)
    elif isinstance(value, float) or kind == "float":
        out.f = float(value)
    elif isinstance(value, str) or kind == "string":
        out.s = value.encode()
    elif isinstance(value, bytes):
        out.s = value
    elif isinstance(value, attr_value_pb2.AttrValue):
        out.CopyFrom(value)
    else:
        raise TypeError(f"cannot make an attr from {value!r}")
    return out
