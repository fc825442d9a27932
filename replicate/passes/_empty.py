"""Helper of the guard pass: ops that a tower without examples computes wrongly or cannot run.

A tower gets an empty slice when a step's batch is smaller than the number of towers (the last
short batch of an epoch). One device never runs these ops on no examples.

Requires: the clone pass's tower copies (``ir.facts["copies"]``) and ``ir.facts["analysis"]``
(its settled dataflow, ``analysis.flow``).

Produces, for reshapes (:func:`infer_reshapes`): in every tower copy of a ``Reshape`` (forward
or gradient code: ``extract_patches``' gradient) whose target is computed at run time (``tf.reshape(flat, [tf.shape(x)[0], -1])``), the
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
an empty tensor), and so does the same range stepping by 1; no other step changes. The same
holds for integer divisions of gradient code (``FloorDiv``) by a divisor computed at run time:
``tf.sparse.reduce_sum``'s gradient divides the dense shape by the reduced one, whose batch
dimension is 0 in an empty tower ("Integer division by zero"), and the quotient only scales
indices of no entries. Divisors TensorFlow already keeps at least 1 (``Maximum``) are left.

Produces, for gathers along another axis (:func:`gather_gradient_widths`): in the gradient
code of every tower copy of a ``GatherV2`` along an axis other than 0 (and no ``batch_dims``,
with which the ``-1`` counts only the indices' other dimensions), the ``-1`` with which
TensorFlow reshapes the incoming gradient to ``params.shape[:axis] + [-1] +
params.shape[axis + 1:]`` is replaced by the number of indices, which is what it always stands
for. With no examples and no indices (offsets into the tower's own rows) the gradient has no
elements, TensorFlow makes the ``-1`` a 1, and the gradient's segment sum then fails
("data.shape = [1,0] does not start with segment_ids.shape = [0]").

Produces, for segment counts (:func:`nonnegative_segments`): every tower copy of an
``UnsortedSegment*`` op whose number of segments is computed at run time reads it through
``Maximum(n, 0)``. ``reduce_max(ids) + 1`` over an empty tower's ids is the smallest integer
plus one, which the op rejects; one device never reduces over no ids, and a count it runs with
is never negative, so nothing changes there.

Produces, for CTC losses and tensor scatters: see :mod:`replicate.passes._empty_kernels`.

Produces, for kernels that leave their output unwritten on no examples
(:func:`zero_unwritten_outputs`, ops in :data:`UNWRITTEN_ON_EMPTY`): every tower copy's
output is read through ``SelectV2(batch == 0, zeros, output)``. TensorFlow's CPU filter
gradient of a depthwise convolution returns uninitialized memory for an empty batch (up to
1e34 in a variable after one step, claimed exact: review 19); zeros are what one device's
sum over no examples is. With examples the select passes the output through.

Produces, for stacked lists (:func:`stack_empty_lists`): every tower copy of a
``TensorListStack`` whose element shape is only partly known (``tf.map_fn`` over the batch
with a per-example result of a dynamic length) stacks an empty list with that shape's unknown
dimensions taken as 0. TensorFlow refuses to stack an empty list without a full element shape
("Tried to stack elements of an empty list with non-fully-defined element_shape"); with
elements the list decides the shape itself, so nothing changes then. Likewise for TF1
TensorArrays (:func:`shape_array_gathers`): every tower copy of a ``TensorArrayGatherV3``
whose ``element_shape`` is not fully defined (the gradient of a TF1 ``map_fn`` over the
batch) gets the element shape of the rows its forward array was scattered from (or of what
was written to it that holds no example), from the input graph's static shapes. TensorFlow refuses
to gather from an array of size zero without one; with elements the shape it checks is the
one the array holds.
"""

from __future__ import annotations

import collections
import math

from tensorflow.core.framework import attr_value_pb2
from tensorflow.python.framework import dtypes, tensor_shape

