"""Op knowledge of the batch dataflow: which rule family each op type follows.

A rule family (see :mod:`replicate.batchflow.rules`) is a transfer function from the facts of
an op's inputs to the facts of its outputs. An op type missing from every table follows the
default rule: shared when all its inputs are shared, otherwise *mixed* ("no batch rule for
this op"), so an unknown op can make a result inexact but never silently wrong.
"""

from __future__ import annotations

__all__ = ["UNARY", "BROADCAST", "SAME_SHAPE", "REDUCTIONS", "ARG_REDUCTIONS", "SCANS",
           "LAST_AXIS", "ROWWISE", "BATCH_CONTRACTIONS", "SHAPE_SOURCES", "PASS_THROUGH",
           "SOURCES", "STATEFUL_PASS", "RowSpec", "PARAM_DRAWS", "IDENTITIES", "behind", "INNER_AXES",
           "SHAPE_READERS", "value_only"]

import dataclasses

from tensorflow.core.framework import types_pb2

from replicate.graph.ir import node_of, parse_tensor, tensor_name

#: Elementwise ops of one data input; the output has the input's shape.
UNARY = frozenset({
    "Abs", "Acos", "Acosh", "Asin", "Asinh", "Atan", "Atanh", "Ceil", "Cos", "Cosh", "Digamma",
    "Elu", "Erf", "Erfc", "Erfinv", "Exp", "Expm1", "Floor", "Imag", "Inv", "Invert", "IsFinite",
    "IsInf", "IsNan", "Lgamma", "Log", "Log1p", "LogicalNot", "Neg", "Real", "Reciprocal",
    "Relu", "Relu6", "Rint", "Round", "Rsqrt", "Selu", "Sigmoid", "Sign", "Sin", "Sinh",
    "Softplus", "Softsign", "Sqrt", "Square", "Tan", "Tanh", "LeakyRelu", "Cast", "Angle",
    "ComplexAbs", "Conj", "OnesLike", "ZerosLike", "BitwiseNot", "PopulationCount",
    "ClipByValue",   # its min/max operands broadcast: listed in BROADCAST as well
    # per-element string features (feature columns): one output element per input element
    "StringToHashBucketFast", "StringToHashBucketStrong", "StringToHashBucket", "Bucketize",
    "AsString", "StringToNumber", "StringStrip", "StringLower", "StringUpper",
})

#: Name suffix of a ``Reshape(p, [-1])`` through which broadcasting ops read a placeholder
#: declared without a shape (``passes/_shapeless.py``): a scalar or a vector, checked at run time.
VECTOR_VIEW = "replicate_vector"


def is_vector_view(node) -> bool:
    """``node`` reads a shapeless placeholder as a vector (rank at most 1, checked)."""
    return node.op == "Reshape" and node.name.endswith("/" + VECTOR_VIEW)


def vector_view_of(ir, name: str, depth: int = 0) -> str | None:
    """The view behind node ``name``: the node itself, or the view that elementwise arithmetic
    with scalars reads (``1 + 2 * view``, ``cast(view)``), which is like the view one value or
    one per row, as fed. None if there is none."""
    node = ir.nodes[name]
    if is_vector_view(node):
        return name
    if depth >= 4 or (node.op not in UNARY and node.op not in BROADCAST):
        return None
    found = None
    for ref in node.inputs:
        view = vector_view_of(ir, node_of(ref), depth + 1)
        if view is not None:
            found = found or view
        elif ir.static_shape(tensor_name(*parse_tensor(ref))) != []:
            return None
    return found


#: Elementwise ops whose data inputs broadcast against each other (numpy rules).
BROADCAST = frozenset({
    "Add", "AddV2", "Sub", "Mul", "MulNoNan", "Div", "DivNoNan", "RealDiv", "TruncateDiv",
    "FloorDiv", "FloorMod", "TruncateMod", "Mod", "Maximum", "Minimum", "Pow", "SquaredDifference",
    "Atan2", "Xdivy", "Xlogy", "Xlog1py", "Equal", "NotEqual", "Less", "LessEqual", "Greater",
    "GreaterEqual", "LogicalAnd", "LogicalOr", "SelectV2", "ClipByValue", "Complex",
    "BitwiseAnd", "BitwiseOr", "BitwiseXor", "LeftShift", "RightShift", "Igamma", "Igammac",
    "Zeta", "Polygamma", "ApproximateEqual", "BiasAdd", "BiasAddV1",
    # gradient kernels of elementwise ops: same-shaped operands
    "ReluGrad", "Relu6Grad", "EluGrad", "SeluGrad", "SoftplusGrad", "SoftsignGrad", "TanhGrad",
    "SigmoidGrad", "RsqrtGrad", "SqrtGrad", "ReciprocalGrad", "InvGrad", "LeakyReluGrad",
})

