"""Helper of the guard pass: kernels that reject an empty batch run in a tower without
examples, in the graph and inside function bodies.

- ``CTCLoss`` rejects a batch of 0 ("batch_size must not be 0") and an example without
  labels. When its batch (axis 1 of its time-major inputs) is empty, it reads one padding
  example (a zero row of the inputs, sequence length 1 and the single label 0), and its loss
  and gradient are sliced back to the batch.
- ``TensorScatter{Add,Sub,Update,Max,Min}`` rejects any index tuple into an empty tensor
  ("Indices and updates specified for empty output shape"; TF2's ``ctc_loss_dense`` writes
  time steps of ``[T, B, L]``). When its tensor has no elements, it reads its tuples and
  updates cut to none; the result, empty, is the same. Likewise a ``GatherNd`` from empty
  params ("params is empty", a tensor scatter's gradient, review 31): it reads no tuples,
  and its result has no elements either way.

- ``CropAndResizeGradImage`` reads the images' size from ``tf.shape`` of the images; with
  oneDNN, TensorFlow gives a convolution of an empty batch its input's depth (``[0, 8, 8,
  3]`` for 4 filters), and the gradient stops ("image_size and grads are incompatible"). Each
  tower's reads the depth of its incoming gradient, which is the images' depth whenever the
  batch has examples. ``CropAndResizeGradBoxes`` reads the images themselves ("image, grads
  depth differ"; Grappler's rewrite of the graph had hidden it, a session without Grappler
  stopped): each tower's reads them reshaped to the depth of its gradient, the same tensor
  whenever the batch has examples.

- A NaN check of gradient code (``CheckNumerics``, or a call of a body that has one: the
  gradient of ``check_numerics`` checks its incoming gradient too) on a value that is not per
  example reads zeros in place of the values that are not finite, in a tower without
  examples. Such a tower's mean of no examples is 0 / 0, and its gradient (1 / 0 through
  ``sum / batch``) is not finite; the aggregate pass weighs it by 0, but the check stopped
  the step first (review 44). A step with no examples at all keeps them, and fails as one
  device's does (review 45). Finite values pass: an empty tower's share of a gradient the
  sync pass adds up across the towers is as much the step's as any other's. A per-example
  value has no elements there and is left alone.

With examples nothing is padded or cut, so every result is exactly the unguarded one.

TF1 ops sit in the graph: each tower copy is guarded. TF2's ``tf.nn.ctc_loss`` calls its op
inside a function (``PartitionedCall``, whose gradient function reads the op's gradient
output), and ``ctc_loss_dense`` scatters inside a ``While`` body: every tower calls the same
function, so the op is guarded in place in the library, which changes nothing for a call with
examples (the one device's included).

Requires: the clone pass's tower copies. Produces: the guard ops under
``<op>/replicate/empty`` (in the graph) or ``<op>/replicate_empty`` (in a body).
"""

from __future__ import annotations

import numpy as np
from tensorflow.core.framework import node_def_pb2
from tensorflow.python.framework import dtypes, tensor_util

from replicate.graph.frames import opening
from replicate.graph.ir import IR, make_attr

__all__ = ["pad_ctc_losses", "empty_tensor_scatters", "empty_gathers", "crop_gradient_depths",
           "finite_gradient_checks", "TENSOR_SCATTERS", "FINITE_CHECKS", "GraphOps", "BodyOps"]

I32, I64 = dtypes.int32, dtypes.int64

#: Ops that place updates at index tuples into a tensor and reject any tuple when it is empty.
TENSOR_SCATTERS = frozenset(f"TensorScatter{kind}" for kind in ("Add", "Sub", "Update", "Max", "Min"))


def pad_ctc_losses(ir: IR) -> int:
    """Pad every ``CTCLoss`` of the towers and of the library (module docstring); returns how
    many ops changed."""
    return _guard_all(ir, {"CTCLoss"}, _pad_ctc)


def empty_tensor_scatters(ir: IR) -> int:
    """Cut the tuples of every ``TensorScatter*`` of the towers and of the library into an
    empty tensor (module docstring); returns how many ops changed."""
    return _guard_all(ir, TENSOR_SCATTERS, _cut_scatter)


def empty_gathers(ir: IR) -> int:
    """Cut the tuples of every tower's ``GatherNd`` of gradient code from empty params (module
    docstring); returns how many ops changed."""
    flow = ir.facts["analysis"].flow
    gradient = flow.ctx.gradient if flow is not None else set()
    return _guard_all(ir, {"GatherNd"}, _cut_gather, bodies=False, only=gradient)


