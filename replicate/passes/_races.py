"""Helper of the analyze pass: races in the program itself.

A training step that reads a variable and writes it with no order between the two has no
single result on one device: TensorFlow runs whichever is ready first. Legacy programs do
this without noticing -- ``ema.apply()`` built before the train op and grouped with it (the
shadow update reads the weights before or after the optimizer's update), a spectral norm's
power-iteration vector assigned in one discriminator call and read by another. A rewrite
cannot match a program that does not match itself, so the report says so instead of letting
a user take the difference for replicate's (review 30: SN-GAN and SAM, 0.02 to 0.05 between
two single-device runs, claimed exact without a word).

Requires: the input graph (``ir`` and its networkx view with control edges) and the train
ops. Produces: one warning per variable found racing, at most three.

Judged on structure: in the ancestors of each train op, every write of a variable (an
assignment, a scatter, an optimizer kernel) must be ordered, by data or control edges, with
every other write of it and with every read of it whose value reaches some write of the step
(a read that only feeds a summary changes no state). Reachability is computed once per train
op, as bit sets of the accesses above each node, in topological order.
"""

from __future__ import annotations

import networkx as nx

from replicate.batchflow.effects import writes
from replicate.graph import ops
from replicate.graph.ir import IR, node_of

__all__ = ["warnings", "racing"]

#: Ops that touch a variable's handle without reading or writing its value.
_NO_VALUE = frozenset({"VariableShape", "VarIsInitializedOp", "IsVariableInitialized", "DestroyResourceOp"})

#: Ops that pass a variable's handle or reference on unchanged.
_PASS = frozenset({"Identity", "IdentityN", "RefIdentity"})


def warnings(ir: IR, graph: nx.DiGraph, train_ops: list[str], limit: int = 3) -> list[str]:
    """What the report says about variables read and written with no order in a step."""
    out = []
    for variable, (a, b, train_op) in sorted(racing(ir, graph, train_ops).items())[:limit]:
        out.append(f"variable '{variable}' is accessed by '{a}' and written by '{b}' with no order "
                   f"between them in the step of '{train_op}': one device's result depends on which "
                   "runs first (the program races with itself, and no rewrite can match it "
                   "reliably); order them with tf.control_dependencies")
    return out


def racing(ir: IR, graph: nx.DiGraph, train_ops: list[str], updates: bool = False
           ) -> dict[str, tuple[str, str, str]]:
    """Variable -> (an access, a write, the train op) with no order between the two. With
    ``updates``, a variable the optimizer alone writes is judged too (in a program,
    ``minimize`` orders its update after every read its gradient needs; in a rewrite, that is
    what the rewrite must keep)."""
    accesses = {v: a for v, a in _accesses(ir).items()
                if (updates or any(ops.apply_spec(ir.nodes[w].op) is None for w in a[1]))
                and len(a[0]) + len(a[1]) > 1}
    if not accesses:        # only optimizer updates, each after its gradient: nothing to race
        return {}
    # only paths from an access to a write can order the two: the nodes between them
    touched = {n for reads, written in accesses.values() for n in reads | written}
    written = {n for _, w in accesses.values() for n in w}
    between = _reach(graph.succ, touched) & _reach(graph.pred, written)
    order = _ordered(graph, between)
    found: dict[str, tuple[str, str, str]] = {}
    for train_op in train_ops:
        if train_op not in graph:
            continue
        cone = _reach(graph.pred, {train_op})
        mine = {v: (r & cone, w & cone) for v, (r, w) in accesses.items() if w & cone}
        for variable, (a, b) in _races(graph, [n for n in order if n in cone], mine).items():
            found.setdefault(variable, (a, b, train_op))
    return found


def _ordered(graph: nx.DiGraph, nodes: set[str]) -> list[str]:
    """``nodes`` in a topological order of the edges among them (Kahn's algorithm: networkx's
    subgraph views cost more than the step's whole graph)."""
    waiting = {n: sum(1 for p in graph.pred[n] if p in nodes) for n in nodes}
    ready = sorted(n for n, count in waiting.items() if not count)
    out = []
    while ready:
        name = ready.pop()
        out.append(name)
        for nxt in graph.succ[name]:
            if nxt in waiting:
                waiting[nxt] -= 1
                if not waiting[nxt]:
                    ready.append(nxt)
    return out


