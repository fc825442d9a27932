"""Check NodeDefs against TensorFlow's op registry before TensorFlow sees them.

TensorFlow's importer trusts NodeDefs; some malformed ones abort the process instead of
raising (a function that calls itself segfaults the importer), and many others raise
errors that do not say which node is at fault. :func:`check_graph_def` looks at every
node first: names, the op (registered or a library function), each attribute's presence,
kind, enum value, allowed values and minimum, tensors and shapes, devices, colocation,
input syntax and counts, output indexes and cycles; then the function library (names,
bodies, no recursion). :func:`import_checked` then imports the graph into a scratch
``tf.Graph`` with any TensorFlow error turned into a one-line :class:`InputError`;
:func:`check_message_size` turns protobuf's 2 GiB limit into a clear error.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import re
from typing import Any

import networkx as nx
from google.protobuf.message import EncodeError
from tensorflow.core.framework import graph_pb2, types_pb2
from tensorflow.python.framework import op_def_registry

from replicate.errors import InputError, OutputError

__all__ = ["cpp_import", "check_graph_def", "import_checked", "import_error", "check_message_size",
           "called_functions", "PROTOBUF_LIMIT", "MAX_RANK"]

log = logging.getLogger(__name__)

#: Protobuf refuses to serialize or parse messages of 2 GiB or more.
PROTOBUF_LIMIT = (1 << 31) - 1
#: TensorFlow's largest tensor rank (``TensorShape::MaxDimensions``).
MAX_RANK = 254

_NAME = re.compile(r"[A-Za-z0-9.][A-Za-z0-9_.\-/>]*\Z")
_KIND_FIELD = {"type": "type", "int": "i", "float": "f", "bool": "b", "string": "s",
               "shape": "shape", "tensor": "tensor", "func": "func"}
_DTYPES = frozenset(v for v in types_pb2.DataType.values() if 0 < v < 100)
_BACK_EDGE_OPS = ("NextIteration", "RefNextIteration")
#: Tensors larger than this are not copied out of the proto to count their values.
_COPY_LIMIT = 16 << 20


def _fail(origin: str, node, what: str) -> InputError:
    return InputError(f"{origin}: node '{node.name}' ({node.op}) {what}")


@functools.lru_cache(maxsize=256)
def _device_error(device: str) -> str | None:
    import tensorflow as tf

    try:
        tf.DeviceSpec.from_string(device)
    except (ValueError, TypeError) as exc:
        return str(exc).splitlines()[0] if str(exc) else "malformed"
    return None


def _dtype_bytes(dtype: int) -> int:
    from tensorflow.python.framework import dtypes

    try:
        return max(dtypes.as_dtype(dtype).size, 1)
    except (TypeError, ValueError):
        return 1


def _shape_error(shape, full: bool) -> str | None:
    """Why a TensorShapeProto is malformed (``full``: every dimension known), or None."""
    if shape.unknown_rank:
        return "has an unknown rank but lists dimensions" if shape.dim else (
            "has an unknown rank" if full else None)
    if len(shape.dim) > MAX_RANK:
        return f"has rank {len(shape.dim)}, above TensorFlow's limit of {MAX_RANK}"
    for d in shape.dim:
        if d.size < (0 if full else -1):
            return f"has dimension {d.size}"
    return None


def _tensor_error(tensor) -> str | None:
    """Why a TensorProto cannot be a valid tensor, or None."""
    if tensor.dtype not in _DTYPES:
        return f"has invalid dtype {tensor.dtype}"
    problem = _shape_error(tensor.tensor_shape, full=True)
    if problem:
        return f"shape {problem}"
    count = 1
    for d in tensor.tensor_shape.dim:
        count *= d.size
    nbytes = count * _dtype_bytes(tensor.dtype)
    if nbytes > PROTOBUF_LIMIT:
        return f"declares {nbytes / (1 << 30):.1f} GiB, more than a GraphDef can hold"
    if nbytes > _COPY_LIMIT:  # reading the contents would copy them; TensorFlow checks them
        return None
    if tensor.tensor_content:
        if tensor.dtype in (types_pb2.DT_STRING, types_pb2.DT_VARIANT, types_pb2.DT_RESOURCE):
            return "stores a string, variant or resource tensor as raw bytes"
        if len(tensor.tensor_content) != nbytes:
            return f"holds {len(tensor.tensor_content)} bytes for a {nbytes}-byte shape"
        return None
    for field, value in tensor.ListFields():
        if field.name.endswith("_val") and len(value) > count * (2 if "complex" in field.name else 1):
            return f"holds {len(value)} values in {field.name} for {count} elements"
    return None


@dataclasses.dataclass(frozen=True)
class _Rule:
    """One attribute of an op, digested for fast checks."""

    name: str
    type: str
    base: str
    is_list: bool
    required: bool
    minimum: int | None
    allowed: frozenset


@dataclasses.dataclass(frozen=True)
class _Op:
    """An OpDef (or a function signature) digested for fast checks."""

    op_def: Any
    known: frozenset[str]
    rules: tuple[_Rule, ...]
    inputs: int | None
    outputs: int | None


def _compile(op_def) -> _Op:
    rules = []
    for a in op_def.attr:
        is_list = a.type.startswith("list(")
        allowed = a.allowed_values.list
        rules.append(_Rule(a.name, a.type, a.type[5:-1] if is_list else a.type, is_list,
                           not a.HasField("default_value"), a.minimum if a.has_minimum else None,
                           frozenset(allowed.type) | frozenset(allowed.s)))

    def fixed(args) -> int | None:
        return None if any(x.number_attr or x.type_list_attr for x in args) else len(args)
    return _Op(op_def, frozenset(a.name for a in op_def.attr), tuple(rules),
               fixed(op_def.input_arg), fixed(op_def.output_arg))


@functools.lru_cache(maxsize=None)
def _registered(op: str) -> _Op | None:
    op_def = op_def_registry.get(op)
    return None if op_def is None else _compile(op_def)


def _attr_error(rule: _Rule, value, in_function: bool, functions) -> str | None:
    """Why ``value`` does not fit the op's attribute ``rule``, or None."""
    kind = value.WhichOneof("value")
    if kind == "placeholder":
        return None if in_function else "is an unresolved placeholder"
    field = _KIND_FIELD.get(rule.base)
    want = "list" if rule.is_list else field
    if want is not None and kind != want and not (rule.is_list and kind is None):
        return f"should be {rule.type}, not {kind or 'empty'}"
    if rule.is_list:
        others = [f.name for f, _ in value.list.ListFields() if f.name != field]
        if others:
            return f"should be {rule.type}, not a list of {others[0]}"
        items = list(getattr(value.list, field)) if field else []
        if rule.minimum is not None and len(items) < rule.minimum:
            return f"has {len(items)} items, fewer than {rule.minimum}"
    else:
        items = [getattr(value, field)] if field else []
        if rule.base == "int" and rule.minimum is not None and value.i < rule.minimum:
            return f"is {value.i}, below its minimum {rule.minimum}"
    for item in items:
        if rule.base == "type":
            if item not in _DTYPES:
                return f"holds invalid DataType {item}"
            if rule.allowed and item not in rule.allowed:
                return f"holds type {types_pb2.DataType.Name(item)}, which the op does not allow"
        elif rule.base == "string" and rule.allowed and item not in rule.allowed:
            return f"is {item[:40]!r}, not one of the allowed values"
        elif rule.base == "shape":
            problem = _shape_error(item, full=False)
            if problem:
                return f"shape {problem}"
        elif rule.base == "tensor":
            problem = _tensor_error(item)
            if problem:
                return f"tensor {problem}"
        elif rule.base == "func" and item.name not in functions and _registered(item.name) is None:
            return f"names function '{item.name}', which the library does not define"
    return None