def crop_gradient_depths(ir: IR) -> int:
    """Every tower's ``CropAndResizeGradImage`` and ``CropAndResizeGradBoxes`` takes the
    images' depth from its gradient (module docstring); returns how many ops changed."""
    return _guard_all(ir, {"CropAndResizeGradImage", "CropAndResizeGradBoxes"}, _crop_depth, bodies=False)


#: Ops that stop a step on a value that is not finite.
FINITE_CHECKS = frozenset({"CheckNumerics", "CheckNumericsV2"})


def finite_gradient_checks(ir: IR) -> int:
    """Every tower's NaN check of gradient code on a value that is not per example reads zeros
    for values that are not finite when the tower has no examples (module docstring); returns
    how many inputs changed."""
    from replicate.batchflow.effects import called_functions
    from replicate.batchflow.lattice import PART
    from replicate.batchflow.roles import FLOAT_TYPES

    flow, towers = ir.facts["analysis"].flow, ir.facts["towers"]
    if flow is None:
        return 0
    checking = _checking_functions(ir, called_functions)
    done = 0
    for k, names in enumerate(ir.facts["copies"]):
        prefix = f"{towers.prefixes[k]}/"
        for name, copied in names.items():
            op = ir.nodes.get(copied)
            if op is None or name not in flow.ctx.gradient or not (
                    op.op in FINITE_CHECKS or checking.intersection(called_functions(op))) \
                    or opening(ir, copied) is not None:
                continue    # (in a TF1 loop's frame the count outside it cannot be read)
            for i, ref in enumerate(list(op.inputs[:1] if op.op in FINITE_CHECKS else op.inputs)):
                fact = flow.fact(ref[len(prefix):] if ref.startswith(prefix) else ref)
                if ir.output_dtype(ref) not in FLOAT_TYPES or (fact is not None and fact.kind == PART):
                    continue
                ops = GraphOps(ir, op)
                dtype = dtypes.as_dtype(ir.output_dtype(ref))
                some = ops.add(f"some_{i}", "Greater", [towers.counts[k], ops.const(f"none_{i}", 0)], T=I32)
                if towers.batch_size:       # a batch of none: one device's check fails, so does this
                    some = ops.add(f"some_or_none_{i}", "LogicalOr", [some, ops.add(f"no_batch_{i}", "Equal", [
                        towers.batch_size, ops.const(f"zero_{i}", 0)], T=I32, incompatible_shape_error=True)])
                kept = ops.add(f"kept_{i}", "LogicalOr", [some, ops.add(f"is_finite_{i}", "IsFinite", [ref], T=dtype)])
                ops.set_input(i, ops.add(f"finite_{i}", "SelectV2", [
                    kept, ref, ops.add(f"zeros_{i}", "ZerosLike", [ref], T=dtype)], T=dtype))
                done += 1
    return done


def _checking_functions(ir: IR, called_functions) -> set[str]:
    """Library functions with a NaN check in their body or in a body they call."""
    bodies = {f.signature.name: f for f in ir.library.function} if ir.library is not None else {}
    calls = {name: {c for n in f.node_def for c in called_functions(n)} for name, f in bodies.items()}
    found = {name for name, f in bodies.items() if any(n.op in FINITE_CHECKS for n in f.node_def)}
    grown = True
    while grown:
        more = {name for name, inner in calls.items() if name not in found and inner & found}
        found |= more
        grown = bool(more)
    return found


def _guard_all(ir: IR, kinds, guard, bodies: bool = True, only=None) -> int:
    """Guard the tower copies of ops of ``kinds`` (of the original ops in ``only``, if given)
    and, with ``bodies``, those ops in every library function."""
    done = 0
    for names in ir.facts["copies"]:
        for original, copied in names.items():
            op = ir.nodes.get(copied)
            if op is not None and op.op in kinds and (only is None or original in only):
                guard(GraphOps(ir, op), list(op.inputs), op.attr)
                done += 1
    for fdef in list(ir.library.function) if ir.library is not None and bodies else ():
        for node in list(fdef.node_def):
            if node.op in kinds:
                guard(BodyOps(ir, fdef, node), list(node.input),
                      lambda key, default=None, node=node: _body_attr(node, key, default))
                done += 1
    return done


def _body_attr(node, key: str, default):
    if key not in node.attr:
        return default
    value = node.attr[key]
    return dtypes.as_dtype(value.type) if value.WhichOneof("value") == "type" else default