def _reach(adjacency, sources: set[str]) -> set[str]:
    """``sources`` and every node reached from them along ``adjacency`` (``graph.succ`` for
    descendants, ``graph.pred`` for ancestors)."""
    seen, work = set(sources), list(sources)
    while work:
        for nxt in adjacency[work.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                work.append(nxt)
    return seen


def _races(graph: nx.DiGraph, order: list[str], accesses: dict) -> dict[str, tuple[str, str]]:
    """variable -> (an access, a write) of it with no order between them, over the nodes of
    ``order`` (a topological order of the step's ancestors)."""
    bit: dict[str, int] = {}
    for reads, written in accesses.values():
        for name in reads | written:
            bit.setdefault(name, 1 << len(bit))
    inside = set(order)
    above: dict[str, int] = {}
    for name in order:
        mask = 0
        for pred in graph.predecessors(name):
            if pred in inside:
                mask |= above.get(pred, 0) | bit.get(pred, 0)
        above[name] = mask
    # (a TF1 loop's back edges leave its nodes out of the order: not judged)
    accesses = {v: ({r for r in reads if r in above}, {w for w in written if w in above})
                for v, (reads, written) in accesses.items()}
    before_writes = 0
    for _, written in accesses.values():
        for w in written:
            before_writes |= above[w]
    out = {}
    for variable, (reads, written) in sorted(accesses.items()):
        relevant = [r for r in sorted(reads) if bit[r] & before_writes] + sorted(written)
        pair = next(((a, w) for w in sorted(written) for a in relevant if a != w
                     and not above[w] & bit[a] and not above[a] & bit[w]), None)
        if pair is not None:
            out[variable] = pair
    return out


def _accesses(ir: IR) -> dict[str, tuple[set[str], set[str]]]:
    """variable -> (its readers, its writers)."""
    out: dict[str, tuple[set[str], set[str]]] = {}
    for name, node in ir.nodes.items():
        if node.op not in ops.VARIABLE_OPS:
            continue
        reads, written = set(), set()
        work, seen = [name], set()
        while work:
            holder = work.pop()
            for user in ir.consumers(holder):
                if user.name in seen:
                    continue
                seen.add(user.name)
                position = next((i for i, r in enumerate(user.inputs) if node_of(r) == holder), None)
                if position is None or user.op in _NO_VALUE:
                    continue
                if user.op in _PASS and not ir.is_handle(f"{holder}:0") and node.op in ops.REF_VARIABLE_OPS \
                        and user.op != "RefIdentity":
                    if not _ignored(ir, user):
                        reads.add(user.name)        # a ref variable's snapshot: its read
                elif user.op in _PASS:
                    work.append(user.name)          # the handle or reference passed on
                elif _writes(ir, user, position):
                    written.add(user.name)
                elif not _ignored(ir, user):
                    reads.add(user.name)
        out[name] = (reads, written)
    return out


def _ignored(ir: IR, read) -> bool:
    """``read``'s value is only passed where it is not used: the moving statistics a fused
    batch norm takes in training mode (a discriminator called on real and generated images
    reads them in its second call while the first call's update writes them)."""
    consumers = ir.consumers(read.name)
    if not any(c.op.startswith("FusedBatchNorm") for c in consumers):
        return False            # no user of that kind (the scan below is long: a Saver's op)
    users = [(c, i) for c in consumers for i, r in enumerate(c.inputs) if node_of(r) == read.name]
    return bool(users) and all(c.op.startswith("FusedBatchNorm") and i in (3, 4) and c.attr("is_training", True)
                               and float(c.attr("exponential_avg_factor", 1.0)) == 1.0 for c, i in users)


def _writes(ir: IR, node, position: int) -> bool:
    """``node`` writes the variable it reads at input ``position``."""
    if node.op in ops.MUTATING_OPS or node.op in ops.GENERATOR_OPS or ops.apply_spec(node.op) is not None:
        return position == 0
    if node.op not in ops.CALL_OPS and node.op not in ("While", "StatelessWhile"):
        return False
    position -= ops.LEADING_NON_ARGUMENTS.get(node.op, 0)     # a cond's predicate is no argument
    return any(e.arg == position for e in writes(ir, node))
