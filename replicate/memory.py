"""An estimate of one training step's memory per device, from static shapes alone.

``replicate inspect`` prints it so that a user can see, before running anything, what
``--accumulate K`` or more towers buy. Three parts, each from the analysed input graph:

- **state**: every variable, optimizer slots included (on the controller, or spread over the
  parameter devices);
- **gradients**, per tower device: without accumulation, one gradient per trained variable
  (a tower's gradients wait for the aggregation); with ``accumulate=k > 1``, the running sums
  (one gradient-sized buffer) plus the gradient of the largest variable in flight, since each
  add runs as soon as a micro-batch's gradient for its variable exists
  (:mod:`replicate.passes.accumulate`). A dense layer's weight gradient that the step computes
  once from the micro-batches' kept slices (:mod:`replicate.passes.defer`, by its rule at this
  batch) is never in flight beside a sum;
- **activations**, per tower device: the per-example forward tensors that the backward pass
  reads (kept from the forward pass until the gradient uses them), times the examples of one
  micro-batch, ``ceil(B / (towers x k))``; with deferred weight gradients, plus their kept
  slices (``k x examples x (in + out)`` values per layer).

One device on the whole batch is estimated the same way, for comparison; its gradient
figure is an upper bound, since one device applies each variable's update as soon as that
gradient exists (measured: 8 of 47 MiB on a 12-layer MLP). None of these are allocator peaks:
TensorFlow frees some saved tensors early and reuses buffers in place, and kernels take
scratch memory not counted here. Against traced steps of the benchmark models
(``benchmarks/RESULTS.md``) the activations came out 8-33% below the measured peak and the
gradient buffers with accumulation within 8% of it. Tensors whose per-example size is not
static are counted, not guessed.
"""

from __future__ import annotations

import dataclasses
import math

from tensorflow.python.framework import dtypes

from replicate.batchflow.facts import Analysis
from replicate.batchflow.lattice import PART
from replicate.graph.ir import IR, parse_tensor, tensor_name
from replicate.passes.accumulate import in_branches
from replicate.passes.defer import product_shape, smaller

__all__ = ["Estimate", "estimate"]


@dataclasses.dataclass
class Estimate:
    """Bytes of one step, per tower device and for one device on the whole batch."""

    batch: int | None              # the global batch the figures are for (None: per example)
    towers: int
    micro: int
    state: int                     # every variable, slots included
    trained: int                   # one gradient per trained variable
    largest: int                   # the largest trained variable's gradient
    saved_per_example: int         # forward tensors the backward pass reads, per example
    unknown: int                   # saved tensors whose per-example size is not static
    #: trained variables' gradient bytes, by variable
    sizes: dict = dataclasses.field(default_factory=dict)
    #: dense layers' weight gradients the defer pass may compute once: variable -> (in, out,
    #: bytes per value), for inputs of one row per example
    products: dict = dataclasses.field(default_factory=dict)

    @property
    def examples(self) -> int | None:
        """Examples of one micro-batch on one tower device (the largest slice)."""
        return None if self.batch is None else math.ceil(self.batch / (self.towers * self.micro))

    def deferred(self) -> list[str]:
        """The variables whose gradient the step defers at this batch (the rule of
        :mod:`replicate.passes.defer`: the micro-batches' slices are smaller than the gradient)."""
        rows = self.examples
        if self.micro <= 1 or rows is None:
            return []
        return sorted(v for v, (m, n, _) in self.products.items() if smaller(self.micro, rows, m, n))

    @property
    def gradients(self) -> int:
        """Gradient buffers on one tower device."""
        if self.micro <= 1:
            return self.trained
        if not self.sizes:
            return self.trained + self.largest
        deferred = set(self.deferred())
        return self.trained + max((b for v, b in self.sizes.items() if v not in deferred), default=0)

    def activations(self, examples: int | None, kept: bool = False) -> int | None:
        """Saved activations of ``examples``; with ``kept``, plus the deferred products' slices."""
        if examples is None:
            return None
        extra = sum(self.micro * examples * (self.products[v][0] + self.products[v][1])
                    * self.products[v][2] for v in self.deferred()) if kept else 0
        return self.saved_per_example * examples + extra

    def to_dict(self) -> dict:
        """Plain data for ``inspect --json``."""
        per_tower = self.activations(self.examples, kept=True)
        single = self.activations(self.batch)
        return {
            "batch": self.batch, "examples_per_micro_batch": self.examples,
            "state_bytes": self.state,
            "saved_activation_bytes_per_example": self.saved_per_example,
            "unknown_saved_tensors": self.unknown,
            "deferred_gradients": self.deferred(),
            "per_device": {"activations": per_tower, "gradients": self.gradients,
                           "step": None if per_tower is None else per_tower + self.gradients},
            "one_device": {"activations": single, "gradients": self.trained,
                           "step": None if single is None else single + self.trained},
        }


