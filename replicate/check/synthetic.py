"""Synthetic inputs for running a training graph, and the ops such a run would execute.

``replicate verify`` runs graphs it did not build. :func:`input_specs` finds the tensors a
training step needs from outside (placeholders; iterator and queue outputs, fed so that
no input pipeline runs) with their dtypes and static shapes, the batch axis of batch
inputs and, for integer inputs used as class labels or lookup ids, the range their values
must stay in (float labels of a softmax cross-entropy are drawn one-hot). :func:`make_feed`
draws a feed of a given global batch size from them; scalar flags (bool placeholders, and
bool ``placeholder_with_default``\ s such as ``is_training``) are True in even steps and False
in odd ones, so that a check takes both sides of the conds they steer. :func:`unsafe_ops` lists the file,
network and Python-callback ops that running given targets with given feeds would
execute, library functions included. :func:`with_variables` and :func:`initializers` let
a bare GraphDef be trained like a MetaGraphDef with variable collections.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np
from tensorflow.python.framework import dtypes

from replicate.batchflow.inputs import seed_only as _seed_only
from replicate.errors import InputError
from replicate.graph import ops
from replicate.graph.ir import IR, node_of, parse_tensor, tensor_name
from replicate.graph.registry import called_functions

__all__ = ["InputSpec", "input_specs", "make_feed", "permute", "unsafe_ops", "initializers", "with_variables",
           "FED_OPS", "UNSAFE_OPS", "SCALAR_VALUES"]

log = logging.getLogger(__name__)

#: Ops whose outputs are fed: placeholders, and iterators and queues (their pipelines never run).
FED_OPS = frozenset({"Placeholder", "PlaceholderV2"}) | (ops.BATCH_SOURCE_OPS - {"PlaceholderWithDefault"})

#: Ops that touch files, the network or Python, beyond ``replicate.graph.ops.UNSAFE_OPS``.
UNSAFE_OPS = ops.UNSAFE_OPS | frozenset(
    {"InitializeTableFromTextFile", "InitializeTableFromTextFileV2", "ReaderRead", "ReaderReadV2",
     "ReaderReadUpTo", "ReaderReadUpToV2", "WriteAudioSummary", "WriteImageSummary",
     "WriteScalarSummary", "WriteHistogramSummary", "WriteGraphSummary", "WriteRawProtoSummary",
     "ImportEvent", "FlushSummaryWriter", "CloseSummaryWriter", "CreateSummaryDbWriter",
     "SummaryWriter", "DebugNumericSummary", "DebugNanCount"})

#: Values given to scalar (non-batch) inputs, by dtype kind: learning rates, keep
#: probabilities, flags such as ``is_training`` (in even steps; odd steps feed flags False).
SCALAR_VALUES = {"f": 0.1, "i": 1, "u": 1, "b": True, "c": 0.1}

#: Ops that index with an input tensor: op -> (argument holding the ids, how the bound is found).
_INDEXING = {
    "SparseSoftmaxCrossEntropyWithLogits": ("labels", "features", -1),
    "GatherV2": ("indices", "params", 0),
    "Gather": ("indices", "params", 0),
    "ResourceGather": ("indices", "resource", 0),
    "InTopKV2": ("targets", "predictions", -1),
    "InTopK": ("targets", "predictions", -1),
    "UnsortedSegmentSum": ("segment_ids", "num_segments", None),
    "OneHot": ("indices", "depth", None),
}
_PASS_THROUGH = frozenset({"Identity", "Cast", "Reshape", "ExpandDims", "Squeeze", "StopGradient",
                           "Unique", "Snapshot"})
#: Ops whose ``labels`` input is a probability distribution over the last axis.
_DISTRIBUTION_LABELS = frozenset({"SoftmaxCrossEntropyWithLogits"})


@dataclasses.dataclass
class InputSpec:
    """A tensor to feed.

    Attributes:
        tensor: its name (``x:0``).
        dtype: numpy dtype name.
        shape: static shape (None entries unknown); None for unknown rank.
        batch_axis: the axis that carries examples, or None for a shared input.
        high: for integer inputs, the exclusive upper bound of their values.
        onehot: for float inputs read as class distributions, draw one-hot rows.
    """

    tensor: str
    dtype: str
    shape: list[int | None] | None
    batch_axis: int | None
    high: int | None = None
    onehot: bool = False
    #: For a part of a batch input fed as a SparseTensor: (``indices``/``values``/``shape``,
    #: the indices' tensor, the dense shape's dimensions after the batch where known).
    sparse: tuple | None = None
    #: Row numbers of the batch, as a gather of its rows reads them (``passes/_rows.py``):
    #: "column" (the first of a ``GatherNd``'s index tuples) or "whole"; each example names
    #: its own row.
    rows: str | None = None
    #: For an integer scalar that selects a mode (compared with a constant, or a ``tf.case``
    #: index: ``mode = placeholder_with_default(1, [])``): its value in even and odd steps.
    mode: tuple | None = None

    def describe(self) -> str:
        """``x:0 float32 [?, 784] (batch)`` for reports."""
        dims = "?" if self.shape is None else "[" + ", ".join(
            "?" if d is None else str(d) for d in self.shape) + "]"
        extra = " (batch)" if self.batch_axis is not None else ""
        extra += f" in [0, {self.high})" if self.high is not None else ""
        extra += " one-hot" if self.onehot else ""
        extra += f" (sparse {self.sparse[0]})" if self.sparse else ""
        return f"{self.tensor} {self.dtype} {dims}{extra}"


def _readers(ir: IR, ref: str) -> Iterator[tuple[Any, int]]:
    """(consumer, input position) of ``ref``, looking through reshapes, casts and identities."""
    work, seen = [tensor_name(*parse_tensor(ref))], set()
    while work:
        current = work.pop()
        if current in seen:
            continue
        seen.add(current)
        for consumer, pos in ir.data_consumers(current):
            if consumer.op in _PASS_THROUGH and pos == 0:
                work.append(tensor_name(consumer.name, 0))
            else:
                yield consumer, pos


def _bound(ir: IR, ref: str) -> int | None:
    """The exclusive upper bound on values of integer tensor ``ref`` that its readers imply."""
    bounds = []
    for consumer, pos in _readers(ir, ref):
        rule = _INDEXING.get(consumer.op)
        if rule is not None and ir.arg_index(consumer, rule[0]) == pos:
            bounds.append(_extent(ir, consumer.inputs[ir.arg_index(consumer, rule[1])], rule[2]))
    found = [b for b in bounds if b]
    return min(found) if found else None


def _is_distribution(ir: IR, ref: str) -> bool:
    """True when float tensor ``ref`` is read as softmax cross-entropy labels."""
    return any(c.op in _DISTRIBUTION_LABELS and ir.arg_index(c, "labels") == pos
               for c, pos in _readers(ir, ref))


def _extent(ir: IR, ref: str, axis: int | None) -> int | None:
    """Size of ``ref`` along ``axis``; the value of a scalar constant when ``axis`` is None."""
    if axis is None:
        value = ir.const_value(node_of(ref))
        return int(value) if value is not None and np.ndim(value) == 0 else None
    node = ir.nodes[node_of(ref)]
    shape = node.attr("shape") if node.op in ops.RESOURCE_VARIABLE_OPS else ir.static_shape(ref)
    if not shape:
        return None
    return shape[axis]


def input_specs(ir: IR, targets: Iterable[str], batch_tensors: Iterable[str] = (),
                sparse: Iterable[tuple] = (), rows: Mapping[str, str] | None = None) -> list[InputSpec]:
    """The tensors to feed when running ``targets``, in graph order.

    Args:
        ir: the graph, with static shapes loaded (``replicate.api.analyze_only``).
        targets: node names that will be run (the train op, initializers).
        batch_tensors: tensors whose axis 0 carries examples (the analysis' batch inputs).
        sparse: batch inputs fed as a SparseTensor, (indices, values, dense shape) each; all
            three are fed together, even a dense shape with a default.
        rows: batch inputs holding row numbers of the batch -> "column" or "whole" (see
            :attr:`InputSpec.rows`).
    """
    batch = {tensor_name(*parse_tensor(t)) for t in batch_tensors}
    roles = {t: (ops.sparse_role(i), triple[0], _dense_dims(ir, triple[2]))
             for triple in sparse for i, t in enumerate(triple) if t}
    graph = ir.to_networkx()
    needed = ir.ancestors([t for t in targets if t in ir.nodes], graph)
    specs = []
    for name in ir.nodes:
        node = ir.nodes[name]
        flag = node.op == "PlaceholderWithDefault" and node.attr("dtype") == dtypes.bool.as_datatype_enum \
            and ir.static_shape(f"{name}:0") == []
        mode = _mode(ir, node) if name in needed else None
        if name not in needed or (node.op not in FED_OPS and f"{name}:0" not in roles and not flag
                                  and mode is None):
            continue
        seed = node.op in FED_OPS and ir.static_shape(f"{name}:0") == [None] and _seed_only(ir, f"{name}:0")
        used = sorted({parse_tensor(r)[1] for c in ir.consumers(name) for r in c.inputs
                       if node_of(r) == name})
        for index in used:
            ref = tensor_name(name, index)
            dtype = dtypes.as_dtype(ir.output_dtype(ref)).base_dtype
            high = _bound(ir, ref) if dtype.is_integer else None
            onehot = dtype.is_floating and _is_distribution(ir, ref)
            specs.append(InputSpec(ref, dtype.name, [2] if seed else ir.static_shape(ref),
                                   0 if ref in batch else None, high, onehot, roles.get(ref),
                                   (rows or {}).get(ref), mode if index == 0 else None))
    return specs


#: Ops through which an integer scalar selects what a step computes.
_SELECTING = frozenset({"Equal", "NotEqual", "Less", "LessEqual", "Greater", "GreaterEqual", "Case",
                        "StatelessCase"})


def _mode(ir: IR, node) -> tuple | None:
    """(even, odd) step values of an integer scalar placeholder that selects a mode: compared
    with a value or a ``tf.case`` index. Even steps take its default (else 1), odd ones another
    value (review 42: a branch taken only when the mode was 0 was never run by the check)."""
    if node.op not in ("Placeholder", "PlaceholderWithDefault") or ir.static_shape(f"{node.name}:0") != []:
        return None
    dtype = dtypes.as_dtype(node.attr("dtype", dtypes.float32.as_datatype_enum))
    if not dtype.is_integer or not any(c.op in _SELECTING for c in ir.consumers(node.name)):
        return None
    default = ir.const_value(node_of(node.inputs[0])) if node.op == "PlaceholderWithDefault" else None
    even = int(default) if default is not None and np.ndim(default) == 0 else 1
    return (even, 0 if even != 0 else 1)


def _dense_dims(ir: IR, shape: str | None) -> list[int | None]:
    """The dimensions after the batch of a sparse input's dense shape: from the default of a
    ``sparse_placeholder(shape=[None, d])``, else unknown."""
    node = ir.nodes.get(node_of(shape)) if shape else None
    value = ir.const_value(node_of(node.inputs[0])) if node is not None and node.inputs else None
    if value is None or np.ndim(value) != 1:
        return []
    return [int(d) if d >= 0 else None for d in np.asarray(value).tolist()[1:]]


def _sparse_feed(specs: list[InputSpec], batch: int, rng: np.random.RandomState, free_dim: int
                 ) -> dict[str, np.ndarray]:
    """The parts of one sparse batch input: 0 to 3 entries per example at distinct sorted
    coordinates (the first example always has one), values like a dense input's."""
    by_role = {s.sparse[0]: s for s in specs if s.sparse[0] != "values"}
    index_spec = by_role["indices"]
    rank = (index_spec.shape[1] if index_spec.shape and len(index_spec.shape) == 2 else None) or 2
    dims = list(index_spec.sparse[2]) + [None] * rank
    dims = [batch] + [d or free_dim for d in dims[: rank - 1]]
    coords = []
    for row in range(batch):
        count = min(int(rng.randint(1 if row == 0 else 0, 4)), int(np.prod(dims[1:])))
        picked = rng.choice(int(np.prod(dims[1:])), count, replace=False) if count else []
        coords += [(row, *np.unravel_index(int(p), dims[1:])) for p in sorted(picked)]
    indices = np.array(coords, np.int64).reshape(-1, rank)
    out = {index_spec.tensor: indices}
    if "shape" in by_role:
        out[by_role["shape"].tensor] = np.array(dims, np.int64)
    for spec in specs:                       # the values, and any weights of the entries
        if spec.sparse[0] == "values":
            dense = dataclasses.replace(spec, shape=[None], batch_axis=0, sparse=None)
            out[spec.tensor] = make_feed([dense], len(indices), rng)[spec.tensor]
    return out


def permute(specs: Iterable[InputSpec], feed: Mapping[str, Any], order: np.ndarray) -> dict[str, Any]:
    """``feed`` with its examples in ``order`` (example ``i`` becomes example ``order[i]``'s),
    for dense batch inputs and sparse ones alike (their entries renumbered and re-sorted)."""
    out = dict(feed)
    specs = list(specs)
    for spec in specs:
        if spec.batch_axis is not None and not spec.sparse and spec.tensor in feed \
                and np.ndim(feed[spec.tensor]):
            out[spec.tensor] = np.asarray(feed[spec.tensor])[order]
    inverse = np.argsort(order)
    for spec in specs:          # row numbers follow their rows to their new places
        if spec.rows is not None and spec.tensor in out and np.ndim(out[spec.tensor]):
            out[spec.tensor] = _own_rows(spec, out[spec.tensor], np.arange(len(order)))
    for spec in specs:
        if spec.sparse and spec.sparse[0] == "indices" and spec.tensor in feed:
            indices = np.array(feed[spec.tensor])
            indices[:, 0] = inverse[indices[:, 0]]
            sort = np.lexsort(indices.T[::-1])
            out[spec.tensor] = indices[sort]
            for other in specs:
                if other.sparse and other.sparse[0] == "values" and other.sparse[1] == spec.tensor:
                    out[other.tensor] = np.asarray(feed[other.tensor])[sort]
    return out


def make_feed(specs: Iterable[InputSpec], batch: int, rng: np.random.RandomState,
              free_dim: int = 3, overrides: Mapping[str, Any] | None = None, step: int = 0
              ) -> dict[str, np.ndarray]:
    """One feed dict for step ``step``: batch inputs get ``batch`` examples, unknown other
    dimensions ``free_dim``; floats are standard normal, integers uniform below their bound
    (2 by default), scalars of shared inputs (and shared inputs of unknown rank, like a
    ``keep_prob`` placeholder without a shape) take :data:`SCALAR_VALUES`, but scalar flags
    are False in odd steps (a draw or an update under ``training=flag`` must happen only in
    the steps whose flag is True, as on one device: review 39 found a check that never fed
    False passing a draw made in every step).

    Raises:
        InputError: an input has an unknown rank, a string dtype, or a static batch
            dimension other than ``batch``; feed it through ``overrides`` instead.
    """
    overrides = dict(overrides or {})
    feed: dict[str, np.ndarray] = {}
    specs = list(specs)
    for spec in specs:
        if spec.sparse and spec.tensor not in feed and spec.tensor not in overrides:
            feed.update(_sparse_feed([s for s in specs if s.sparse and s.sparse[1] == spec.sparse[1]],
                                     batch, rng, free_dim))
        if spec.sparse:
            if spec.tensor in overrides:
                feed[spec.tensor] = np.asarray(overrides[spec.tensor], dtype=spec.dtype)
            continue
        if spec.tensor in overrides:
            feed[spec.tensor] = np.asarray(overrides[spec.tensor], dtype=spec.dtype)
            continue
        if spec.shape is None and spec.batch_axis is not None:
            raise InputError(f"input '{spec.tensor}' has an unknown rank: give its value with --feed")
        if spec.shape is None:  # a shapeless placeholder, such as keep_prob: most likely a scalar
            spec = dataclasses.replace(spec, shape=[])
        if spec.batch_axis is not None and spec.shape[spec.batch_axis] not in (None, batch):
            raise InputError(f"input '{spec.tensor}' fixes the batch size at "
                             f"{spec.shape[spec.batch_axis]}; use --batch {spec.shape[spec.batch_axis]}")
        shape = [batch if i == spec.batch_axis else (free_dim if d is None else d)
                 for i, d in enumerate(spec.shape)]
        kind = np.dtype(spec.dtype).kind if spec.dtype not in ("string", "resource", "variant") else "O"
        if kind == "O":
            raise InputError(f"input '{spec.tensor}' is a {spec.dtype} tensor: give its value "
                             "with --feed")
        if not shape and spec.batch_axis is None:
            value = SCALAR_VALUES[kind] if kind != "b" else step % 2 == 0
            if spec.mode is not None:
                value = spec.mode[step % 2]
            feed[spec.tensor] = np.asarray(value, dtype=spec.dtype)
        elif kind == "b":
            feed[spec.tensor] = rng.randint(0, 2, shape).astype(bool)
        elif kind in "iu":
            feed[spec.tensor] = _own_rows(spec, rng.randint(0, spec.high or 2, shape).astype(spec.dtype))
        elif spec.onehot and shape and shape[-1]:
            hot = rng.randint(0, shape[-1], shape[:-1])
            feed[spec.tensor] = np.eye(shape[-1], dtype=spec.dtype)[hot]
        else:
            feed[spec.tensor] = rng.standard_normal(shape).astype(spec.dtype)
    return feed


def _own_rows(spec: InputSpec, values: np.ndarray, numbers: np.ndarray | None = None) -> np.ndarray:
    """``values`` with each example's row number (``numbers``, by default its position) where
    ``spec`` holds row numbers of the batch."""
    if spec.rows is None or not values.ndim:
        return values
    values = np.array(values)
    numbers = np.arange(len(values)) if numbers is None else numbers
    own = numbers.reshape([-1] + [1] * (values.ndim - (2 if spec.rows == "column" else 1)))
    if spec.rows == "column":
        values[..., 0] = own
    else:
        values[...] = own
    return values


def unsafe_ops(ir: IR, targets: Iterable[str], fed: Iterable[str] = ()) -> list[tuple[str, str]]:
    """(node, op type) of every file, network or Python op that running ``targets`` with the
    tensors ``fed`` (their producers do not run) would execute, in graph order; ops inside
    library functions called on the way are named ``function/node``."""
    fed_nodes = {node_of(t) for t in fed}
    graph = ir.to_networkx()
    for name in fed_nodes & set(graph):
        graph.remove_edges_from(list(graph.in_edges(name)))
    run = ir.ancestors([t for t in targets if t in ir.nodes], graph) - fed_nodes
    found = [(n, ir.nodes[n].op) for n in ir.nodes if n in run and ir.nodes[n].op in UNSAFE_OPS]
    functions = {f.signature.name: f for f in ir.library.function} if ir.library is not None else {}
    work = [c for n in ir.nodes if n in run
            for c in called_functions(ir.nodes[n].op, ir.nodes[n].attrs, functions)]
    seen: set[str] = set()
    while work:
        name = work.pop()
        if name in seen:
            continue
        seen.add(name)
        for inner in functions[name].node_def:
            if inner.op in UNSAFE_OPS:
                found.append((f"{name}/{inner.name}", inner.op))
            work.extend(called_functions(inner.op, inner.attr, functions))
    return found



def initializers(meta) -> list[str]:
    """Node names a Trainer runs before training: variable and table initializers."""
    from tensorflow.core.framework import variable_pb2

    out = []
    for key in ("variables", "local_variables"):
        for raw in meta.collection_def[key].bytes_list.value if key in meta.collection_def else ():
            out.append(node_of(variable_pb2.VariableDef.FromString(raw).initializer_name))
    if "table_initializer" in meta.collection_def:
        out.extend(node_of(n) for n in meta.collection_def["table_initializer"].node_list.value)
    return out


def with_variables(meta, ir: IR, trainable: Iterable[str]):
    """``meta``, or a copy whose ``variables`` collection lists every variable of ``ir`` that
    has an initializer (``V/Assign``) when ``meta`` lists none (a bare GraphDef).

    Args:
        meta: a MetaGraphDef.
        ir: the same graph as an IR.
        trainable: variable names to list in ``trainable_variables`` too.
    """
    from tensorflow.core.framework import variable_pb2
    from tensorflow.core.protobuf import meta_graph_pb2

    if "variables" in meta.collection_def:
        return meta
    out = meta_graph_pb2.MetaGraphDef()
    out.CopyFrom(meta)
    trainable = set(trainable)
    for node in ir:
        if node.op not in ops.REF_VARIABLE_OPS | ops.RESOURCE_VARIABLE_OPS:
            continue
        assigns = [c for c in ir.consumers(node.name) if c.op in ("Assign", "AssignVariableOp")
                   and c.inputs and node_of(c.inputs[0]) == node.name]
        assigns.sort(key=lambda c: c.name != f"{node.name}/Assign")
        reads = [c.name for c in ir.consumers(node.name) if c.op in ("Identity", "ReadVariableOp")]
        if not assigns or (node.op in ops.RESOURCE_VARIABLE_OPS and not reads):
            log.warning("variable %s has no initializer; it is not initialized", node.name)
            continue
        snapshot = f"{node.name}/read" if f"{node.name}/read" in ir.nodes else (reads or [node.name])[0]
        proto = variable_pb2.VariableDef(
            variable_name=tensor_name(node.name), initializer_name=assigns[0].name,
            snapshot_name=tensor_name(snapshot), initial_value_name=tensor_name(*parse_tensor(
                assigns[0].inputs[1])), is_resource=node.op in ops.RESOURCE_VARIABLE_OPS,
            trainable=node.name in trainable)
        for key in ("variables", "trainable_variables") if proto.trainable else ("variables",):
            out.collection_def[key].bytes_list.value.append(proto.SerializeToString())
    return out