def _arity(node, args, fixed: int | None) -> int | None:
    """Number of tensors ``args`` (input_arg or output_arg of an OpDef) take on ``node``."""
    if fixed is not None:
        return fixed
    total = 0
    for arg in args:
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


def _check_node(node, origin: str, ops: dict, functions, in_function: bool = False) -> _Op:
    """Raise InputError when ``node`` does not match its op's definition; return the op."""
    spec = ops.get(node.op) or _registered(node.op)
    if spec is None:
        raise _fail(origin, node, f"has unknown op type '{node.op}'")
    attrs = node.attr
    for key in attrs:
        if key not in spec.known and key[:1] != "_" and node.op not in ops:
            raise _fail(origin, node, f"has attribute '{key}', which {node.op} does not define")
    if "_class" in attrs and (attrs["_class"].WhichOneof("value") not in ("list", None) or any(
            f.name != "s" for f, _ in attrs["_class"].list.ListFields())):
        raise _fail(origin, node, "attribute '_class' should be a list of strings")
    for rule in spec.rules:
        if rule.name not in attrs:
            if rule.required:
                raise _fail(origin, node, f"lacks required attribute '{rule.name}'")
            continue
        problem = _attr_error(rule, attrs[rule.name], in_function, functions)
        if problem:
            raise _fail(origin, node, f"attribute '{rule.name}' {problem}")
    if node.op == "Const" and not in_function and "value" in attrs and "dtype" in attrs and (
            attrs["value"].tensor.dtype != attrs["dtype"].type):
        raise _fail(origin, node, "attribute 'value' has a dtype other than attribute 'dtype'")
    if node.device and not in_function and _device_error(node.device):
        raise _fail(origin, node, f"has malformed device '{node.device}': {_device_error(node.device)}")
    return spec


