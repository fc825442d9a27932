"""Mirror the trained variables on every tower device and apply the optimizer on each.

Requires: the finished rewrite (the facts of analyze, split, clone, aggregate with an
all-reduce strategy, and rewire).

Produces: for every variable the optimizer updates (weights, slots such as Adam's moments,
and optimizer state such as the beta powers), a copy ``replicate/mirror_<k>/<name>`` on
tower ``k``'s device, ``k >= 1``; the original, which keeps its name and is the one checkpoints hold, moves
to tower 0's device. The shared update section (the ops that read an all-reduced gradient
or a mirrored variable and that the train op runs: gradient processing, the apply ops, the
optimizer's own bookkeeping) is copied once per tower device and reads that device's
all-reduce result and mirrors, so every device applies the same update to its own copy and
no device waits on a parameter server. Towers read their own device's copy. The global
step is not mirrored and still advances once per step.

Other writes to a mirrored variable outside the update section (its initializer, the saved
Saver's restore assigns, any user assign) become a group of the same write on every copy,
under the original name, so ``global_variables_initializer`` (even one built after import)
and ``saver.restore`` keep the copies equal. ``replicate/mirror/sync`` copies every
original onto its mirrors, for drivers that restore through a Saver built after import.
``ir.facts["mirrored"]`` lists the mirrored variables.
"""

from __future__ import annotations

import logging

import networkx as nx
from tensorflow.core.framework import attr_value_pb2

from replicate.errors import AnalysisError
from replicate.graph import ops
from replicate.graph.ir import IR, Node, node_of, parse_tensor
from replicate.options import MIRRORED
from replicate.graph.kernels import runnable_on
from replicate.passes.pipeline import PassResult

__all__ = ["Mirror", "MIRRORED", "SYNC_OP"]

log = logging.getLogger(__name__)

#: The ``param_devices`` value that asks for mirrored variables.

#: Scope of device ``k``'s copies: ``replicate/mirror_<k>/<original name>``.
COPY_SCOPE = "replicate/mirror"

#: Name of the op that copies every mirrored variable's original onto its mirrors.
SYNC_OP = "replicate/mirror/sync"

_WRITES = frozenset(ops.MUTATING_OPS) | frozenset(ops.APPLY_OPS)


