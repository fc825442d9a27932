"""Op knowledge in tables: what each TensorFlow op type means to the rewrite.

Passes consult these tables instead of branching on op types themselves. Input
positions are not written here: they are read from TensorFlow's op registry by
argument name (``grad``, ``indices``, ``var``), so a table row is just the op
type and the names of its arguments.
"""

from __future__ import annotations

__all__ = [
    "SUMMARY_VALUE",
    "VARIABLE_OPS",
    "RESOURCE_VARIABLE_OPS",
    "REF_VARIABLE_OPS",
    "INPUT_SOURCE_OPS",
    "BATCH_SOURCE_OPS",
    "SPARSE_OPERANDS",
    "SPARSE_PARTS",
    "sparse_role",
    "APPLY_OPS",
    "MUTATING_OPS",
    "RANDOM_OPS",
    "CONTROL_FLOW_OPS",
    "LEADING_NON_ARGUMENTS",
    "CALL_OPS",
    "REDUCTION_KINDS",
    "AFFINE_OPS",
    "SHAPE_CONSUMERS",
    "SHAPE_ATTRS",
    "NUMERIC_CHECK_OPS",
    "PER_TOWER_NAME_ATTRS",
    "STATEFUL_NAME_ATTRS",
    "UNSAFE_OPS",
    "ApplySpec",
    "apply_spec",
]

import dataclasses

#: Ops that own variable storage. They are always shared, never replicated.
REF_VARIABLE_OPS = frozenset({"VariableV2", "Variable", "AutoReloadVariable", "TemporaryVariable"})
RESOURCE_VARIABLE_OPS = frozenset({"VarHandleOp", "_VarHandlesOp"})
VARIABLE_OPS = REF_VARIABLE_OPS | RESOURCE_VARIABLE_OPS | frozenset(
    {"MutableHashTable", "MutableHashTableV2", "MutableHashTableOfTensors",
     "MutableHashTableOfTensorsV2", "MutableDenseHashTable", "MutableDenseHashTableV2",
     # a static lookup table (a vocabulary): copied into the towers, it was never initialized
     "HashTable", "HashTableV2"}
)

#: Ops that bring data into the graph. Shared; batch inputs among them are split.
BATCH_SOURCE_OPS = frozenset(
    {"Placeholder", "PlaceholderV2", "PlaceholderWithDefault", "IteratorGetNext",
     "IteratorGetNextSync", "QueueDequeueMany", "QueueDequeueManyV2", "QueueDequeueUpTo",
     "QueueDequeueUpToV2", "QueueDequeue", "QueueDequeueV2",
     # a SparseTensor an iterator yields (tf.data encodes it as a variant): its (indices,
     # values, dense shape), split by the examples the indices name like a sparse placeholder
     "DeserializeSparse"}
)
#: Ops that read a ``SparseTensor`` as three operands: op -> (indices, values, dense shape)
#: positions (values None: the op does not read them). A batch input fed as a SparseTensor is
#: recognised by them and split by the examples its indices name.
SPARSE_OPERANDS = {
    "SparseTensorDenseMatMul": (0, 1, 2), "SparseToDense": (0, 2, 1), "SparseReduceSum": (0, 1, 2),
    "SparseReduceMax": (0, 1, 2), "SparseReduceSumSparse": (0, 1, 2),
    "SparseReduceMaxSparse": (0, 1, 2), "SparseReshape": (0, None, 1),
    "SparseFillEmptyRows": (0, 1, 2), "SparseSoftmax": (0, 1, 2), "SparseDenseCwiseMul": (0, 1, 2),
    "SparseDenseCwiseAdd": (0, 1, 2), "SparseDenseCwiseDiv": (0, 1, 2), "SparseReorder": (0, 1, 2),
    "SparseSlice": (0, 1, 2), "SerializeSparse": (0, 1, 2), "SparseAdd": (0, 1, 2),
}

INPUT_SOURCE_OPS = BATCH_SOURCE_OPS | frozenset(
    {"Iterator", "IteratorV2", "OneShotIterator", "AnonymousIterator", "AnonymousIteratorV2",
     "AnonymousIteratorV3", "MakeIterator", "FIFOQueue", "FIFOQueueV2", "RandomShuffleQueue",
     "RandomShuffleQueueV2", "PaddingFIFOQueue", "PaddingFIFOQueueV2", "PriorityQueue",
     "PriorityQueueV2", "ReaderReadV2", "ReaderReadUpToV2"}
)


