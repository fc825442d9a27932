"""Helper of the draw pass: a draw inside a loop makes only the tower's rows.

Every tower drawing the global batch's rows and keeping its own is cheap once per step, but
a dropout mask inside a loop (``DropoutWrapper`` in ``dynamic_rnn``) is drawn in every
iteration, and then N towers make N times the numbers of one device (1.12x the per-tower
streams' step time at 4 devices, measured). Counter-based draws avoid that:

- A stateful random kernel of TensorFlow (``RandomUniform``, ``RandomStandardNormal``,
  ``TruncatedNormal``, ``RandomUniformInt``) is a Philox stream keyed by the op's ``seed``;
  its 128-bit counter starts with ``seed2`` in its high word, and each run advances it by
  256 per element drawn. Element ``e`` of a run comes from the counter at the run's start
  plus ``(e // G) * S``: a group of ``G`` elements takes ``S`` counter values
  (:data:`TWINS`, by op and dtype; tests/test_streams.py checks the table bit for bit).
- The op's stateless twin (``Stateless*V2``: key and counter are inputs) draws from any
  counter. Tower ``k``, whose rows begin at element ``e_k`` of the draw, draws only its
  rows, from counter ``c + (e_k // G) * S``, where ``c`` is the stream's counter at this
  run. When a row's element count is not a multiple of ``G``, the tower's first element
  need not start a group: it draws ``e_k % G`` elements more, flat, and drops them.
- Each tower keeps the stream's state (counter and key, ``tf.random.Generator``'s layout) in
  a resource variable of its own (``replicate/draw/stream/<tower>/...``). ``RngReadAndSkip``
  reads it and advances it by the global draw's element count, as the kernel advances; so
  the state follows the one-device kernel run by run, over iterations and steps, exactly as
  the tower's own kernel of a global-shape draw did. That holds where the kernel is the
  session's, one per node whatever a run fetches: in TF1 loops and in the conds and loops
  TensorFlow lowers into the graph. Under a defun (a ``PartitionedCall``) the kernel can be
  one per fetch signature, which no session-wide state follows: those draws keep the global
  rows (:func:`replicate.passes._body_draws.streams_of`). A guard sets it to the op's seeds the
  first time a session runs it: no initializer that a driver would have to know about, and
  like the kernel it starts again in every new session (and on a server's target, where a
  session's successor finds the state where it was left, so did the kernels in review 38's
  measurement: a second session on an in-process server matched one device exactly).

Requires: a ``rows`` draw with its rows contiguous (axis 0, one copy of the batch), a seeded
op of :data:`TWINS` and a static element count per row (:func:`plan`); else the draw pass
keeps the global-shape draw.

Produces: :func:`state` (a tower's variable and the guard that sets it), :func:`in_frames`
(the tower's draw inside TF1 while loops) and :func:`in_function` (inside a function body).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from tensorflow.core.framework import attr_value_pb2, node_def_pb2, tensor_shape_pb2
from tensorflow.python.framework import dtypes, tensor_util

from replicate.graph.ir import IR, node_of
from replicate.graph.node import make_attr
from replicate.passes._frames import enter

__all__ = ["TWINS", "Plan", "plan", "state", "state_name", "in_frames", "in_function", "SCOPE"]

SCOPE = "replicate/draw/stream"

#: Stateful random op -> (its stateless twin, the attribute naming the output dtype, (G, S)
#: by dtype, (G, S) otherwise): a group of G elements takes S counter values.
TWINS = {
    "RandomUniform": ("StatelessRandomUniformV2", "dtype", {dtypes.float64: (2, 1)}, (4, 1)),
    "RandomStandardNormal": ("StatelessRandomNormalV2", "dtype", {dtypes.float64: (2, 1)}, (4, 1)),
    "TruncatedNormal": ("StatelessTruncatedNormalV2", "dtype", {dtypes.float64: (2, 128)}, (4, 256)),
    "RandomUniformInt": ("StatelessRandomUniformIntV2", "Tout", {dtypes.int64: (2, 1)}, (4, 1)),
}

#: ``RNG_ALG_PHILOX``: the algorithm of the stateful kernels.
PHILOX = 1


class Plan(NamedTuple):
    """How a tower draws its rows of one op: the stateless ``twin``, its output ``dtype``, the
    seeds, the op's ``group`` and ``skip`` (G and S of :data:`TWINS`), and ``elements``: the
    elements of one example's rows (``block`` rows of ``width`` elements)."""
    twin: str
    dtype: object
    seed: int
    seed2: int
    group: int
    skip: int
    elements: int

    @property
    def aligned(self) -> bool:
        """Every tower's first element starts a group."""
        return self.elements % self.group == 0