def estimate(ir: IR, analysis: Analysis, towers: int, micro: int = 1,
             batch: int | None = None, aggregation: str = "add_n") -> Estimate:
    """The estimate for ``towers`` devices with ``micro`` micro-batches each at global batch
    ``batch`` (default: the inputs' static batch size, if any), gradients aggregated by
    ``aggregation`` (packed parts are never deferred)."""
    trained = {a.variable for a in analysis.apply_ops}
    sizes = {v.name: v.bytes for v in analysis.variables.values() if v.name in trained}
    per_example, unknown = _saved(ir, analysis)
    return Estimate(batch=batch if batch is not None else analysis.static_batch, towers=towers,
                    micro=micro, state=sum(v.bytes for v in analysis.variables.values()),
                    trained=sum(sizes.values()), largest=max(sizes.values(), default=0),
                    saved_per_example=per_example, unknown=unknown, sizes=sizes,
                    products={} if aggregation.startswith("packed") else _products(ir, analysis, trained))


def _products(ir: IR, analysis: Analysis, trained: set[str]) -> dict[str, tuple]:
    """Trained variables whose gradient the defer pass may defer: summed plainly (an exact
    rewrite, weights ``ones``, no shared rows), a ``MatMul`` with ``transpose_a`` of one row
    per example, outside TF1 loops and cond branches: variable -> (in, out, bytes per value)."""
    if analysis.reasons:
        return {}               # inexact: each tower's part is weighed (MulNoNan), not a product
    branches = in_branches(ir, set(ir.nodes))
    found = {}
    for f in analysis.frontier:
        if (not f.gradient or f.variable not in trained or f.role != "dense"
                or f.weights != ("ones",) or f.tail):
            continue
        name, index = parse_tensor(f.tensor)
        while index == 0 and ir.nodes[name].op == "Identity":
            name, index = parse_tensor(ir.nodes[name].inputs[0])
        node = ir.nodes[name]
        shape = None if index else product_shape(ir, analysis, node, name, node.inputs[0],
                                                 name in branches)
        if shape is None:
            continue
        try:
            width = dtypes.as_dtype(node.attr("T")).size
        except (TypeError, ValueError):
            continue
        found[f.variable] = (shape[0], shape[1], width)
    return found


def _saved(ir: IR, analysis: Analysis) -> tuple[int, int]:
    """Per-example bytes of the forward tensors that gradient code reads, and how many such
    tensors have no static per-example size."""
    prefixes = tuple(s.prefix + "/" for s in analysis.scopes)
    region = analysis.region_set
    seen: set[str] = set()
    total = unknown = 0
    for name in analysis.region:
        if not name.startswith(prefixes):
            continue
        for ref in ir.nodes[name].inputs:
            producer, index = parse_tensor(ref)
            tensor = tensor_name(producer, index)
            if tensor in seen or producer not in region or producer.startswith(prefixes):
                continue
            seen.add(tensor)
            fact = analysis.flow.fact(tensor) if analysis.flow is not None else None
            if fact is None or fact.kind != PART:
                continue                        # shared or reduced: not per example
            size = _per_example(ir, tensor, fact)
            if size is None:
                unknown += 1
            else:
                total += size
    return total, unknown


def _per_example(ir: IR, tensor: str, fact) -> int | None:
    shape = ir.static_shape(tensor)
    if shape is None or fact.axis is None or fact.axis >= len(shape) \
            or not isinstance(fact.block, int) or not isinstance(fact.outer, int):
        return None                             # rows per example unknown (a ragged fold)
    others = [d for i, d in enumerate(shape) if i != fact.axis]
    if any(d is None for d in others):
        return None
    try:
        width = dtypes.as_dtype(ir.output_dtype(tensor)).size
    except (TypeError, ValueError):
        return None
    return math.prod(others) * fact.block * fact.outer * width