@dataclasses.dataclass(frozen=True)
class ApplySpec:
    """How an optimizer op consumes its gradient.

    Attributes:
        optimizer: the family name shown in reports (``Adam``, ``Momentum``...).
        grad_arg: name of the input argument carrying the gradient (or its values).
        indices_arg: name of the indices argument for sparse updates, else ``None``.
        var_arg: name of the argument holding the updated variable.
    """

    optimizer: str
    grad_arg: str = "grad"
    indices_arg: str | None = None
    var_arg: str = "var"


def _family(optimizer: str, names: list[str], grad_arg: str = "grad") -> dict[str, ApplySpec]:
    table: dict[str, ApplySpec] = {}
    for name in names:
        table[f"Apply{name}"] = ApplySpec(optimizer, grad_arg)
        table[f"ResourceApply{name}"] = ApplySpec(optimizer, grad_arg)
    return table


def _sparse_family(optimizer: str, names: list[str], grad_arg: str = "grad") -> dict[str, ApplySpec]:
    table: dict[str, ApplySpec] = {}
    for name in names:
        table[f"SparseApply{name}"] = ApplySpec(optimizer, grad_arg, "indices")
        table[f"ResourceSparseApply{name}"] = ApplySpec(optimizer, grad_arg, "indices")
    return table


#: Optimizer update ops: op type -> how it takes its gradient.
APPLY_OPS: dict[str, ApplySpec] = {
    **_family("GradientDescent", ["GradientDescent"], grad_arg="delta"),
    **_family("ProximalGradientDescent", ["ProximalGradientDescent"], grad_arg="delta"),
    **_family("Momentum", ["Momentum", "KerasMomentum"]),
    **_family("Adam", ["Adam", "AdamWithAmsgrad"]),
    **_family("AdaMax", ["AdaMax"]),
    **_family("RMSProp", ["RMSProp", "CenteredRMSProp"]),
    **_family("Adagrad", ["Adagrad", "AdagradV2"]),
    **_family("AdagradDA", ["AdagradDA"], grad_arg="gradient"),
    **_family("Adadelta", ["Adadelta"]),
    **_family("Ftrl", ["Ftrl", "FtrlV2"]),
    **_family("ProximalAdagrad", ["ProximalAdagrad"]),
    **_family("PowerSign", ["PowerSign"]),
    **_family("AddSign", ["AddSign"]),
    **_sparse_family("Momentum", ["Momentum", "KerasMomentum"]),
    **_sparse_family("RMSProp", ["RMSProp", "CenteredRMSProp"]),
    **_sparse_family("Adagrad", ["Adagrad", "AdagradV2"]),
    **_sparse_family("AdagradDA", ["AdagradDA"]),
    **_sparse_family("Adadelta", ["Adadelta"]),
    **_sparse_family("Ftrl", ["Ftrl", "FtrlV2"]),
    **_sparse_family("ProximalAdagrad", ["ProximalAdagrad"]),
    **_sparse_family("ProximalGradientDescent", ["ProximalGradientDescent"]),
}

#: Ops that write to a variable other than through an optimizer kernel:
#: op type -> (name of the variable argument, name of the value argument, name of indices or None).
MUTATING_OPS: dict[str, tuple[str, str, str | None]] = {
    "Assign": ("ref", "value", None),
    "AssignAdd": ("ref", "value", None),
    "AssignSub": ("ref", "value", None),
    "AssignVariableOp": ("resource", "value", None),
    "AssignAddVariableOp": ("resource", "value", None),
    "AssignSubVariableOp": ("resource", "value", None),
    **{f"Scatter{k}": ("ref", "updates", "indices")
       for k in ("Add", "Sub", "Mul", "Div", "Update", "Min", "Max")},
    **{f"ScatterNd{k}": ("ref", "updates", "indices") for k in ("Add", "Sub", "Update")},
    **{f"ResourceScatter{k}": ("resource", "updates", "indices")
       for k in ("Add", "Sub", "Mul", "Div", "Update", "Min", "Max")},
    **{f"ResourceScatterNd{k}": ("ref", "updates", "indices") for k in ("Add", "Sub", "Update")},
}