def _int(attrs, key: str) -> int:
    value = attrs.get(key)
    return int(value.i) if value is not None else 0


def plan(op: str, attrs, axis: int | None, outer: int, block: int, width: int | None) -> Plan | None:
    """The counter-based plan of a draw of ``op`` (attributes ``attrs``: AttrValues by name)
    whose rows lie along ``axis`` with ``width`` elements after it (static, else None), or
    None when the tower's rows cannot be drawn alone."""
    if op not in TWINS or axis != 0 or outer != 1 or not width:
        return None
    twin, key, special, usual = TWINS[op]
    dtype = dtypes.as_dtype(attrs[key].type)
    group, skip = special.get(dtype, usual)
    seed, seed2 = _int(attrs, "seed"), _int(attrs, "seed2")
    if (seed, seed2) == (0, 0):
        return None
    return Plan(twin, dtype, seed, seed2, group, skip, block * width)


def _uint64(value: int) -> np.ndarray:
    return np.array([value], np.int64).view(np.uint64)


def state_name(name: str) -> str:
    """The shared name of a tower's state of one op's stream (``name``: tower and op)."""
    return f"{SCOPE}/{name}/state"


def _handle_attrs(shared: str) -> dict:
    shape = attr_value_pb2.AttrValue(shape=tensor_shape_pb2.TensorShapeProto(
        dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=3)]))
    return {"dtype": dtypes.int64, "shape": shape, "shared_name": shared, "container": ""}


def state(ir: IR, name: str, p: Plan, device: str) -> tuple[str, str]:
    """A tower's stream state for one op (``<SCOPE>/<name>``): the variable's handle and a
    guard to wait for, which sets it to the op's seeds when the session has not yet."""
    base = f"{SCOPE}/{name}"
    if f"{base}/state" in ir.nodes:     # calls of one function share its kernels, and states
        return f"{base}/state", f"{base}/guard"
    handle = ir.add(f"{base}/state", "VarHandleOp", device=device,
                    attrs=_handle_attrs(state_name(name))).name
    seeds = ir.const(f"{base}/seeds", np.array([0, p.seed2, p.seed], np.int64), dtypes.int64, device)
    ready = ir.add(f"{base}/is_set", "VarIsInitializedOp", [handle], device=device).name
    switch = ir.add(f"{base}/switch", "Switch", [ready, ready], device=device,
                    attrs={"T": dtypes.bool}).name
    unset = ir.add(f"{base}/unset", "Identity", [f"{switch}:0"], device=device,
                   attrs={"T": dtypes.bool}).name       # alive only in a session's first run
    assign = ir.add(f"{base}/set", "AssignVariableOp", [handle, seeds], [unset], device,
                    attrs={"dtype": dtypes.int64}).name
    was_set = ir.add(f"{base}/was_set", "Identity", [unset], [assign], device,
                     attrs={"T": dtypes.bool}).name
    guard = ir.add(f"{base}/guard", "Merge", [was_set, f"{switch}:1"], device=device,
                   attrs={"T": dtypes.bool, "N": 2}).name
    return handle, guard


