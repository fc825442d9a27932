"""Split one traced step's memory into persistent, gradient-buffer and activation bytes.

Input: the ``RunMetadata`` of one ``session.run`` with ``RunOptions(trace_level=FULL_TRACE,
output_partition_graphs=True)``. TensorFlow's step statistics give, for every executed node,
the allocation records of its tracking allocator: ``(alloc_micros, alloc_bytes)`` pairs, a
positive size when the node's kernel allocated a buffer and a negative one when that buffer
was freed (whenever in the step that happened, by whichever later op dropped the last
reference), plus ``allocator_bytes_in_use``, the allocator's live bytes when the node ended.

From these, :func:`breakdown` builds the step's memory over time by replaying every record in
time order, each buffer charged to the node that allocated it, and classifies the nodes:

* **gradient buffers**: nodes whose output is (or is summed, scaled, cast, forwarded into)
  the gradient an optimizer update reads -- found by walking back from every ``Apply*`` /
  ``ResourceApply*`` op's inputs (in the executed, post-Grappler partition graphs) through
  forwarding, scaling and summing ops (the walk stops at the op that computed a gradient from
  activations) whose traced output has the shape of the updated variable (data or control inputs:
  Grappler turns a large ``AddN`` into ``AssignAdd`` ops on a temporary variable that only
  control edges connect to the sum); variable reads stop the walk. This covers one device's gradients, replicate's per-micro-batch gradients and their
  running sums, and a hand-written loop's accumulators. The update ops' own allocations are
  counted here too: an ``Apply*`` op copies its variable when a read of it is still live (a
  micro-batch's backward pass still using the weights), a parameter-sized buffer;
* **activations**: every other buffer allocated during the step: forward outputs,
  backward intermediates (gradients with respect to activations), kernels' scratch space,
  input slices -- everything whose size scales with the (micro-)batch;
* **persistent**: what was live throughout the step (variables, optimizer slots, the fed
  batch, cached constants): the smallest, over the nodes, of ``allocator_bytes_in_use`` at a
  node's end minus the replayed step bytes live then; how far that difference rises above its
  minimum is reported as ``untracked`` (the records do not explain those bytes).

Peaks are maxima of the replayed curves (at equal timestamps frees are applied before
allocations). The whole-step peak is also reported directly as the largest
``allocator_bytes_in_use`` any node saw, which checks the replay.
"""

from __future__ import annotations

import dataclasses

__all__ = ["Breakdown", "breakdown", "gradient_nodes"]

_PASS_THROUGH_STOP = {"ReadVariableOp", "VarHandleOp", "VariableV2", "Variable", "Const", "_Arg"}

#: Ops that forward, scale or sum gradients: the walk goes on through their inputs. Any other op
#: (``MatMul``, ``Conv2DBackpropFilter``, ``BiasAddGrad``, ...) produced a gradient from
#: activations and ends the walk, so activations that happen to have a variable's shape (a
#: [4096, 4096] layer output at batch 4096) are not taken for gradients.
_ACCUMULATING = {"Identity", "IdentityN", "Snapshot", "AddV2", "Add", "AddN", "AccumulateNV2",
                 "Mul", "MulNoNan", "RealDiv", "DivNoNan", "Cast", "Neg", "Switch", "Merge",
                 "Enter", "Exit", "NextIteration", "RefSwitch", "RefMerge", "RefEnter", "RefExit",
                 "RefNextIteration", "TemporaryVariable", "DestroyTemporaryVariable", "Assign",
                 "AssignAdd", "ClipByValue", "Maximum", "Minimum", "Select", "SelectV2"}


@dataclasses.dataclass
class Breakdown:
    """One step's memory, bytes.

    Attributes:
        persistent: live when the step began (variables, slots, feeds, caches).
        activation_peak: largest live activation bytes at any moment of the step.
        gradient_peak: largest live gradient-buffer bytes at any moment.
        step_peak: largest live bytes allocated by the step (activations + gradients).
        whole_peak: ``persistent + step_peak`` (replayed).
        allocator_peak: largest ``allocator_bytes_in_use`` reported by any node (measured).
        gradient_nodes: how many executed nodes were classed as gradient buffers.
        untracked: how far the allocator's live bytes rose above ``persistent`` + the replayed
            buffers at some node end: bytes the records do not explain (buffers allocated outside
            a node's tracking allocator, or freed late from an earlier step); 0 when they all do.
    """

    persistent: int
    activation_peak: int
    gradient_peak: int
    step_peak: int
    whole_peak: int
    allocator_peak: int
    gradient_nodes: int
    untracked: int = 0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _shapes(step_stats) -> dict[str, list[tuple]]:
    """Traced output shapes of every executed node (by output slot)."""
    out: dict[str, list[tuple]] = {}
    for dev in step_stats.dev_stats:
        for n in dev.node_stats:
            slots = out.setdefault(n.node_name, [])
            for o in n.output:
                while len(slots) <= o.slot:
                    slots.append(None)
                slots[o.slot] = tuple(d.size for d in o.tensor_description.shape.dim)
    return out