#: TF1 (v1) control-flow ops: a loop or cond is replicated whole, never split between a tower
#: and the shared graph.
CONTROL_FLOW_OPS = frozenset(
    {"Enter", "RefEnter", "Exit", "RefExit", "Switch", "RefSwitch", "Merge", "RefMerge",
     "NextIteration", "RefNextIteration", "LoopCond"}
)

#: Calls whose results come from a function body and whose gradient is one gradient function
#: of the call (a v2 cond's branches, a defun); v2 loops are ``While``/``StatelessWhile``.
CALL_OPS = frozenset({"If", "StatelessIf", "PartitionedCall", "StatefulPartitionedCall"})

#: Calls whose first inputs select a body instead of being its arguments: input ``i`` of such
#: a call is argument ``i - LEADING_NON_ARGUMENTS[op]`` of the body (0 for other calls).
LEADING_NON_ARGUMENTS = {"If": 1, "StatelessIf": 1, "Case": 1, "StatelessCase": 1}

#: Ops that draw random numbers: each tower must get its own stream.
RANDOM_OPS = frozenset(
    {"RandomUniform", "RandomUniformInt", "RandomStandardNormal", "TruncatedNormal",
     "RandomShuffle", "Multinomial", "RandomGamma", "RandomPoisson", "RandomPoissonV2",
     "ParameterizedTruncatedNormal", "StatelessRandomUniformV2", "StatelessRandomNormalV2",
     "StatelessTruncatedNormalV2", "RandomCrop", "LogUniformCandidateSampler",
     "UniformCandidateSampler", "LearnedUnigramCandidateSampler", "FixedUnigramCandidateSampler",
     "ThreadUnsafeUnigramCandidateSampler", "AllCandidateSampler",
     "SampleDistortedBoundingBox", "SampleDistortedBoundingBoxV2", "FractionalMaxPool",
     "FractionalAvgPool", "NonDeterministicInts", "StatelessMultinomial", "StatelessShuffle",
     "StatelessParameterizedTruncatedNormal", "StatelessSampleDistortedBoundingBox",
     "RandomIndexShuffle"}
)

#: Ops of ``tf.random.Generator`` (``tf.random.experimental.Generator`` in 2019) that read and
#: advance a generator's state variable: each call is a write of that state, and those that
#: return numbers are draws whose stream is the state's, not a seed's.
GENERATOR_OPS = frozenset(
    {"StatefulStandardNormal", "StatefulStandardNormalV2", "StatefulTruncatedNormal",
     "StatefulUniform", "StatefulUniformFullInt", "StatefulUniformInt", "StatefulRandomBinomial",
     "RngSkip", "RngReadAndSkip"}
)

#: Other ops that write state and are not assignments of a value (``MUTATING_OPS``).
STATE_OPS = GENERATOR_OPS | frozenset(
    {"ResourceStridedSliceAssign", "StridedSliceAssign", "CountUpTo", "ResourceCountUpTo",
     "ScatterNdMax", "ScatterNdMin", "ResourceScatterNdMax", "ResourceScatterNdMin",
     "LookupTableInsert", "LookupTableInsertV2", "LookupTableRemoveV2", "LookupTableImport",
     "LookupTableImportV2", "NegTrain", "AccumulatorApplyGradient",
     "SparseAccumulatorApplyGradient", "AccumulatorSetGlobalStep", "ResourceAccumulatorApplyGradient",
     "ResourceAccumulatorSetGlobalStep", "QueueEnqueue", "QueueEnqueueV2", "QueueEnqueueMany",
     "QueueEnqueueManyV2", "Stage", "MapStage", "OrderedMapStage"}
)

#: Ops that take the next element of an input (an iterator, a queue, a reader, a staging
#: area): at the top level they are the batch inputs the split pass cuts; inside a function
#: body every tower's copy would take an element of its own, so there they count as writes.
CONSUMING_OPS = frozenset(
    {"IteratorGetNext", "IteratorGetNextSync", "IteratorGetNextAsOptional", "QueueDequeue",
     "QueueDequeueV2", "QueueDequeueMany", "QueueDequeueManyV2", "QueueDequeueUpTo",
     "QueueDequeueUpToV2", "ReaderRead", "ReaderReadV2", "ReaderReadUpTo", "ReaderReadUpToV2",
     "Unstage", "MapUnstage", "MapUnstageNoKey", "OrderedMapUnstage", "OrderedMapUnstageNoKey",
     "TakeManySparseFromTensorsMap"}
)