from replicate.batchflow.lattice import PART, SHARED, Sym
from replicate.graph.ir import IR, node_of

__all__ = ["tower_copies", "dimension_of", "infer_reshapes", "infer_sparse_reshapes", "nonzero_steps", "stack_empty_lists", "gather_gradient_widths",
           "nonnegative_segments", "zero_unwritten_outputs", "shape_array_gathers"]

SCOPE = "replicate/reshape"


def _tower_ops(ir: IR, op: str, operand: int, gradient: bool | None):
    """(tower prefix, tower copy) of every ``op`` of the forward code (or of gradient code;
    ``None``: of both) whose ``operand`` is computed at run time."""
    flow, copies = ir.facts["analysis"].flow, ir.facts["copies"]
    if flow is None:
        return
    for k, names in enumerate(copies):
        prefix = f"{ir.facts['towers'].prefixes[k]}/"
        for name, copied in names.items():
            copy = ir.nodes.get(copied)
            if copy is not None and copy.op == op \
                    and (gradient is None or (name in flow.ctx.gradient) == gradient) \
                    and ir.const_value(node_of(copy.inputs[operand])) is None:
                yield prefix, copy


def infer_reshapes(ir: IR) -> int:
    """Pin the ``-1`` of the towers' run-time reshape targets (see the module docstring);
    returns how many tower ops changed."""
    done = 0
    towers, flow = ir.facts["towers"], ir.facts["analysis"].flow
    for prefix, copy in list(_tower_ops(ir, "Reshape", 1, gradient=None)):
        source, target = (r[len(prefix):] if r.startswith(prefix) else r for r in copy.inputs[:2])
        found = _inferred(ir, flow, source, target)
        if found is None:
            continue
        k = towers.prefixes.index(prefix[:-1])
        dims = [_tower_dimension(ir, flow, k, token) for token in found[1]]
        if None not in dims:
            _pin(ir, copy, found[0], dims)
            done += 1
    return done


def _inferred(ir: IR, flow, data: str, shape_of: str) -> tuple[int, list[str]] | None:
    """The value of the ``-1`` of the target ``shape_of`` of a reshape of ``data`` (names of
    the input graph), when the analysis proves it: a constant times named dimensions
    (``tf.shape(x)[1]``, :mod:`replicate.batchflow.dims`) of a dynamic time axis."""
    source, target = flow.fact(data), flow.fact(shape_of)
    if source is None or source.kind != PART or not isinstance(source.block, (int, str)) \
            or not isinstance(source.outer, int) or target is None or target.value is None:
        return None
    shape = flow.ctx.named_shape(data, skip=source.axis)
    if shape is None:
        return None
    # rows per example along the axis: ``block`` of each, in ``outer`` copies of the batch (a
    # time-major ``[T, B, H]`` holds T * H elements of each example, as ``[B, T, H]`` does)
    rest_dims = [d for i, d in enumerate(shape) if i != source.axis]
    block = source.block if isinstance(source.block, int) else 1     # else a named dimension
    per_example = block * source.outer * math.prod(d for d in rest_dims if isinstance(d, int))
    named = collections.Counter(d for d in rest_dims + [source.block] if isinstance(d, str))
    rest, syms = 1, 0
    for element in target.value:
        if isinstance(element, Sym):
            if element.coef is None or element.cls != source.cls:
                return None
            rest, syms = rest * element.coef, syms + 1
        elif isinstance(element, str) and named[element] > 0:
            named[element] -= 1             # a dynamic dimension of the input, kept
        elif not isinstance(element, int) or isinstance(element, bool):
            return None
        elif element != -1:
            rest *= element
    if syms != 1 or list(target.value).count(-1) != 1 or rest <= 0 or per_example % rest:
        return None
    return per_example // rest, sorted(named.elements())


