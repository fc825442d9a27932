"""Row numbers of the global batch fed to a gather: each tower reads them as its own.

Requires: ``ir.facts["analysis"]`` (its settled dataflow's ``fed_rows``: gathers of a batch's
rows by row numbers fed in a batch input of the same class,
:func:`replicate.batchflow.rules.index._fed_rows`), the split pass's counts and the clone
pass's tower copies.

Produces: before every tower copy of such a ``GatherNd``, and before its own gradient (the
``ScatterNd`` into its params' shape), the index tuples with the tower's first row's number
taken from their row column, through an ``Identity`` that waits for an ``Assert`` that they
all name rows of the tower (from 0 to its count).

Why: DQN drivers feed ``[[0, a0], [1, a1], ...]`` beside the states, and one device's
``tf.gather_nd(q, idx)`` reads row ``i`` of the whole batch. A tower holds rows ``offset`` to
``offset + count`` of it, so the same numbers read other rows, or none (the rewrite failed at
step 1 with TensorFlow's "does not index into param shape"). Less the offset, each tower reads
exactly the rows one device reads, and its gradient scatters to them. Numbers that name
another tower's row (pairs drawn across the batch) have no such tower: the check stops the
step with a message that names the op and the input, instead of training differently.
"""

from __future__ import annotations

from tensorflow.python.framework import dtypes

from replicate.batchflow.table import behind
from replicate.graph.ir import IR, node_of, parse_tensor, tensor_name
from replicate.passes.split import tower_offsets

__all__ = ["MARKER", "local_rows", "warnings"]

#: The start of every assertion message.
MARKER = "replicate: fed row numbers leave the tower's rows"

SCOPE = "replicate/rows"


def warnings(ir: IR, flow) -> list[str]:
    """What the report says about each gather by fed row numbers."""
    out = []
    for name, (_, fed, _) in sorted(flow.ctx.fed_rows.items() if flow is not None else ()):
        out.append(f"'{name}' picks rows of the batch by the row numbers fed in '{fed}', taken to "
                   "number the rows of the whole batch as one device reads them: each tower reads "
                   "them less its first row's number, and checks every step that they name its "
                   "own rows")
    return out


def local_rows(ir: IR) -> int:
    """Rewrite every tower copy of a gather by fed row numbers (module docstring); returns how
    many tower ops read local numbers."""
    flow = ir.facts["analysis"].flow
    fed = flow.ctx.fed_rows if flow is not None else None
    if not fed:
        return 0
    towers, copies = ir.facts["towers"], ir.facts["copies"]
    done = 0
    for k, names in enumerate(copies):
        prefix = f"{towers.prefixes[k]}/"
        made: dict[str, str] = {}
        for name in sorted(fed):
            copied = names.get(name)
            if copied is None or copied not in ir.nodes:
                continue
            copy = ir.nodes[copied]
            cls, tensor, _ = fed[name]
            cls = flow.classes.find(cls)
            indices = copy.inputs[1]
            if indices not in made:
                made[indices] = _checked(ir, copy, indices, tower_offsets(ir, towers, cls)[k],
                                         towers.class_counts[cls][k], k, prefix, tensor)
            # the gather and its own gradient, ScatterNd(indices, dy, shape(params)); not a
            # lookup of a shared table by the same numbers, nor its gradient (review 29: the
            # table's rows were updated at the tower's numbers)
            ir.replace_uses(indices, made[indices], only=[copy.name] + _gradients_of(ir, copy, indices, prefix))
            done += 1
    return done


def _gradients_of(ir: IR, gather, indices: str, prefix: str) -> list[str]:
    """The tower's ``ScatterNd`` ops that read ``indices`` into the shape of ``gather``'s
    params: its gradient."""
    params = gather.inputs[0]
    out = []
    for reader, position in ir.data_consumers(indices):
        if reader.op != "ScatterNd" or position != 0 or not reader.name.startswith(prefix):
            continue
        shape = ir.nodes.get(node_of(behind(ir, reader.inputs[2], _SHAPE_PATH)))
        if shape is not None and shape.op == "Shape" and _same(shape.inputs[0], params):
            out.append(reader.name)
    return out


#: Ops between a params' ``Shape`` and the ``ScatterNd`` of its gradient.
_SHAPE_PATH = frozenset({"Identity", "Cast"})


def _same(a: str, b: str) -> bool:
    return tensor_name(*parse_tensor(a)) == tensor_name(*parse_tensor(b))


def _checked(ir: IR, copy, indices: str, offset: str, count: str, tower: int, prefix: str,
             fed: str) -> str:
    """``indices`` less ``offset`` in their row column, behind the check that every row is in
    ``[0, count)``."""
    scope, dev = f"{copy.name}/{SCOPE}", copy.device
    dtype = dtypes.as_dtype(ir.output_dtype(indices))
    i32 = dtypes.int32

    def add(suffix, op, inputs, control=(), **attrs):
        return ir.add(f"{scope}/{suffix}", op, inputs, list(control), device=dev, attrs=attrs).name

    def const(suffix, value, kind=i32):
        return ir.const(f"{scope}/{suffix}", value, kind, dev)

    def typed(ref, suffix):
        return ref if dtype == i32 else add(suffix, "Cast", [ref], SrcT=i32, DstT=dtype, Truncate=False)

    start, rows = typed(offset, "offset"), typed(count, "count")
    # [start, 0, ..., 0] as long as an index tuple
    shape = add("shape", "Shape", [indices], T=dtype, out_type=i32)
    depth = add("depth", "StridedSlice", [shape, const("last", [-1]), const("end", [0]), const("step", [1])],
                T=i32, Index=i32, end_mask=1, shrink_axis_mask=1)
    first = add("is_first", "Equal", [add("columns", "Range", [const("zero_start", 0), depth, const("one", 1)],
                                          Tidx=i32), const("zero_column", 0)], T=i32,
                incompatible_shape_error=True)
    shift = add("shift", "Mul", [add("first_column", "Cast", [first], SrcT=dtypes.bool, DstT=dtype,
                                     Truncate=False), start], T=dtype)
    local = add("local", "Sub", [indices, shift], T=dtype)
    picked = add("row_column", "GatherV2", [local, const("first", 0), const("last_axis", -1)],
                 Tparams=dtype, Tindices=i32, Taxis=i32, batch_dims=0)
    flat = add("flat", "Reshape", [picked, const("minus_one", [-1])], T=dtype, Tshape=i32)
    inside = add("inside", "LogicalAnd", [add("from_zero", "GreaterEqual", [flat, const("zero", 0, dtype)], T=dtype),
                                         add("below_count", "Less", [flat, rows], T=dtype)])
    ok = add("ok", "All", [inside, const("axis", [0])], Tidx=i32, keep_dims=False)
    text = const("message", f"{MARKER}: '{copy.name[len(prefix):]}' picks rows of the batch by the "
                 f"row numbers fed in '{fed}', which one device reads as rows of the whole batch; "
                 f"tower {tower} holds only its own rows, and these name others (feed row numbers "
                 "that stay within each example's own row, or train this graph on one device). "
                 "Tower's first row and row count:", dtypes.string)
    check = add("check", "Assert", [ok, text, offset, count], T=[dtypes.string, i32, i32], summarize=3)
    return add("checked", "Identity", [local], control=[check], T=dtype)