#: Elementwise ops over a list of same-shaped inputs.
SAME_SHAPE = frozenset({"AddN", "AccumulateNV2"})

#: Reductions with a ``reduction_indices`` input: op -> how the batch's value follows from the
#: towers' values when the batch axis is reduced.
REDUCTIONS = {"Sum": "sum", "Mean": "mean", "Max": "max", "Min": "min", "All": "min",
              "Any": "max", "Prod": "other", "EuclideanNorm": "other"}

#: Ops that reduce one axis to an index (``dimension`` input).
ARG_REDUCTIONS = frozenset({"ArgMax", "ArgMin"})

#: Scans along an axis given as input 1: along the batch they mix examples.
SCANS = frozenset({"Cumsum", "Cumprod", "CumulativeLogsumexp"})

#: Ops that work along the last axis of their first input (and keep or drop it).
LAST_AXIS = {"Softmax": "keep", "LogSoftmax": "keep", "TopKV2": "topk", "TopK": "topk",
             "InTopK": "drop", "InTopKV2": "drop"}


@dataclasses.dataclass(frozen=True)
class RowSpec:
    """An op whose inputs and outputs all carry examples on axis 0, one row per example.

    Attributes:
        data: positions of inputs that may be partitioned on axis 0.
        params: positions of inputs that must be shared (filters, scales, sizes of windows).
        sizes: positions of shape operands whose element 0 is the batch size.
        reduced: outputs that sum over the batch instead (a filter's gradient).
        stats: outputs that are batch statistics (``mean`` or ``other``) in training mode.
    """

    data: tuple[int, ...] = (0,)
    params: tuple[int, ...] = ()
    sizes: tuple[int, ...] = ()
    reduced: tuple[int, ...] = ()
    stats: tuple[tuple[int, str], ...] = ()


_CONV = RowSpec(data=(0,), params=(1,))
_POOL = RowSpec(data=(0,), params=(1, 2))
_BN = RowSpec(data=(0,), params=(1, 2, 3, 4), stats=((1, "mean"), (2, "other"), (3, "other"),
                                                     (4, "other"), (5, "other")))

