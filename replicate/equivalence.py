"""Run a graph's training steps and compare single-device with replicated training.

Both graphs start from the same variable values (the single-device graph's initial
values are copied into the replicated one), take the same feeds step by step, and their
variables are compared afterwards. Used by the tests, the examples and ``replicate verify``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = ["session_config", "Trainer", "Comparison", "compare", "Verification", "verify",
           "default_batch", "DRIFT_FACTOR"]

log = logging.getLogger(__name__)


def session_config(cpus: int = 4, threads: int = 0, soft_placement: bool = False):
    """A ConfigProto with ``cpus`` logical CPU devices (``/cpu:0`` ... ``/cpu:{cpus-1}``);
    ``soft_placement`` lets ops pinned to absent devices (GPUs) run on a CPU."""
    import tensorflow as tf

    config = tf.compat.v1.ConfigProto(device_count={"CPU": cpus},
                                      allow_soft_placement=soft_placement)
    if threads:
        config.intra_op_parallelism_threads = threads
        config.inter_op_parallelism_threads = threads
    return config


class Trainer:
    """A session over an imported copy of a training graph.

    Args:
        source: a tf.Graph or MetaGraphDef (a copy is imported; the source is not touched).
        train_op: name of the op to run per step.
        cpus: logical CPU devices of the session.
        soft_placement: run ops pinned to absent devices on a CPU.
    """

    def __init__(self, source: Any, train_op: str, cpus: int = 4, threads: int = 0,
                 soft_placement: bool = False):
        import tensorflow as tf

        meta = source
        if isinstance(source, tf.Graph):
            meta = tf.compat.v1.train.export_meta_graph(graph=source, clear_devices=False)
        self.graph = tf.Graph()
        with self.graph.as_default():
            tf.compat.v1.train.import_meta_graph(meta, clear_devices=False)
            self.variables = {v.op.name: v for v in tf.compat.v1.global_variables()}
            self.init = tf.compat.v1.variables_initializer(list(self.variables.values()))
            local = tf.compat.v1.local_variables()
            self.local_init = tf.compat.v1.variables_initializer(local) if local else None
            table_init = self.graph.get_collection(tf.compat.v1.GraphKeys.TABLE_INITIALIZERS)
            self.table_init = tf.group(*table_init) if table_init else None
            self._names = sorted(self.variables)
            self._reads = [self.variables[n].value() if hasattr(self.variables[n], "value")
                           else self.variables[n] for n in self._names]
        self.train_op = self.graph.get_operation_by_name(train_op)
        self.session = tf.compat.v1.Session(graph=self.graph,
                                            config=session_config(cpus, threads, soft_placement))
        self.session.run(self.init)
        for extra in (self.local_init, self.table_init):
            if extra is not None:
                self.session.run(extra)

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
        """Run the train op once (plus ``fetch`` tensor names); return the fetched values."""
        fetches = [self.train_op] + [self.graph.get_tensor_by_name(n) for n in fetch]
        return self.session.run(fetches, feed_dict=dict(feed or {}))[1:]

    def close(self) -> None:
        """Close the session."""
        self.session.close()


@dataclasses.dataclass
class Comparison:
    """Largest differences between single-device and replicated training."""

    max_abs: float
    max_rel: float
    worst: str
    per_variable: dict[str, float]
    fetched: list[tuple[list[Any], list[Any]]]
    unchanged: list[str]
    reference_rel: float | None = None

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
    """
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
            fetched.append((single.step(feed, fetch), multi.step(feed, fetch)))
            if reference is not None:
                trainers[2].step(reference(feed))
            if on_step is not None:
                on_step(i)
        a, b = single.values(), multi.values()
        ref = trainers[2].values() if reference is not None else None
    finally:
        for trainer in trainers:
            trainer.close()
    per_var = {n: relative_difference(a[n], b[n]) for n in a if n in b}
    abs_diff = {n: float(np.max(np.abs(np.asarray(a[n], np.float64) - np.asarray(b[n], np.float64))))
                if np.asarray(a[n]).size else 0.0 for n in a if n in b}
    worst = max(per_var, key=per_var.get) if per_var else ""
    unchanged = [n for n in a if n in start and np.array_equal(a[n], start[n])]
    ref_rel = None if ref is None else max(
        (relative_difference(a[n], ref[n]) for n in a if n in ref), default=0.0)
    return Comparison(max(abs_diff.values(), default=0.0), max(per_var.values(), default=0.0), worst,
                      per_var, fetched, unchanged, ref_rel)


@dataclasses.dataclass
class Verification:
    """What ``replicate verify`` found: N towers against one device on synthetic inputs.

    Attributes:
        devices: the logical CPU devices the towers ran on.
        inputs: the fed tensors (see :class:`replicate.synthetic.InputSpec`).
        comparison: the variables' differences after ``steps`` steps.
        exact: whether the transform's report promises exactness (``reasons`` if not).
        unchanged: variables the single-device train op never changed.
        no_gradient: trainable variables that no optimizer update gives a gradient.
    """

    source: str
    devices: list[str]
    steps: int
    batch: int
    seed: int
    rtol: float
    inputs: list[Any]
    comparison: Comparison
    exact: bool
    reasons: list[str]
    unchanged: list[str]
    no_gradient: list[str]

    @property
    def ok(self) -> bool:
        """True when every variable agrees within ``rtol`` or, for a graph promised exact,
        within :data:`DRIFT_FACTOR` times the rounding reference (one device with each batch
        reordered; meaningless when random ops make every run differ)."""
        ref = self.comparison.reference_rel if self.exact else None
        return self.comparison.max_rel <= max(self.rtol, DRIFT_FACTOR * (ref or 0.0))

    def to_dict(self) -> dict[str, Any]:
        """Plain data for ``--json``."""
        c = self.comparison
        return {"source": self.source, "devices": self.devices, "steps": self.steps,
                "batch": self.batch, "seed": self.seed, "rtol": self.rtol, "ok": self.ok,
                "max_abs_difference": c.max_abs, "max_rel_difference": c.max_rel, "worst": c.worst,
                "rounding_reference": c.reference_rel,
                "inputs": [i.describe() for i in self.inputs], "exact": self.exact,
                "reasons": self.reasons, "unchanged": self.unchanged, "no_gradient": self.no_gradient}