def _check_inputs(node, origin: str, nodes: dict, specs: dict) -> None:
    """Input syntax, order, counts, producers and output indexes of a graph node."""
    data, seen_control = 0, False
    for ref in node.input:
        if ref[:1] == "^":
            seen_control = True
            if ref[1:] not in nodes:
                raise _fail(origin, node, f"waits for '{ref[1:]}', which does not exist")
            continue
        if seen_control:
            raise _fail(origin, node, f"lists data input '{ref}' after a control input")
        name, sep, index = ref.rpartition(":")
        name, index = (name, index) if sep else (ref, "0")
        if not index.isdigit() or name not in nodes:
            raise _fail(origin, node, f"reads '{ref}', which does not exist")
        producer = nodes[name]
        spec = specs[name]
        outputs = _arity(producer, spec.op_def.output_arg, spec.outputs)
        if outputs is not None and int(index) >= outputs:
            raise _fail(origin, node, f"reads output {int(index)} of '{name}', which has {outputs}")
        data += 1
    spec = specs[node.name]
    expected = _arity(node, spec.op_def.input_arg, spec.inputs)
    if expected is not None and data != expected:
        raise _fail(origin, node, f"has {data} data inputs, expected {expected}")
    for loc in node.attr["_class"].list.s if "_class" in node.attr else ():
        target = loc.decode("utf-8", "replace")
        if target.startswith("loc:@") and target[5:] not in nodes:
            raise _fail(origin, node, f"is colocated with '{target[5:]}', which does not exist")


def _check_cycles(graph_def: graph_pb2.GraphDef, origin: str, nodes: dict) -> None:
    edges = []
    for node in graph_def.node:
        for ref in node.input:
            producer = ref.lstrip("^").rpartition(":")[0] if ":" in ref else ref.lstrip("^")
            if nodes[producer].op not in _BACK_EDGE_OPS:
                edges.append((producer, node.name))
    graph = nx.DiGraph(edges)
    if nx.is_directed_acyclic_graph(graph):
        return
    cycle = nx.find_cycle(graph)
    path = " -> ".join([u for u, _ in cycle[:6]] + [cycle[0][0] if len(cycle) <= 6 else "..."])
    raise InputError(f"{origin}: node '{cycle[0][0]}' is on a cycle ({path})")


def _check_library(graph_def: graph_pb2.GraphDef, origin: str, ops: dict, functions) -> None:
    calls = nx.DiGraph()
    for fdef in graph_def.library.function:
        name = fdef.signature.name
        where = f"{origin}: function '{name}'"
        if not _NAME.match(name or "-") and not name.startswith("_"):
            raise InputError(f"{where} has an invalid name")
        if _registered(name) is not None:
            raise InputError(f"{where} has the name of a TensorFlow op")
        for arg in list(fdef.signature.input_arg) + list(fdef.signature.output_arg):
            if arg.type and arg.type not in _DTYPES:
                raise InputError(f"{where} argument '{arg.name}' has invalid type {arg.type}")
        inner = {a.name for a in fdef.signature.input_arg}
        for node in fdef.node_def:
            if node.name in inner or not node.name:
                raise InputError(f"{where} has a duplicate or empty node name '{node.name}'")
            inner.add(node.name)
        for node in fdef.node_def:
            _check_node(node, where, ops, functions, in_function=True)
            for ref in node.input:
                if ref.lstrip("^").split(":", 1)[0] not in inner:
                    raise _fail(where, node, f"reads '{ref}', which does not exist")
            calls.add_edges_from((name, c) for c in called_functions(node.op, node.attr, functions))
        for ret in fdef.ret.values():
            if ret.split(":", 1)[0] not in inner:
                raise InputError(f"{where} returns '{ret}', which does not exist")
    for grad in graph_def.library.gradient:
        if grad.gradient_func not in functions:
            raise InputError(f"{origin}: gradient of '{grad.function_name}' names missing "
                             f"function '{grad.gradient_func}'")
    if nx.is_directed_acyclic_graph(calls):
        return
    cycle = nx.find_cycle(calls)
    path = " -> ".join([u for u, _ in cycle] + [cycle[0][0]])
    raise InputError(f"{origin}: function '{cycle[0][0]}' calls itself ({path}); TensorFlow "
                     "does not support recursive functions")


