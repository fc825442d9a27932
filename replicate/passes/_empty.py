"""Helper of the guard pass: ops that a tower without examples computes wrongly or cannot run.

A tower gets an empty slice when a step's batch is smaller than the number of towers (the last
short batch of an epoch). One device never runs these ops on no examples.

Requires: the clone pass's tower copies (``ir.facts["copies"]``) and ``ir.facts["analysis"]``
(its settled dataflow, ``analysis.flow``).

Produces, for reshapes (:func:`infer_reshapes`): in every tower copy of a forward ``Reshape``
whose target is computed at run time (``tf.reshape(flat, [tf.shape(x)[0], -1])``), the
``-1`` is replaced, when the input has no elements, by the value the analysis proved it has:
the number of elements per example of the input (the rows each example holds, in each copy of
the batch the axis holds, times the static size of one row) over the target's other
per-example dimensions. With elements TensorFlow infers it itself.

With no examples the input has no elements, and TensorFlow cannot infer the ``-1`` from it: a
flat ``[0]`` reshaped to ``[0, -1]`` becomes ``[0, 1]``, which then meets the other towers'
``[n, T]`` where their batch statistics are summed (a loss averaged over the batch only, per
time step), or breaks its own gradient code.

Produces, for ranges (:func:`nonzero_steps`): every tower copy of a gradient ``Range`` whose
step is computed at run time steps by 1 where that step is 0. TensorFlow rejects a zero step
("Requires delta != 0"); ``top_k``'s gradient steps by the length of the last axis, which is
the tower's count when ``top_k`` ranks the examples (hard-example mining, an inexact rewrite
that must still run). A range of step 0 has no elements in that gradient (it counts rows of
an empty tensor), and so does the same range stepping by 1; no other step changes.

Produces, for stacked lists (:func:`stack_empty_lists`): every tower copy of a
``TensorListStack`` whose element shape is only partly known (``tf.map_fn`` over the batch
with a per-example result of a dynamic length) stacks an empty list with that shape's unknown
dimensions taken as 0. TensorFlow refuses to stack an empty list without a full element shape
("Tried to stack elements of an empty list with non-fully-defined element_shape"); with
elements the list decides the shape itself, so nothing changes then.
"""

from __future__ import annotations

import math

from tensorflow.python.framework import dtypes

from replicate.batchflow.lattice import PART, Sym
from replicate.graph.ir import IR, node_of

__all__ = ["infer_reshapes", "nonzero_steps", "stack_empty_lists"]

SCOPE = "replicate/reshape"


def _tower_ops(ir: IR, op: str, operand: int, gradient: bool):
    """(tower prefix, tower copy) of every ``op`` of the forward code (or of gradient code)
    whose ``operand`` is computed at run time."""
    flow, copies = ir.facts["analysis"].flow, ir.facts["copies"]
    if flow is None:
        return
    for k, names in enumerate(copies):
        prefix = f"{ir.facts['towers'].prefixes[k]}/"
        for name, copied in names.items():
            copy = ir.nodes.get(copied)
            if copy is not None and copy.op == op and (name in flow.ctx.gradient) == gradient \
                    and ir.const_value(node_of(copy.inputs[operand])) is None:
                yield prefix, copy


def infer_reshapes(ir: IR) -> int:
    """Pin the ``-1`` of the towers' run-time reshape targets (see the module docstring);
    returns how many tower ops changed."""
    done = 0
    for prefix, copy in list(_tower_ops(ir, "Reshape", 1, gradient=False)):
        source, target = (r[len(prefix):] if r.startswith(prefix) else r for r in copy.inputs[:2])
        value = _inferred(ir, ir.facts["analysis"].flow, source, target)
        if value is not None:
            _pin(ir, copy, value)
            done += 1
    return done


