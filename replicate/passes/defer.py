"""Defer a large weight gradient to the end of a device's micro-batches when that needs less memory.

With gradient accumulation, micro-batch j of a dense layer computes its weight gradient
``dW_j = a_jᵀ · dy_j`` (a ``MatMul`` with ``transpose_a``) and adds it into the running sum,
so at the moment of the add two weight-sized buffers are live: the sum and ``dW_j``. For a
wide layer fed a modest batch, the layer's inputs and output gradients over all micro-batches
are smaller than that: ``Σ_j a_jᵀ · dy_j`` is exactly ``concat(a)ᵀ · concat(dy)``, one
``MatMul`` after the last micro-batch, as one device computes it. Keeping ``a_j`` and
``dy_j`` until then costs ``rows × (in + out)`` values, against ``in × out`` for the gradient
and again for the sum.

Which is smaller depends on the batch, known only when the step runs. So both ways are built,
and the step chooses with a TF1 switch: ``pred = k × (size(a_0) + size(dy_0)) < in × out``,
from micro-batch 0's slices (the largest of an uneven split). That holds only when ``a`` has
one row per example (the analysis's fact: per example along axis 0, one row each); a layer
over a data-dependent number of rows (the real tokens of padded sequences, picked by a mask)
is left to the running sum, since a small first micro-batch would not tell the others'
sizes (review 25). When the switch says defer, the micro-batches' ``MatMul``s and adds are
dead (they never run) and the concatenated product is the device's sum; otherwise the
concatenations are dead and the running sum is as before. The choice is only about memory:
both ways compute the same sum (in a different order of additions).

Control edges out of the running-sum path (the accumulate pass's gates wait for a
micro-batch's gradients and adds) would kill what waits on them when that path is dead, so
each is replaced by a ``Merge`` of the op and micro-batch j's switched ``dy_j``: live either
way, and in the running-sum mode no earlier than the op itself. The deferred product waits
for what the parts waited for (the gradient tuple's group, which holds the layer's
input-gradient product): an update that ran while that product still read the weights would
copy them.

Requires: ``ir.facts["towers"]`` with ``sums`` (the aggregate pass's running sums, per device:
towers, parts, adds), ``ir.facts["analysis"]`` (loop depths, the inputs' facts); runs after
accumulate.

Produces: under ``<sum>_defer/``, the decision, a ``Switch`` per micro-batch input of the
product, the two ``ConcatV2``, the deferred ``MatMul`` and a ``Merge`` that every reader of
the device's sum reads instead; ``ir.facts["deferred"]``: the sums changed.
"""

from __future__ import annotations

import logging

from tensorflow.python.framework import dtypes

from replicate.batchflow.lattice import PART
from replicate.graph.ir import IR, node_of, parse_tensor
from replicate.passes.accumulate import in_branches
from replicate.passes.pipeline import PassResult

__all__ = ["Defer", "product_shape", "smaller"]

log = logging.getLogger(__name__)


class Defer:
    """Weight gradients of ``MatMul`` products deferred to one product per device and step,
    when the step's slices are smaller than the gradient (no options)."""

    name = "defer"

    def run(self, ir: IR) -> PassResult:
        towers = ir.facts["towers"]
        if towers.micro <= 1:
            return PassResult(ir, False)
        analysis = ir.facts["analysis"]
        branches = in_branches(ir, set(ir.nodes))    # before any switch is added
        deferred = []
        for chain, parts, adds in towers.sums:
            found = _products(ir, towers, chain, parts, adds, analysis, branches)
            if found is not None:
                deferred.append(_defer(ir, parts, adds, *found))
        ir.facts["deferred"] = deferred
        if deferred:
            log.info("defer: %d weight gradients chosen at run time", len(deferred))
        return PassResult(ir, bool(deferred))


def smaller(micro: int, rows: int, m: int, n: int) -> bool:
    """The rule: ``micro`` micro-batches of ``rows`` rows each of an ``m x n`` product's
    inputs hold fewer values than its gradient."""
    return micro * rows * (m + n) < m * n


def product_shape(ir: IR, analysis, node, original: str, rows: str | None,
                  in_branch: bool) -> tuple[int, int] | None:
    """``(in, out)`` when ``node`` (the original graph's product ``original``, or a tower's
    copy of it) is a deferrable weight gradient: a ``MatMul`` with ``transpose_a`` outside TF1
    loops and cond branches, of static shape, whose first input (``rows``, the original
    graph's tensor) the analysis found per example along axis 0, one row each; else None.
    Shared by this pass and the memory estimate, so that both choose the same products."""
    if (node.op != "MatMul" or not node.attr("transpose_a") or node.attr("transpose_b")
            or in_branch or analysis.flow is None or analysis.flow.depths.get(original, 0)):
        return None
    shape = ir.static_shape(original)
    if not shape or len(shape) != 2 or None in shape:
        return None
    fact = analysis.flow.fact(rows) if rows is not None else None
    if (fact is None or fact.kind != PART or fact.axis != 0 or fact.block != 1
            or fact.outer != 1):
        return None
    return shape[0], shape[1]


def _original(towers, t: int, ref: str) -> str | None:
    """The original graph's tensor that tower ``t``'s ``ref`` copies (a clone, or a batch
    input's slice), or None."""
    prefix = towers.prefixes[t] + "/"
    if node_of(ref).startswith(prefix):
        return ref[len(prefix):]
    return next((o for o, s in towers.inputs[t].items() if parse_tensor(s) == parse_tensor(ref)), None)


