"""Helper of the analyze pass: region nodes that must run once, outside the towers.

Three kinds of ops land in the tower region only because training waits for them, yet copying
them per tower would change what they do:

- **state updates of global values**: an ``ExponentialMovingAverage`` of the loss, or of a
  weight-decay term, that the gradients wait for by a control edge. Per tower it would run on
  tower 0's slice; run once it reads the merged value under the loss's original name, exactly
  as on one device;
- **writes of per-example rows** (the final state a stateful RNN stores into its state
  variables for the next window): per tower it would write tower 0's rows over the whole
  variable; run once it writes the towers' rows concatenated in order, the batch's value;
- **random draws that do not depend on the batch** (the negative samples of a sampled softmax
  or NCE loss): per tower each would draw its own sample; drawn once, every tower uses the
  single-device draw of the same op and seed. A per-example output next to the draw (the
  expected counts of each example's true classes) is computed for the whole batch and each
  tower reads its own rows.

Such a node leaves the region; what it reads from the towers is merged under the original
names by the rewire pass (or is shared and kept); per-example outputs it gives back are split.

An evicted write still runs after every read of its variable that runs before it on one device
(:func:`reads_before`): the rewire pass makes it wait for each tower's copy of those reads.
Without that edge nothing orders a tower's own read against the single write (spectral
normalization's power iteration assigns ``u`` in the forward pass, and a tower that read ``u``
after the assign normalized by the next step's ``sigma``: claimed exact, 0.17 off, review 18).
"""

from __future__ import annotations

import heapq

from replicate.batchflow.effects import called_functions, draws, writes
from replicate.batchflow.lattice import MIXED, PART, RED, SHARED
from replicate.batchflow.merge import batch_multiple
from replicate.graph.ir import IR, node_of

__all__ = ["evictable", "reads_before", "reaching"]

#: Merges under which a batch-reduced value read by an evicted op equals the single-device one.
_GLOBAL = frozenset({"sum", "mean", "ratio", "count", "max", "min"})


def evictable(ir: IR, flow, region: list[str], harmless: set[str]) -> set[str]:
    """Region nodes to run once outside the towers (see the module docstring).

    Args:
        harmless: couplings that are synchronized (their per-tower values equal the batch's).
    """
    out: set[str] = set()
    inside = set(region)
    for name in region:
        node = ir.nodes[name]
        if flow.depths.get(name, 0):
            continue            # inside a TF1 loop: it runs with the loop, per tower
        if writes(ir, node):
            if _reads_global(ir, flow, node, harmless, inside) and not (
                    _batch_call(ir, flow, node) and _feeds_gradient(ir, flow, name)) \
                    and _outputs_split(ir, flow, node, inside):
                out.add(name)
        elif draws(ir, node) and not _batch_call(ir, flow, node):
            facts = [flow.fact(f"{name}:{i}") for i in range(len(ir.output_types(node)))]
            if facts and facts[0] is not None and facts[0].kind == SHARED and \
                    all(f is not None and f.kind in (SHARED, PART) for f in facts) and \
                    all(_mergeable(ir, flow, r) for r in node.inputs):
                out.add(name)
    return out


def _outputs_split(ir: IR, flow, node, region: set[str]) -> bool:
    """Whether every output of ``node`` the towers read can be handed to them once computed
    for the whole batch: the same for every tower, batch-reduced, or rows the split pass cuts.
    A cond whose branch draws noise from a ``tf.random.Generator`` (a state write) gives
    values the facts do not describe; run once, its whole-batch output met each tower's rows
    and the rewrite failed at step 1 (review 23)."""
    for i in range(len(ir.output_types(node))):
        fact = flow.fact(f"{node.name}:{i}")
        if (fact is None or fact.kind == MIXED) and any(
                c.name in region for c, _ in ir.data_consumers(f"{node.name}:{i}")):
            return False
    return True


def _feeds_gradient(ir: IR, flow, name: str) -> bool:
    """Whether gradient code reads an output of ``name`` (a TF2 cond's intermediates, which
    its gradient ``If`` takes: run once on the whole batch, they met a tower's rows there and
    the rewrite failed at step 1 -- a hand-written batch norm whose branch updates an EMA)."""
    return any(c.name in flow.ctx.gradient for c in ir.consumers(name))


def _batch_call(ir: IR, flow, node) -> bool:
    """True for a call or loop (``While``, ``If``, a defun) that reads per-example rows: it is
    the towers' own work, its draws are reproduced per tower by the draw pass, and what it
    hands its gradient (a loop's accumulators) cannot be cut into rows."""
    if not (called_functions(node) or ir.function(node.op) is not None):
        return False
    return any((f := flow.fact(r)) is not None and f.kind != SHARED for r in node.inputs
               if not ir.is_handle(r))


def _mergeable(ir: IR, flow, ref: str) -> bool:
    """A shared input, or per-example rows the towers hold in order (concatenated back), that
    are not row numbers local to each tower."""
    fact = flow.fact(ref)
    if fact is None:
        return False
    return fact.kind == SHARED or (fact.kind == PART and fact.ordered and fact.outer == 1
                                   and not fact.filtered and not fact.tail and fact.index is None)


