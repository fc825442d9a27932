"""Keep towers with an empty batch slice away from kernels that abort on an empty batch.

Requires: ``ir.facts["towers"]``, the clone pass's tower copies (``ir.facts["copies"]``) and
``ir.facts["analysis"]``.

Produces: every max-pooling gradient in a tower (``MaxPoolGrad``, ``MaxPoolGradV2``,
``MaxPool3DGrad``) reads its three batch-shaped inputs padded with one zero example when the
batch is empty, and its result is sliced back to the tower's batch size. With examples the
padding is zero and the slice is the whole tensor, so the values are the same bits; with none,
the kernel sees one example instead of zero.

Also: every tower copy of an op that picks examples by position checks first that its tower
holds enough examples, with a message that says so (:mod:`replicate.passes._picks`), or, when
only prints, summaries and assertion messages read it (in function bodies too), reads its input
padded with zeros to what it picks (:mod:`replicate.passes._logged`); and a
tower's run-time reshape target gets the ``-1`` the analysis proved (a sparse one to ``[n, -1]``
the product of its input's other dimensions), a gradient range a
nonzero step, a stack of an empty list or a TensorArray's gather a full element shape, and the gradient of a gather
along another axis its number of indices, a segment op a count of at least 0, a CTC loss a padding example, a NaN check of gradient code zeros, and a depthwise filter
gradient zeros (its kernel leaves the output unwritten), where an empty tower would fail (:mod:`replicate.passes._empty`), and
``max_pool_with_argmax`` and its gradient one zero example (:mod:`replicate.passes._pad`); and every tower gather of a flattened batch by offsets
``range(batch) * stride + offset`` checks that each offset stays inside its own example
(:mod:`replicate.passes._strided`); and every tower gather by row numbers fed for the whole
batch reads them less its first row's number, checked (:mod:`replicate.passes._rows`).

When the gradient's ``orig_output`` is the forward pooling op's output (``MaxPool``,
``MaxPoolV2``, ``MaxPool3D`` in the same tower, reading the same ``orig_input``) -- the usual
case -- the padding is put *before the forward op* instead: the forward op pools the padded
input, its other readers get its output sliced back to the tower's batch, and the gradient
reads the padded input, the forward output itself and its padded incoming gradient. Keeping the
forward op's output a direct input of the gradient is what lets TensorFlow's oneDNN rewrite pair
the two (the gradient then reuses the forward op's workspace); with a ``Pad`` in between the
gradient falls back to the Eigen kernel, which recomputes the pooling and allocates an int64
argmax buffer the size of the pooled output (the seeds' CNN at batch 256: 12 MiB more live
memory and 5x the kernel time, measured in ``benchmarks/accumulate.py``'s traces).

Why: TensorFlow's oneDNN ``MaxPoolGrad`` kernel (CPU builds, the default) aborts the whole
process on an empty batch with ``Check failed: dtype() == expected_dtype (1 vs. 3) int32
expected, got float`` -- even on one device, without replicate. A tower gets an empty slice when
the global batch is smaller than the number of towers (or, between-graph, a worker's local
batch is), which the fuzzer's tiny batches drew; it first showed up with collective all-reduce
strategies because those were the ones run with such batches at the time.
"""

from __future__ import annotations

import logging

from tensorflow.python.framework import dtypes

from replicate.graph.ir import IR
from replicate.passes._empty import (gather_gradient_widths, infer_reshapes, infer_sparse_reshapes,
                                     nonnegative_segments, nonzero_steps, shape_array_gathers,
                                     stack_empty_lists, zero_unwritten_outputs)
from replicate.passes._empty_kernels import (crop_gradient_depths, empty_gathers, empty_tensor_scatters,
                                             finite_gradient_checks, pad_ctc_losses)
from replicate.passes._logged import pad_logged_body_picks
from replicate.passes._pad import pad_empty_batches
from replicate.passes._picks import assert_examples
from replicate.passes._rows import local_rows
from replicate.passes._strided import check_offsets
from replicate.passes.pipeline import PassResult

__all__ = ["Guard", "GUARDED_OPS"]

log = logging.getLogger(__name__)

#: Op type -> how many leading data inputs carry the batch (orig_input, orig_output, grad).
GUARDED_OPS = {"MaxPoolGrad": 3, "MaxPoolGradV2": 3, "MaxPool3DGrad": 3}

SCOPE = "replicate/guard"

#: Guards of ops an empty tower would run wrongly or not at all (``passes/_empty.py``).
EMPTY_GUARDS = (
    (infer_reshapes, "reshapes get their inferred dimension from the analysis"),
    (infer_sparse_reshapes, "sparse reshapes to [examples, -1] the product of the other dimensions"),
    (nonzero_steps, "gradient ranges and integer divisions a nonzero step or divisor"),
    (stack_empty_lists, "list stacks a full element shape when empty"),
    (shape_array_gathers, "TensorArray gathers a full element shape"),
    (gather_gradient_widths, "gather gradients their number of indices"),
    (nonnegative_segments, "segment ops a count of at least 0"),
    (pad_ctc_losses, "CTC losses a padding example when empty"),
    (empty_tensor_scatters, "tensor scatters no index tuples into an empty tensor"),
    (empty_gathers, "gathers no index tuples from empty params"),
    (crop_gradient_depths, "crop gradients the depth of their incoming gradient"),
    (pad_empty_batches, "kernels that reject an empty batch one zero example"),
    (zero_unwritten_outputs, "kernels that leave their output unwritten when empty read zeros"),
    (finite_gradient_checks, "NaN checks of gradient code on values not per example read zeros when empty"),
    (pad_logged_body_picks, "picks in function bodies that only logging reads their input padded"),
)


