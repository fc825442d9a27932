"""Copy the tower region once per tower, renamed under ``tower_<k>/`` and put on its device.

Requires: ``ir.facts["analysis"]`` (the region, the nodes every tower needs) and
``ir.facts["towers"]`` (prefixes, devices, per-tower input slices); shared nodes placed.

Produces: tower copies of every region node (tower 0) or every needed region node (other
towers: ops that only feed state updates such as batch-norm moving averages run in tower 0
alone). Inputs from the region point at the same tower's copy; batch inputs at the tower's
slice; everything else at the shared node. Control inputs to region nodes a tower does not
copy are dropped. Copies run on the tower's device, except ops that read a shared
variable's handle (also through a loop's ``Enter``) or are colocated with a shared op, which
stay with it, and ops with no kernel for the tower's device type, which run on the same
task's CPU. ``_class``
colocation, while-loop frame names, stack and TensorArray names, and ``shared_name`` are
renamed per tower; random ops the towers reproduce (``analysis.draws``) keep their seeds,
other random ops with fixed seeds get a distinct seed per tower.
The originals are left in place for the rewire pass.
"""

from __future__ import annotations

import logging

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2

from replicate.graph import hubs, ops
from replicate.graph.ir import IR, Node, node_of, parse_tensor, tensor_name
from replicate.graph.kernels import has_kernel, host_of
from replicate.passes.pipeline import PassResult

__all__ = ["Clone", "SEED_STRIDE"]

log = logging.getLogger(__name__)

#: Added to ``seed2`` of a random op once per tower index, so towers draw distinct streams.
SEED_STRIDE = 104729


