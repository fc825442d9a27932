"""Choose a device for every shared node: variables and their state, the optimizer, the rest.

Requires: ``ir.facts["analysis"]``.

Produces: devices set on every node outside the tower region (and on the region nodes the
rewrite keeps as shared); ``ir.facts["var_devices"]``, variable name -> device. Variables go
to the controller, or are spread over parameter devices by byte size (greedy: the largest
variable first, each to the least-loaded device). Ops that read a variable's handle, or are
colocated with it, follow the variable; shared ops with no device go to the controller
(or its task's CPU when the controller's device type has no kernel for them, such as an
iterator on a GPU controller); shared ops the user pinned keep their device.
"""

from __future__ import annotations

import logging

from replicate.batchflow.roles import variable_of
from replicate.graph.ir import IR, node_of
from replicate.graph.kernels import runnable_on
from replicate.passes.pipeline import PassResult

__all__ = ["Place"]

log = logging.getLogger(__name__)


class Place:
    """Configuration of variable placement.

    Args:
        controller: device for shared ops and, by default, all variables.
        param_devices: when given, variables are spread over these devices by size.
    """

    name = "place"

    def __init__(self, controller: str, param_devices: list[str] | None = None):
        self.controller = controller
        self.param_devices = list(param_devices or [])

    def run(self, ir: IR) -> PassResult:
        analysis = ir.facts["analysis"]
        var_devices = self._variable_devices(analysis)
        ir.facts["var_devices"] = var_devices
        replicated = set(analysis.region) - analysis.keep
        changed = False
        for node in ir:
            if node.name in replicated:
                continue
            device = var_devices.get(node.name) or self._anchor(ir, node, var_devices)
            if device is None:
                device = runnable_on(node.op, node.attrs, node.device or self.controller)
            if device != node.device:
                ir.set_device(node.name, device)
                changed = True
        changed |= self._follow_handles(ir, replicated)
        return PassResult(ir, changed)

    @staticmethod
    def _follow_handles(ir: IR, replicated: set[str]) -> bool:
        """Ops reading another shared op's resource handle (an iterator, a queue, a table) run
        where that op runs, as TensorFlow requires."""
        changed = False
        for _ in range(8):
            moved = False
            for node in ir:
                if node.name in replicated:
                    continue
                for ref in node.inputs:
                    producer = ir.nodes.get(node_of(ref))
                    if producer is not None and producer.name not in replicated and ir.is_handle(ref) \
                            and producer.device and producer.device != node.device:
                        ir.set_device(node.name, producer.device)
                        moved = changed = True
                        break
            if not moved:
                break
        return changed

    def _variable_devices(self, analysis) -> dict[str, str]:
        if not self.param_devices:
            return {name: self.controller for name in analysis.variables}
        load = {d: 0 for d in self.param_devices}
        out: dict[str, str] = {}
        by_size = sorted(analysis.variables.values(), key=lambda v: (-v.bytes, v.name))
        for var in by_size:
            device = min(self.param_devices, key=lambda d: (load[d], self.param_devices.index(d)))
            out[var.name] = device
            load[device] += var.bytes
        log.info("variables spread over %d devices: %s", len(load),
                 ", ".join(f"{d}={b}B" for d, b in load.items()))
        return out

    @staticmethod
    def _anchor(ir: IR, node, var_devices: dict[str, str]) -> str | None:
        """Device of the variable this op must sit with (colocation or a handle input)."""
        for target in node.colocation():
            var = variable_of(ir, target) or target
            if var in var_devices:
                return var_devices[var]
        for ref in node.inputs:
            if node_of(ref) in ir.nodes and ir.is_handle(ref):
                var = variable_of(ir, ref)
                if var in var_devices:
                    return var_devices[var]
        return None