class Mirror:
    """Mirrored variables (no options: the devices are the towers')."""

    name = "mirror"

    def run(self, ir: IR) -> PassResult:
        analysis = ir.facts["analysis"]
        towers = ir.facts["towers"]
        chains = towers.chains()     # with gradient accumulation, a device's micro-batch towers
        devices = [towers.devices[c[0]] for c in chains]
        groups = [{towers.prefixes[t] for t in c} for c in chains]
        if len(devices) < 2:
            ir.facts["mirrored"] = []
            return PassResult(ir, False)
        prefixes = set(towers.prefixes)
        shared = {n.name for n in ir if n.name.split("/", 1)[0] not in prefixes}
        graph = ir.to_networkx(control=True)
        train = analysis.train_op
        needed = ir.ancestors([train], graph) - {train}
        sources = _allreduce_sources(ir, shared, len(devices))
        step_ops = self._step_ops(ir, graph, shared, analysis.global_step)
        mirrored = {v for a in analysis.apply_ops for v in _written(ir, ir.nodes[a.name])}
        mirrored.discard(analysis.global_step)
        section: set[str] = set()
        inner = graph.subgraph(shared)
        while True:
            reach: set[str] = set()
            for start in mirrored | set(sources):
                reach |= nx.descendants(inner, start)
            section = (reach & needed) - mirrored - step_ops - set(sources)
            more = {v for n in section if ir.nodes[n].op in _WRITES for v in _written(ir, ir.nodes[n])}
            more.discard(analysis.global_step)
            if more <= mirrored:
                break
            mirrored |= more
        self._check_writers(ir, mirrored, shared)
        self._move_to_first(ir, mirrored, section, devices[0])
        copies = [self._copy(ir, k, groups[k], devices[k], mirrored, section, sources,
                             needed | {train}, shared) for k in range(1, len(devices))]
        self._mirror_writes(ir, mirrored, section, shared, copies, towers.prefixes, devices)
        self._sync_op(ir, mirrored, copies, devices)
        ir.facts["mirrored"] = sorted(mirrored)
        log.info("mirrored %d variables on %d devices; %d update ops per device",
                 len(mirrored), len(devices), len(section))
        return PassResult(ir, bool(mirrored))

    @staticmethod
    def _step_ops(ir: IR, graph: nx.DiGraph, shared: set[str], step: str | None) -> set[str]:
        """Shared ops that write the global step, and everything after them."""
        if not step:
            return set()
        writers = {n for n in shared if ir.nodes[n].op in _WRITES and step in _written(ir, ir.nodes[n])}
        out = set(writers)
        for w in writers:
            out |= nx.descendants(graph, w) & shared
        return out

    @staticmethod
    def _check_writers(ir: IR, mirrored: set[str], shared: set[str]) -> None:
        """A mirrored variable written inside a tower would drift apart from its copies."""
        for node in ir:
            if node.name in shared or node.op not in _WRITES:
                continue
            hit = _written(ir, node) & mirrored
            if hit:
                raise AnalysisError(
                    f"mirrored variables: '{sorted(hit)[0]}' is also written by tower op "
                    f"'{node.name}', so its copies would differ; use controller or parameter-"
                    "device placement for this graph")

    @staticmethod
    def _move_to_first(ir: IR, mirrored: set[str], section: set[str], device: str) -> None:
        """The originals become tower 0's copies: they, the update section and every op bound
        to them (colocated, or taking their ref or handle) run on tower 0's device."""
        bound = set(mirrored) | section
        for node in list(ir):
            if node.name in bound:
                continue
            if any(c in mirrored for c in node.colocation()) or any(
                    node_of(r) in mirrored for r in node.inputs):   # a variable's ref or handle
                bound.add(node.name)
        for name in bound:
            node = ir.nodes[name]
            ir.set_device(name, runnable_on(node.op, node.attrs, device))

    def _copy(self, ir: IR, k: int, prefixes: set[str], device: str, mirrored: set[str],
              section: set[str], sources: dict[str, list[str]], run: set[str],
              shared: set[str]) -> dict[str, str]:
        """Device ``k``'s mirrors and update section, and its towers (``prefixes``) reading them;
        returns the names of the copies."""
        names = {n: ir.unique_name(f"{COPY_SCOPE}_{k}/{n}") for n in sorted(mirrored | section)}

        def remap(ref: str) -> str:
            name, idx = parse_tensor(ref)
            if name in sources:
                name, idx = parse_tensor(sources[name][k])
            elif name in names:
                name = names[name]
            return name if idx == 0 else f"{name}:{idx}"

        for name in sorted(mirrored | section):
            node = ir.nodes[name]
            attrs = dict(node.attrs)
            _rebind_colocation(attrs, node, names)
            if name in mirrored and node.attr("shared_name"):
                attrs["shared_name"] = attr_value_pb2.AttrValue(s=names[name].encode())
            ir.add_node(Node(names[name], node.op, [remap(r) for r in node.inputs],
                             [names.get(c, c) for c in node.control],
                             runnable_on(node.op, node.attrs, device), attrs))
        for node in list(ir):
            if node.name.split("/", 1)[0] in prefixes and node.name not in names.values():
                self._retarget_tower_node(ir, node, names, remap, device)
        for name in sorted(section):
            for consumer in ir.consumers(name):
                if consumer.name in run and consumer.name not in section and consumer.name in shared:
                    ir.set_control(consumer.name, consumer.control + [names[name]])
        return names

    @staticmethod
    def _retarget_tower_node(ir: IR, node: Node, names: dict[str, str], remap, device: str) -> None:
        inputs = [remap(r) if node_of(r) in names else r for r in node.inputs]
        locs = node.colocation()
        if inputs == node.inputs and not any(c in names for c in locs) and \
                not any(c in names for c in node.control):
            return
        for i, ref in enumerate(inputs):
            if ref != node.inputs[i]:
                ir.set_input(node.name, i, ref)
        if any(c in names for c in node.control):
            ir.set_control(node.name, [names.get(c, c) for c in node.control])
        attrs = dict(node.attrs)
        _rebind_colocation(attrs, node, names)
        node.attrs = attrs
        ir.set_device(node.name, runnable_on(node.op, node.attrs, device))

    @staticmethod
    def _mirror_writes(ir: IR, mirrored: set[str], section: set[str], shared: set[str],
                       copies: list[dict[str, str]], prefixes: list[str], devices: list[str]) -> None:
        """Every shared write of a mirrored variable outside the update section (initializer,
        restore, user assigns) is repeated on each mirror, from the same value tensor, and the
        original waits for the repeats: whatever runs it (``init``, ``restore_all``,
        ``Variable.load`` feeding the initializer's value) writes every copy in the same step."""
        writes = [n for n in ir if n.name in shared and n.name not in section and n.op in _WRITES
                  and _written(ir, n) & mirrored]
        for node in writes:
            targets = _written(ir, node) & mirrored
            repeats = []
            for k in range(1, len(devices)):
                names = copies[k - 1]
                attrs = dict(node.attrs)
                _rebind_colocation(attrs, node, names)
                inputs = [names[node_of(r)] if node_of(r) in targets else r for r in node.inputs]
                repeats.append(ir.add_node(Node(ir.unique_name(f"{COPY_SCOPE}_{k}/{node.name}"), node.op,
                                                inputs, list(node.control),
                                                runnable_on(node.op, attrs, devices[k]), attrs)).name)
            ir.set_control(node.name, node.control + repeats)

    @staticmethod
    def _sync_op(ir: IR, mirrored: set[str], copies: list[dict[str, str]], devices: list[str]) -> None:
        """``replicate/mirror/sync``: assign every original's value to its mirrors."""
        group = []
        for name in sorted(mirrored):
            var = ir.nodes[name]
            dtype = var.attrs["dtype"]
            resource = var.op in ops.RESOURCE_VARIABLE_OPS
            value = name
            if resource:
                value = ir.add(f"replicate/mirror/read/{name}", "ReadVariableOp", [name],
                               device=var.device, attrs={"dtype": dtype}).name
            for k in range(1, len(devices)):
                target = copies[k - 1][name]
                op, attrs = (("AssignVariableOp", {"dtype": dtype}) if resource
                             else ("Assign", {"T": dtype, "use_locking": True}))
                group.append(ir.add(f"replicate/mirror/assign_{k}/{name}", op, [target, value],
                                    device=ir.nodes[target].device, attrs=attrs).name)
        ir.add(ir.unique_name(SYNC_OP), "NoOp", control=group)