#: Stateful ops (by their OpDef) whose state is a value the step reads, a resource they
#: create, a run's own bookkeeping or an input source: no effect the analysis must see.
#: Any other stateful op with no row in a table here is taken to write state (conservative:
#: its region copies make the rewrite inexact, with the op named).
READ_STATE_OPS = frozenset(
    {"ReadVariableOp", "ResourceGather", "ResourceGatherNd", "VariableShape", "VarIsInitializedOp",
     "IsVariableInitialized", "DestroyResourceOp", "DestroyTemporaryVariable", "CheckNumerics",
     "CheckNumericsV2", "Empty", "DeepCopy", "GuaranteeConst", "Timestamp", "While", "Case",
     "StatefulPartitionedCall", "LookupTableFind", "LookupTableFindV2", "LookupTableSize",
     "LookupTableSizeV2", "LookupTableExport", "LookupTableExportV2", "HashTable", "HashTableV2",
     "MutableHashTable", "MutableHashTableV2", "MutableHashTableOfTensors",
     "MutableHashTableOfTensorsV2", "MutableDenseHashTable", "MutableDenseHashTableV2",
     "AnonymousHashTable", "AnonymousMutableHashTable", "AnonymousMutableHashTableOfTensors",
     "AnonymousMutableDenseHashTable", "InitializeTable", "InitializeTableV2",
     "InitializeTableFromTextFile", "InitializeTableFromTextFileV2",
     "InitializeTableFromDataset", "GetSessionHandle", "GetSessionHandleV2", "GetSessionTensor",
     "DeleteSessionTensor", "MutexV2", "MutexLock", "ConsumeMutexLock", "SyncDevice",
     "DeviceIndex", "StageSize", "StageClear", "StagePeek", "HostConst",
     "ResourceUsingOp", "DisableCopyOnRead", "MakeWeakResourceHandle", "AnonymousSeedGenerator",
     "AnonymousRandomSeedGenerator", "DeleteRandomSeedGenerator", "DeleteSeedGenerator",
     "DummySeedGenerator", "ConditionalAccumulator", "SparseConditionalAccumulator",
     "ResourceConditionalAccumulator", "AccumulatorNumAccumulated", "AccumulatorTakeGradient",
     "SparseAccumulatorTakeGradient", "ResourceAccumulatorNumAccumulated",
     "ResourceAccumulatorTakeGradient", "_Send", "_Recv", "_HostSend", "_HostRecv",
     "CollectiveReduce", "CollectiveReduceV2", "CollectiveGather", "CollectiveGatherV2",
     "CollectiveBcastSend", "CollectiveBcastRecv", "CollectiveBcastSendV2",
     "CollectiveBcastRecvV2", "CollectiveAllToAllV2", "NcclAllReduce", "NcclReduce",
     "NcclBroadcast", "CudnnRNN", "CudnnRNNV2", "CudnnRNNV3", "CudnnRNNBackprop",
     "CudnnRNNBackpropV2", "CudnnRNNBackpropV3", "StatelessRandomGetAlg", "GraphDefVersion",
     "IsTensorFloat32Enabled", "DevicePlacementOp", "_ParallelConcatStart", "_Arg", "_Retval",
     "_DeviceArg", "_DeviceRetval", "Send", "Recv", "AddSparseToTensorsMap",
     "AddManySparseToTensorsMap", "TakeManySparseFromTensorsMap"}
)

#: Families of stateful ops read the same way, by name: iterators and datasets (input
#: sources), queues, readers, TensorArrays and stacks (a run's own storage), summaries,
#: barriers, record and checkpoint I/O (``UNSAFE_OPS`` holds the ones that touch files).
READ_STATE_FAMILIES = ("Iterator", "Dataset", "Queue", "Reader", "TensorArray", "Stack",
                       "Summary", "Barrier", "Record", "Save", "Restore", "Print", "Assert",
                       "Optional", "Tpu", "TPU", "Infeed", "Outfeed", "Debug", "Variable")

