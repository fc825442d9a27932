"""What :func:`replicate.transform` returns: the rewritten graph and handles into it."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from tensorflow.core.framework import graph_pb2
from tensorflow.core.protobuf import meta_graph_pb2

from replicate.batchflow.facts import Analysis, Towers
from replicate.errors import REPORT, InternalError
from replicate.graph.ir import parse_tensor
from replicate.options import Options
from replicate.passes.pipeline import PassRecord
from replicate.report import Report

__all__ = ["Result"]


@dataclasses.dataclass
class Result:
    """The replicated graph and handles into it.

    Attributes:
        graph_def: the rewritten GraphDef.
        meta_graph_def: the same with collections, saver and signatures carried over.
        report: what was found and whether the result is exact.
        analysis: the analyze pass's facts (for tools).
        records: timing of each pass.
        options: the options the transform ran with.
    """

    graph_def: graph_pb2.GraphDef
    meta_graph_def: meta_graph_pb2.MetaGraphDef
    report: Report
    analysis: Analysis
    towers: Towers
    records: list[PassRecord]
    aggregates: dict[str, str]
    transform_seconds: float
    options: Options = dataclasses.field(default_factory=Options)

    @functools.cached_property
    def graph(self):
        """A new tf.Graph holding the result (built on first use).

        ``transform`` imported the graph already, so this does not fail on the graph; should
        it fail anyway, the error is an :class:`InternalError`, never TensorFlow's own.
        """
        import tensorflow as tf
        from tensorflow.python.framework import meta_graph

        graph = tf.Graph()
        try:
            with graph.as_default():
                # Collections (and so tf.Variable objects) without creating a new Saver.
                meta_graph.import_scoped_meta_graph(self.meta_graph_def, clear_devices=False)
        except Exception as exc:  # noqa: BLE001 - the contract: only ReplicateError escapes
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise InternalError(f"the rewritten graph cannot be imported ({type(exc).__name__}: "
                                f"{first}); {REPORT}") from exc
        return graph

    @property
    def train_op(self):
        """The train op (same name as the original)."""
        return self.graph.get_operation_by_name(self.analysis.train_op)

    @property
    def train_ops(self) -> list:
        """Every train op of the graph (all replicated), ``train_op`` first."""
        return [self.graph.get_operation_by_name(n) for n in self.analysis.train_ops]

    @property
    def loss(self):
        """The global-batch loss under the original loss name, or None."""
        if self.analysis.loss is None:
            return None
        return self.graph.get_tensor_by_name(self.analysis.loss)

    @property
    def tower_losses(self) -> list:
        """Each tower's loss on its slice of the batch."""
        if self.analysis.loss is None:
            return []
        return [self.tower_tensor(self.analysis.loss, k) for k in range(len(self.towers.devices))]

    def tower_tensor(self, name: str, tower: int):
        """Tower ``tower``'s copy of the tensor (or op, without ``:k``) called ``name``."""
        prefix = self.towers.prefixes[tower]
        if ":" in name:
            return self.graph.get_tensor_by_name(f"{prefix}/{name}")
        return self.graph.get_operation_by_name(f"{prefix}/{name}")

    @property
    def grads_and_vars(self) -> list[tuple[Any, Any]]:
        """(aggregated gradient, variable) for every optimizer update, as the optimizer reads them."""
        import tensorflow as tf

        graph = self.graph
        variables = {v.op.name: v for v in graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES)}
        out = []
        for apply in self.analysis.apply_ops:
            op = graph.get_operation_by_name(apply.name)
            node = next(n for n in self.graph_def.node if n.name == apply.name)
            grad = op.inputs[_gradient_position(op, node, apply.grad, ("grad", "delta"))]
            if apply.indices is not None:
                where = _gradient_position(op, node, apply.indices, ("indices",))
                grad = tf.IndexedSlices(grad, op.inputs[where])
            var = variables.get(apply.variable)
            if var is None:
                var = graph.get_operation_by_name(apply.variable).outputs[0]
            out.append((grad, var))
        return out

    @property
    def update_ops(self) -> list:
        """State updates inside the model (batch-norm moving averages), as they run (tower 0)."""
        return [self.graph.get_operation_by_name(f"{self.towers.prefixes[0]}/{n}")
                for n in self.analysis.update_ops]


def _gradient_position(op, node, ref: str, args: tuple[str, ...]) -> int:
    """Position of the optimizer op's gradient input: its op-def argument (``grad``,
    ``delta``, ``indices``), else the input still named ``ref``. The gradient the update reads
    is usually an aggregate under a new name, so matching ``ref`` alone finds nothing (it fell
    back to input 0, the variable)."""
    for position, arg in enumerate(op.op_def.input_arg):
        if arg.number_attr or arg.type_list_attr:
            break                               # positions past a list are not the arg's
        if arg.name in args:
            return position
    inputs = [i for i in node.input if not i.startswith("^")]
    for i, r in enumerate(inputs):
        if parse_tensor(r) == parse_tensor(ref):
            return i
    raise InternalError(f"cannot find the gradient '{ref}' among the inputs of '{node.name}'; {REPORT}")
