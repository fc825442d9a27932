"""Check the invariants of a (replicated) graph; change nothing.

Requires: an IR. With the facts of the earlier passes it also checks the replication.

Produces: nothing, or a :class:`~replicate.errors.PassError` naming the first broken
invariant: every input names an existing node and output; names are unique (by
construction of the IR); the graph has no cycle other than while-loop back edges; and,
after replication, no tower reads another tower's nodes, every variable is shared (none
inside a tower scope), and every optimizer update reads a shared gradient, not one tower's.
"""

from __future__ import annotations

import logging

import networkx as nx

from replicate.graph import ops
from replicate.graph.ir import IR, node_of, parse_tensor
from replicate.passes.pipeline import PassResult

__all__ = ["Validate", "InvariantError"]

log = logging.getLogger(__name__)


class InvariantError(Exception):
    """An invariant of the IR does not hold."""


class Validate:
    """Invariant checks (no options)."""

    name = "validate"

    def run(self, ir: IR) -> PassResult:
        self._inputs_resolve(ir)
        self._acyclic(ir)
        towers = ir.facts.get("towers")
        if towers is not None and "copies" in ir.facts:
            self._towers(ir, towers.prefixes)
        return PassResult(ir, False)

    @staticmethod
    def _inputs_resolve(ir: IR) -> None:
        for node in ir:
            for ref in node.inputs:
                name, idx = parse_tensor(ref)
                producer = ir.nodes.get(name)
                if producer is None:
                    raise InvariantError(f"node '{node.name}' reads '{ref}', which does not exist")
                if not idx:
                    continue        # a read of output 0 of an op without outputs: the import check
                outputs = ir.output_types(producer)
                if outputs and idx >= len(outputs):
                    raise InvariantError(f"node '{node.name}' reads output {idx} of '{name}', "
                                         f"which has {len(outputs)}")
            for ctl in node.control:
                if ctl not in ir.nodes:
                    raise InvariantError(f"node '{node.name}' waits for '{ctl}', which does not exist")

    @staticmethod
    def _acyclic(ir: IR) -> None:
        if _in_topological_order(ir):
            return
        graph = _dependencies(ir)
        if not nx.is_directed_acyclic_graph(graph):
            cycle = [u for u, _ in nx.find_cycle(graph) if isinstance(u, str)]
            raise InvariantError(f"the graph has a cycle through '{cycle[0]}' ({' -> '.join(cycle[:6])})")

    @staticmethod
    def _towers(ir: IR, prefixes: list[str]) -> None:
        prefixes = set(prefixes)
        owner = {name: head if (head := name.split("/", 1)[0]) in prefixes else None
                 for name in ir.nodes}

        def tower_of(name: str) -> str | None:
            return owner.get(name)

        for node in ir.nodes.values():
            mine = owner[node.name]
            if node.op in ops.VARIABLE_OPS and mine is not None:
                raise InvariantError(f"variable '{node.name}' lives inside tower '{mine}'")
            if mine is not None:
                for ref in node.inputs + node.control:
                    theirs = owner.get(node_of(ref))
                    if theirs is not None and theirs != mine:
                        raise InvariantError(f"'{node.name}' in {mine} reads '{ref}' of {theirs}")
            spec = ops.APPLY_OPS.get(node.op)
            if spec is not None and mine is None:
                pos = ir.arg_index(node, spec.grad_arg)
                if pos is not None and tower_of(node_of(node.inputs[pos])) is not None:
                    raise InvariantError(f"optimizer update '{node.name}' reads one tower's "
                                         f"gradient '{node.inputs[pos]}'")


def _in_topological_order(ir: IR) -> bool:
    """True when every node comes after the nodes it reads or waits for (while-loop back
    edges aside): then the graph has no other cycle, and no graph needs to be built."""
    seen: set[str] = set()
    for node in ir.nodes.values():
        for ref in node.inputs + node.control:
            name = node_of(ref)
            if name not in seen and ir.nodes[name].op not in ("NextIteration", "RefNextIteration"):
                return False
        seen.add(node.name)
    return True


#: Control-input sets at least this large go through one hub node per distinct set.
HUB_MIN = 8


def _dependencies(ir: IR) -> nx.DiGraph:
    """The graph of data and control edges, while-loop back edges left out, with its cycles
    and reachability but fewer edges: a set of control inputs that many nodes share (ops built
    under ``tf.control_dependencies(update_ops)``: ResNet-152's gradient code has 445,000
    control edges on 15,800 nodes) reaches them through one hub node, a tuple, not a name."""
    back = {n.name for n in ir.nodes.values() if n.op in ("NextIteration", "RefNextIteration")}
    hubs: dict[frozenset[str], tuple[str, int]] = {}
    edges = []
    for node in ir.nodes.values():
        edges.extend((p, node.name) for p in map(node_of, node.inputs) if p not in back)
        control = [c for c in node.control if c not in back]
        if len(control) < HUB_MIN:
            edges.extend((c, node.name) for c in control)
            continue
        key = frozenset(control)
        hub = hubs.get(key)
        if hub is None:
            hub = hubs[key] = ("hub", len(hubs))
            edges.extend((c, hub) for c in key)
        edges.append((hub, node.name))
    graph = nx.DiGraph()
    graph.add_nodes_from(ir.nodes)
    graph.add_edges_from(edges)
    return graph
