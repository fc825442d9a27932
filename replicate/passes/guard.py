"""Keep towers with an empty batch slice away from kernels that abort on an empty batch.

Requires: ``ir.facts["towers"]`` and the clone pass's tower copies.

Produces: every max-pooling gradient in a tower (``MaxPoolGrad``, ``MaxPoolGradV2``,
``MaxPool3DGrad``) reads its three batch-shaped inputs padded with one zero example when the
batch is empty, and its result is sliced back to the tower's batch size. With examples the
padding is zero and the slice is the whole tensor, so the values are the same bits; with none,
the kernel sees one example instead of zero.

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

from replicate.ir import IR
from replicate.pipeline import PassResult

__all__ = ["Guard", "GUARDED_OPS"]

log = logging.getLogger(__name__)

#: Op type -> how many leading data inputs carry the batch (orig_input, orig_output, grad).
GUARDED_OPS = {"MaxPoolGrad": 3, "MaxPoolGradV2": 3, "MaxPool3DGrad": 3}

SCOPE = "replicate/guard"


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
        log.info("guard: %d max-pooling gradients guarded against empty batches", done)
        return PassResult(ir, done > 0)

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
        for i in range(GUARDED_OPS[node.op]):
            padded = add(f"padded_{i}", "Pad", [node.inputs[i], paddings], T=dtype, Tpaddings=i32)
            ir.set_input(node.name, i, padded)
        size = add("size", "ConcatV2", [add("batch_vec", "Reshape", [batch, const("one", [1])],
                                                T=i32, Tshape=i32),
                                            const("rest", [-1] * (rank - 1)), zero],
                   T=i32, N=2, Tidx=i32)
        begin = const("begin", [0] * rank)
        ref = node.name
        readers = [c.name for c, _ in ir.data_consumers(ref)]
        sliced = add("sliced", "Slice", [ref, begin, size], T=dtype, Index=i32)
        ir.replace_uses(ref, sliced, only=readers)
