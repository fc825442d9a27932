"""Rewrite constants that bake the global batch size into each tower's own batch size.

Requires: ``ir.facts["analysis"]`` with a static batch size, ``ir.facts["towers"]`` with
static per-tower counts, and ``ir.facts["copies"]`` from the clone pass (originals still
present, so their static shapes can be read).

Produces: in each tower whose count differs from the global batch ``B``, the copies of
(1) shape constants (folded static shapes of batch-dependent tensors, reshape targets, tile multiples, fill dims, broadcast shapes, as listed
in ``ops.SHAPE_CONSUMERS``) whose first element is ``B`` where the consumer's output has
leading dimension ``B``, (2) the element-count factor of a ``Mean`` gradient, and (3)
shape attributes (``ops.SHAPE_ATTRS``) with leading dimension ``B`` rewritten for the
tower's count. A shape constant it cannot account for is recorded as a reason the result
is not exact. With a dynamic batch size there is nothing to do.
"""

from __future__ import annotations

import logging

import numpy as np
from tensorflow.core.framework import attr_value_pb2

from replicate import ops
from replicate.facts import Reason
from replicate.ir import IR, node_of
from replicate.pipeline import PassResult
from replicate.reductions import reduces_batch_axis
from replicate.roles import forward_op_of

__all__ = ["Rebatch"]

log = logging.getLogger(__name__)


class Rebatch:
    """Static batch-size rewrite (no options)."""

    name = "rebatch"

    def run(self, ir: IR) -> PassResult:
        analysis = ir.facts["analysis"]
        towers = ir.facts["towers"]
        batch = analysis.static_batch
        if batch is None or towers.static_counts is None:
            return PassResult(ir, False)
        plan, unexplained = self._plan(ir, analysis, batch)
        rewrites = 0
        for k, copies in enumerate(ir.facts["copies"]):
            count = towers.static_counts[k]
            if count == batch:
                continue
            for name, how in plan.items():
                if name not in copies:
                    continue
                copy = copies[name]
                if how == "shape":
                    value = np.array(ir.const_value(name))
                    value[0] = count
                    ir.set_const(copy, value)
                elif how == "factor":
                    value = np.array(ir.const_value(name))
                    ir.set_const(copy, value * count / batch)
                else:
                    ir.set_attr(copy, how, _resize(ir.nodes[name].attrs[how], count))
                rewrites += 1
        for name in unexplained:
            analysis.reasons.append(Reason(name, f"constant holds the static batch size {batch} "
                                           "where a tower sees fewer examples",
                                           "give the batch input a dynamic batch dimension (None)"))
        ir.facts["rebatched"] = sorted(plan)
        log.info("rebatch: %d constants and attributes rewritten for static batch %d", rewrites, batch)
        return PassResult(ir, rewrites > 0)

    @staticmethod
    def _plan(ir: IR, analysis, batch: int) -> tuple[dict[str, str], list[str]]:
        """Region nodes to rewrite -> "shape" | "factor" | attribute name; and unexplained ones."""
        scopes = [s.prefix for s in analysis.scopes]
        plan: dict[str, str] = {}
        unexplained: list[str] = []
        region = analysis.region_set
        batch_shapes, other_shapes = _shapes(ir, analysis, batch)
        for name in analysis.region:
            node = ir.nodes[name]
            for key in ops.SHAPE_ATTRS.get(node.op, ()):
                shape = node.attr(key)
                if shape and shape[0] == batch:
                    plan[name] = key
            if node.op != "Const":
                continue
            value = ir.const_value(name)
            if value is None or value.size == 0 or value.size > 16:
                continue
            key = tuple(value.tolist()) if value.ndim == 1 and value.dtype.kind == "i" else None
            if key in batch_shapes and key not in other_shapes:
                plan[name] = "shape"
                continue
            for consumer in ir.consumers(name):
                if consumer.name not in region:
                    continue
                for pos, ref in enumerate(consumer.inputs):
                    if node_of(ref) != name:
                        continue
                    vote = _local_vote(ir, consumer, key, scopes, analysis)
                    how = None if vote == "shared" else _classify(ir, consumer, pos, value, batch,
                                                                  scopes, analysis)
                    if vote == "batch" and key is not None and key[0] == batch:
                        how = "shape"
                    if how is not None:
                        plan[name] = how
                    elif key in batch_shapes or ((consumer.op, pos) in ops.SHAPE_CONSUMERS
                                                 and key is not None and key[0] == batch):
                        if vote != "shared":
                            unexplained.append(name)
        return plan, [n for n in dict.fromkeys(unexplained) if n not in plan]


