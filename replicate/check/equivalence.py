"""Run a graph's training steps and compare single-device with replicated training.

Both graphs start from the same variable values (the single-device graph's initial
values are copied into the replicated one), take the same feeds step by step, and their
variables are compared afterwards (optionally next to a rounding reference: the
single-device graph trained on the same batches with their examples reordered). Used by
the tests, the examples and ``replicate verify``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = ["session_config", "Trainer", "Comparison", "compare", "relative_difference"]

log = logging.getLogger(__name__)


def session_config(cpus: int = 4, threads: int = 0, soft_placement: bool = False,
                   optimize: bool = True):
    """A ConfigProto with ``cpus`` logical CPU devices (``/cpu:0`` ... ``/cpu:{cpus-1}``);
    ``soft_placement`` lets ops pinned to absent devices (GPUs) run on a CPU. ``optimize=False``
    turns Grappler off: a session that runs a graph for a few steps to check it (the
    certificate, ``verify``, ``compare``) spent most of its time in Grappler's first-run
    rewrite of a small graph, and the plain graph is what the check is about."""
    import tensorflow as tf

    config = tf.compat.v1.ConfigProto(device_count={"CPU": cpus},
                                      allow_soft_placement=soft_placement)
    if not optimize:
        config.graph_options.rewrite_options.disable_meta_optimizer = True
    if threads:
        config.intra_op_parallelism_threads = threads
        config.inter_op_parallelism_threads = threads
    return config


class Trainer:
    """A session over an imported copy of a training graph.

    Args:
        source: a tf.Graph or MetaGraphDef (the source is not touched: a tf.Graph whose
            variables all have their read op already is run as it is, with the ops it has;
            anything else is imported as a copy).
        train_op: name of the op to run per step.
        cpus: logical CPU devices of the session.
        soft_placement: run ops pinned to absent devices on a CPU.
        optimize: run Grappler on the graph (off by default: a check runs a few steps, and
            Grappler's first-run rewrite cost more than the steps; see ``session_config``).
    """

    def __init__(self, source: Any, train_op: str, cpus: int = 4, threads: int = 0,
                 soft_placement: bool = False, optimize: bool = False):
        import tensorflow as tf

        from replicate.graph.io import export_graph, importable

        found = _existing_ops(source) if isinstance(source, tf.Graph) else None
        if found is not None:       # no copy: importing one costs far more than the steps
            self.graph = source
            self.variables, self._reads, local = found
        else:
            meta = export_graph(source) if isinstance(source, tf.Graph) else importable(source)
            self.graph = tf.Graph()
            with self.graph.as_default():
                tf.compat.v1.train.import_meta_graph(meta, clear_devices=False)
                self.variables = {v.op.name: v for v in tf.compat.v1.global_variables()}
                local = tf.compat.v1.local_variables()
                self._reads = [self.variables[n].value() if hasattr(self.variables[n], "value")
                               else self.variables[n] for n in sorted(self.variables)]
        self._names = sorted(self.variables)
        tables = self.graph.get_collection(tf.compat.v1.GraphKeys.TABLE_INITIALIZERS)
        self.train_op = self.graph.get_operation_by_name(train_op)
        self.session = tf.compat.v1.Session(graph=self.graph,
                                            config=session_config(cpus, threads, soft_placement, optimize))
        for ops in ([self.variables[n].initializer for n in self._names],
                    [v.initializer for v in local], list(tables)):
            if ops:
                self.session.run(ops)

    def values(self) -> dict[str, np.ndarray]:
        """Current value of every global variable, by variable name."""
        return dict(zip(self._names, self.session.run(self._reads)))

    def load(self, values: dict[str, np.ndarray]) -> None:
        """Set variables to ``values`` (names missing here are ignored), in one session run."""
        ops, feed = [], {}
        for name, value in values.items():
            var = self.variables.get(name)
            if var is not None:
                ops.append(var.initializer)
                feed[var.initializer.inputs[1]] = value
        if ops:
            self.session.run(ops, feed_dict=feed)

    def step(self, feed: dict[str, Any] | None = None, fetch: Sequence[str] = ()) -> list[Any]:
        """Run the train op once; return the values of ``fetch`` (tensor names) for this step's
        feed, evaluated in a run of their own just before it: a fetch in the train op's own run
        may read a variable before or after its update when nothing orders the two (a loss
        with a statically shaped gradient seed), in the single-device graph as much as in any
        other. A graph that reads its own input (no feed) is fetched in the train op's run.
        """
        feed = dict(feed or {})
        tensors = [self.graph.get_tensor_by_name(n) for n in fetch]
        if not feed:        # the graph reads its own input: a second run would take another batch
            return self.session.run([self.train_op] + tensors)[1:]
        values = self.session.run(tensors, feed_dict=feed) if tensors else []
        self.session.run(self.train_op, feed_dict=feed)
        return values

    def close(self) -> None:
        """Close the session."""
        self.session.close()


def _existing_ops(graph) -> tuple[dict, list, list] | None:
    """(global variables by name, a read of each in name order, local variables) of ``graph``
    from ops it already has, or None when a variable has no read op of its own (a read would
    have to be added to the user's graph)."""
    import tensorflow as tf

    def read(var):
        found = getattr(var, "_graph_element", None)            # a resource variable's read
        if found is None and hasattr(var, "_snapshot"):        # a ref variable's
            found = var._snapshot
        return found if getattr(found, "graph", None) is graph else None

    with graph.as_default():
        variables = {v.op.name: v for v in tf.compat.v1.global_variables()}
        local = tf.compat.v1.local_variables()
    reads = [read(variables[n]) for n in sorted(variables)]
    if any(r is None for r in reads) or any(getattr(v, "initializer", None) is None
                                            for v in list(variables.values()) + local):
        return None
    return variables, reads, local


@dataclasses.dataclass
class Comparison:
    """Largest differences between single-device and replicated training.

    A variable of the single-device graph that the replicated graph lacks (lost or renamed) is
    listed in ``missing`` and counts as an infinite difference.
    """

    max_abs: float
    max_rel: float
    worst: str
    per_variable: dict[str, float]
    fetched: list[tuple[list[Any], list[Any]]]
    unchanged: list[str]
    reference_rel: float | None = None
    missing: list[str] = dataclasses.field(default_factory=list)

    def ok(self, rtol: float = 1e-5) -> bool:
        """True when every variable agrees within ``rtol`` (relative to its scale)."""
        return self.max_rel <= rtol


def relative_difference(a: np.ndarray, b: np.ndarray) -> float:
    """max |a - b| / max(max |a|, 1e-3): a scale-aware difference of two arrays.

    The floor keeps values that should be zero (the bias before a batch norm, whose gradient
    vanishes) from turning float rounding noise into large relative differences.
    """
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        return float("inf")
    if a.size == 0:
        return 0.0
    scale = max(float(np.max(np.abs(a))), 1e-3)
    return float(np.max(np.abs(a - b))) / scale


def op_error(exc: Exception) -> str:
    """TensorFlow's error in one line: the failing node and what it says, without the
    traceback of where the node was defined."""
    import re

    text = str(getattr(exc, "message", exc))
    node = re.search(r"Node: '([^']+)'", text)
    said: list[str] = []
    for line in text.splitlines():
        line = re.sub(r"^\(\d+\) ", "", line.strip())
        if line and line not in said and not re.match(
                r"(Graph execution error|Detected at node|Node:|\[\[|\d+ root error|\d+ successful "
                r"operations|\d+ derived errors|File |defined at)", line):
            said.append(line)
    what = " ".join(said[:2])[:300] or " ".join(text.split())[:300]
    return f"{node.group(1)}: {what}" if node else what


def compare(original: Any, replicated: Any, train_op: str, feeds: Sequence[dict[str, Any]] | int,
            cpus: int = 4, fetch: Sequence[str] = (), on_step: Callable[[int], None] | None = None,
            soft_placement: bool = False,
            reference: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> Comparison:
    """Train ``original`` and ``replicated`` side by side and compare their variables.

    Args:
        original: the single-device graph (tf.Graph or MetaGraphDef).
        replicated: the replicated graph (tf.Graph or MetaGraphDef).
        train_op: name of the train op in both.
        feeds: one feed dict per step (tensor name -> array), or a step count for graphs
            that read their own input (iterators).
        cpus: logical CPU devices.
        fetch: tensor names fetched at every step in both graphs (e.g. the loss).
        on_step: called with the step index after each step.
        soft_placement: run ops pinned to absent devices (GPUs) on a CPU.
        reference: a function that reorders the examples of a feed; when given, a third
            session trains ``original`` on reordered feeds, and ``reference_rel`` says how far
            float rounding alone moves single-device training (the same sums in another order).

    Raises:
        RewriteError: a step one device runs fails in the replicated graph.
    """
    import tensorflow as tf

    from replicate.errors import RewriteError

    steps = [None] * feeds if isinstance(feeds, int) else list(feeds)
    sources = [original, replicated] + ([original] if reference is not None else [])
    trainers: list[Trainer] = []
    try:
        for graph in sources:
            trainers.append(Trainer(graph, train_op, cpus, soft_placement=soft_placement))
        single, multi = trainers[:2]
        start = single.values()
        for other in trainers[1:]:
            other.load(start)
        fetched = []
        for i, feed in enumerate(steps):
            before = single.step(feed, fetch)
            try:
                after = multi.step(feed, fetch)
            except tf.errors.OpError as exc:     # one device ran this step: the rewrite is at fault
                raise RewriteError(f"the rewrite fails at step {i + 1} where one device runs: "
                                   f"{op_error(exc)}") from None
            fetched.append((before, after))
            if reference is not None:
                trainers[2].step(reference(feed))
            if on_step is not None:
                on_step(i)
        a, b = single.values(), multi.values()
        ref = trainers[2].values() if reference is not None else None
    finally:
        for trainer in trainers:
            trainer.close()
    missing = sorted(n for n in a if n not in b)
    per_var = {n: relative_difference(a[n], b[n]) for n in a if n in b}
    per_var.update({n: float("inf") for n in missing})
    abs_diff = {n: float(np.max(np.abs(np.asarray(a[n], np.float64) - np.asarray(b[n], np.float64))))
                if np.asarray(a[n]).size else 0.0 for n in a if n in b}
    abs_diff.update({n: float("inf") for n in missing})
    worst = max(per_var, key=per_var.get) if per_var else ""
    unchanged = [n for n in a if n in start and np.array_equal(a[n], start[n])]
    ref_rel = None if ref is None else max(
        (relative_difference(a[n], ref[n]) for n in a if n in ref), default=0.0)
    return Comparison(max(abs_diff.values(), default=0.0), max(per_var.values(), default=0.0), worst,
                      per_var, fetched, unchanged, ref_rel, missing)