#: Per-example ops with a fixed layout: batch on axis 0 of every data input and output.
ROWWISE: dict[str, RowSpec] = {
    "SparseSoftmaxCrossEntropyWithLogits": RowSpec(data=(0, 1)),
    "SoftmaxCrossEntropyWithLogits": RowSpec(data=(0, 1)),
    "Conv2D": _CONV, "Conv3D": _CONV, "DepthwiseConv2dNative": _CONV, "Conv": _CONV,
    "Conv2DBackpropInput": RowSpec(data=(2,), params=(1,), sizes=(0,)),
    "Conv3DBackpropInputV2": RowSpec(data=(2,), params=(1,), sizes=(0,)),
    "DepthwiseConv2dNativeBackpropInput": RowSpec(data=(2,), params=(1,), sizes=(0,)),
    "MaxPool": RowSpec(), "AvgPool": RowSpec(), "MaxPool3D": RowSpec(), "AvgPool3D": RowSpec(),
    "MaxPoolV2": _POOL, "MaxPoolWithArgmax": RowSpec(),
    "MaxPoolGrad": RowSpec(data=(0, 1, 2)), "MaxPoolGradV2": RowSpec(data=(0, 1, 2), params=(3, 4)),
    "MaxPool3DGrad": RowSpec(data=(0, 1, 2)), "MaxPoolGradGrad": RowSpec(data=(0, 1, 2)),
    "MaxPoolGradWithArgmax": RowSpec(data=(0, 1, 2)),
    "AvgPoolGrad": RowSpec(data=(1,), sizes=(0,)), "AvgPool3DGrad": RowSpec(data=(1,), sizes=(0,)),
    "LRN": RowSpec(), "LRNGrad": RowSpec(data=(0, 1, 2)),
    "ResizeBilinear": RowSpec(params=(1,)), "ResizeNearestNeighbor": RowSpec(params=(1,)),
    "ResizeBicubic": RowSpec(params=(1,)), "ResizeArea": RowSpec(params=(1,)),
    "ResizeBilinearGrad": RowSpec(data=(0,), params=(1,)),
    "ResizeNearestNeighborGrad": RowSpec(data=(0,), params=(1,)),
    "SpaceToDepth": RowSpec(), "DepthToSpace": RowSpec(), "ExtractImagePatches": RowSpec(),
    "Multinomial": RowSpec(params=(1,)), "StatelessMultinomial": RowSpec(params=(1, 2)),
    "Dilation2D": RowSpec(params=(1,)), "Dilation2DBackpropInput": RowSpec(data=(0, 2), params=(1,)),
    "FusedBatchNorm": _BN, "FusedBatchNormV2": _BN, "FusedBatchNormV3": _BN,
    # the reserve spaces (3, 4, 5) are per-channel statistics: the batch's in training mode,
    # the moving averages in inference mode (the other branch of a `training` placeholder's
    # cond), never rows of examples
    "FusedBatchNormGrad": RowSpec(data=(0, 1), params=(2,), reduced=(1, 2)),
    "FusedBatchNormGradV2": RowSpec(data=(0, 1), params=(2,), reduced=(1, 2)),
    "FusedBatchNormGradV3": RowSpec(data=(0, 1), params=(2,), reduced=(1, 2)),
    "L2Normalize": RowSpec(),
}

#: Ops over the innermost axes of their inputs, batched over the others (FFTs, matrix
#: algebra on ``[B, n, n]``): op -> (how many innermost axes, positions of shared operands).
#: Per example when the batch is one of the other axes; across examples when it is inside.
INNER_AXES = {
    **{op: (1, ()) for op in ("FFT", "IFFT")}, **{op: (1, (1,)) for op in ("RFFT", "IRFFT")},
    **{op: (2, ()) for op in ("FFT2D", "IFFT2D")}, **{op: (2, (1,)) for op in ("RFFT2D", "IRFFT2D")},
    **{op: (3, ()) for op in ("FFT3D", "IFFT3D")}, **{op: (3, (1,)) for op in ("RFFT3D", "IRFFT3D")},
    **{op: (2, ()) for op in ("MatrixInverse", "MatrixDeterminant", "LogMatrixDeterminant", "Cholesky",
                              "MatrixSolve", "MatrixTriangularSolve", "Qr", "SelfAdjointEigV2", "Svd",
                              "MatrixExponential", "MatrixLogarithm", "MatrixSquareRoot", "CholeskyGrad",
                              "MatrixSolveLs")},
    # diagonals (tf.linalg.diag_part / diag and their gradients; review 30's Barlow twins)
    "MatrixDiagPart": (2, ()), "MatrixDiagPartV2": (2, (1, 2)), "MatrixDiagPartV3": (2, (1, 2)),
    "MatrixDiag": (1, ()), "MatrixDiagV2": (1, (1, 2, 3, 4)), "MatrixDiagV3": (1, (1, 2, 3, 4)),
}

#: Ops that contract the batch away: their output sums over examples (filter gradients).
BATCH_CONTRACTIONS = {
    "Conv2DBackpropFilter": RowSpec(data=(0, 2), params=(1,)),
    "Conv3DBackpropFilterV2": RowSpec(data=(0, 2), params=(1,)),
    "DepthwiseConv2dNativeBackpropFilter": RowSpec(data=(0, 2), params=(1,)),
    "Dilation2DBackpropFilter": RowSpec(data=(0, 2), params=(1,)),
    "BiasAddGrad": RowSpec(data=(0,)),
    "BiasAddGradV1": RowSpec(data=(0,)),
}