class Clone:
    """Tower copies of the region (no options: everything comes from the facts)."""

    name = "clone"

    def run(self, ir: IR) -> PassResult:
        analysis = ir.facts["analysis"]
        towers = ir.facts["towers"]
        region = analysis.region
        anchors = self._anchors(ir, region, analysis.region_set)
        copies: list[dict[str, str]] = []
        kinds = [tf.DeviceSpec.from_string(d).device_type or "CPU" for d in towers.devices]
        hosts = [host_of(d) for d in towers.devices]
        moved = 0
        runnable: dict[tuple[str, str], bool] = {}      # (node, device type): has a kernel
        gone = (analysis.region_set - analysis.keep) | analysis.dead
        hub_control = {n.name: n.control for n in ir.nodes.values() if hubs.is_hub(n.attrs)}
        for k, (prefix, device) in enumerate(zip(towers.prefixes, towers.devices)):
            members = [n for n in region if k == 0 or n in analysis.needed]
            inside = set(members)
            # a hub this tower does not copy stands for its members, as if it were not there
            uncopied = {h: c for h, c in hub_control.items() if h not in inside}
            slices = towers.inputs[k]
            # a batch input is cut per tower: colocation with the whole of it (a TF1
            # TensorArray's unstack of the batch) would pull a tower's op off its device
            split = gone | {node_of(t) for t in slices}
            for name in members:
                node = ir.nodes[name]
                inputs = [self._map_input(ref, inside, slices, prefix) for ref in node.inputs]
                for position, (variable, barriers) in analysis.phase_reads.get(name, {}).items():
                    inputs[position] = self._late_read(ir, node.inputs[position], variable,
                                                       barriers, prefix)
                waits = node.control
                if uncopied and any(c in uncopied for c in waits):
                    waits = hubs.expand(waits, uncopied)
                control = [f"{prefix}/{c}" if c in inside else c for c in waits
                           if c in inside or c not in analysis.region_set]
                if waits and not control and not inputs:
                    control = [f"{prefix}/{c}" for c in
                               self._nearest_copied(ir, waits, inside, analysis.region_set)]
                attrs = self._attrs(node, k, prefix, inside, split, name in analysis.draws)
                where = anchors[name] or device
                if where == device:
                    key = (name, kinds[k])
                    if key not in runnable:
                        runnable[key] = has_kernel(node.op, kinds[k], node.attrs)
                    if not runnable[key]:
                        where = hosts[k]
                        moved += 1
                ir.add_node(Node(f"{prefix}/{name}", node.op, inputs, control, where, attrs))
            copies.append({n: f"{prefix}/{n}" for n in members})
        ir.facts["copies"] = copies
        outer = _function_colocation(ir)
        if moved:
            analysis.warnings.append(f"{moved} tower ops have no kernel for their tower's device "
                                     "type and run on the same task's CPU")
        log.info("cloned %d region nodes into %d towers (%d colocations of function nodes with "
                 "the calling graph dropped)", len(region), len(towers.prefixes), outer)
        return PassResult(ir, True)

    @staticmethod
    def _nearest_copied(ir: IR, dropped: list[str], inside: set[str], region: set[str]) -> list[str]:
        """The copied region nodes the dropped control inputs wait for, nearest first. A node
        whose only inputs were control edges from ops this tower does not copy (a constant in
        a TF1 loop body anchored to the update that uses it) waits for them instead, so it
        stays in its loop frame: with no input at all it would run in the root frame, and its
        loop would fail ("inputs from different frames"). An ``Enter`` does not anchor (a
        control edge from a constant ``Enter`` reaches the first iteration only: the loop
        hangs); the walk goes on past it."""
        found: list[str] = []
        seen: set[str] = set()
        work = list(dropped)
        while work:
            name = work.pop(0)
            if name in seen or name not in region:
                continue
            seen.add(name)
            node = ir.nodes[name]
            if name in inside and node.op not in ("Enter", "RefEnter"):
                found.append(name)
                continue
            work.extend(node_of(r) for r in node.inputs)
            work.extend(node.control)
        return sorted(set(found))

    @staticmethod
    def _late_read(ir: IR, read: str, variable: str, barriers: tuple[str, ...], prefix: str) -> str:
        """The tower's read of reference variable ``variable`` after ``barriers`` (an earlier
        phase's update), beside the variable, for the tower ops that wait for them."""
        name = f"{prefix}/replicate/phase_read/{variable}"
        if name not in ir.nodes:
            original = ir.nodes[node_of(read)]
            attrs = {k: v for k, v in original.attrs.items() if k != "_class"}
            ir.add_node(Node(name, "Identity", [variable], sorted(barriers),
                             ir.nodes[variable].device, attrs))
        return name

    @staticmethod
    def _map_input(ref: str, inside: set[str], slices: dict[str, str], prefix: str) -> str:
        name, idx = parse_tensor(ref)
        if name in inside:
            return f"{prefix}/{ref}"
        sliced = slices.get(tensor_name(name, idx))
        if sliced is not None:
            node, out = parse_tensor(sliced)
            return node if out == 0 else sliced
        return ref

    @classmethod
    def _anchors(cls, ir: IR, order: list[str], region: set[str]) -> dict[str, str | None]:
        """Device each region op must stay on (None: the tower's). A handle that enters a TF1
        loop (``Enter`` of a variable's handle) stays with the variable, and so do the ops
        that read the handle inside the loop and the ops colocated with them."""
        anchors = {name: cls._anchor(ir, ir.nodes[name], region) for name in order}
        changed = True
        while changed:
            changed = False
            for name in order:
                if anchors[name] is not None:
                    continue
                node = ir.nodes[name]
                via = [t for t in node.colocation() if t in region] + [
                    node_of(r) for r in node.inputs if node_of(r) in region and ir.is_handle(r)]
                found = next((anchors[v] for v in via if anchors.get(v)), None)
                if found is not None:
                    anchors[name] = found
                    changed = True
        return anchors

    @staticmethod
    def _anchor(ir: IR, node: Node, region: set[str]) -> str | None:
        """Device of the shared op a copy must stay with, if any."""
        for target in node.colocation():
            if target not in region and target in ir.nodes:
                return ir.nodes[target].device or None
        for ref in node.inputs:
            producer = node_of(ref)
            if producer not in region and producer in ir.nodes and ir.is_handle(ref):
                return ir.nodes[producer].device or None
        return None

    @staticmethod
    def _attrs(node: Node, k: int, prefix: str, inside: set[str],
               gone: frozenset[str] | set[str], reproduced: bool = False
               ) -> dict[str, attr_value_pb2.AttrValue]:
        """Per-tower attributes; colocation with nodes the rewrite removes (``gone``) is dropped."""
        attrs = node.attrs
        changed: dict[str, attr_value_pb2.AttrValue] = {}
        if "_class" in attrs:
            locs = []
            for loc in node.attr("_class", []):
                target = loc[len("loc:@"):] if loc.startswith("loc:@") else None
                if target in inside:
                    locs.append(f"loc:@{prefix}/{target}")
                elif target is None or target not in gone:
                    locs.append(loc)
            value = attr_value_pb2.AttrValue()
            value.list.s.extend(s.encode() for s in locs)
            changed["_class"] = value
        for key in ops.PER_TOWER_NAME_ATTRS.get(node.op, ()):
            if key in attrs:
                changed[key] = attr_value_pb2.AttrValue(s=f"{prefix}/{node.attr(key)}".encode())
        if node.attr("shared_name"):
            changed["shared_name"] = attr_value_pb2.AttrValue(
                s=f"{prefix}/{node.attr('shared_name')}".encode())
        if k > 0 and not reproduced and node.op in ops.RANDOM_OPS and (
                node.attr("seed", 0) or node.attr("seed2", 0)):
            seed2 = (int(node.attr("seed2", 0)) + k * SEED_STRIDE) % (2 ** 31 - 1)
            changed["seed2"] = attr_value_pb2.AttrValue(i=seed2)
        if not changed:
            return attrs
        return {**attrs, **changed}


def _function_colocation(ir: IR) -> int:
    """Drop the ``_class`` colocation of function nodes with nodes of the calling graph (a
    gradient loop's ops colocated with the forward ops outside it): every tower calls the same
    function, so once inlined the towers' copies would all join one group, on no one device."""
    dropped = 0
    for fdef in (ir.library.function if ir.library is not None else ()):
        own = {n.name for n in fdef.node_def}
        for node in fdef.node_def:
            if "_class" not in node.attr:
                continue
            entries = [e.decode() if isinstance(e, bytes) else e for e in node.attr["_class"].list.s]
            kept = [e for e in entries if not e.startswith("loc:@") or e[5:] in own]
            if len(kept) == len(entries):
                continue
            dropped += len(entries) - len(kept)
            if kept:
                del node.attr["_class"].list.s[:]
                node.attr["_class"].list.s.extend(e.encode() for e in kept)
            else:
                del node.attr["_class"]
    return dropped
