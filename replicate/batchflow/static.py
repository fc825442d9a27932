"""Helper of the analyze pass: constants that bake a static batch size into the graph.

When the batch inputs have a static leading dimension ``B``, Python folded shape
computations into constants: reshape targets, tile multiples, fill dims, the element count of
a ``Mean`` gradient, the shape of a per-example tensor. Each tower sees ``n_k`` examples, so
those constants must be rewritten per tower. A constant counts as batch-derived when its
first element is a multiple of ``B`` and it matches the static shape of a batch-dependent
tensor next to where it is used (the forward op whose gradient code reads it, or its
consumer) and not that of a batch-independent one (so a batch of 10 next to 10 classes is
told apart by context). Nodes found here depend on the batch even though no data flows to
them from the inputs.
"""

from __future__ import annotations

import logging

import numpy as np

from replicate.batchflow.reductions import reduces_batch_axis
from replicate.batchflow.roles import forward_op_of
from replicate.graph import ops
from replicate.graph.ir import IR, node_of

__all__ = ["plan"]

log = logging.getLogger(__name__)


def plan(ir: IR, region: list[str], dependent: set[str], scopes: list[str], batch: int
         ) -> tuple[dict[str, str], list[str]]:
    """Region nodes to rewrite per tower -> ``"shape"`` (scale element 0), ``"factor"`` (scale
    the value), ``"fill"`` (a uniform tensor resized along axis 0) or the name of a shape
    attribute; and the constants it cannot account for."""
    inside = set(region)
    plan: dict[str, str] = {}
    unexplained: list[str] = []
    batch_shapes, other_shapes = _shapes(ir, region, dependent, batch)
    for name in region:
        node = ir.nodes[name]
        for key in ops.SHAPE_ATTRS.get(node.op, ()):
            shape = node.attr(key)
            if shape and shape[0] == batch:
                plan[name] = key
        if node.op != "Const":
            continue
        value = ir.const_value(name)
        if value is None or value.size == 0:
            continue
        if _uniform_batch_tensor(ir, name, value, batch, scopes, dependent):
            plan[name] = "fill"
            continue
        if value.size > 16:
            continue
        key = tuple(value.tolist()) if value.ndim == 1 and value.dtype.kind == "i" else None
        forward = not any(name.startswith(p + "/") for p in scopes)
        if key in batch_shapes and (key not in other_shapes or (
                forward and _scope_vote(ir, name, key, dependent) == "batch")):
            plan[name] = "shape"
            continue
        if value.ndim == 0 and value.dtype.kind == "i" and _scales((int(value),), batch):
            if _count_vote(ir, name, int(value), scopes, dependent) == "batch":
                plan[name] = "factor"
                continue
        for consumer in ir.consumers(name):
            if consumer.name not in inside:
                continue
            for pos, ref in enumerate(consumer.inputs):
                if node_of(ref) != name:
                    continue
                vote = _local_vote(ir, consumer, key, scopes, dependent)
                how = None if vote == "shared" else _classify(ir, consumer, pos, value, batch,
                                                              scopes, dependent)
                if vote == "batch" and _scales(key, batch):
                    how = "shape"
                if how is not None:
                    plan[name] = how
                elif vote != "shared" and (key in batch_shapes or (
                        (consumer.op, pos) in ops.SHAPE_CONSUMERS and _scales(key, batch))):
                    unexplained.append(name)
    return plan, [n for n in dict.fromkeys(unexplained) if n not in plan]


def _scales(key, batch: int) -> bool:
    return key is not None and key[0] > 0 and key[0] % batch == 0


def _shapes(ir: IR, region: list[str], dependent: set[str], batch: int
            ) -> tuple[set[tuple[int, ...]], set[tuple[int, ...]]]:
    """Fully known static shapes in the region: those of batch-dependent tensors whose leading
    dimension is a multiple of ``batch`` (an integer constant equal to one is that tensor's
    shape, folded by Python), and those of batch-independent tensors (a constant equal to one
    of these is ambiguous when the batch size coincides with a model dimension)."""
    batch_shapes: set[tuple[int, ...]] = set()
    other: set[tuple[int, ...]] = set()
    for name in region:
        is_dependent = name in dependent
        for shape in ir.static_shapes.get(name) or ():
            if not shape or None in shape:
                continue
            if is_dependent and _scales(tuple(shape), batch):
                batch_shapes.add(tuple(shape))
            elif not is_dependent:
                other.add(tuple(shape))
    return batch_shapes, other