#: Ops that create a tensor from a shape operand: op -> position of the shape operand.
SHAPE_SOURCES = {"Fill": 0, "RandomUniform": 0, "RandomStandardNormal": 0, "TruncatedNormal": 0,
                 "RandomUniformInt": 0, "ParameterizedTruncatedNormal": 0, "Empty": 0,
                 "StatelessRandomUniform": 0, "StatelessRandomNormal": 0,
                 "StatelessTruncatedNormal": 0, "StatelessRandomUniformV2": 0,
                 "StatelessRandomNormalV2": 0, "StatelessTruncatedNormalV2": 0,
                 "StatelessRandomUniformInt": 0, "StatelessRandomUniformIntV2": 0,
                 "StatelessRandomUniformFullInt": 0, "StatelessRandomUniformFullIntV2": 0,
                 "StatelessRandomPoisson": 0, "StatelessRandomGammaV2": 0,
                 "StatelessRandomGammaV3": 0, "StatelessRandomBinomial": 0,
                 "StatelessParameterizedTruncatedNormal": 0}

#: Operands that size an op's output, other than a shape op's shape (those rules check
#: theirs): op -> (positions, whether the operand is the output's whole shape, where the
#: batch size belongs at the output's batch axis). The batch size elsewhere in them makes
#: the result mixed (``rules._sized_once``).
SIZE_OPERANDS = {
    "Pad": ((1,), False), "PadV2": ((1,), False), "MirrorPad": ((1,), False),
    "ScatterNd": ((2,), True), "SparseToDense": ((1,), True), "OneHot": ((1,), False),
    **{op: ((1,), False) for op in ("ResizeBilinear", "ResizeNearestNeighbor", "ResizeBicubic",
                                    "ResizeArea", "ScaleAndTranslate")},
    "CropAndResize": ((3,), False), "MatrixDiagV2": ((1, 2, 3), False),
    "MatrixDiagV3": ((1, 2, 3), False), "MatrixDiagPartV2": ((1,), False),
    "MatrixDiagPartV3": ((1,), False), "MatrixSetDiagV2": ((2,), False),
    "MatrixSetDiagV3": ((2,), False), "SpaceToBatchND": ((1, 2), False),
    "BatchToSpaceND": ((1, 2), False), "TopKV2": ((1,), False), "InTopKV2": ((2,), False),
    "Multinomial": ((1,), False), "StatelessMultinomial": ((1,), False),
    "MatrixBandPart": ((1, 2), False), "Roll": ((1,), False),
    # indices holding the batch size, along an axis other than the examples' (a pick of
    # example B - 1 along the batch axis is a positional pick, :mod:`replicate.passes._picks`)
    "GatherV2": ((1,), "off_axis"), "Gather": ((1,), "off_axis"), "ResourceGather": ((1,), "off_axis"),
}

#: Random ops that draw one row per row of a parameter (``tf.random.categorical``'s logits):
#: op -> position of that parameter. TensorFlow's kernels give row ``r`` the stream position
#: ``r`` alone decides, so a row's draw is the same in any batch holding it at ``r``.
PARAM_DRAWS = {"Multinomial": 0, "StatelessMultinomial": 0}

#: Ops whose output i is input i unchanged (identities, checks, gradient barriers).
PASS_THROUGH = frozenset({"Identity", "IdentityN", "Snapshot", "StopGradient", "PreventGradient",
                          "CheckNumerics", "DebugIdentity", "Print", "RefIdentity",
                          "EnsureShape", "PlaceholderWithDefault"})

#: Ops a demand for a tower-sized tensor passes through to their inputs (the rewrite plan,
#: :mod:`replicate.batchflow.plan`): identities, casts, loop and cond plumbing, unary math.
DEMAND_PASS = frozenset({"Identity", "Snapshot", "StopGradient", "Cast", "Neg", "ZerosLike",
                         "OnesLike", "Enter", "RefEnter", "Exit", "RefExit", "NextIteration",
                         "RefNextIteration", "Switch", "RefSwitch", "CheckNumerics",
                         "EnsureShape"}) | UNARY

#: Ops whose output holds their input's value (a batch-size position moves through them to it).
VALUE_PASS = frozenset({"Identity", "Snapshot", "Cast", "StopGradient"})

