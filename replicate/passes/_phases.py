"""Helper of the analyze pass: the phases of one training step.

pix2pix-style GANs build the generator's train op under
``tf.control_dependencies([discrim_train])``: one ``sess.run`` applies the discriminator's
update, then computes the generator's gradients against the updated discriminator. The
optimizer kernels, and the train ops, state updates and variable reads after them, are the
*barriers* between phases: the tower region stops there, the barriers run once (from merged
gradients), and tower code that waits for one by a control edge keeps that edge.

Requires: the IR, its networkx graph, the optimizer updates (``ApplyOp``s) and the gradient
code's node names.

Produces: :func:`barriers`; :func:`phases` (the barriers the region waits for, and the reads
of reference variables that the waiting tower ops must repeat after them).
"""

from __future__ import annotations

import networkx as nx

from replicate.graph import ops
from replicate.graph.ir import IR, node_of

__all__ = ["barriers", "phases", "variable_read"]


def barriers(ir: IR, graph: nx.DiGraph, apply_ops, in_grad: set[str]) -> set[str]:
    """Optimizer updates, and the train ops, state updates and variable reads after them that
    are not gradient code (the train op of a discriminator that a generator's gradients wait
    for, pix2pix-style): the phases of one step. Code that waits for one (by a control edge)
    runs in the towers after the update, which runs once; the region stops there."""
    # optimizer kernels only: their gradients are merged like every optimizer's; a plain
    # assignment from gradient rows (per-example state written by hand) stays in the region
    updates = {a.name for a in apply_ops if a.name in graph and ir.nodes[a.name].op in ops.APPLY_OPS}
    after: set[str] = set()
    for name in updates:
        after |= nx.descendants(graph, name)
    return updates | {n for n in after if n not in in_grad and (
        ir.nodes[n].op in ("NoOp",) or ir.nodes[n].op in ops.MUTATING_OPS
        or ir.nodes[n].op in ops.APPLY_OPS or variable_read(ir, n))}


def phases(ir: IR, graph: nx.DiGraph, region: list[str], barriers: set[str], apply_ops
            ) -> tuple[list[str], dict[str, dict[int, tuple[str, tuple[str, ...]]]]]:
    """The barriers tower ops wait for, and the reads of reference variables that later
    phases must repeat. On one device the generator's gradient code reads the
    discriminator's reference variables through their ``read`` identities, which alias the
    variables' buffers: it sees the values the discriminator's update wrote in place. A
    tower's copy of such a read runs early, and on another device is a copy made before the
    update; the tower's waiting ops read the variable again after the barriers instead.
    Returns ``(barriers waited for, consumer -> {input position: (variable, barriers)})``."""
    inside = set(region)
    waits = sorted({c for n in region for c in ir.nodes[n].control if c in barriers})
    if not waits:
        return [], {}
    # the barriers each region node waits for, directly or through its inputs
    after: dict[str, set[str]] = {}
    for barrier in waits:
        work = [n for n in region if barrier in ir.nodes[n].control]
        while work:
            name = work.pop()
            if barrier in after.setdefault(name, set()):
                continue
            after[name].add(barrier)
            work.extend(s for s in graph.successors(name) if s in inside)
    earlier = ir.ancestors(waits, graph)
    updated = {a.variable for a in apply_ops if a.name in earlier and a.variable in ir.nodes
               and ir.nodes[a.variable].op in ("VariableV2", "Variable")}
    reads: dict[str, dict[int, tuple[str, tuple[str, ...]]]] = {}
    for name, deps in after.items():
        for i, ref in enumerate(ir.nodes[name].inputs):
            read = ir.nodes.get(node_of(ref))
            if read is not None and read.op == "Identity" and read.inputs \
                    and node_of(read.inputs[0]) in updated and node_of(ref) not in after:
                reads.setdefault(name, {})[i] = (node_of(read.inputs[0]), tuple(sorted(deps)))
    return waits, reads

def variable_read(ir: IR, name: str) -> bool:
    """A read of a variable's value (``ReadVariableOp``, a reference variable's ``Identity``)."""
    node = ir.nodes[name]
    return node.op == "ReadVariableOp" or (node.op == "Identity" and bool(node.inputs)
                                           and ir.nodes[node_of(node.inputs[0])].op in ops.VARIABLE_OPS)
