"""Split every batch input along its batch axis into one slice per tower.

Requires: ``ir.facts["analysis"]`` (batch inputs, static batch size if any) and the
tower devices.

Produces: for each batch input a ``SplitV`` on the controller under ``replicate/split/``,
per-tower example counts (balanced: the first ``B mod N`` towers get one more example),
and ``ir.facts["towers"]``, a :class:`~replicate.facts.Towers` holding the tower
prefixes, each tower's input tensors and its count tensor. With a static batch size the
counts are constants; otherwise they are computed from the first batch input's shape,
so uneven and tiny batches (even fewer examples than towers) split correctly.
"""

from __future__ import annotations

import logging

from tensorflow.python.framework import dtypes

from replicate.errors import AnalysisError
from replicate.facts import Towers
from replicate.ir import IR, parse_tensor, tensor_name
from replicate.pipeline import PassResult

__all__ = ["Split", "tower_prefixes", "SCOPE"]

log = logging.getLogger(__name__)

SCOPE = "replicate/split"


def tower_prefixes(ir: IR, count: int) -> list[str]:
    """``tower_<k>``, or ``replicate_tower_<k>`` if the graph already uses those names."""
    for base in ("tower", "replicate_tower", "replicate_tower_x"):
        prefixes = [f"{base}_{k}" for k in range(count)]
        if not any(n.split("/", 1)[0] in prefixes for n in ir.nodes):
            return prefixes
    raise ValueError("no free tower name scope")


class Split:
    """Configuration of the input split.

    Args:
        devices: one device per tower.
        controller: device of the split ops.
    """

    name = "split"

    def __init__(self, devices: list[str], controller: str):
        self.devices = list(devices)
        self.controller = controller

    def run(self, ir: IR) -> PassResult:
        analysis = ir.facts["analysis"]
        n = len(self.devices)
        towers = Towers(self.devices, tower_prefixes(ir, n), [dict() for _ in range(n)], [], None)
        dev = self.controller
        if analysis.static_batch is not None:
            batch = analysis.static_batch
            if batch < n:
                raise AnalysisError(f"the batch inputs have a static batch size of {batch}, fewer "
                                    f"than the {n} towers; give them a dynamic batch dimension (None)")
            counts = [(batch + n - 1 - k) // n for k in range(n)]
            towers.static_counts = counts
            towers.batch_size = ir.const(f"{SCOPE}/batch_size", batch, dtypes.int32, dev)
            towers.counts = [ir.const(f"{SCOPE}/count_{k}", c, dtypes.int32, dev)
                             for k, c in enumerate(counts)]
            sizes = ir.const(f"{SCOPE}/sizes", counts, dtypes.int32, dev)
        else:
            first = analysis.batch_inputs[0]
            shape = ir.add(f"{SCOPE}/shape", "Shape", [first.tensor], device=dev,
                           attrs={"T": dtypes.as_dtype(ir.output_dtype(first.tensor)),
                                  "out_type": dtypes.int32}).name
            zero = ir.const(f"{SCOPE}/axis", first.axis, dtypes.int32, dev)
            towers.batch_size = ir.add(f"{SCOPE}/batch_size", "GatherV2", [shape, zero, zero],
                                       device=dev, attrs={"Tparams": dtypes.int32,
                                                          "Tindices": dtypes.int32,
                                                          "Taxis": dtypes.int32}).name
            towers_const = ir.const(f"{SCOPE}/towers", n, dtypes.int32, dev)
            for k in range(n):
                extra = ir.const(f"{SCOPE}/round_{k}", n - 1 - k, dtypes.int32, dev)
                total = ir.add(f"{SCOPE}/padded_{k}", "AddV2", [towers.batch_size, extra], device=dev,
                               attrs={"T": dtypes.int32}).name
                towers.counts.append(ir.add(f"{SCOPE}/count_{k}", "FloorDiv", [total, towers_const],
                                            device=dev, attrs={"T": dtypes.int32}).name)
            sizes = ir.add(f"{SCOPE}/sizes", "Pack", towers.counts, device=dev,
                           attrs={"T": dtypes.int32, "N": n, "axis": 0}).name
        for batch_input in analysis.batch_inputs:
            name, idx = parse_tensor(batch_input.tensor)
            axis = ir.const(f"{SCOPE}/{name}_{idx}/axis", batch_input.axis, dtypes.int32, dev)
            node = ir.add(f"{SCOPE}/{name}_{idx}", "SplitV", [_ref(batch_input.tensor), sizes, axis],
                          device=dev, attrs={"T": dtypes.as_dtype(ir.output_dtype(batch_input.tensor)),
                                             "Tlen": dtypes.int32, "num_split": n})
            for k in range(n):
                towers.inputs[k][batch_input.tensor] = tensor_name(node.name, k)
        ir.facts["towers"] = towers
        log.info("split %d batch inputs over %d towers%s", len(analysis.batch_inputs), n,
                 f" (static counts {towers.static_counts})" if towers.static_counts else "")
        return PassResult(ir, True)


def _ref(tensor: str) -> str:
    name, idx = parse_tensor(tensor)
    return name if idx == 0 else f"{name}:{idx}"

