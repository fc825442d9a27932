"""Combine the towers' gradients into one aggregated gradient per gradient tensor.

Requires: ``ir.facts["analysis"]`` (the gradient frontier: tensors of a ``gradients``
scope read by shared ops, with their role and weighting), ``ir.facts["towers"]`` and the
tower copies from the clone pass.

Produces: for each frontier gradient ``g`` an op under ``replicate/aggregate/`` on the
device of the variable it updates, and ``ir.facts["aggregates"]``, tensor -> aggregate.
Dense gradients of a mean loss are summed with weights ``n_k / B`` (each tower's share of
the global batch), which equals the single-device gradient for even and uneven splits;
gradients of a sum loss are summed. Sparse gradients stay sparse: values are weighted and
concatenated, indices concatenated in tower order. ``MulNoNan`` makes a tower with no
examples contribute zero. With the ``packed`` strategy, dense gradients that share a dtype,
weighting and device travel through a few flat buffers instead.
"""

from __future__ import annotations

import logging

from replicate.combine import combine
from replicate.passes._packing import pack
from replicate.ir import IR, parse_tensor
from replicate.pipeline import PassResult

__all__ = ["Aggregate", "SCOPE", "STRATEGIES"]

log = logging.getLogger(__name__)

SCOPE = "replicate/aggregate"


#: Aggregation strategies: each gradient summed on its variable's device, small gradients
#: packed into buffers first, and either of those all-reduced among the towers instead.
STRATEGIES = ("add_n", "packed", "allreduce", "packed_allreduce")


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

        keys = iter(range(1, 1 << 30)) if self.strategy.endswith("allreduce") else None
        if self.strategy.startswith("packed"):
            aggregates.update(pack(ir, towers, analysis.frontier, copies, device_of, self.controller,
                                   SCOPE, keys))
        for f in analysis.frontier:
            if f.tensor in aggregates:
                continue
            name, idx = parse_tensor(f.tensor)
            parts = [f"{copies[k][name]}:{idx}" for k in range(len(towers.devices))]
            kind = f.role
            if kind == "dense" and f.weights == ("ones",):
                kind = "sum"
            elif kind == "sparse_values" and f.weights == ("ones",):
                kind = "concat"
            device = device_of(f)
            suffix = "" if idx == 0 else f"_{idx}"
            aggregates[f.tensor] = combine(ir, towers, f"{SCOPE}/{name}{suffix}", parts, kind,
                                           ir.output_dtype(f.tensor), device, self.controller,
                                           f.weights, next(keys) if keys is not None else None)
        ir.facts["aggregates"] = aggregates
        sparse = sum(1 for f in analysis.frontier if f.role.startswith("sparse"))
        log.info("aggregated %d gradient tensors (%d sparse parts)", len(aggregates), sparse)
        return PassResult(ir, bool(aggregates))

