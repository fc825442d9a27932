"""Helper of the guard pass: kernels that reject a batch of no examples run on one zero example.

Requires: the clone pass's tower copies (``ir.facts["copies"]``).

Produces: every tower copy of an op of :data:`PADDED` reads its batch-shaped inputs with one
zero example appended when its tower has none, and its readers get its batch-shaped outputs
sliced back to the tower's examples (none). With examples nothing is appended and the slices
are whole, so the values are the same bits.

Why (for ``MirrorPad``, see :data:`MIRRORED`): ``tf.nn.max_pool_with_argmax`` (SegNet's
pooling, whose indices the decoder unpools by) rejects an empty batch with "tensor_in must not
be empty", with or without oneDNN, and so does its gradient; a tower gets no examples when a
step's batch is smaller than the number of towers (review 28: exact claimed, the train step
failed where one device runs).
"""

from __future__ import annotations

from tensorflow.python.framework import dtypes

from replicate.graph.ir import IR, node_of
from replicate.passes._empty import dimension_of, tower_copies

__all__ = ["PADDED", "MIRRORED", "pad_empty_batches"]

#: Op -> (positions of its inputs with examples on axis 0, outputs with examples on axis 0,
#: their rank).
PADDED = {
    "MaxPoolWithArgmax": ((0,), (0, 1), 4),
    "MaxPoolGradWithArgmax": ((0, 1, 2), (0,), 4),
}

#: Reflection padding (CycleGAN's and style transfer's generators, ``tf.image.sobel_edges``)
#: and its gradient: every padding must be less than its dimension (``REFLECT``), so a batch
#: axis padded by none is rejected when it is empty ("paddings must be less than the dimension
#: size: 0, 0 not less than 0", review 33). Each empty axis it pads by none reads one zero row
#: more, cut from the result (the batch axis wherever it is, review 34).
MIRRORED = frozenset({"MirrorPad", "MirrorPadGrad"})

SCOPE = "replicate/pad"


def pad_empty_batches(ir: IR) -> int:
    """Pad the tower copies of :data:`PADDED` and :data:`MIRRORED` ops (module docstring);
    returns how many."""
    done = 0
    for op in tower_copies(ir, PADDED):
        _pad(ir, op, *PADDED[op.op])
        done += 1
    for op in tower_copies(ir, MIRRORED):
        paddings = ir.const_value(node_of(op.inputs[1]))
        if paddings is None or paddings.ndim != 2 or not len(paddings):
            continue        # paddings known only at run time: left as they are
        _mirror(ir, op, [int(not p.any()) for p in paddings])
        done += 1
    return done


def _mirror(ir: IR, op, unpadded: list[int]) -> None:
    """``op`` (``MirrorPad`` or its gradient) reads its input with one zero row more along
    every axis it pads by none that is empty (the batch axis of an empty tower, wherever it
    is: ``[T, B, C]`` too), and its readers get its output cut by that row."""
    i32, scope, dev, rank = dtypes.int32, f"{op.name}/{SCOPE}", op.device, len(unpadded)

    def add(name, kind, inputs, **attrs):
        return ir.add(f"{scope}/{name}", kind, inputs, device=dev, attrs=attrs).name

    def const(name, value):
        return ir.const(f"{scope}/{name}", value, i32, dev)

    dtype = dtypes.as_dtype(ir.output_dtype(op.inputs[0]))
    readers = [c.name for c, _ in ir.data_consumers(op.name)]
    empty = add("empty", "Equal", [add("shape", "Shape", [op.inputs[0]], T=dtype, out_type=i32),
                                   const("zero", 0)], T=i32, incompatible_shape_error=True)
    extra = add("extra", "Mul", [add("empty_axes", "Cast", [empty], SrcT=dtypes.bool, DstT=i32),
                                 const("unpadded", unpadded)], T=i32)
    rows = add("paddings", "Pack", [const("none", [0] * rank), extra], T=i32, N=2, axis=1)
    ir.set_input(op.name, 0, add("input_0", "Pad", [op.inputs[0], rows], T=dtype, Tpaddings=i32))
    size = add("size", "Sub", [add("out_shape", "Shape", [op.name], T=dtype, out_type=i32), extra], T=i32)
    sliced = add("output_0", "Slice", [op.name, const("begin", [0] * rank), size], T=dtype, Index=i32)
    ir.replace_uses(op.name, sliced, only=readers)


def _pad(ir: IR, op, ins: tuple[int, ...], outs: tuple[int, ...], rank: int) -> None:
    """``op`` reads inputs ``ins`` with one zero example appended when its batch is empty;
    its readers get outputs ``outs`` sliced back to the batch."""
    i32, scope, dev = dtypes.int32, f"{op.name}/{SCOPE}", op.device

    def add(name, kind, inputs, **attrs):
        return ir.add(f"{scope}/{name}", kind, inputs, device=dev, attrs=attrs).name

    def const(name, value):
        return ir.const(f"{scope}/{name}", value, i32, dev)

    batch = dimension_of(ir, op.inputs[ins[0]], 0, scope, dev)
    extra = add("extra", "Cast", [add("empty", "Equal", [batch, const("zero", 0)], T=i32,
                                      incompatible_shape_error=True)], SrcT=dtypes.bool, DstT=i32)
    row = add("row", "Reshape", [add("pair", "Pack", [const("none", 0), extra], T=i32, N=2),
                                 const("row_shape", [1, 2])], T=i32, Tshape=i32)
    paddings = add("paddings", "ConcatV2", [row, const("rest", [[0, 0]] * (rank - 1)), const("axis", 0)],
                   T=i32, N=2, Tidx=i32)
    for i in ins:
        ref = op.inputs[i]
        ir.set_input(op.name, i, add(f"input_{i}", "Pad", [ref, paddings],
                                     T=dtypes.as_dtype(ir.output_dtype(ref)), Tpaddings=i32))
    size = add("size", "Pack", [batch] + [const(f"all_{d}", -1) for d in range(1, rank)], T=i32, N=rank)
    for out in outs:
        ref = f"{op.name}:{out}" if out else op.name
        readers = [c.name for c, _ in ir.data_consumers(ref)]
        if not readers:
            continue
        sliced = add(f"output_{out}", "Slice", [ref, const(f"begin_{out}", [0] * rank), size],
                     T=dtypes.as_dtype(ir.output_dtype(ref)), Index=i32)
        ir.replace_uses(ref, sliced, only=readers)