def infer_sparse_reshapes(ir: IR) -> int:
    """In every tower copy of a forward ``SparseReshape`` to ``[n, -1]`` where ``n`` is the
    tower's count of examples and the input's dense shape starts with it (feature columns'
    ``sparse_reshape(ids, [tf.shape(ids)[0], -1])``), the ``-1`` becomes the product of the
    input's other dimensions. TensorFlow infers the same from a batch with examples; from an
    empty one it cannot ("reshape cannot infer the missing input size for an empty tensor",
    review 28: a hashed column in ``linear_model``). Returns how many tower ops changed."""
    done, flow = 0, ir.facts["analysis"].flow
    for prefix, copy in list(_tower_ops(ir, "SparseReshape", 2, gradient=False)):
        shape, target = (r[len(prefix):] if r.startswith(prefix) else r for r in copy.inputs[1:3])
        have, want = flow.fact(shape), flow.fact(target)
        if have is None or want is None or not have.value or not want.value or len(want.value) != 2 \
                or want.value[1] != -1 or not isinstance(want.value[0], Sym) \
                or not isinstance(have.value[0], Sym) or want.value[0] != have.value[0]:
            continue
        scope, dev = f"{copy.name}/{SCOPE}", copy.device
        i64 = dtypes.int64
        rest = ir.add(f"{scope}/rest", "StridedSlice", [
            copy.inputs[1], ir.const(f"{scope}/begin", [1], i64, dev), ir.const(f"{scope}/end", [0], i64, dev),
            ir.const(f"{scope}/step", [1], i64, dev)], device=dev,
            attrs={"T": i64, "Index": i64, "end_mask": 1}).name
        per = ir.add(f"{scope}/per_example", "Prod", [rest, ir.const(f"{scope}/axis", 0, dtypes.int32, dev)],
                     device=dev, attrs={"T": i64, "Tidx": dtypes.int32, "keep_dims": False}).name
        count = ir.add(f"{scope}/count", "StridedSlice", [
            copy.inputs[2], ir.const(f"{scope}/first", [0], i64, dev), ir.const(f"{scope}/second", [1], i64, dev),
            ir.const(f"{scope}/one", [1], i64, dev)], device=dev, attrs={"T": i64, "Index": i64}).name
        pinned = ir.add(f"{scope}/target", "ConcatV2", [count, ir.add(f"{scope}/per_vector", "Reshape", [
            per, ir.const(f"{scope}/vector", [1], dtypes.int32, dev)], device=dev, attrs={"T": i64, "Tshape": dtypes.int32}).name,
            ir.const(f"{scope}/concat_axis", 0, dtypes.int32, dev)], device=dev, attrs={"T": i64, "N": 2, "Tidx": dtypes.int32}).name
        ir.set_input(copy.name, 2, pinned)
        done += 1
    return done


def _tower_dimension(ir: IR, flow, k: int, token: str) -> tuple[str, int] | None:
    """Tower ``k``'s tensor and axis holding named dimension ``token`` (``t:0#axis``), or None
    where it is the batch axis of ``t`` (a tower's own count) or ``t`` is not found."""
    ref, _, axis = token.rpartition("#")
    fact = flow.fact(ref)
    if fact is None or (fact.kind == PART and fact.axis == int(axis)):
        return None
    towers, copies = ir.facts["towers"], ir.facts["copies"][k]
    name, _, out = ref.partition(":")
    if ref in towers.inputs[k]:
        return towers.inputs[k][ref], int(axis)
    if name in copies:
        return f"{copies[name]}:{out or 0}", int(axis)
    return (ref, int(axis)) if name in ir.nodes and fact.kind == SHARED else None