def _inferred(ir: IR, flow, data: str, shape_of: str) -> int | None:
    """The value of the ``-1`` of the target ``shape_of`` of a reshape of ``data`` (names of
    the input graph), when the analysis proves it."""
    source, target = flow.fact(data), flow.fact(shape_of)
    if source is None or source.kind != PART or not isinstance(source.block, int) \
            or not isinstance(source.outer, int) or target is None or target.value is None:
        return None
    shape = ir.static_shape(data)
    if shape is None or any(d is None for i, d in enumerate(shape) if i != source.axis):
        return None
    # rows per example along the axis: ``block`` of each, in ``outer`` copies of the batch (a
    # time-major ``[T, B, H]`` holds T * H elements of each example, as ``[B, T, H]`` does)
    rest_dims = [d for i, d in enumerate(shape) if i != source.axis]
    per_example = source.block * source.outer * math.prod(rest_dims)
    rest, syms = 1, 0
    for element in target.value:
        if isinstance(element, Sym):
            if element.coef is None or element.cls != source.cls:
                return None
            rest, syms = rest * element.coef, syms + 1
        elif element is None:
            return None
        elif element != -1:
            rest *= element
    if syms != 1 or list(target.value).count(-1) != 1 or rest <= 0 or per_example % rest:
        return None
    return per_example // rest


def _pin(ir: IR, copy, value: int) -> None:
    """Replace the ``-1`` of ``copy``'s target by ``value`` when its input has no elements
    (with some, TensorFlow infers the same value itself)."""
    scope = f"{copy.name}/{SCOPE}"
    dtype = dtypes.as_dtype(copy.attr("Tshape", dtypes.int32))
    dev, target = copy.device, copy.inputs[1]
    data_type = dtypes.as_dtype(ir.output_dtype(copy.inputs[0]))
    size = ir.add(f"{scope}/size", "Size", [copy.inputs[0]], device=dev,
                  attrs={"T": data_type, "out_type": dtype}).name
    empty = ir.add(f"{scope}/empty", "Equal", [size, ir.const(f"{scope}/zero", 0, dtype, dev)],
                   device=dev, attrs={"T": dtype, "incompatible_shape_error": True}).name
    minus = ir.add(f"{scope}/minus", "Equal",
                   [target, ir.const(f"{scope}/minus_one", -1, dtype, dev)], device=dev,
                   attrs={"T": dtype, "incompatible_shape_error": True}).name
    unknown = ir.add(f"{scope}/unknown", "LogicalAnd", [minus, empty], device=dev).name
    pinned = ir.add(f"{scope}/target", "SelectV2",
                    [unknown, ir.const(f"{scope}/value", value, dtype, dev), target], device=dev,
                    attrs={"T": dtype}).name
    ir.set_input(copy.name, 1, pinned)


def nonzero_steps(ir: IR) -> int:
    """Make the towers' run-time gradient range steps nonzero (see the module docstring);
    returns how many tower ops changed."""
    done = 0
    for _, copy in list(_tower_ops(ir, "Range", 2, gradient=True)):
        scope, dev = f"{copy.name}/replicate/step", copy.device
        dtype = dtypes.as_dtype(copy.attr("Tidx", dtypes.int32))
        step = copy.inputs[2]
        zero = ir.add(f"{scope}/zero", "Equal", [step, ir.const(f"{scope}/nil", 0, dtype, dev)],
                      device=dev, attrs={"T": dtype, "incompatible_shape_error": True}).name
        ir.set_input(copy.name, 2, ir.add(f"{scope}/step", "SelectV2",
                                          [zero, ir.const(f"{scope}/one", 1, dtype, dev), step],
                                          device=dev, attrs={"T": dtype}).name)
        done += 1
    return done


def stack_empty_lists(ir: IR) -> int:
    """Give the towers' stacks of lists a full element shape when the list is empty (see the
    module docstring); returns how many tower ops changed."""
    done, i32 = 0, dtypes.int32
    for names in ir.facts["copies"]:
        for copied in names.values():
            copy = ir.nodes.get(copied)
            if copy is None or copy.op != "TensorListStack":
                continue
            shape = ir.const_value(node_of(copy.inputs[1]))
            if shape is None or shape.ndim != 1 or (shape >= 0).all():
                continue
            scope, dev = f"{copy.name}/replicate/empty", copy.device
            length = ir.add(f"{scope}/length", "TensorListLength", [copy.inputs[0]], device=dev).name
            empty = ir.add(f"{scope}/empty", "Equal", [length, ir.const(f"{scope}/zero", 0, i32, dev)],
                           device=dev, attrs={"T": i32, "incompatible_shape_error": True}).name
            full = ir.const(f"{scope}/full", [max(int(d), 0) for d in shape], i32, dev)
            ir.set_input(copy.name, 1, ir.add(f"{scope}/shape", "SelectV2", [empty, full, copy.inputs[1]],
                                              device=dev, attrs={"T": i32}).name)
            done += 1
    return done