def _shapes(ir: IR, analysis, batch: int) -> tuple[set[tuple[int, ...]], set[tuple[int, ...]]]:
    """Fully known static shapes in the region: those with leading dimension ``batch`` of
    batch-dependent tensors (an integer constant equal to one is that tensor's shape, folded
    by Python), and those of tensors that do not depend on the batch (a constant equal to one
    of these is ambiguous when the batch size coincides with a model dimension)."""
    batch_shapes: set[tuple[int, ...]] = set()
    other: set[tuple[int, ...]] = set()
    for name in analysis.region:
        dependent = name in analysis.batch_dependent
        for shape in ir.static_shapes.get(name) or ():
            if not shape or None in shape:
                continue
            if dependent and shape[0] == batch:
                batch_shapes.add(tuple(shape))
            elif not dependent:
                other.add(tuple(shape))
    return batch_shapes, other


def _local_vote(ir: IR, consumer, key, scopes, analysis) -> str | None:
    """Whether a shape constant is the shape of a batch-dependent tensor ("batch") or of a
    batch-independent one ("shared") next to where it is used: among the inputs and outputs
    of the forward op whose gradient code uses it, or of its consumer."""
    if key is None:
        return None
    context = [consumer.name]
    for prefix in scopes:
        if consumer.name.startswith(prefix + "/"):
            forward = forward_op_of(ir, prefix, consumer.name)
            if forward is not None:
                context = [forward]
    tensors = []
    for name in context:
        node = ir.nodes[name]
        tensors += [(node_of(r), r) for r in node.inputs]
        tensors += [(name, f"{name}:{i}") for i in range(len(ir.static_shapes.get(name) or ()))]
    votes = set()
    for producer, ref in tensors:
        shape = ir.static_shape(ref)
        if shape and None not in shape and tuple(shape) == key:
            votes.add("batch" if producer in analysis.batch_dependent else "shared")
    return votes.pop() if len(votes) == 1 else None


def _classify(ir: IR, consumer, pos: int, value: np.ndarray, batch: int, scopes, analysis) -> str | None:
    if (consumer.op, pos) in ops.SHAPE_CONSUMERS and value.ndim == 1 and value[0] == batch:
        if consumer.op == "BroadcastGradientArgs":
            return "shape"
        out = ir.static_shape(f"{consumer.name}:0")
        if out and out[0] == batch:
            return "shape"
        return None
    if consumer.op == "RealDiv" and pos == 1 and value.ndim == 0:
        for prefix in scopes:
            if not consumer.name.startswith(prefix + "/"):
                continue
            forward = forward_op_of(ir, prefix, consumer.name)
            if forward is None or ir.nodes[forward].op != "Mean" \
                    or not reduces_batch_axis(ir, ir.nodes[forward]):
                continue
            shape_in = ir.static_shape(ir.nodes[forward].inputs[0])
            shape_out = ir.static_shape(f"{forward}:0")
            if shape_in and shape_in[0] == batch and shape_out is not None \
                    and None not in shape_in and None not in shape_out:
                factor = int(np.prod(shape_in)) // max(1, int(np.prod(shape_out)))
                if float(value) == float(factor) and forward in analysis.batch_dependent:
                    return "factor"
    return None


def _resize(attr: attr_value_pb2.AttrValue, count: int) -> attr_value_pb2.AttrValue:
    out = attr_value_pb2.AttrValue()
    out.CopyFrom(attr)
    out.shape.dim[0].size = count
    return out