def gradient_nodes(partition_graphs, step_stats) -> set[str]:
    """Executed nodes that produce (or accumulate) the gradients an optimizer update reads."""
    nodes = {n.name: n for g in partition_graphs for n in g.node}
    shapes = _shapes(step_stats)

    def source(inp: str) -> tuple[str, int]:
        name, _, idx = inp.lstrip("^").partition(":")
        return name, int(idx or 0)

    def shape(name: str, idx: int):
        slots = shapes.get(name, [])
        return slots[idx] if idx < len(slots) else None

    found: set[str] = set()
    todo = []
    for n in nodes.values():
        if not (n.op.startswith("Apply") or n.op.startswith("ResourceApply")):
            continue
        for inp in n.input:
            if inp.startswith("^"):
                continue
            name, idx = source(inp)
            s = shape(name, idx)
            if s and len(s) >= 1 and name in nodes and nodes[name].op not in _PASS_THROUGH_STOP:
                todo.append((name, s))
    while todo:
        name, want = todo.pop()
        if name in found or name not in nodes:
            continue
        found.add(name)
        if nodes[name].op not in _ACCUMULATING:
            continue
        for inp in nodes[name].input:     # control inputs too: Grappler's AddN -> AssignAdd
            src, idx = source(inp)           # rewrite feeds its sum through control edges
            if src in nodes and nodes[src].op not in _PASS_THROUGH_STOP and shape(src, idx) == want:
                todo.append((src, want))
    return found


def breakdown(run_metadata) -> Breakdown:
    """Persistent, gradient-buffer and activation peaks of the traced step (see module doc)."""
    stats = run_metadata.step_stats
    grads = gradient_nodes(run_metadata.partition_graphs, stats)
    updates = {n.name for g in run_metadata.partition_graphs for n in g.node
               if n.op.startswith(("Apply", "ResourceApply"))}
    events = []        # (micros, bytes, is_gradient)
    ends = []          # (node end micros, allocator_bytes_in_use)
    for dev in stats.dev_stats:
        for n in dev.node_stats:
            is_grad = n.node_name in grads or n.node_name in updates
            for m in n.memory:
                for r in m.allocation_records:
                    events.append((r.alloc_micros, r.alloc_bytes, is_grad))
                if m.allocation_records:
                    ends.append((n.all_start_micros + n.all_end_rel_micros, m.allocator_bytes_in_use))
    events.sort(key=lambda e: (e[0], e[1]))
    live = {True: 0, False: 0}
    peaks = {True: 0, False: 0, "all": 0}
    curve = []         # (micros, live step bytes after the event)
    for micros, size, is_grad in events:
        live[is_grad] += size
        total = live[True] + live[False]
        peaks[is_grad] = max(peaks[is_grad], live[is_grad])
        peaks["all"] = max(peaks["all"], total)
        curve.append((micros, total))
    # allocator bytes not explained by the replayed step buffers, at every node end
    unexplained = []
    if ends and curve:
        ends.sort()
        i, live_then = 0, 0
        for at, in_use in ends:
            while i < len(curve) and curve[i][0] <= at:
                live_then = curve[i][1]
                i += 1
            unexplained.append(in_use - live_then)
    persistent = min(unexplained, default=0)
    allocator_peak = max((m.allocator_bytes_in_use for d in stats.dev_stats for n in d.node_stats
                          for m in n.memory), default=0)
    return Breakdown(persistent=persistent, activation_peak=peaks[False], gradient_peak=peaks[True],
                     step_peak=peaks["all"], whole_peak=persistent + peaks["all"],
                     allocator_peak=allocator_peak, gradient_nodes=len(grads),
                     untracked=max(unexplained, default=0) - persistent)