def _products(ir: IR, towers, chain: list[int], parts: list[str], adds: list[str], analysis,
              branches: set[str]):
    """``(products, paths, size)`` when every part of the chain is a ``MatMul`` with
    ``transpose_a`` read by the running sum alone (through ``Identity`` ops), outside TF1 loops
    and cond branches (``branches``), whose first input has one row per example; else None.

    ``paths[j]``: micro-batch j's ops from the product to its part; ``size``: the gradient's
    number of elements, from the original product's static shape."""
    if len(parts) < 2 or len(adds) != len(parts) - 1:
        return None
    products, paths, original = [], [], None
    for j, (t, part) in enumerate(zip(chain, parts)):
        name, idx = parse_tensor(part)
        readers = {adds[0]} if j == 0 else {adds[j - 1]}
        path = []
        while idx == 0 and ir.nodes[name].op == "Identity":
            if {c.name for c, _ in ir.data_consumers(name)} != readers:
                return None
            path.append(name)
            readers = {name}
            name, idx = parse_tensor(ir.nodes[name].inputs[0])
        node = ir.nodes[name]
        prefix = towers.prefixes[t] + "/"
        if (idx != 0 or not name.startswith(prefix)
                or {c.name for c, _ in ir.data_consumers(name)} != readers):
            return None
        here = name[len(prefix):]
        if original is None:        # the first micro-batch's copy: the original's facts
            original = here
            shape = product_shape(ir, analysis, node, here, _original(towers, t, node.inputs[0]),
                                  name in branches)
            if shape is None:
                return None
        elif here != original or name in branches:
            return None
        products.append(node)
        paths.append([name] + path[::-1])
    return products, paths, shape[0] * shape[1]


def _defer(ir: IR, parts: list[str], adds: list[str], products, paths, size: int) -> str:
    """Build both ways for one device's sum; returns the ``Merge`` its readers read now."""
    total = adds[-1]
    scope = f"{total}_defer"
    device = products[0].device
    dtype = dtypes.as_dtype(products[0].attr("T"))
    k = len(products)
    a0, b0 = products[0].inputs[0], products[0].inputs[1]
    sizes = [ir.add(f"{scope}/size_{i}", "Size", [ref], device=device,
                    attrs={"T": dtype, "out_type": dtypes.int64}).name for i, ref in enumerate((a0, b0))]
    both = ir.add(f"{scope}/slices", "AddV2", sizes, device=device, attrs={"T": dtypes.int64}).name
    ir.const(f"{scope}/micro", k, dtypes.int64, device)
    kept = ir.add(f"{scope}/kept", "Mul", [both, f"{scope}/micro"], device=device,
                  attrs={"T": dtypes.int64}).name
    ir.const(f"{scope}/gradient", size, dtypes.int64, device)
    pred = ir.add(f"{scope}/smaller", "Less", [kept, f"{scope}/gradient"], device=device,
                  attrs={"T": dtypes.int64}).name
    switched = []       # per micro-batch: (a switch, dy switch)
    for j, product in enumerate(products):
        pair = []
        for pos in (0, 1):
            ref = product.inputs[pos]
            sw = ir.add(f"{scope}/switch_{j}_{pos}", "Switch", [ref, pred], device=product.device,
                        attrs={"T": dtype}).name
            ir.set_input(product.name, pos, sw)              # output 0: the running-sum way
            pair.append(sw)
        switched.append(pair)
    ir.const(f"{scope}/axis", 0, dtypes.int32, device)
    joined = [ir.add(f"{scope}/concat_{pos}", "ConcatV2",
                     [f"{pair[pos]}:1" for pair in switched] + [f"{scope}/axis"], device=device,
                     attrs={"T": dtype, "N": k, "Tidx": dtypes.int32}).name for pos in (0, 1)]
    # what each part waited for (the gradient's tuple: the product of the layer's input
    # gradient too, which reads the weights): else the update may run while a read of the
    # weights is live, and copies them
    waits = list(dict.fromkeys(c for path in paths for op in path[1:] for c in ir.nodes[op].control))
    product = ir.add(f"{scope}/MatMul", "MatMul", joined, control=waits, device=device,
                     attrs=dict(products[0].attrs)).name
    merged = ir.add(f"{scope}/sum", "Merge", [total, product], device=device,
                    attrs={"T": dtype, "N": 2}).name
    ir.replace_uses(total, merged, only=[c.name for c, _ in ir.data_consumers(total)
                                         if c.name != merged])
    # control edges out of the running-sum way: wait for a Merge that is live either way
    ours = {merged}
    for j, path in enumerate(paths):
        ops = path + ([adds[j - 1]] if j else [])
        for i, op in enumerate(ops):
            waiting = [c for c in ir.consumers(op) if op in c.control and c.name not in ours]
            if not waiting:
                continue
            live = ir.add(f"{scope}/done_{j}_{i}_merged", "Merge",
                          [op, f"{switched[j][1]}:1"], device=device, attrs={"T": dtype, "N": 2}).name
            ours.add(live)
            for c in waiting:
                ir.set_control(c.name, [live if x == op else x for x in c.control])
    return total