def _context(ir: IR, consumer, scopes) -> list[tuple[str, str]]:
    """(producer, tensor) pairs around ``consumer``: the inputs and outputs of the forward op
    whose gradient code it belongs to, or its own."""
    context = consumer.name
    for prefix in scopes:
        if consumer.name.startswith(prefix + "/"):
            context = forward_op_of(ir, prefix, consumer.name) or context
    node = ir.nodes[context]
    return [(node_of(r), r) for r in node.inputs] + [
        (context, f"{context}:{i}") for i in range(len(ir.static_shapes.get(context) or ()))]


def _count_vote(ir: IR, name: str, value: int, scopes, dependent: set[str]) -> str | None:
    """Whether an integer scalar is the element count of a batch-dependent tensor (a folded
    ``Size``) near each of its consumers, and of no batch-independent one."""
    votes = set()
    for consumer in ir.consumers(name):
        for producer, ref in _context(ir, consumer, scopes):
            shape = ir.static_shape(ref)
            if shape is not None and None not in shape and int(np.prod(shape)) == value:
                votes.add("batch" if producer in dependent else "shared")
    return votes.pop() if len(votes) == 1 else None


def _uniform_batch_tensor(ir: IR, name: str, value: np.ndarray, batch: int, scopes,
                          dependent: set[str]) -> bool:
    """A constant filled with one value whose shape is a per-example tensor's (a folded
    ``zeros_like``/``ones_like`` of a batch-dependent tensor): each tower needs its own size."""
    if value.ndim == 0 or not _scales(value.shape, batch) or value.size > (1 << 24):
        return False
    flat = value.reshape(-1)
    if not np.all(flat == flat[0]):
        return False
    votes = {_local_vote(ir, c, tuple(value.shape), scopes, dependent, exclude=name)
             for c in ir.consumers(name)}
    return votes == {"batch"}


def _scope_vote(ir: IR, name: str, key, dependent: set[str]) -> str | None:
    """For a folded shape in forward code (``<scope>/Shape``): which tensors of the same name
    scope have that shape, batch-dependent or not. Python folds ``tf.shape(x)`` of an op's own
    input there. (Not for gradient code, whose parameter gradients depend on the batch.)"""
    scope = name.rsplit("/", 1)[0] + "/" if "/" in name else ""
    votes = set()
    for other, node in ir.nodes.items():
        if node.op == "Const" or not (other.startswith(scope) or scope.rstrip("/") == other):
            continue
        for producer, ref in [(node_of(r), r) for r in node.inputs] + [(other, f"{other}:0")]:
            shape = ir.static_shape(ref)
            if shape and None not in shape and tuple(shape) == key:
                votes.add("batch" if producer in dependent else "shared")
    return votes.pop() if len(votes) == 1 else None


def _local_vote(ir: IR, consumer, key, scopes, dependent: set[str], exclude: str = "") -> str | None:
    """Whether a shape constant is the shape of a batch-dependent tensor ("batch") or of a
    batch-independent one ("shared") next to where it is used: among the inputs and outputs
    of the forward op whose gradient code uses it, or of its consumer."""
    if key is None:
        return None
    tensors = _context(ir, consumer, scopes)
    votes = set()
    for producer, ref in tensors:
        if producer == exclude:
            continue
        shape = ir.static_shape(ref)
        if shape and None not in shape and tuple(shape) == key:
            votes.add("batch" if producer in dependent else "shared")
    return votes.pop() if len(votes) == 1 else None


def _classify(ir: IR, consumer, pos: int, value: np.ndarray, batch: int, scopes,
              dependent: set[str]) -> str | None:
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
                if float(value) == float(factor) and forward in dependent:
                    return "factor"
    return None