#: Summary ops (a protocol buffer of a value, no state) -> the input holding the value.
SUMMARY_VALUE: dict[str, int] = {"ScalarSummary": 1, "HistogramSummary": 1, "TensorSummaryV2": 1,
                                 "ImageSummary": 1, "AudioSummaryV2": 1}

#: Reductions over the batch and how tower results combine into the global value:
#: ``mean`` is weighted by example counts, ``sum`` adds, ``max``/``min`` take extremes.
REDUCTION_KINDS: dict[str, str] = {
    "Mean": "mean",
    "Sum": "sum",
    "Max": "max",
    "Min": "min",
    "EuclideanNorm": "other",
    "Prod": "other",
    "L2Loss": "sum",
    "Size": "sum",
}

#: Ops through which a batch-mean stays a batch-mean when their other inputs do not
#: depend on the batch (affine with weights that sum to one across towers).
AFFINE_OPS = frozenset(
    {"Identity", "Add", "AddV2", "AddN", "Sub", "Neg", "Mul", "RealDiv", "Cast", "Snapshot",
     "StopGradient", "CheckNumerics", "EnsureShape", "Reshape", "Squeeze", "ExpandDims"}
)

#: Inputs that carry a shape (or tile multiples) as a constant: (op type, input index).
#: With a static global batch these constants hold the batch size at element 0.
SHAPE_CONSUMERS = frozenset(
    {("Reshape", 1), ("Tile", 1), ("Fill", 0), ("BroadcastTo", 1), ("Zeros", 0),
     ("RandomUniform", 0), ("RandomStandardNormal", 0), ("TruncatedNormal", 0),
     ("SplitV", 1), ("Slice", 2), ("BroadcastGradientArgs", 0), ("BroadcastGradientArgs", 1)}
)

#: Ops that check their input's values for NaN and Inf and pass it on: TensorFlow marks them
#: stateful, but they compute nothing else (a value checked once is the value checked).
NUMERIC_CHECK_OPS = frozenset({"CheckNumerics", "CheckNumericsV2"})

#: Shape-valued attributes that repeat a static batch size: op type -> attribute names.
SHAPE_ATTRS: dict[str, tuple[str, ...]] = {
    "EnsureShape": ("shape",),
    "TensorArrayV3": ("element_shape",),
    "PlaceholderWithDefault": ("shape",),
}

#: String attributes that name per-instance runtime state; each tower needs its own.
PER_TOWER_NAME_ATTRS: dict[str, tuple[str, ...]] = {
    "Enter": ("frame_name",),
    "RefEnter": ("frame_name",),
    "StackV2": ("stack_name",),
    "Stack": ("stack_name",),
    "TensorArrayV3": ("tensor_array_name",),
    "TensorArrayV2": ("tensor_array_name",),
}

#: Attributes that share state between ops by name when non-empty.
STATEFUL_NAME_ATTRS = ("shared_name", "container")

#: Ops that touch files, the network or Python: never executed by `verify`.
UNSAFE_OPS = frozenset(
    {"ReadFile", "WriteFile", "PyFunc", "PyFuncStateless", "EagerPyFunc", "Save", "SaveV2",
     "SaveSlices", "Restore", "RestoreV2", "RestoreSlice", "MergeV2Checkpoints",
     "WholeFileReader", "WholeFileReaderV2", "TFRecordReader", "TFRecordReaderV2",
     "TextLineReader", "TextLineReaderV2", "FixedLengthRecordReader",
     "FixedLengthRecordReaderV2", "MatchingFiles", "DeleteFile", "WriteSummary",
     "CreateSummaryFileWriter", "ImmutableConst", "DebugIdentity", "PrintV2", "Print",
     "TFRecordDataset", "TFRecordDatasetV2", "TextLineDataset", "FixedLengthRecordDataset",
     "FixedLengthRecordDatasetV2"}
)


#: The parts of a batch input fed as a ``SparseTensor``, in the order the analysis lists
#: them; parts after the third are further values of the same entries (sparse weights).
SPARSE_PARTS = ("indices", "values", "shape")


def sparse_role(position: int) -> str:
    """The role of part ``position`` of a sparse batch input."""
    return SPARSE_PARTS[position] if position < len(SPARSE_PARTS) else "values"


def apply_spec(op_type: str) -> ApplySpec | None:
    """Return the optimizer table row for ``op_type``, or ``None`` if it is not an update op."""
    return APPLY_OPS.get(op_type)