def _forward(ir: IR, flow, ref: str, region: set[str]) -> bool:
    """True when neither gradient code nor row numbers local to a tower compute ``ref``: a
    tower's gradient rows are its share of the gradient of its own loss, and arithmetic on
    its row numbers (``tf.range`` over the batch) gives values that are not the batch's rows."""
    gradient = flow.ctx.gradient
    work, seen = [node_of(ref)], set()
    while work:
        name = work.pop()
        if name in seen or name not in region:
            continue
        if name in gradient:
            return False
        seen.add(name)
        node = ir.nodes[name]
        for i in range(max(1, len(ir.output_types(node)))):
            fact = flow.fact(f"{name}:{i}")
            if fact is not None and fact.index is not None:
                return False
        work.extend([node_of(r) for r in node.inputs] + list(node.control))
    return True


def _reads_global(ir: IR, flow, node, harmless: set[str], region: set[str]) -> bool:
    """True when every data input of update ``node`` is the same in every tower, a batch
    reduction whose merge is its single-device value, or per-example rows the towers hold in
    order (the final state a stateful RNN stores back), and no unsynchronized coupling feeds
    it."""
    for ref in node.inputs:
        fact = flow.fact(ref)
        if ir.is_handle(ref):
            # the variable's handle: what it carries is the predicate of a cond the write is
            # in, through the Switch it passes (review 49 S2)
            if fact is not None and fact.taint - harmless:
                return False
            continue
        if fact is not None and fact.kind == PART and _mergeable(ir, flow, ref) \
                and not fact.taint - harmless and _forward(ir, flow, ref, region):
            continue            # per-example rows in order: the merged value is the batch's
        if fact is None or fact.kind in (PART, MIXED):
            return False
        if fact.taint - harmless:
            return False
        if fact.kind == RED and fact.merge not in _GLOBAL and not batch_multiple(fact):
            return False
        if fact.kind not in (SHARED, RED):
            return False
    return bool(node.inputs)




def reads_before(ir: IR, graph, evicted: set[str], region: list[str], depths: dict) -> dict[str, list[str]]:
    """For each write run once (evicted, or run by tower 0 alone), the region nodes that read
    a variable it writes and are its ancestors (they run before it on one device): every
    tower's copy must run before it too.
    A reference variable's reads go through ``Identity`` ops that alias its buffer (``u/read``,
    often shared, outside the towers): what reads them reads the variable. Reads inside TF1
    loops are left out: a control edge out of a loop frame is invalid (a stateful RNN's
    ``Enter`` of its state failed to import)."""
    inside, candidates = set(region), {}
    for name in sorted(evicted):
        node = ir.nodes[name]
        reads = {n for r in node.inputs if ir.is_handle(r) for n in _readers(ir, node_of(r), inside)
                 if not depths.get(n, 0) and n != name}
        if reads:
            candidates[name] = reads
    masks = reaching(ir, graph, list(candidates))
    out = {}
    for i, (name, reads) in enumerate(candidates.items()):
        before = sorted(r for r in reads if masks.get(r, 0) >> i & 1)
        if before:
            out[name] = before
    return out


def reaching(ir: IR, graph, targets: list[str]) -> dict[str, int]:
    """For every node with a path into some of ``targets`` (in ``graph``, a view from
    :meth:`IR.to_networkx`), the bit mask of the targets it reaches: bit ``i`` for
    ``targets[i]``, a target's own bit included.

    One walk for all targets instead of one ancestor search each (ResNet-152 in the default
    batch-norm mode has 310 writes tower 0 runs alone): nodes are taken latest in graph order
    first, so in a graph without loops each passes its bits on once, after every consumer has
    given it theirs; a TF1 loop's back edge only sends a node round again when it brings new
    bits."""
    position = {name: i for i, name in enumerate(ir.nodes)}
    masks = {t: 1 << i for i, t in enumerate(targets)}
    heap = [(-position.get(t, len(position)), t) for t in targets]
    heapq.heapify(heap)
    queued = set(targets)
    while heap:
        _, name = heapq.heappop(heap)
        queued.discard(name)
        mask = masks[name]
        for pred in graph.predecessors(name):
            old = masks.get(pred, 0)
            if old | mask != old:
                masks[pred] = old | mask
                if pred not in queued:
                    queued.add(pred)
                    heapq.heappush(heap, (-position.get(pred, len(position)), pred))
    return masks


def _readers(ir: IR, variable: str, inside: set[str]) -> set[str]:
    """Region nodes that read ``variable`` directly or through identities."""
    found, work, seen = set(), [variable], {variable}
    while work:
        for consumer, _ in ir.data_consumers(work.pop()):
            if consumer.name in inside:
                found.add(consumer.name)
            if consumer.op in ("Identity", "RefIdentity") and consumer.name not in seen:
                seen.add(consumer.name)
                work.append(consumer.name)
    return found