def _start(op, const, first, p: Plan) -> tuple[str, str | None]:
    """From the tower's first row ``first`` (int64): the counter offset of its first element
    (int64 ``[offset, 0, 0]``, added to the state) and, when the plan is not aligned, how many
    elements of the group it starts in to drop (int64), else None. ``op(name, kind, inputs,
    output_arg, **attrs)`` and ``const(name, value, dtype)`` add nodes where the caller says."""
    i64 = dtypes.int64
    if p.aligned:
        per_row = np.array([p.elements // p.group * p.skip, 0, 0], np.int64)
        return op("start", "Mul", [first, const("per_row", per_row, i64)], "z", T=i64), None
    element = op("first_element", "Mul", [first, const("per_example", p.elements, i64)], "z", T=i64)
    group = const("group", p.group, i64)
    groups = op("first_group", "FloorDiv", [element, group], "z", T=i64)
    start = op("start", "Mul", [groups, const("skip", np.array([p.skip, 0, 0], np.int64), i64)], "z", T=i64)
    return start, op("drop", "FloorMod", [element, group], "z", T=i64)


def _flat(op, shape: str, index, drop: str, all_axes: str) -> tuple[str, str]:
    """For a plan not aligned: the tower's element count and the flat shape to draw (the
    count and the ``drop`` elements before the tower's first)."""
    count = op("elements", "Prod", [shape, all_axes], "output", T=index, Tidx=dtypes.int32,
               keep_dims=False)
    flat = op("flat_elements", "AddV2", [count, drop], "z", T=index)
    return count, op("flat_shape", "Pack", [flat], "output", T=index, N=1, axis=0)


def in_frames(ir: IR, copy: str, p: Plan, chain, batch: str, offset: str, tower: str) -> None:
    """Tower copy ``copy`` of a draw inside the TF1 loops ``chain`` draws only its rows. What
    does not change within a step (the global draw's element count, the counter offset of
    the tower's first element, the key, the handle) is computed at the root and entered into
    the frames; each run costs the state's read-and-skip, the offset's add and a bitcast
    (and, not aligned, five small ops to cut the rows from a flat draw)."""
    node = ir.nodes[copy]
    dev, i64, u64 = node.device, dtypes.int64, dtypes.uint64
    index = dtypes.as_dtype(node.attrs["T"].type)
    base = f"{copy}/stream"
    handle, guard = state(ir, f"{tower}/{copy.split('/', 1)[-1]}", p, dev)

    def op(name: str, kind: str, inputs: list[str], _out: str = "", control=(), **attrs) -> str:
        return ir.add(f"{base}/{name}", kind, inputs, list(control), dev, attrs).name

    def const(name: str, value, dtype) -> str:
        return ir.const(f"{base}/{name}", value, dtype, dev)

    def cast(name: str, ref: str, to) -> str:
        return op(name, "Cast", [ref], SrcT=dtypes.as_dtype(ir.output_dtype(ref)), DstT=to, Truncate=False)

    def into(name: str, ref: str, dtype) -> str:
        return enter(ir, ref, chain, f"{base}/{name}", dev, dtype)

    # once per step, at the root
    count = op("global_elements", "Mul", [cast("batch", batch, i64), const("row_elements", p.elements, i64)], T=i64)
    delta = into("delta", cast("delta", count, u64), u64)
    start, drop = _start(op, const, cast("first", offset, i64), p)
    start = into("start", start, i64)
    h = into("handle", handle, dtypes.resource)
    ir.set_control(f"{base}/handle/enter_0", [guard])
    key = into("key", ir.const(f"{base}/key", _uint64(p.seed), u64, dev), u64)
    alg = into("alg", ir.const(f"{base}/alg", PHILOX, dtypes.int32, dev), dtypes.int32)
    # in every run: the read runs when the draw would, after the draw's inputs and control
    # inputs: a dead input (an untaken branch of a cond in the loop) skips the read as it
    # skips the draw. A control edge from a Switch is not gated by its branch (TF1 conds wait
    # on a pivot Identity for that): a Switch output the draw reads is waited for through an
    # Identity of it (without, the state advanced in every iteration, review 38, 0.2-0.77 off).
    waits = set(node.control)
    for i, ref in enumerate(node.inputs):
        if ir.nodes[node_of(ref)].op in ("Switch", "RefSwitch"):
            ref = op(f"taken_{i}", "Identity", [ref], T=dtypes.as_dtype(ir.output_dtype(ref)))
        waits.add(node_of(ref))
    read = op("read", "RngReadAndSkip", [h, alg, delta], control=sorted(waits))
    moved = op("counter", "AddV2", [read, start], T=i64)
    counter = op("counter_bits", "Bitcast", [moved], T=i64, type=u64)
    shape, rest = node.inputs[0], list(node.inputs[1:])
    attrs = {"dtype": p.dtype, "Tshape": index}
    ir.remove_many([copy])
    if drop is None:
        ir.add(copy, p.twin, [shape, key, counter, alg] + rest, list(node.control), dev, attrs)
        return
    dropped = cast("drop_index", drop, index)
    begin = into("begin", op("begin_vector", "Pack", [dropped], T=index, N=1, axis=0), index)
    drop = into("drop", dropped, index)
    tower_count, flat = _flat(op, shape, index, drop, into("all_axes", const("all_axes", 0, dtypes.int32),
                                                           dtypes.int32))
    drawn = ir.add(f"{base}/flat", p.twin, [flat, key, counter, alg] + rest, list(node.control), dev, attrs).name
    size = op("size", "Pack", [tower_count], T=index, N=1, axis=0)
    rows = op("rows", "Slice", [drawn, begin, size], T=p.dtype, Index=index)
    ir.add(copy, "Reshape", [rows, shape], device=dev, attrs={"T": p.dtype, "Tshape": index})


def in_function(fdef, op_name: str, p: Plan, shared: str, grow: str, first_row: str, index) -> None:
    """Node ``op_name`` of function ``fdef`` draws only the tower's rows: ``shared`` is the
    shared name of the tower's state (:func:`state` made it at the top level, on the device
    the function runs on), ``grow`` the global shape's excess over the tower's (a tensor of
    the body), ``first_row`` the tower's first row (an int32 argument). In a loop body
    everything runs once per iteration: 11 small ops and constants around the draw (five
    more, not aligned)."""
    node = next(n for n in fdef.node_def if n.name == op_name)
    base = f"{op_name}/replicate_stream"
    added = []
    i64, u64 = dtypes.int64, dtypes.uint64

    def op(name: str, kind: str, inputs: list[str], out: str, **attrs) -> str:
        nd = node_def_pb2.NodeDef(name=f"{base}/{name}", op=kind)
        nd.input.extend(inputs)
        for key, value in attrs.items():
            nd.attr[key].CopyFrom(value if isinstance(value, attr_value_pb2.AttrValue) else make_attr(value))
        added.append(nd)
        return f"{nd.name}:{out}:0"

    def const(name: str, value, dtype) -> str:
        proto = tensor_util.make_tensor_proto(np.asarray(value, dtype=dtype.as_numpy_dtype))
        nd = node_def_pb2.NodeDef(name=f"{base}/{name}", op="Const")
        nd.attr["dtype"].type = dtype.as_datatype_enum
        nd.attr["value"].tensor.CopyFrom(proto)
        added.append(nd)
        return f"{nd.name}:output:0"

    shape = node.input[0]
    rest = [r for r in node.input[1:] if not r.startswith("^")]
    control = [r for r in node.input if r.startswith("^")]
    all_axes = const("all_axes", 0, dtypes.int32)
    global_count = op("global_elements", "Prod", [op("global_shape", "AddV2", [shape, grow], "z", T=index),
                                                  all_axes], "output", T=index, Tidx=dtypes.int32, keep_dims=False)
    delta = op("delta", "Cast", [global_count], "y", SrcT=index, DstT=u64, Truncate=False)
    alg = const("alg", PHILOX, dtypes.int32)
    read = op("read", "RngReadAndSkip", [op("state", "VarHandleOp", [], "resource", **_handle_attrs(shared)),
                                         alg, delta], "value")
    first = op("first", "Cast", [first_row], "y", SrcT=dtypes.int32, DstT=i64, Truncate=False)
    start, drop = _start(op, const, first, p)
    moved = op("counter", "AddV2", [read, start], "z", T=i64)
    counter = op("counter_bits", "Bitcast", [moved], "output", T=i64, type=u64)
    key = const("key", _uint64(p.seed), u64)
    twin = node_def_pb2.NodeDef(op=p.twin)
    twin.attr["dtype"].type = p.dtype.as_datatype_enum
    twin.attr["Tshape"].type = index.as_datatype_enum
    if drop is None:
        twin.name = op_name
        twin.input.extend([shape, key, counter, alg] + rest + control)
    else:
        dropped = op("drop_index", "Cast", [drop], "y", SrcT=i64, DstT=index, Truncate=False)
        tower_count, flat = _flat(op, shape, index, dropped, all_axes)
        twin.name = f"{base}/flat"
        twin.input.extend([flat, key, counter, alg] + rest + control)
        begin = op("begin", "Pack", [dropped], "output", T=index, N=1, axis=0)
        size = op("size", "Pack", [tower_count], "output", T=index, N=1, axis=0)
        rows = op("rows", "Slice", [f"{twin.name}:output:0", begin, size], "output", T=p.dtype, Index=index)
        # under the op's own name, so that every reference to its output reads the rows
        view = node_def_pb2.NodeDef(name=op_name, op="Reshape")
        view.input.extend([rows, shape])
        view.attr["T"].type = p.dtype.as_datatype_enum
        view.attr["Tshape"].type = index.as_datatype_enum
        added.append(view)
    fdef.node_def.remove(node)
    fdef.node_def.extend(added + [twin])