class Guard:
    """Empty-batch guards around max-pooling gradients in the towers (no options)."""

    name = "guard"

    def run(self, ir: IR) -> PassResult:
        towers = ir.facts["towers"]
        prefixes = set(towers.prefixes)
        done = 0
        for node in [n for n in ir if n.op in GUARDED_OPS and n.name.split("/", 1)[0] in prefixes]:
            self._guard(ir, node)
            done += 1
        picks = assert_examples(ir)
        if picks:
            log.info("guard: %d tower ops that pick examples by position check their tower's count",
                     picks)
            done += picks
        fed = local_rows(ir)
        if fed:
            log.info("guard: %d tower gathers read fed row numbers as their own rows", fed)
            done += fed
        offsets = check_offsets(ir)
        if offsets:
            log.info("guard: %d tower gathers check their offsets into the flattened batch", offsets)
            done += offsets
        for guard, what in EMPTY_GUARDS:
            changed = guard(ir)
            if changed:
                log.info("guard: %d tower %s", changed, what)
                done += changed
        log.info("guard: %d tower ops guarded in all", done)
        return PassResult(ir, done > 0)

    @staticmethod
    def _forward(ir: IR, node):
        """The forward pooling op whose output 0 ``node`` reads as ``orig_output``, or None.

        Only when that op is in the same tower and pools ``node``'s ``orig_input``.
        """
        src, _, idx = node.inputs[1].partition(":")
        forward = ir.nodes.get(src)
        if (forward is None or idx not in ("", "0") or forward.op != FORWARD_OPS.get(node.op)
                or not forward.inputs or forward.inputs[0] != node.inputs[0]
                or src.split("/", 1)[0] != node.name.split("/", 1)[0]):
            return None
        return forward

    @staticmethod
    def _guard(ir: IR, node) -> None:
        tower, _, rest = node.name.partition("/")
        scope = f"{tower}/{SCOPE}/{rest}"
        dev = node.device
        i32 = dtypes.int32
        dtype = dtypes.as_dtype(node.attrs["T"].type)
        rank = 5 if node.op == "MaxPool3DGrad" else 4

        def add(name, op, inputs, **attrs):
            return ir.add(f"{scope}/{name}", op, inputs, device=dev, attrs=attrs).name

        def const(name, value):
            return ir.const(f"{scope}/{name}", value, i32, dev)

        first = node.inputs[0]
        shape = add("shape", "Shape", [first], T=dtype, out_type=i32)
        zero = const("zero", 0)
        batch = add("batch", "GatherV2", [shape, zero, zero], Tparams=i32, Tindices=i32, Taxis=i32)
        empty = add("empty", "Equal", [batch, zero], T=i32, incompatible_shape_error=True)
        extra = add("extra", "Cast", [empty], SrcT=dtypes.bool, DstT=i32)
        row = add("row", "Pack", [zero, extra], T=i32, N=2, axis=0)
        others = const("others", [[0, 0]] * (rank - 1))
        row2 = add("row2", "Reshape", [row, const("row_shape", [1, 2])], T=i32, Tshape=i32)
        paddings = add("paddings", "ConcatV2", [row2, others, zero], T=i32, N=2, Tidx=i32)
        size = add("size", "ConcatV2", [add("batch_vec", "Reshape", [batch, const("one", [1])],
                                                T=i32, Tshape=i32),
                                            const("rest", [-1] * (rank - 1)), zero],
                   T=i32, N=2, Tidx=i32)
        begin = const("begin", [0] * rank)
        forward = Guard._forward(ir, node)
        if forward is not None:
            # Pad the forward op's input; its other readers see its output sliced back.
            padded = add("padded_0", "Pad", [node.inputs[0], paddings], T=dtype, Tpaddings=i32)
            out = forward.name
            others = [c.name for c, _ in ir.data_consumers(out) if c.name != node.name]
            ir.set_input(forward.name, 0, padded)
            ir.set_input(node.name, 0, padded)
            pooled = add("forward_sliced", "Slice", [out, begin, size], T=dtype, Index=i32)
            ir.replace_uses(out, pooled, only=others)
            padded = add("padded_2", "Pad", [node.inputs[2], paddings], T=dtype, Tpaddings=i32)
            ir.set_input(node.name, 2, padded)
        else:
            for i in range(GUARDED_OPS[node.op]):
                padded = add(f"padded_{i}", "Pad", [node.inputs[i], paddings], T=dtype, Tpaddings=i32)
                ir.set_input(node.name, i, padded)
        ref = node.name
        readers = [c.name for c, _ in ir.data_consumers(ref)]
        sliced = add("sliced", "Slice", [ref, begin, size], T=dtype, Index=i32)
        ir.replace_uses(ref, sliced, only=readers)


#: Gradient op -> the forward op whose output it reads as ``orig_output``.
FORWARD_OPS = {"MaxPoolGrad": "MaxPool", "MaxPoolGradV2": "MaxPoolV2", "MaxPool3DGrad": "MaxPool3D"}