def _pin(ir: IR, copy, value: int, dims: list[tuple[str, int]] = ()) -> None:
    """Replace the ``-1`` of ``copy``'s target by ``value`` times the sizes of ``dims``
    ((tensor, axis) of the tower) when its input has no elements (with some, TensorFlow
    infers the same value itself)."""
    scope = f"{copy.name}/{SCOPE}"
    dtype = dtypes.as_dtype(copy.attr("Tshape", dtypes.int32))
    dev, target = copy.device, copy.inputs[1]
    data_type = dtypes.as_dtype(ir.output_dtype(copy.inputs[0]))
    fill = ir.const(f"{scope}/value", value, dtype, dev)
    for j, (tensor, axis) in enumerate(dims):
        size = dimension_of(ir, tensor, axis, f"{scope}/dim_{j}", dev)
        if dtype != dtypes.int32:
            size = ir.add(f"{scope}/dim_{j}/cast", "Cast", [size], device=dev,
                          attrs={"SrcT": dtypes.int32, "DstT": dtype, "Truncate": False}).name
        fill = ir.add(f"{scope}/value_{j}", "Mul", [fill, size], device=dev, attrs={"T": dtype}).name
    size = ir.add(f"{scope}/size", "Size", [copy.inputs[0]], device=dev,
                  attrs={"T": data_type, "out_type": dtype}).name
    empty = ir.add(f"{scope}/empty", "Equal", [size, ir.const(f"{scope}/zero", 0, dtype, dev)],
                   device=dev, attrs={"T": dtype, "incompatible_shape_error": True}).name
    minus = ir.add(f"{scope}/minus", "Equal",
                   [target, ir.const(f"{scope}/minus_one", -1, dtype, dev)], device=dev,
                   attrs={"T": dtype, "incompatible_shape_error": True}).name
    unknown = ir.add(f"{scope}/unknown", "LogicalAnd", [minus, empty], device=dev).name
    pinned = ir.add(f"{scope}/target", "SelectV2", [unknown, fill, target], device=dev,
                    attrs={"T": dtype}).name
    ir.set_input(copy.name, 1, pinned)


