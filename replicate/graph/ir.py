"""The graph IR: with :mod:`replicate.graph.node`, the only code that reads or writes NodeDef protos.

An :class:`IR` holds the nodes of one GraphDef in graph order, keeps data inputs and
control inputs apart, and indexes consumers so passes can rewire in O(1). Passes
change the graph only through its methods. Facts that passes hand to later passes
(the analysis, the split tensors, the aggregates) live in ``ir.facts``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any

import networkx as nx
import numpy as np
from tensorflow.core.framework import attr_value_pb2, graph_pb2, node_def_pb2, types_pb2
from tensorflow.core.protobuf import meta_graph_pb2
from tensorflow.python.framework import dtypes, op_def_registry, tensor_util

from replicate.errors import InputError
from replicate.graph import hubs as _hubs
from replicate.graph.node import Node, _input_ref, make_attr, node_of, parse_tensor, tensor_name

__all__ = ["IR", "Node", "parse_tensor", "tensor_name", "node_of", "make_attr"]

log = logging.getLogger(__name__)

RESOURCE = types_pb2.DT_RESOURCE


class IR:
    """A mutable graph of :class:`Node` objects with consumer indexes.

    Build one with :meth:`from_graph_def`; write it back with :meth:`to_graph_def`.
    """

    def __init__(self) -> None:
        self.nodes: dict[str, Node] = {}
        self._consumers: dict[str, dict[str, None]] = {}
        self.library = None
        self.versions = None
        self.meta: meta_graph_pb2.MetaGraphDef | None = None
        self.static_shapes: dict[str, list[list[int | None] | None]] = {}
        #: A function body's resource and TensorList arguments -> what they hold
        #: (``batchflow.bodies.Probe``), for the shapes of the bodies nested in it.
        self.probes: dict = {}
        self.facts: dict[str, Any] = {}
        self._functions: dict[str, Any] = {}
        self._types: dict[str, tuple] = {}
        self.tf_graph: Any = None

    # ------------------------------------------------------------------ build / write
    @classmethod
    def from_graph_def(cls, graph_def: graph_pb2.GraphDef,
                       meta: meta_graph_pb2.MetaGraphDef | None = None, *,
                       hubs: bool = False) -> IR:
        """Build an IR from a GraphDef (and the rest of its MetaGraphDef, if any).

        With ``hubs``, control sets that many nodes share go through one hub node each
        (:mod:`replicate.graph.hubs`); :meth:`to_graph_def` writes their members back.
        """
        ir = cls()
        ir.library = graph_def.library
        ir.versions = graph_def.versions
        ir._functions = {f.signature.name: f for f in graph_def.library.function}
        if meta is not None:
            ir.meta = meta_graph_pb2.MetaGraphDef()
            ir.meta.CopyFrom(meta)
            ir.meta.ClearField("graph_def")
        parsed = []
        for nd in graph_def.node:
            inputs, control = [], []
            for ref in nd.input:
                if ref.startswith("^"):
                    control.append(ref[1:])
                else:
                    inputs.append(ref)
            parsed.append((nd, inputs, control))
        members, names = _hubs.plan([(nd.name, nd.op, control) for nd, _, control in parsed]) \
            if hubs else ([], [])
        pending = dict(zip(names, members))
        for nd, inputs, control in parsed:
            if nd.name in ir.nodes:
                raise InputError(f"duplicate node name '{nd.name}' in the input graph")
            if members and len(control) >= _hubs.MIN_MEMBERS:
                control = _hubs.substitute(control, members, names)
                for hub in [c for c in control if c in pending]:
                    ir._insert(Node(hub, "NoOp", [], list(pending.pop(hub)), "", _hubs.hub_attrs()))
            ir._insert(Node(nd.name, nd.op, inputs, control, nd.device,
                            {k: v for k, v in nd.attr.items() if k != "_output_shapes"}))
        return ir

    def to_graph_def(self) -> graph_pb2.GraphDef:
        """Serialize the IR to a new GraphDef, in IR order; hubs give way to their members."""
        gd = graph_pb2.GraphDef()
        hub_control = {n.name: n.control for n in self.nodes.values() if _hubs.is_hub(n.attrs)}
        if self.versions is not None:
            gd.versions.CopyFrom(self.versions)
        if self.library is not None:
            gd.library.CopyFrom(self.library)
        for node in self.nodes.values():
            if hub_control and node.name in hub_control:
                continue
            control = node.control
            if hub_control and any(c in hub_control for c in control):
                control = _hubs.expand(control, hub_control)
            nd = gd.node.add()
            nd.name = node.name
            nd.op = node.op
            nd.input.extend(node.inputs)
            nd.input.extend("^" + c for c in control)
            if node.device:
                nd.device = node.device
            for key in sorted(node.attrs):
                nd.attr[key].CopyFrom(node.attrs[key])
        return gd

    def _insert(self, node: Node) -> None:
        self.nodes[node.name] = node
        self._consumers.setdefault(node.name, {})
        for ref in node.inputs:
            self._consumers.setdefault(node_of(ref), {})[node.name] = None
        for ctl in node.control:
            self._consumers.setdefault(ctl, {})[node.name] = None

    # ------------------------------------------------------------------ queries
    def __contains__(self, name: str) -> bool:
        return name in self.nodes

    def __iter__(self) -> Iterator[Node]:
        return iter(list(self.nodes.values()))

    def __len__(self) -> int:
        return len(self.nodes)

    def node(self, name: str) -> Node:
        """The node called ``name`` (KeyError if absent)."""
        return self.nodes[name]

    def consumers(self, name: str) -> list[Node]:
        """Nodes that read any output of ``name`` or depend on it by control edge."""
        return [self.nodes[c] for c in self._consumers.get(name, ()) if c in self.nodes]

    def data_consumers(self, ref: str) -> list[tuple[Node, int]]:
        """(consumer, input position) pairs reading tensor ``ref``."""
        target = parse_tensor(ref)
        out = []
        for node in self.consumers(target[0]):
            for i, inp in enumerate(node.inputs):
                if parse_tensor(inp) == target:
                    out.append((node, i))
        return out

    def edge_count(self) -> int:
        """Number of data and control edges."""
        return sum(len(n.inputs) + len(n.control) for n in self.nodes.values())

    def op_def(self, op_type: str):
        """The OpDef of ``op_type`` from TensorFlow's registry, or a library function's signature."""
        if op_type in self._functions:
            return self._functions[op_type].signature
        return op_def_registry.get(op_type)

    def function(self, name: str):
        """The FunctionDef called ``name`` in the graph's library, or None."""
        return self._functions.get(name)

    def add_function(self, fdef) -> str:
        """Add FunctionDef ``fdef`` to the library (once: a name already there is kept)."""
        from tensorflow.core.framework import function_pb2

        name = fdef.signature.name
        if name not in self._functions:
            if self.library is None:
                self.library = function_pb2.FunctionDefLibrary()
            self.library.function.append(fdef)
            self._functions[name] = self.library.function[-1]
        return name

    def arg_index(self, node: Node, arg_name: str) -> int | None:
        """Position in ``node.inputs`` of the first tensor of input argument ``arg_name``."""
        op_def = self.op_def(node.op)
        if op_def is None:
            return None
        pos = 0
        for arg in op_def.input_arg:
            if arg.name == arg_name:
                return pos
            pos += self._arg_len(node, arg)
        return None

    def _arg_len(self, node: Node, arg) -> int:
        if arg.number_attr:
            return int(node.attr(arg.number_attr, 0))
        if arg.type_list_attr:
            return len(node.attr(arg.type_list_attr, []) or [])
        return 1

    def output_types(self, node: Node) -> list[tuple[int, bool]]:
        """The outputs of ``node`` as (DataType enum, is_ref) pairs, from the op registry.

        Cached per node while its attributes are unchanged (they are replaced, never mutated).
        """
        cached = self._types.get(node.name)
        if cached is not None and cached[0] is node.attrs and cached[1] == node.op:
            return cached[2]
        out = self._output_types(node)
        self._types[node.name] = (node.attrs, node.op, out)
        return out

    def _output_types(self, node: Node) -> list[tuple[int, bool]]:
        op_def = self.op_def(node.op)
        if op_def is None:
            return []
        out: list[tuple[int, bool]] = []
        for arg in op_def.output_arg:
            if arg.type_list_attr:
                types = node.attr(arg.type_list_attr, []) or []
                out.extend((t, arg.is_ref) for t in types)
                continue
            dtype = arg.type if arg.type else node.attr(arg.type_attr, types_pb2.DT_INVALID)
            out.extend([(dtype, arg.is_ref)] * (int(node.attr(arg.number_attr, 0)) if arg.number_attr else 1))
        return out

    def output_dtype(self, ref: str) -> int:
        """DataType enum of tensor ``ref`` (DT_INVALID if unknown)."""
        name, idx = parse_tensor(ref)
        types = self.output_types(self.nodes[name])
        return types[idx][0] if idx < len(types) else types_pb2.DT_INVALID

    def is_handle(self, ref: str) -> bool:
        """True when tensor ``ref`` is a resource handle or a ref-typed output."""
        name, idx = parse_tensor(ref)
        types = self.output_types(self.nodes[name])
        if idx >= len(types):
            return False
        dtype, is_ref = types[idx]
        return is_ref or dtype == RESOURCE

    def static_shape(self, ref: str) -> list[int | None] | None:
        """Static shape of ``ref`` as inferred for the input graph (None if unknown rank)."""
        name, idx = parse_tensor(ref)
        shapes = self.static_shapes.get(name)
        if not shapes or idx >= len(shapes):
            return None
        return shapes[idx]

    def load_static_shapes(self, graph: Any) -> None:
        """Record the static output shapes TensorFlow inferred for ``graph`` (a tf.Graph
        holding the same nodes as this IR)."""
        for op in graph.get_operations():
            if op.name in self.nodes:
                self.static_shapes[op.name] = [
                    t.shape.as_list() if t.shape.rank is not None else None for t in op.outputs]

    def const_value(self, name: str) -> np.ndarray | None:
        """The value of a Const node, else None."""
        node = self.nodes.get(name)
        if node is None or node.op != "Const":
            return None
        return node.attr("value")

    def to_networkx(self, control: bool = True) -> nx.DiGraph:
        """A DiGraph with an edge producer -> consumer for every data (and control) edge."""
        graph = nx.DiGraph()
        graph.add_nodes_from(self.nodes)
        graph.add_edges_from((node_of(ref), node.name) for node in self.nodes.values()
                             for ref in node.inputs)
        if control:
            graph.add_edges_from((ctl, node.name) for node in self.nodes.values()
                                 for ctl in node.control)
        return graph

    def ancestors(self, targets: Iterable[str], graph: nx.DiGraph | None = None,
                  stop: Iterable[str] = (), control: bool = True) -> set[str]:
        """All nodes with a path (data, and with ``control`` control) into ``targets``, targets
        included. Walks ``graph`` (a view from :meth:`to_networkx`, ``control`` ignored) when
        one is given, else the nodes' own inputs, with no view built.

        Nodes in ``stop`` are included but not walked through.
        """
        if graph is not None:
            known, predecessors = graph.__contains__, graph.predecessors
        else:
            known = self.nodes.__contains__

            def predecessors(name: str) -> list[str]:
                node = self.nodes.get(name)
                refs = () if node is None else node.inputs + node.control if control else node.inputs
                return [node_of(r) for r in refs]
        stop = set(stop)
        seen: set[str] = set()
        work = [t for t in targets if known(t)]
        seen.update(work)
        while work:
            name = work.pop()
            if name in stop:
                continue
            for pred in predecessors(name):
                if pred not in seen:
                    seen.add(pred)
                    work.append(pred)
        return seen

    # ------------------------------------------------------------------ mutation
    def add(self, name: str, op: str, inputs: Iterable[str] = (), control: Iterable[str] = (),
            device: str = "", attrs: dict[str, Any] | None = None, defaults: bool = True) -> Node:
        """Add a node. ``attrs`` values may be Python values or AttrValues.

        With ``defaults``, attributes the op registry gives a default for are filled in.
        """
        if name in self.nodes:
            raise ValueError(f"node '{name}' already exists")
        converted: dict[str, attr_value_pb2.AttrValue] = {}
        op_def = self.op_def(op) if defaults else None
        kinds = {a.name: a.type for a in op_def.attr} if op_def is not None else {}
        for key, value in (attrs or {}).items():
            converted[key] = value if isinstance(value, attr_value_pb2.AttrValue) else make_attr(
                value, kinds.get(key))
        if op_def is not None:
            for a in op_def.attr:
                if a.name not in converted and a.HasField("default_value"):
                    converted[a.name] = a.default_value
        node = Node(name, op, list(inputs), list(control), device, converted)
        self._insert(node)
        return node

    def add_node(self, node: Node) -> Node:
        """Insert a fully built node (e.g. a clone)."""
        if node.name in self.nodes:
            raise ValueError(f"node '{node.name}' already exists")
        self._insert(node)
        return node

    def const(self, name: str, value: Any, dtype: Any = None, device: str = "") -> str:
        """Add a Const node; returns its tensor name."""
        proto = tensor_util.make_tensor_proto(value, dtype=dtype)
        attrs = {"value": attr_value_pb2.AttrValue(tensor=proto),
                 "dtype": make_attr(dtypes.as_dtype(proto.dtype))}
        self.add(name, "Const", device=device, attrs=attrs)
        return name

    def set_const(self, name: str, value: Any) -> None:
        """Replace the value of Const node ``name`` (same dtype)."""
        node = self.nodes[name]
        dtype = dtypes.as_dtype(node.attr("dtype"))
        proto = tensor_util.make_tensor_proto(np.asarray(value), dtype=dtype)
        node.attrs = dict(node.attrs)
        node.attrs["value"] = attr_value_pb2.AttrValue(tensor=proto)

    def set_attr(self, name: str, key: str, value: Any, kind: str | None = None) -> None:
        """Set attribute ``key`` of node ``name`` (copy-on-write)."""
        node = self.nodes[name]
        node.attrs = dict(node.attrs)
        node.attrs[key] = value if isinstance(value, attr_value_pb2.AttrValue) else make_attr(value, kind)

    def drop_attr(self, name: str, key: str) -> None:
        """Remove attribute ``key`` of node ``name`` if present."""
        node = self.nodes[name]
        if key in node.attrs:
            node.attrs = {k: v for k, v in node.attrs.items() if k != key}

    def set_device(self, name: str, device: str) -> None:
        """Set the requested device of node ``name``."""
        self.nodes[name].device = device

    def set_input(self, name: str, position: int, ref: str) -> None:
        """Point data input ``position`` of node ``name`` at tensor ``ref``."""
        node = self.nodes[name]
        old = node_of(node.inputs[position])
        node.inputs[position] = ref
        self._consumers.setdefault(node_of(ref), {})[name] = None
        self._forget_if_unused(old, name)

    def set_control(self, name: str, control: list[str]) -> None:
        """Replace the control inputs of node ``name``."""
        node = self.nodes[name]
        old = node.control
        node.control = list(dict.fromkeys(control))
        consumers = self._consumers
        for ctl in node.control:
            consumers.setdefault(ctl, {})[name] = None
        gone = set(old).difference(node.control)
        if gone:
            gone.difference_update(node_of(r) for r in node.inputs)
            for ctl in gone:
                consumers.get(ctl, {}).pop(name, None)

    def replace_uses(self, old: str, new: str, only: Iterable[str] | None = None) -> int:
        """Make every reader of tensor ``old`` (or only those named in ``only``) read ``new``.

        Returns the number of inputs changed.
        """
        allowed = set(only) if only is not None else None
        changed = 0
        for consumer, pos in self.data_consumers(old):
            if allowed is None or consumer.name in allowed:
                self.set_input(consumer.name, pos, _canonical_input(new))
                changed += 1
        return changed

    def remove(self, name: str) -> None:
        """Delete node ``name``. Its consumers must have been rewired first."""
        node = self.nodes.pop(name)
        for ref in node.inputs:
            self._forget_if_unused(node_of(ref), name)
        for ctl in node.control:
            self._forget_if_unused(ctl, name)
        leftover = [c for c in self._consumers.get(name, ()) if c in self.nodes]
        if leftover:
            self.nodes[name] = node
            raise ValueError(f"cannot remove '{name}': still read by '{leftover[0]}'")
        self._consumers.pop(name, None)

    def remove_many(self, names: Iterable[str]) -> None:
        """Delete several nodes at once. Readers outside the set keep their references, which
        must be satisfied by nodes added under the same names before the IR is used again."""
        doomed = set(names)
        consumers = self._consumers
        for name in doomed:
            node = self.nodes.pop(name)
            # a doomed producer's own entry is cleaned below: skip it here (ResNet-152's
            # gradient ops each wait for its 312 batch-norm updates, all removed together)
            for producer in {node_of(r) for r in node.inputs}.union(node.control).difference(doomed):
                consumers.get(producer, {}).pop(name, None)
        for name in doomed:
            entry = consumers.get(name)
            if entry is None:
                continue
            live = [c for c in entry if c not in doomed and c in self.nodes]
            if not live:
                del consumers[name]
            elif len(live) < len(entry):
                consumers[name] = dict.fromkeys(live)

    def _forget_if_unused(self, producer: str, consumer: str) -> None:
        node = self.nodes.get(consumer)
        if node is not None and (producer in node.control
                                 or any(node_of(r) == producer for r in node.inputs)):
            return
        self._consumers.get(producer, {}).pop(consumer, None)

    def unique_name(self, base: str) -> str:
        """``base`` if unused, else ``base_1``, ``base_2``..."""
        if base not in self.nodes:
            return base
        k = 1
        while f"{base}_{k}" in self.nodes:
            k += 1
        return f"{base}_{k}"

    def stats(self) -> str:
        """``"<nodes> nodes, <edges> edges"`` for logs."""
        return f"{len(self.nodes)} nodes, {self.edge_count()} edges"


def _canonical_input(ref: str) -> str:
    name, idx = parse_tensor(ref)
    return _input_ref(name, idx)


def graph_def_from_nodes(nodes: Iterable[node_def_pb2.NodeDef]) -> graph_pb2.GraphDef:
    """A GraphDef holding copies of ``nodes`` (used by tests to build tiny graphs)."""
    gd = graph_pb2.GraphDef()
    gd.node.extend(nodes)
    return gd