def _allreduce_sources(ir: IR, shared: set[str], n: int) -> dict[str, list[str]]:
    """All-reduced aggregates (``Identity`` of tower 0's ``CollectiveReduceV2``) -> every
    device's all-reduce result, in tower order."""
    out: dict[str, list[str]] = {}
    for name in shared:
        node = ir.nodes[name]
        if node.op != "Identity" or not node.inputs:
            continue
        first = ir.nodes.get(node_of(node.inputs[0]))
        if first is None or first.op != "CollectiveReduceV2":
            continue
        others = [c for c in node.control if ir.nodes[c].op == "CollectiveReduceV2"]
        if len(others) == n - 1:
            out[name] = [first.name] + others
    return out


def _written(ir: IR, node: Node) -> set[str]:
    """Variables a writing op takes by ref or handle (for apply ops: the variable and slots)."""
    out = set()
    for ref in node.inputs:
        producer = ir.nodes.get(node_of(ref))
        if producer is not None and producer.op in ops.VARIABLE_OPS:
            out.add(producer.name)
    return out


def _rebind_colocation(attrs: dict, node: Node, names: dict[str, str]) -> None:
    """Point ``_class`` colocation at the copies in ``names``."""
    if "_class" not in attrs:
        return
    locs = [f"loc:@{names.get(c, c)}" for c in node.colocation()]
    attrs["_class"] = attr_value_pb2.AttrValue(list=attr_value_pb2.AttrValue.ListValue(
        s=[s.encode() for s in locs]))