def nonzero_steps(ir: IR) -> int:
    """Make the towers' run-time gradient range steps nonzero (see the module docstring);
    returns how many tower ops changed."""
    done = 0
    ops = [(copy, 2, "Tidx") for _, copy in _tower_ops(ir, "Range", 2, gradient=True)]
    ops += [(copy, 1, "T") for _, copy in _tower_ops(ir, "FloorDiv", 1, gradient=True)
            if dtypes.as_dtype(copy.attr("T", dtypes.float32)).is_integer
            and ir.nodes[node_of(copy.inputs[1])].op != "Maximum"]
    for copy, operand, attr in ops:
        scope, dev = f"{copy.name}/replicate/step", copy.device
        dtype = dtypes.as_dtype(copy.attr(attr, dtypes.int32))
        step = copy.inputs[operand]
        zero = ir.add(f"{scope}/zero", "Equal", [step, ir.const(f"{scope}/nil", 0, dtype, dev)],
                      device=dev, attrs={"T": dtype, "incompatible_shape_error": True}).name
        ir.set_input(copy.name, operand,
                     ir.add(f"{scope}/step", "SelectV2", [zero, ir.const(f"{scope}/one", 1, dtype, dev), step],
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


def shape_array_gathers(ir: IR) -> int:
    """Give the towers' TensorArray gathers a full element shape where the input graph's
    static shapes prove one (see the module docstring); returns how many tower ops changed."""
    done, flow = 0, ir.facts["analysis"].flow
    for names in ir.facts["copies"]:
        for original, copied in names.items():
            copy = ir.nodes.get(copied)
            if copy is None or copy.op != "TensorArrayGatherV3":
                continue
            held = copy.attrs.get("element_shape")
            if held is not None and not held.shape.unknown_rank and all(d.size >= 0 for d in held.shape.dim):
                continue
            dims = _array_element(ir, flow, copied, copied[:-len(original)])
            if dims is None:
                continue
            ir.set_attr(copied, "element_shape", attr_value_pb2.AttrValue(
                shape=tensor_shape.TensorShape(dims).as_proto()))
            done += 1
    return done


def _array_element(ir: IR, flow, gather: str, prefix: str) -> list[int] | None:
    """The full element shape of the TensorArray the tower's ``gather`` reads (of its forward
    array, for a gradient array), where it holds no rows of the batch: from the input graph's
    static shapes (of the originals, ``prefix`` stripped) of what the array is scattered from
    along the batch axis, or of what is written to it that holds no example, through
    ``Enter``/``Identity``. An array over time steps (a TF1 ``dynamic_rnn``'s) holds the
    tower's rows in every element, whose size is not the input graph's."""
    def full(dims):
        return dims is not None and all(d is not None for d in dims)

    def static(ref: str):
        return ir.static_shape(ref.removeprefix(prefix))

    def holds(ref: str, kind: str, axis=None) -> bool:
        fact = flow.fact(ref.removeprefix(prefix))
        return fact is not None and fact.kind == kind and (axis is None or (
            fact.axis == axis and fact.block == 1 and fact.outer == 1))

    handle = ir.nodes.get(node_of(ir.nodes[gather].inputs[0]))
    if handle is not None and handle.op in ("TensorArrayGradV3", "TensorArrayGradWithShape"):
        handle = ir.nodes.get(node_of(handle.inputs[0]))
    work, seen = [handle.name] if handle is not None else [], set()
    while work:
        name = work.pop()
        if name in seen:
            continue
        seen.add(name)
        for reader, _ in ir.data_consumers(name):
            if reader.op in ("Enter", "Identity"):
                work.append(reader.name)
            elif reader.op == "TensorArrayScatterV3" and holds(reader.inputs[2], PART, 0):
                value = static(reader.inputs[2])
                if value and full(value[1:]):
                    return list(value[1:])
            elif reader.op == "TensorArrayWriteV3" and holds(reader.inputs[2], SHARED) \
                    and full(static(reader.inputs[2])):
                return list(static(reader.inputs[2]))
    return None


def gather_gradient_widths(ir: IR) -> int:
    """Give the gradient reshapes of the towers' gathers along other axes the number of
    indices for their ``-1`` (see the module docstring); returns how many changed."""
    done = 0
    for names in ir.facts["copies"]:
        for copied in names.values():
            gather = ir.nodes.get(copied)
            if gather is None or gather.op != "GatherV2" or gather.attr("batch_dims", 0):
                continue
            axis = ir.const_value(node_of(gather.inputs[2]))
            if axis is None or axis.ndim or int(axis) == 0:
                continue
            for concat in _gradient_targets(ir, gather.inputs[0]):
                scope, dev = f"{concat.name}/replicate/width", concat.device
                dtype = dtypes.as_dtype(concat.attr("T", dtypes.int32))
                size = ir.add(f"{scope}/size", "Size", [gather.inputs[1]], device=dev,
                              attrs={"T": dtypes.as_dtype(ir.output_dtype(gather.inputs[1])),
                                     "out_type": dtype}).name
                width = ir.add(f"{scope}/width", "Reshape", [size, ir.const(f"{scope}/one", [1],
                                                                             dtypes.int32, dev)],
                               device=dev, attrs={"T": dtype, "Tshape": dtypes.int32}).name
                position = next(i for i, ref in enumerate(concat.inputs[:-1]) if _minus_one(ir, ref))
                ir.set_input(concat.name, position, width)
                done += 1
    return done


def _gradient_targets(ir: IR, params: str) -> list:
    """The ``ConcatV2`` targets ``shape(params)[:axis] + [-1] + shape(params)[axis + 1:]``
    built from a ``Shape`` of ``params``: TensorFlow's gather gradient for an axis other than 0."""
    found = []
    for shape, _ in ir.data_consumers(params):
        if shape.op != "Shape":
            continue
        for part, _ in ir.data_consumers(shape.name):
            if part.op != "StridedSlice":
                continue
            for concat, _ in ir.data_consumers(part.name):
                if concat.op == "ConcatV2" and concat not in found \
                        and sum(_minus_one(ir, ref) for ref in concat.inputs[:-1]) == 1:
                    found.append(concat)
    return found


def _minus_one(ir: IR, ref: str) -> bool:
    value = ir.const_value(node_of(ref))
    return value is not None and value.shape == (1,) and int(value[0]) == -1


#: Segment ops whose input 2 is the number of segments.
SEGMENT_COUNTS = ("UnsortedSegmentSum", "UnsortedSegmentMax", "UnsortedSegmentMin",
                  "UnsortedSegmentProd")


def nonnegative_segments(ir: IR) -> int:
    """Read the towers' run-time segment counts through ``Maximum(n, 0)`` (see the module
    docstring); returns how many tower ops changed."""
    done = 0
    for names in ir.facts["copies"]:
        for copied in names.values():
            copy = ir.nodes.get(copied)
            if copy is None or copy.op not in SEGMENT_COUNTS \
                    or ir.const_value(node_of(copy.inputs[2])) is not None:
                continue
            scope, dev = f"{copy.name}/replicate/segments", copy.device
            dtype = dtypes.as_dtype(copy.attr("Tnumsegments", dtypes.int32))
            count = ir.add(f"{scope}/count", "Maximum",
                           [copy.inputs[2], ir.const(f"{scope}/zero", 0, dtype, dev)],
                           device=dev, attrs={"T": dtype}).name
            ir.set_input(copy.name, 2, count)
            done += 1
    return done


#: Op -> the input whose axis 0 is the batch, for kernels whose output is left unwritten
#: (uninitialized memory) when that batch is empty.
UNWRITTEN_ON_EMPTY = {"DepthwiseConv2dNativeBackpropFilter": 0}


def tower_copies(ir: IR, kinds) -> list:
    """The tower copies (nodes) of ops whose type is in ``kinds``."""
    return [op for names in ir.facts["copies"] for op in (ir.nodes.get(c) for c in names.values())
            if op is not None and op.op in kinds]


def zero_unwritten_outputs(ir: IR) -> int:
    """Read the towers' copies of :data:`UNWRITTEN_ON_EMPTY` ops as zeros when their batch is
    empty (see the module docstring); returns how many tower ops changed."""
    done, i32 = 0, dtypes.int32
    for op in tower_copies(ir, UNWRITTEN_ON_EMPTY):
        scope, dev = f"{op.name}/replicate/empty", op.device
        dtype = dtypes.as_dtype(op.attr("T", dtypes.float32))
        readers = [c.name for c, _ in ir.data_consumers(op.name)]
        batch = dimension_of(ir, op.inputs[UNWRITTEN_ON_EMPTY[op.op]], 0, scope, dev)
        empty = ir.add(f"{scope}/empty", "Equal", [batch, ir.const(f"{scope}/zero", 0, i32, dev)],
                       device=dev, attrs={"T": i32, "incompatible_shape_error": True}).name
        zeros = ir.add(f"{scope}/zeros", "ZerosLike", [op.name], device=dev, attrs={"T": dtype}).name
        chosen = ir.add(f"{scope}/output", "SelectV2", [empty, zeros, op.name], device=dev,
                        attrs={"T": dtype}).name
        ir.replace_uses(op.name, chosen, only=readers)
        done += 1
    return done


def dimension_of(ir: IR, tensor: str, axis: int, scope: str, dev: str) -> str:
    """``<scope>/batch``: ``tensor``'s size along ``axis`` at run time (int32 scalar)."""
    i32 = dtypes.int32
    shape = ir.add(f"{scope}/shape", "Shape", [tensor], device=dev,
                   attrs={"T": dtypes.as_dtype(ir.output_dtype(tensor)), "out_type": i32}).name
    return ir.add(f"{scope}/batch", "StridedSlice", [
        shape, ir.const(f"{scope}/at", [axis], i32, dev), ir.const(f"{scope}/end", [axis + 1], i32, dev),
        ir.const(f"{scope}/step", [1], i32, dev)], device=dev,
        attrs={"T": i32, "Index": i32, "shrink_axis_mask": 1}).name
