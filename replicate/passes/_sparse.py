"""The split of a batch input fed as a ``SparseTensor`` (a helper of the split pass).

Tower ``k`` owns examples ``[lo_k, lo_k + n_k)`` of the batch. It gets the entries whose
column 0 of ``indices`` falls in that range, in their order, with column 0 renumbered from 0,
their values (and the entries of any further values fed for the same indices: sparse
weights), and the dense shape with element 0 replaced by ``n_k``. The analysis
(``batchflow/rules/sparse.py``) proves what the towers compute from these parts.
"""

from __future__ import annotations

from tensorflow.python.framework import dtypes

from replicate.errors import AnalysisError
from replicate.graph.ir import IR, parse_tensor

__all__ = ["split", "batch_size"]

SCOPE = "replicate/split/sparse"
I32, I64 = dtypes.int32, dtypes.int64


def _ref(tensor: str) -> str:
    name, idx = parse_tensor(tensor)
    return name if idx == 0 else f"{name}:{idx}"


def _base(triple: tuple) -> str:
    return f"{SCOPE}/{parse_tensor(triple[0])[0]}"


def batch_size(ir: IR, triple: tuple, scope: str, dev: str) -> str:
    """The batch size (int32) of a class whose only members are a sparse input's parts."""
    shape = triple[2]
    if shape is None:
        raise AnalysisError(f"the sparse batch input '{triple[0]}' has no fed dense shape to take "
                            "the batch size from; feed its SparseTensor whole, or name the inputs "
                            "to split with batch_inputs=")
    zero = ir.const(f"{scope}/sparse_row", 0, I32, dev)
    first = ir.add(f"{scope}/sparse_batch", "GatherV2", [_ref(shape), zero, zero], device=dev,
                   attrs={"Tparams": I64, "Tindices": I32, "Taxis": I32}).name
    return ir.add(f"{scope}/batch_size", "Cast", [first], device=dev,
                  attrs={"SrcT": I64, "DstT": I32, "Truncate": False}).name


def split(ir: IR, towers, triple: tuple, counts: list[str], dev: str) -> None:
    """Each tower's (indices, values, shape) of the sparse input ``triple``, in ``towers.inputs``."""
    indices, values, shape, *more = triple
    base = _base(triple)

    def add(name: str, op: str, inputs: list[str], **attrs) -> str:
        return ir.add(f"{base}/{name}", op, inputs, device=dev, attrs=attrs).name

    def const(name: str, value, dtype) -> str:
        return ir.const(f"{base}/{name}", value, dtype, dev)

    rows = add("rows", "StridedSlice", [_ref(indices), const("rows_begin", [0, 0], I32),
                                        const("rows_end", [0, 1], I32), const("rows_step", [1, 1], I32)],
               T=I64, Index=I32, begin_mask=1, end_mask=1, ellipsis_mask=0, new_axis_mask=0,
               shrink_axis_mask=2)
    dims = add("dims", "Shape", [_ref(indices)], T=I64, out_type=I32)
    one = const("one", 1, I32)
    rank = add("rank", "GatherV2", [dims, one, const("axis0", 0, I32)], Tparams=I32, Tindices=I32,
               Taxis=I32)
    first_col = add("first_column", "OneHot", [const("column", 0, I32), rank, const("on", 1, I64),
                                                 const("off", 0, I64)], T=I64, TI=I32, axis=-1)
    flat = const("flat", [-1], I32)
    lo = const("lo_0", 0, I32)
    for k, count in enumerate(counts):
        hi = add(f"hi_{k}", "AddV2", [lo, count], T=I32)
        lo64 = add(f"lo64_{k}", "Cast", [lo], SrcT=I32, DstT=I64, Truncate=False)
        hi64 = add(f"hi64_{k}", "Cast", [hi], SrcT=I32, DstT=I64, Truncate=False)
        mine = add(f"mine_{k}", "LogicalAnd", [add(f"from_{k}", "GreaterEqual", [rows, lo64], T=I64),
                                               add(f"below_{k}", "Less", [rows, hi64], T=I64)])
        picked = add(f"picked_{k}", "Reshape", [add(f"where_{k}", "Where", [mine], T=dtypes.bool),
                                                 flat], T=I64, Tshape=I32)
        gathered = add(f"entries_{k}", "GatherV2", [_ref(indices), picked, const(f"axis_{k}", 0, I32)],
                       Tparams=I64, Tindices=I64, Taxis=I32)
        shift = add(f"shift_{k}", "Mul", [first_col, lo64], T=I64)
        towers.inputs[k][indices] = add(f"indices_{k}", "Sub", [gathered, shift], T=I64) + ":0"
        entries = [p for p in [values] + more if p is not None]
        vaxis = const(f"vaxis_{k}", 0, I32) if entries else None
        for j, part in enumerate(entries):
            towers.inputs[k][part] = add(
                f"values_{k}" if j == 0 else f"values{j}_{k}", "GatherV2", [_ref(part), picked, vaxis],
                Tparams=dtypes.as_dtype(ir.output_dtype(part)), Tindices=I64, Taxis=I32) + ":0"
        if shape is not None:
            n64 = add(f"count64_{k}", "Cast", [count], SrcT=I32, DstT=I64, Truncate=False)
            rest = add(f"rest_{k}", "StridedSlice", [_ref(shape), const(f"rest_begin_{k}", [1], I32),
                                                     const(f"rest_end_{k}", [0], I32), const(f"rest_step_{k}", [1], I32)],
                       T=I64, Index=I32, begin_mask=0, end_mask=1, ellipsis_mask=0, new_axis_mask=0,
                       shrink_axis_mask=0)
            towers.inputs[k][shape] = add(f"shape_{k}", "ConcatV2", [
                add(f"count_row_{k}", "Reshape", [n64, const(f"one_row_{k}", [1], I32)], T=I64, Tshape=I32),
                rest, const(f"concat_axis_{k}", 0, I32)], T=I64, N=2, Tidx=I32) + ":0"
        lo = hi
