"""Check, in every tower, that offsets into a flattened batch stay inside their examples.

Requires: ``ir.facts["analysis"]`` (its settled dataflow, ``analysis.flow``) and the clone
pass's tower copies (``ir.facts["copies"]``).

Produces: before every tower copy of a ``Gather`` that the analysis accepted as a gather of a
flattened batch by offsets ``range(batch) * stride + offset``
(:mod:`replicate.batchflow.rules.strided`), an ``Assert`` that

- the flattened tensor holds ``stride`` entries per example of the tower, and
- every offset lies in its own example's entries: ``offset // stride`` is the number of the
  example the offset belongs to,

read by the gather and by its gradient through a checked ``Identity`` of the offsets. With the
offsets one device's program computes from lengths or tags in range, the check passes and the
values are the same bits. An offset outside its example makes one device read a neighbour's
entries, which a tower holding only its own examples cannot: the step stops with a message
that names the op, instead of training differently.
"""

from __future__ import annotations

from tensorflow.python.framework import dtypes

from replicate.batchflow.lattice import PART
from replicate.batchflow.rules.strided import strided
from replicate.graph.ir import IR
from replicate.passes._picks import behind_check

__all__ = ["GATHERS", "MARKER", "accepted", "check_offsets", "warning", "warnings"]

GATHERS = frozenset({"Gather", "GatherV2"})

#: The start of every assertion message.
MARKER = "replicate: an offset into a flattened batch leaves its example"

SCOPE = "replicate/offsets"


def accepted(flow, name: str, op: str, indices: str) -> tuple | None:
    """The offsets' tag when the analysis accepted node ``name`` (``op`` reading ``indices``)
    as such a gather, else None."""
    if op not in GATHERS:
        return None
    index, out = flow.fact(indices), flow.fact(f"{name}:0")
    if not strided(index) or out is None or out.kind != PART:
        return None
    return index.index


def warnings(ir: IR, flow, region) -> list[str]:
    """What the report says about each such gather of ``region``."""
    return [warning(n) for n in region if len(ir.nodes[n].inputs) > 1
            and accepted(flow, n, ir.nodes[n].op, ir.nodes[n].inputs[1]) is not None]


def warning(name: str) -> str:
    """What the report says about one such gather."""
    return (f"'{name}' gathers from a flattened batch at range(batch) * stride + offset: exact "
            "while every offset stays within its own example's entries (lengths and tags in "
            f"range); every tower checks that at run time ('{name}/{SCOPE}/check')")


def check_offsets(ir: IR) -> int:
    """Add the checks (see the module docstring); returns how many tower ops got one."""
    flow, copies = ir.facts["analysis"].flow, ir.facts["copies"]
    if flow is None:
        return 0
    done = 0
    for k, names in enumerate(copies):
        prefix = f"{ir.facts['towers'].prefixes[k]}/"
        for name, copied in names.items():
            copy = ir.nodes.get(copied)
            if copy is None or copy.op not in GATHERS or len(copy.inputs) < 2:
                continue
            indices = copy.inputs[1]
            tag = accepted(flow, name, copy.op, indices[len(prefix):] if indices.startswith(prefix) else indices)
            if tag is None:
                continue

            def mine(ref: str) -> str:
                src, _, out = ref.partition(":")
                moved = names.get(src)
                return ref if moved is None else f"{moved}:{out or 0}"

            _check(ir, copy, k, [mine(s) for s in tag[2]], mine(tag[3]), tag[4], prefix)
            done += 1
    return done


def _check(ir: IR, copy, tower: int, strides: list[str], rows: str, axis: int, prefix: str) -> None:
    scope, dev = f"{copy.name}/{SCOPE}", copy.device
    i32, i64 = dtypes.int32, dtypes.int64

    def add(suffix, op, inputs, **attrs):
        return ir.add(f"{scope}/{suffix}", op, inputs, device=dev, attrs=attrs).name

    def const(suffix, value, dtype=i64):
        return ir.const(f"{scope}/{suffix}", value, dtype, dev)

    def long(ref, suffix):
        dtype = dtypes.as_dtype(ir.output_dtype(ref))
        return ref if dtype == i64 else add(suffix, "Cast", [ref], SrcT=dtype, DstT=i64, Truncate=False)

    def dim(ref, at, suffix):
        dtype = dtypes.as_dtype(ir.output_dtype(ref))
        shape = add(f"{suffix}_shape", "Shape", [ref], T=dtype, out_type=i64)
        return add(suffix, "GatherV2", [shape, const(f"{suffix}_at", at, i32), const(f"{suffix}_axis", 0, i32)],
                   Tparams=i64, Tindices=i32, Taxis=i32, batch_dims=0)

    indices = copy.inputs[1]
    one = const("one", 1)
    examples = dim(rows, axis, "examples")
    stride = long(strides[0], "stride_0")
    for j, ref in enumerate(strides[1:], 1):
        stride = add(f"stride_{j}_product", "Mul", [stride, long(ref, f"stride_{j}")], T=i64)
    entries = dim(copy.inputs[0], 0, "entries")
    whole = add("entries_per_example", "Equal", [entries, add("expected", "Mul", [stride, examples], T=i64)],
                T=i64, incompatible_shape_error=True)
    flat = add("flat", "Reshape", [long(indices, "offsets"), const("minus_one", [-1], i32)], T=i64, Tshape=i32)
    count = add("count", "Size", [flat], T=i64, out_type=i64)
    per = add("per_example", "FloorDiv", [count, add("examples_at_least_one", "Maximum", [examples, one], T=i64)], T=i64)
    owner = add("owner", "FloorDiv", [add("positions", "Range", [const("zero", 0), count, one], Tidx=i64),
                                      add("per_example_at_least_one", "Maximum", [per, one], T=i64)], T=i64)
    block = add("block", "FloorDiv", [flat, add("stride_at_least_one", "Maximum", [stride, one], T=i64)], T=i64)
    inside = add("inside", "All", [add("same_example", "Equal", [block, owner], T=i64,
                                       incompatible_shape_error=True), const("dims", [0], i32)],
                 Tidx=i32, keep_dims=False)
    ok = add("ok", "LogicalAnd", [whole, inside])
    text = const("message", f"{MARKER}: '{copy.name[len(prefix):]}' gathers at range(batch) * "
                 "stride + offset from a flattened batch, which each tower reproduces only while "
                 "every offset stays within its own example's stride entries (one device would "
                 "read another example's); check the lengths or tags fed. Tower "
                 f"{tower}: examples, stride, entries:", dtypes.string)
    check = add("check", "Assert", [ok, text, examples, stride, entries], T=[dtypes.string, i64, i64, i64],
                summarize=3)
    behind_check(ir, indices, check, f"{scope}/checked", dev, prefix, SCOPE)