#: Ops that produce values with no data inputs: constants, variables, variable reads.
SOURCES = frozenset({"Const", "HostConst", "VariableV2", "Variable", "VarHandleOp",
                     "ReadVariableOp", "_VarHandlesOp", "VarIsInitializedOp", "IsVariableInitialized",
                     "NoOp", "ControlTrigger"})

#: Stateful ops whose outputs carry their first input's value (assignments in the region).
STATEFUL_PASS = frozenset({"Assign", "AssignAdd", "AssignSub", "AssignVariableOp",
                           "AssignAddVariableOp", "AssignSubVariableOp"})


#: Ops that hand on their input unchanged, for :func:`behind`.
_THROUGH = frozenset({"Identity", "Snapshot", "CheckNumerics", "StopGradient"})
#: The plain identities (a function body's returns pass through them).
IDENTITIES = frozenset({"Identity", "IdentityN"})


def behind(ir, ref: str, through: frozenset = _THROUGH) -> str:
    """``ref`` behind the ops of ``through`` (identities; output ``k`` of an ``IdentityN`` is
    its input ``k``), as ``name:index``."""
    for _ in range(16):
        name, idx = parse_tensor(ref)
        node = ir.nodes.get(name)
        if node is None or node.op not in through or not node.inputs:
            break
        ref = node.inputs[idx if node.op == "IdentityN" else 0]
    return tensor_name(*parse_tensor(ref))


def size_root(ir, ref: str, fact_of, depth: int = 32) -> str | None:
    """The op that makes the batch size ``ref`` holds (``fact_of``: tensor -> its fact), behind
    every op whose batch-size inputs all lead to it (a cast, ``tf.stop_gradient``, ``x + 0.0``,
    a reshape, a stack and an index into it, a TF1 cond's ``Switch`` and ``Merge``): each size
    is synchronized once, where it is made, since the ops after it then read the batch's.
    Named after a cast of it too, ``tf.cast(B)`` was summed again after ``B``, N times the
    batch's (claimed exact, 0.36 off; behind ``stop_gradient``, ``+ 0.0`` or a reshape, review
    51 F1 and review 52 F1, 0.28-0.66 off), and a copy of it switched into a branch was no size
    op the sync pass could replace (review 50 F2, F3). What makes a size reads a shape (a
    slice of ``tf.shape(x)``, ``tf.size(y)``). None when sizes made by different ops meet
    (``tf.shape(x)[0] + tf.shape(z)[0]``): no one op to synchronize."""
    from replicate.batchflow.lattice import batch_size

    ref = tensor_name(*parse_tensor(ref))
    node = ir.nodes.get(node_of(ref))
    if node is None or depth <= 0 or node.op in SHAPE_READERS:
        return ref
    facts = {r: fact_of(r) for r in node.inputs if not r.startswith("^") and node_of(r) in ir.nodes
             and ir.nodes[node_of(r)].op not in SHAPE_READERS}
    sized = [r for r, f in facts.items() if f is not None and batch_size(f)]
    if not sized:
        return ref      # what makes it: a slice of a shape
    roots = {size_root(ir, r, fact_of, depth - 1) for r in sized}
    return roots.pop() if len(roots) == 1 else None


#: Ops that move values around (into another shape, beside others, summed) without computing
#: on them: a float copy of a batch size is followed through them, since what comes out can be
#: cast back to an integer shape.
_MOVES = frozenset({"Reshape", "ExpandDims", "Squeeze", "Pack", "Unpack", "ConcatV2", "Concat",
                    "Tile", "Transpose", "BroadcastTo", "Fill", "Slice", "StridedSlice", "Gather",
                    "GatherV2", "Split", "SplitV", "ReverseV2", "Sum", "Max", "Min", "Mean",
                    "Prod", "PlaceholderWithDefault", "IdentityN", "StopGradient", "CheckNumerics",
                    "EnsureShape", "Snapshot", "PreventGradient", "Print", "Cumsum", "Cumprod"})
#: Ops that read a value of any type as a length.
_LENGTHS = frozenset({"Range", "LinSpace"})
#: Calls of function bodies.
_CALLS = frozenset({"If", "StatelessIf", "While", "StatelessWhile", "PartitionedCall",
                    "StatefulPartitionedCall"})
