"""Check NodeDefs against TensorFlow's op registry before TensorFlow sees them.

TensorFlow's importer trusts NodeDefs; some malformed ones abort the process instead of
raising. Every node is checked here first: the op exists (or is a library function), each
attribute the op requires is present with the right kind, and the number of data inputs
matches the op's signature. Then the graph is imported into a scratch ``tf.Graph`` (for
static shapes), with any TensorFlow error turned into an :class:`InputError`.
"""

from __future__ import annotations

import logging

from tensorflow.core.framework import graph_pb2
from tensorflow.python.framework import op_def_registry

from replicate.errors import InputError

__all__ = ["check_graph_def", "import_checked"]

log = logging.getLogger(__name__)

_KIND_FIELD = {"type": "type", "int": "i", "float": "f", "bool": "b", "string": "s",
               "shape": "shape", "tensor": "tensor", "func": "func"}


def _expected_inputs(node, op_def) -> int | None:
    total = 0
    for arg in op_def.input_arg:
        if arg.number_attr:
            if arg.number_attr not in node.attr:
                return None
            total += node.attr[arg.number_attr].i
        elif arg.type_list_attr:
            if arg.type_list_attr not in node.attr:
                return None
            total += len(node.attr[arg.type_list_attr].list.type)
        else:
            total += 1
    return total


def check_graph_def(graph_def: graph_pb2.GraphDef, origin: str) -> None:
    """Raise InputError naming the first node that does not match the op registry."""
    functions = {f.signature.name: f.signature for f in graph_def.library.function}
    names: set[str] = set()
    for node in graph_def.node:
        if node.name in names:
            raise InputError(f"{origin}: duplicate node name '{node.name}'")
        names.add(node.name)
    for node in graph_def.node:
        op_def = functions.get(node.op) or op_def_registry.get(node.op)
        if op_def is None:
            raise InputError(f"{origin}: node '{node.name}' has unknown op type '{node.op}'")
        if node.op in functions:
            continue
        for attr in op_def.attr:
            if attr.name not in node.attr:
                if not attr.HasField("default_value"):
                    raise InputError(f"{origin}: node '{node.name}' ({node.op}) lacks required "
                                     f"attribute '{attr.name}'")
                continue
            value = node.attr[attr.name]
            kind = value.WhichOneof("value")
            want = "list" if attr.type.startswith("list(") else _KIND_FIELD.get(attr.type)
            if want is not None and kind not in (want, "placeholder") and not (
                    want == "list" and kind is None):
                raise InputError(f"{origin}: node '{node.name}' ({node.op}) attribute "
                                 f"'{attr.name}' should be {attr.type}, not {kind or 'empty'}")
        data = [i for i in node.input if not i.startswith("^")]
        expected = _expected_inputs(node, op_def)
        if expected is not None and len(data) != expected:
            raise InputError(f"{origin}: node '{node.name}' ({node.op}) has {len(data)} data inputs, "
                             f"expected {expected}")
        for ref in node.input:
            target = ref.lstrip("^").rsplit(":", 1)[0] if ":" in ref else ref.lstrip("^")
            if target not in names:
                raise InputError(f"{origin}: node '{node.name}' reads '{ref}', which does not exist")


def import_checked(graph_def: graph_pb2.GraphDef, origin: str):
    """Check ``graph_def`` and import it into a new tf.Graph; InputError on any failure."""
    import tensorflow as tf

    check_graph_def(graph_def, origin)
    graph = tf.Graph()
    try:
        with graph.as_default():
            tf.graph_util.import_graph_def(graph_def, name="")
    except (ValueError, TypeError, KeyError, tf.errors.OpError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InputError(f"{origin}: TensorFlow cannot import the graph: {first}") from None
    return graph