def _pad_ctc(ops, refs: list[str], attr) -> None:
    """One ``CTCLoss`` reads one padding example when its batch is empty."""
    add, const, dtype = ops.add, ops.const, dtypes.as_dtype(attr("T", dtypes.float32))
    inputs, indices, values, lengths = refs[:4]
    batch = _dimension(ops, "batch", inputs, 1, dtype)
    extra = add("extra", "Cast", [add("empty", "Equal", [batch, const("zero", 0)], T=I32,
                                      incompatible_shape_error=True)], SrcT=dtypes.bool, DstT=I32)
    extra64 = add("extra64", "Cast", [extra], SrcT=I32, DstT=I64)
    row = add("row", "Reshape", [add("pair", "Pack", [const("none", 0), extra], T=I32, N=2),
                                 const("row_shape", [1, 2])], T=I32, Tshape=I32)
    paddings = add("paddings", "ConcatV2", [const("before", [[0, 0]]), row, const("after", [[0, 0]]),
                                            const("axis", 0)], T=I32, N=3, Tidx=I32)

    def grown(name, ref, count, kind, width, fill):
        """``ref`` with ``count`` more rows of ``fill`` (``width`` columns, if any)."""
        dims = [count] if width is None else [count, const(f"{name}_width", width, kind)]
        rows = add(f"{name}_rows", "Fill", [add(f"{name}_dims", "Pack", dims, T=kind, N=len(dims)),
                                            const(f"{name}_fill", fill, kind)], T=kind, index_type=kind)
        return add(name, "ConcatV2", [ref, rows, const(f"{name}_axis", 0)], T=kind, N=2, Tidx=I32)

    ops.set_input(0, add("inputs", "Pad", [inputs, paddings], T=dtype, Tpaddings=I32))
    ops.set_input(1, grown("indices", indices, extra64, I64, 2, 0))
    ops.set_input(2, grown("values", values, extra, I32, None, 0))
    ops.set_input(3, grown("lengths", lengths, extra, I32, None, 1))
    for out, begin, size in ((0, [0], [batch]),
                             (1, [0, 0, 0], [const("time", -1), batch, const("classes", -1)])):
        ops.read_output_through(out, lambda ref, out=out, begin=begin, size=size: add(
            f"sliced_{out}", "Slice", [ref, const(f"begin_{out}", begin),
                                       add(f"size_{out}", "Pack", size, T=I32, N=len(size))],
            T=dtype, Index=I32))


def _cut_scatter(ops, refs: list[str], attr) -> None:
    """One ``TensorScatter*`` reads no index tuples (nor updates) when its tensor is empty."""
    _cut(ops, refs, attr, "T", (1, 2))


def _cut_gather(ops, refs: list[str], attr) -> None:
    """One ``GatherNd`` reads no index tuples when its params are empty, and its result is
    reshaped to the shape the tuples give it (``indices.shape[:-1] + params.shape[depth:]``,
    no elements either way)."""
    _cut(ops, refs, attr, "Tparams", (1,))
    add, const = ops.add, ops.const
    tindices, dtype = dtypes.as_dtype(attr("Tindices", I32)), dtypes.as_dtype(attr("Tparams", dtypes.float32))
    tuples = add("index_shape", "Shape", [refs[1]], T=tindices, out_type=I32)
    leading = add("leading", "StridedSlice", [tuples, const("first", [0]), const("last", [-1]),
                                              const("one", [1])], T=I32, Index=I32)
    depth = add("depth", "StridedSlice", [tuples, const("at_last", [-1]), const("end_last", [0]),
                                          const("one_more", [1])], T=I32, Index=I32, end_mask=1)
    trailing = add("trailing", "StridedSlice", [add("params_shape", "Shape", [refs[0]], T=dtype, out_type=I32),
                                                depth, const("to_end", [0]), const("step_on", [1])],
                   T=I32, Index=I32, end_mask=1)
    shape = add("result_shape", "ConcatV2", [leading, trailing, const("axis", 0)], T=I32, N=2, Tidx=I32)
    ops.read_output_through(0, lambda ref: add("result", "Reshape", [ref, shape], T=dtype, Tshape=I32))


def _cut(ops, refs: list[str], attr, value_type: str, positions: tuple[int, ...]) -> None:
    """The op reads the index tuples at ``refs[1]`` (and the other ``positions``) cut to none
    when the tensor ``refs[0]`` has no elements."""
    add, const, dtype = ops.add, ops.const, dtypes.as_dtype(attr(value_type, dtypes.float32))
    size = add("size", "Size", [refs[0]], T=dtype, out_type=I32)
    some = add("some", "Cast", [add("any", "Greater", [size, const("zero", 0)], T=I32)],
               SrcT=dtypes.bool, DstT=I32)
    tindices = dtypes.as_dtype(attr("Tindices", I32))
    tuples = _dimension(ops, "tuples", refs[1], 0, tindices)
    end = add("end", "Pack", [add("count", "Mul", [tuples, some], T=I32)], T=I32, N=1)
    for position, kind in ((p, tindices if p == 1 else dtype) for p in positions):
        ops.set_input(position, add(f"kept_{position}", "StridedSlice", [
            refs[position], const(f"begin_{position}", [0]), end, const(f"stride_{position}", [1])],
            T=kind, Index=I32))