_INTEGERS = frozenset({types_pb2.DT_INT8, types_pb2.DT_INT16, types_pb2.DT_INT32, types_pb2.DT_INT64,
                       types_pb2.DT_UINT8, types_pb2.DT_UINT16, types_pb2.DT_UINT32, types_pb2.DT_UINT64})


def _lengths_in_bodies(ir, attrs, depth: int = 8) -> bool:
    """Whether a function body that ``attrs`` name (nested bodies included) could make a float
    it is passed into a length: it casts to an integer, or has a ``tf.range``. A float size
    passed into a ``tf.function`` and cast back to a shape there was taken for a value
    (review 52 F2: claimed exact, the rewrite failed or trained 0.91 off); a v2 cond's branch
    that only computes with it (``tf.cond(B > 5, lambda: loss * 1.5, ...)``) is a value."""
    for value in attrs.values():
        kind = value.WhichOneof("value")
        names = [value.func.name] if kind == "func" else \
            [f.name for f in value.list.func] if kind == "list" else []
        for name in names:
            fdef = ir.function(name) if name else None
            if fdef is None or depth <= 0:
                return bool(name)       # a body not in the library: it could
            for nd in fdef.node_def:
                if nd.op in _LENGTHS or nd.op == "Cast" and nd.attr["DstT"].type in _INTEGERS \
                        or nd.op in _CALLS and _lengths_in_bodies(ir, nd.attr, depth - 1):
                    return True
    return False


#: TF1 cond ops that pass a value on as it is (into a branch, out of it): a batch size a
#: branch reads from outside is switched in (review 50 F2, F3).
_PASSING = frozenset({"Switch", "RefSwitch", "Merge", "RefMerge"})

#: Conds, whose boolean predicate decides a branch (as one device decides it, if it is the
#: batch's).
_DECIDERS = frozenset({"If", "StatelessIf", "Switch", "RefSwitch"})

#: Ops that read only a tensor's shape, never its values.
SHAPE_READERS = frozenset({"Shape", "ShapeN", "Size", "Rank"})


def value_only(ir, name: str, limit: int = 128) -> bool:
    """Every use of ``name``'s output (a batch size) is as a value: elementwise arithmetic,
    casts included, ends in float values that no op reads as a shape, a bound or a position
    (``tf.reshape(h, [n, -1])``, ``tf.range(n)``, ``x[int(0.7 * (n - 1))]``), where the
    tower's own count is the right one and the batch's cannot replace it. Ops that read only
    a shape do not count. A float copy is followed through the ops that move values around
    (an ``ExpandDims`` of it cast back to an integer shape, review 51 F2: claimed exact, the
    rewrite failed), and a ``tf.range`` of it is a length (review 51 F3). Followed through at
    most ``limit`` ops."""
    from replicate.batchflow.roles import FLOAT_TYPES

    work, seen = [name], {name}
    while work:
        current = work.pop()
        floating = ir.output_dtype(f"{current}:0") in FLOAT_TYPES
        op = ir.nodes[current].op
        outputs = (0, 1) if op in ("Switch", "RefSwitch") else \
            range(max(1, len(ir.output_types(ir.nodes[current])))) if op in _MOVES else (0,)
        for consumer, pos in [c for k in outputs for c in ir.data_consumers(f"{current}:{k}")]:
            if consumer.op in SHAPE_READERS:
                continue
            if consumer.op in _LENGTHS:
                return False        # of any type, a length
            if floating and consumer.op in _CALLS and _lengths_in_bodies(ir, consumer.attrs):
                return False
            passed = consumer.op in _PASSING and (pos == 0 or consumer.op in ("Merge", "RefMerge")) \
                or floating and consumer.op in _MOVES
            if consumer.op not in UNARY | BROADCAST | SAME_SHAPE | IDENTITIES and not passed:
                if floating or consumer.op in _DECIDERS and ir.output_dtype(f"{current}:0") == types_pb2.DT_BOOL:
                    continue        # a float value, or a cond's predicate: no shape, no position
                return False        # an integer (or boolean) read otherwise: maybe one
            if consumer.name not in seen:   # (cast back to an integer, it is followed on)
                if len(seen) >= limit:
                    return False
                seen.add(consumer.name)
                work.append(consumer.name)
    return True