def called_functions(op: str, attrs, functions) -> list[str]:
    """Names in ``functions`` that a node of type ``op`` with attributes ``attrs`` calls
    (as its op type or through ``func`` and ``list(func)`` attributes)."""
    out = [op] if op in functions else []
    for value in attrs.values():
        kind = value.WhichOneof("value")
        if kind == "func":
            out.append(value.func.name)
        elif kind == "list":
            out.extend(f.name for f in value.list.func)
    return [c for c in out if c in functions]


def check_graph_def(graph_def: graph_pb2.GraphDef, origin: str) -> None:
    """Raise a one-line InputError naming the first node or function that TensorFlow would
    reject, or that could abort TensorFlow's importer.

    Args:
        graph_def: the graph to check (not modified).
        origin: the file or object it came from, first in every message.
    """
    if _estimated_bytes(graph_def) > PROTOBUF_LIMIT // 2:  # sizing a message serializes it
        check_message_size(graph_def, origin, InputError)
    functions: dict = {}
    for fdef in graph_def.library.function:
        if fdef.signature.name in functions:
            raise InputError(f"{origin}: the library defines function '{fdef.signature.name}' twice")
        functions[fdef.signature.name] = fdef.signature
    ops = {name: _compile(signature) for name, signature in functions.items()}
    nodes: dict = {}
    for node in graph_def.node:
        if node.name in nodes:
            raise InputError(f"{origin}: duplicate node name '{node.name}'")
        if not _NAME.match(node.name):
            raise InputError(f"{origin}: node name {node.name[:80]!r} has invalid characters")
        nodes[node.name] = node
    specs = {node.name: _check_node(node, origin, ops, functions) for node in graph_def.node}
    for node in graph_def.node:
        _check_inputs(node, origin, nodes, specs)
    _check_library(graph_def, origin, ops, functions)
    _check_cycles(graph_def, origin, nodes)


def _estimated_bytes(graph_def: graph_pb2.GraphDef) -> int:
    """A cheap estimate of the serialized size: constants' declared bytes, plus a little per node."""
    total = 256 * len(graph_def.node)
    for node in graph_def.node:
        if node.op == "Const" and "value" in node.attr:
            tensor = node.attr["value"].tensor
            count = 1
            for d in tensor.tensor_shape.dim:
                count *= max(d.size, 0)
            total += count * _dtype_bytes(tensor.dtype)
    return total + sum(len(f.node_def) * 256 for f in graph_def.library.function)


def check_message_size(message, what: str, error: type = OutputError) -> int:
    """Return ``message.ByteSize()``; raise ``error`` when protobuf cannot serialize it.

    Protobuf messages are limited to 2 GiB. A graph above it (usually large constants
    such as embedding tables, or many towers of a big model) cannot be written as one
    file; keep large values in variables restored from a checkpoint instead.
    """
    try:
        size = message.ByteSize()
    except (EncodeError, ValueError):  # upb will not even size a message over the limit
        size = None
    if size is None or size > PROTOBUF_LIMIT:
        amount = "over 2 GiB" if size is None else f"{size / (1 << 30):.2f} GiB"
        raise error(f"{what}: the graph is {amount}, above protobuf's 2 GiB limit; move large "
                    "constants into variables restored from a checkpoint")
    return size


def import_error(origin: str, exc: Exception) -> InputError:
    """The one-line InputError for TensorFlow's error ``exc`` on importing ``origin``."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return InputError(f"{origin}: TensorFlow cannot import the graph: {text[:300]}")


def import_checked(graph_def: graph_pb2.GraphDef, origin: str):
    """Check ``graph_def`` and import it into a new tf.Graph; InputError on any failure."""
    import tensorflow as tf

    check_graph_def(graph_def, origin)
    graph = tf.Graph()
    try:
        with graph.as_default():
            tf.graph_util.import_graph_def(graph_def, name="")
    except (ValueError, TypeError, KeyError, tf.errors.OpError) as exc:
        raise import_error(origin, exc) from None
    return graph


def cpp_import(graph_def: graph_pb2.GraphDef) -> None:
    """Import ``graph_def`` with TensorFlow's C++ importer (op signatures, input types, shape
    inference) without building Python objects: as strict as a Python import and several
    times faster. Raises TensorFlow's own error (ValueError or OpError) on failure."""
    import tensorflow as tf
    from tensorflow.python.client import pywrap_tf_session as c_api
    from tensorflow.python.framework import c_api_util

    options = c_api_util.ScopedTFImportGraphDefOptions()
    buffer = c_api.TF_NewBufferFromString(graph_def.SerializeToString())
    try:
        with tf.Graph()._c_graph.get() as c_graph:  # noqa: SLF001 - what TF's importer fills
            results = c_api.TF_GraphImportGraphDefWithResults(c_graph, buffer, options.options)
        c_api_util.ScopedTFImportGraphDefResults(results)
    finally:
        c_api.TF_DeleteBuffer(buffer)