#: How much further than the rounding reference replicated training may drift in ``verify``.
DRIFT_FACTOR = 4.0


def default_batch(towers: int) -> int:
    """A global batch that splits unevenly over ``towers`` (``4N - 1``, at least 3)."""
    return max(4 * towers - 1, 3)


def verify(source: Any, towers: int, *, steps: int = 3, batch: int | None = None, seed: int = 0,
           rtol: float = 1e-5, train_op: str | None = None, loss: str | None = None,
           feeds: dict[str, Any] | None = None, allow_unsafe: bool = False) -> Verification:
    """Train ``source`` on one device and on ``towers`` logical CPUs from the same start with
    the same synthetic inputs; compare the variables.

    Raises:
        ReplicateError: bad input, an op that touches files, the network or Python (unless
            ``allow_unsafe``), inputs that cannot be synthesized, or a graph that fails to run.
    """
    import tensorflow as tf

    from replicate import api, io, synthetic
    from replicate.errors import InputError
    from replicate.ir import IR, node_of

    loaded = io.load(source)
    origin = loaded.origin
    meta = loaded.meta if loaded.meta is not None else _bare_meta(loaded.graph_def)
    ir = api.analyze_only(meta, train_op=train_op, loss=loss)
    analysis = ir.facts["analysis"]
    trainable = _trainable(meta, ir, analysis)
    meta = synthetic.with_variables(meta, ir, trainable)
    targets = [analysis.train_op] + synthetic.initializers(meta)
    specs = synthetic.input_specs(ir, targets, [b.tensor for b in analysis.batch_inputs])
    devices = [f"/cpu:{k}" for k in range(towers)]
    result = api.transform(meta, devices, controller="/cpu:0", train_op=analysis.train_op, loss=loss)
    if not allow_unsafe:
        fed = [s.tensor for s in specs]
        bad = synthetic.unsafe_ops(ir, targets, fed) or synthetic.unsafe_ops(
            IR.from_graph_def(result.graph_def), targets, fed)
        if bad:
            raise InputError(f"{origin}: refusing to run node '{bad[0][0]}' ({bad[0][1]}): it touches "
                             "files, the network or Python; pass --allow-unsafe-ops to run it anyway")
    static = [s.shape[0] for s in specs if s.batch_axis is not None and s.shape and s.shape[0]]
    batch = batch or (static[0] if static else default_batch(towers))
    rng = np.random.RandomState(seed)
    steps_feeds = [synthetic.make_feed(specs, batch, rng, overrides=feeds) for _ in range(steps)]
    batched = {s.tensor for s in specs if s.batch_axis is not None}

    def reorder(feed: dict[str, Any]) -> dict[str, Any]:
        order = rng.permutation(batch)
        return {k: v[order] if k in batched and np.ndim(v) else v for k, v in feed.items()}
    try:
        comparison = compare(meta, result.meta_graph_def, analysis.train_op, steps_feeds,
                             cpus=towers, soft_placement=True, reference=reorder if batched else None)
    except (tf.errors.OpError, ValueError, TypeError) as exc:
        first = " ".join(str(exc).split())[:300]
        raise InputError(f"{origin}: the graph fails on synthetic inputs: {first}") from None
    updated = {a.variable for a in analysis.apply_ops} | {analysis.global_step}
    return Verification(origin, devices, steps, batch, seed, rtol, specs, comparison,
                        result.report.exact, [str(r) for r in result.report.reasons],
                        [node_of(n) for n in comparison.unchanged],
                        [v for v in trainable if v not in updated])


def _bare_meta(graph_def):
    from tensorflow.core.protobuf import meta_graph_pb2

    meta = meta_graph_pb2.MetaGraphDef()
    meta.graph_def.CopyFrom(graph_def)
    return meta


def _trainable(meta, ir, analysis) -> list[str]:
    """Trainable variables: the ``trainable_variables`` collection, or else the float
    variables the loss reads."""
    from tensorflow.core.framework import variable_pb2
    from tensorflow.python.framework import dtypes

    from replicate import ops
    from replicate.ir import node_of

    if "trainable_variables" in meta.collection_def:
        return [node_of(variable_pb2.VariableDef.FromString(raw).variable_name)
                for raw in meta.collection_def["trainable_variables"].bytes_list.value]
    reads = ir.ancestors([node_of(analysis.loss)]) if analysis.loss else set()
    return [n for n in ir.nodes if n in reads and ir.nodes[n].op in ops.VARIABLE_OPS
            and dtypes.as_dtype(ir.nodes[n].attr("dtype", 1)).base_dtype.is_floating]
