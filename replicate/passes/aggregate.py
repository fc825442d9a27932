"""Combine the towers' gradients into one aggregated gradient per gradient tensor.

Requires: ``ir.facts["analysis"]`` (the gradient frontier: tensors of a ``gradients``
scope read by shared ops, with their role and weighting), ``ir.facts["towers"]`` and the
tower copies from the clone pass.

Produces: for each frontier gradient ``g`` an op under ``replicate/aggregate/`` on the
device of the variable it updates, and ``ir.facts["aggregates"]``, tensor -> aggregate.
Dense gradients of a mean loss are summed with weights ``n_k / B`` (each tower's share of
the global batch), which equals the single-device gradient for even and uneven splits;
gradients of a sum loss are summed. With reference variables (read in place, not
snapshot), every aggregate waits for every tower's gradients, so that no update overtakes a
tower's read. Sparse gradients stay sparse: values are weighted and
concatenated, indices concatenated in tower order; rows shared by every tower after the batch
rows (a sampled loss's sampled classes) are summed once, so the aggregate has the
single-device rows in the single-device order. ``MulNoNan`` makes a tower with no
examples contribute zero; in an inexact rewrite that holds for gradients weighed inside the
towers too (a tower's own batch statistics over no examples are NaN: batch norm per tower). With the ``packed`` strategy, dense gradients that share a dtype,
weighting and device travel through a few flat buffers instead.
"""

from __future__ import annotations

import dataclasses
import logging

from replicate.graph.ir import IR, parse_tensor
from replicate.options import AGGREGATIONS
from replicate.passes._combine import combine
from replicate.passes._packing import pack
from replicate.passes.pipeline import PassResult

__all__ = ["Aggregate", "SCOPE", "STRATEGIES"]

log = logging.getLogger(__name__)

SCOPE = "replicate/aggregate"


#: Aggregation strategies: each gradient summed on its variable's device, small gradients
#: packed into buffers first, and either of those all-reduced among the towers instead.
STRATEGIES = AGGREGATIONS


class Aggregate:
    """Gradient aggregation.

    Args:
        controller: device for the weights and for gradients with no known variable.
        strategy: ``"add_n"`` (one weighted sum per gradient, on its variable's device),
            ``"packed"`` (gradients sharing a dtype and device are flattened into a few buffers
            per tower, summed once, and split back), ``"allreduce"`` / ``"packed_allreduce"``
            (the same sums done by collective all-reduce among the tower devices — NCCL on
            GPUs — and read from tower 0).
    """

    name = "aggregate"

    def __init__(self, controller: str, strategy: str = "add_n"):
        self.controller = controller
        self.strategy = strategy

    def run(self, ir: IR) -> PassResult:
        analysis = ir.facts["analysis"]
        towers = ir.facts["towers"]
        copies = ir.facts["copies"]
        var_devices = ir.facts.get("var_devices", {})
        aggregates: dict[str, str] = {}

        def device_of(f) -> str:
            return var_devices.get(f.variable or "", self.controller)

        prefixes = sorted((s.prefix for s in analysis.scopes), key=len, reverse=True)

        def scope_of(f) -> str:
            """The gradient computation a gradient belongs to: buffers hold one's only, so that
            a train op computes no other's gradients (review 28: with two train ops, packing
            made each run the other's gradients and its seeded draw; claimed exact, 0.38 off)."""
            return next((p for p in prefixes if f.tensor.startswith(p + "/")), "")

        keys = iter(range(1, 1 << 30)) if self.strategy.endswith("allreduce") else None
        frontier = analysis.frontier
        if analysis.reasons:
            # inexact: a tower's own batch statistic over no examples is NaN, and a gradient
            # weighed in the towers would carry it into the sum (batch norm per tower)
            frontier = [dataclasses.replace(f, weights=("nonempty",))
                        if f.role == "dense" and not f.tail and f.weights == ("ones",) else f
                        for f in frontier]
        if self.strategy.startswith("packed"):
            aggregates.update(pack(ir, towers, frontier, copies, device_of, self.controller,
                                   SCOPE, keys, scope_of))
        for f in frontier:
            if f.tensor in aggregates:
                continue
            name, idx = parse_tensor(f.tensor)
            parts = [f"{copies[k][name]}:{idx}" for k in range(len(towers.devices))]
            kind = f.role
            if f.tail and kind == "dense":
                kind = "sparse_values"          # rows: the examples' concatenated, the shared summed
            if kind == "dense" and f.weights == ("ones",):
                kind = "sum"
            elif kind == "sparse_values" and f.weights == ("ones",):
                kind = "concat"
            device = device_of(f)
            suffix = "" if idx == 0 else f"_{idx}"
            aggregates[f.tensor] = combine(ir, towers, f"{SCOPE}/{name}{suffix}", parts, kind,
                                           ir.output_dtype(f.tensor), device, self.controller,
                                           f.weights, next(keys) if keys is not None and not f.tail else None,
                                           tail=f.tail, tail_sum=f.role != "sparse_indices")
        if any(v.kind == "ref" for v in analysis.variables.values()) and len(towers.devices) > 1:
            self._gate(ir, analysis, copies, aggregates)
        ir.facts["aggregates"] = aggregates
        sparse = sum(1 for f in analysis.frontier if f.role.startswith("sparse"))
        log.info("aggregated %d gradient tensors (%d sparse parts)", len(aggregates), sparse)
        return PassResult(ir, bool(aggregates))

    def _gate(self, ir: IR, analysis, copies, aggregates: dict[str, str]) -> None:
        """Reference variables are read in place: an update that runs while a tower's gradient
        code still reads the variable changes what that tower reads. Every aggregate waits for
        every tower's gradients of its own gradient computation (not another train op's), so
        updates start only when the towers are done."""
        for scope in analysis.scopes:
            mine = [f for f in analysis.frontier if f.tensor.startswith(scope.prefix + "/")]
            waits = sorted({copies[k][parse_tensor(f.tensor)[0]] for f in mine
                            for k in range(len(copies)) if parse_tensor(f.tensor)[0] in copies[k]})
            if not waits:
                continue
            gate = ir.add(ir.unique_name(f"{SCOPE}/gate"), "NoOp", control=waits,
                          device=self.controller).name
            for f in mine:
                aggregate = aggregates.get(f.tensor)
                if aggregate is not None:
                    node = ir.nodes[parse_tensor(aggregate)[0]]
                    ir.set_control(node.name, node.control + [gate])