def _dimension(ops, name: str, ref: str, axis: int, dtype) -> str:
    """``ref``'s size along ``axis`` at run time (an int32 scalar)."""
    shape = ops.add(f"{name}_shape", "Shape", [ref], T=dtype, out_type=I32)
    return ops.add(name, "StridedSlice", [shape, ops.const(f"{name}_at", [axis]),
                                          ops.const(f"{name}_end", [axis + 1]), ops.const(f"{name}_step", [1])],
                   T=I32, Index=I32, shrink_axis_mask=1)


def _crop_depth(ops, refs: list[str], attr) -> None:
    """One ``CropAndResizeGradImage`` reads its image size, or one ``CropAndResizeGradBoxes``
    its images, with the depth of its gradient."""
    add, const = ops.add, ops.const
    grads = add("grads_shape", "Shape", [refs[0]], T=dtypes.float32, out_type=I32)
    depth = add("depth", "StridedSlice", [grads,
                                          const("at", [3]), const("end", [4]), const("step", [1])],
                T=I32, Index=I32)
    boxes, kind = ops.op.op == "CropAndResizeGradBoxes", dtypes.as_dtype(attr("T", dtypes.float32))
    sizes = add("images_shape", "Shape", [refs[1]], T=kind, out_type=I32) \
        if boxes else refs[3]
    size = add("size", "StridedSlice", [sizes, const("first", [0]), const("last", [3]), const("one", [1])],
               T=I32, Index=I32)
    shape = add("image_size", "ConcatV2", [size, depth, const("axis", 0)], T=I32, N=2, Tidx=I32)
    if boxes:
        ops.set_input(1, add("images", "Reshape", [refs[1], shape], T=kind, Tshape=I32))
    else:
        ops.set_input(3, shape)


class GraphOps:
    """Ops added to the graph beside a tower's op."""

    def __init__(self, ir: IR, op) -> None:
        self.ir, self.op, self.scope = ir, op, f"{op.name}/replicate/empty"

    def add(self, name: str, kind: str, inputs: list[str], **attrs) -> str:
        return self.ir.add(f"{self.scope}/{name}", kind, inputs, device=self.op.device, attrs=attrs).name

    def const(self, name: str, value, kind=I32) -> str:
        return self.ir.const(f"{self.scope}/{name}", value, kind, self.op.device)

    def set_input(self, position: int, ref: str) -> None:
        self.ir.set_input(self.op.name, position, ref)

    def read_output_through(self, out: int, make) -> None:
        ref = f"{self.op.name}:{out}" if out else self.op.name
        readers = [c.name for c, _ in self.ir.data_consumers(ref)]
        self.ir.replace_uses(ref, make(ref), only=readers)


class BodyOps:
    """Ops added to a function body beside its op (references in the body's
    ``node:output_arg:index`` form)."""

    def __init__(self, ir: IR, fdef, op) -> None:
        self.ir, self.fdef, self.op, self.scope = ir, fdef, op, f"{op.name}/replicate_empty"

    def add(self, name: str, kind: str, inputs: list[str], **attrs) -> str:
        node = node_def_pb2.NodeDef(name=f"{self.scope}/{name}", op=kind)
        node.input.extend(inputs)
        for key, value in attrs.items():
            node.attr[key].CopyFrom(make_attr(value))
        op_def = self.ir.op_def(kind)
        for attr in op_def.attr:            # a body's nodes carry every attr
            if attr.name not in node.attr and attr.HasField("default_value"):
                node.attr[attr.name].CopyFrom(attr.default_value)
        self.fdef.node_def.append(node)
        return f"{node.name}:{op_def.output_arg[0].name}:0"

    def const(self, name: str, value, kind=I32) -> str:
        node = node_def_pb2.NodeDef(name=f"{self.scope}/{name}", op="Const")
        node.attr["dtype"].CopyFrom(make_attr(kind))
        node.attr["value"].tensor.CopyFrom(tensor_util.make_tensor_proto(np.asarray(value, kind.as_numpy_dtype)))
        self.fdef.node_def.append(node)
        return f"{node.name}:output:0"

    def set_input(self, position: int, ref: str) -> None:
        self.op.input[position] = ref

    def read_output_through(self, out: int, make) -> None:
        op_def = self.ir.op_def(self.op.op)
        ref = f"{self.op.name}:{op_def.output_arg[out].name}:0"
        readers = [n for n in self.fdef.node_def if ref in n.input]
        returns = [k for k, v in self.fdef.ret.items() if v == ref]
        if not readers and not returns:
            return
        new = make(ref)
        for node in readers:
            node.input[:] = [new if r == ref else r for r in node.input]
        for key in returns:
            self.fdef.ret[key] = new
