"""The engine of ``replicate verify``: N towers against one device, on synthetic inputs.

:func:`verify` converts a graph for N towers on logical CPUs (``/cpu:0`` ... ``/cpu:N-1``),
trains the original and the rewrite from the same initial values on the same synthetic inputs
(:mod:`replicate.check.synthetic`), and compares the variables
(:mod:`replicate.check.equivalence`). The numeric certificate (:mod:`replicate.check.certificate`)
and the ``verify`` command (:mod:`replicate.cli.commands.verify`) both run it.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from replicate.check.equivalence import Comparison
from replicate.errors import InputError
from replicate.options import Options

__all__ = ["Verification", "verify", "default_batch"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Verification:
    """What ``replicate verify`` found: N towers against one device on synthetic inputs.

    Attributes:
        devices: the logical CPU devices the towers ran on.
        inputs: the fed tensors (see :class:`replicate.check.synthetic.InputSpec`).
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
        """True when every variable agrees within ``rtol`` (relative to its scale). The bar is
        fixed: the rounding reference is reported beside it and never widens it, since an
        order-dependent loss makes the reference itself far off."""
        return self.comparison.max_rel <= self.rtol

    def to_dict(self) -> dict[str, Any]:
        """Plain data for ``--json``."""
        c = self.comparison
        return {"source": self.source, "devices": self.devices, "steps": self.steps,
                "batch": self.batch, "seed": self.seed, "rtol": self.rtol, "ok": self.ok,
                "max_abs_difference": c.max_abs, "max_rel_difference": c.max_rel, "worst": c.worst,
                "rounding_reference": c.reference_rel,
                "inputs": [i.describe() for i in self.inputs], "exact": self.exact,
                "reasons": self.reasons, "unchanged": self.unchanged, "no_gradient": self.no_gradient}


def default_batch(towers: int) -> int:
    """A global batch that splits unevenly over ``towers`` (``4N - 1``, at least 3)."""
    return max(4 * towers - 1, 3)


def verify(source: Any, towers: int, *, steps: int = 3, batch: int | None = None, seed: int = 0,
           rtol: float = 1e-5, train_op: str | None = None, loss: str | None = None,
           feeds: dict[str, Any] | None = None, allow_unsafe: bool = False,
           strategy: Options | dict[str, Any] | None = None) -> Verification:
    """Train ``source`` on one device and on ``towers`` logical CPUs from the same start with
    the same synthetic inputs; compare the variables.

    Args:
        source: a path, GraphDef, MetaGraphDef or tf.Graph (see ``replicate.transform``).
        towers: how many towers (logical CPUs ``/cpu:0`` ... ``/cpu:{towers-1}``).
        steps: training steps.
        batch: global batch size; by default the graph's static one, else :func:`default_batch`.
        seed: seed of the synthetic inputs.
        rtol: largest relative parameter difference accepted.
        train_op: the train op, when the graph has several (a SavedModel's
            ``saved_model_train_op`` collection is used when it names one).
        loss: the loss tensor, when it cannot be recovered from the gradients.
        feeds: tensor name -> value, instead of synthetic values.
        allow_unsafe: run file, network and Python-callback ops.
        strategy: more ``transform`` options (``aggregation``, ``param_devices``, ``batch_norm``),
            as an :class:`~replicate.options.Options` or keyword arguments.

    Raises:
        ReplicateError: bad input, an op that touches files, the network or Python (unless
            ``allow_unsafe``), inputs that cannot be synthesized, or a graph that fails to run.
    """
    import numpy as np
    import tensorflow as tf

    from replicate import rewrite
    from replicate.check import synthetic
    from replicate.check.equivalence import compare
    from replicate.graph import io
    from replicate.graph import meta as replicate_meta
    from replicate.graph.ir import IR, node_of

    loaded = io.load(source)
    origin = loaded.origin
    meta = loaded.meta if loaded.meta is not None else _bare_meta(loaded.graph_def)
    hinted = replicate_meta.collection_ops(meta, "saved_model_train_op")
    train_op = train_op or (hinted[0] if len(hinted) == 1 else None)
    # A tf.Graph is analysed and rewritten as itself, as transform() does: its static shapes
    # are the graph's own, which an import of its export can lose (a TF1 loop's body: the
    # certificate checked another, inexact rewrite and contradicted an exact claim)
    live = source if loaded.graph is not None else None
    ir = rewrite.analyze_only(live or meta, train_op=train_op, loss=loss)
    analysis = ir.facts["analysis"]
    trainable = _trainable(meta, ir, analysis)
    meta = synthetic.with_variables(meta, ir, trainable)
    targets = [analysis.train_op] + synthetic.initializers(meta)
    rows = {tensor: kind for _, tensor, kind in (analysis.flow.ctx.fed_rows if analysis.flow else {}).values()}
    specs = synthetic.input_specs(ir, targets, [b.tensor for b in analysis.batch_inputs],
                                  {b.sparse for b in analysis.batch_inputs if b.sparse}, rows)
    devices = [f"/cpu:{k}" for k in range(towers)]
    base = strategy if isinstance(strategy, Options) else Options.build(**(strategy or {}))
    options = dataclasses.replace(base, controller="/cpu:0", train_op=analysis.train_op, loss=loss,
                                  check=False)
    result = rewrite.rewrite(live or meta, devices, options)
    replicated = result.meta_graph_def
    if live is not None:    # its variables listed as the original's were, for the sessions
        replicated = synthetic.with_variables(replicated, IR.from_graph_def(replicated.graph_def),
                                              trainable)
    if not allow_unsafe:
        fed = [s.tensor for s in specs]
        bad = synthetic.unsafe_ops(ir, targets, fed) or synthetic.unsafe_ops(
            IR.from_graph_def(result.graph_def), targets, fed)
        if bad:
            raise InputError(f"{origin}: refusing to run node '{bad[0][0]}' ({bad[0][1]}): it touches "
                             "files, the network or Python; pass --allow-unsafe-ops to run it anyway")
    static = [s.shape[0] for s in specs if s.batch_axis is not None and s.shape and s.shape[0]
              and not s.sparse]
    micro = options.accumulate
    batch = batch or (static[0] if static else default_batch(towers * micro))
    batched = {s.tensor for s in specs if s.batch_axis is not None}
    for flags in (True, False):     # flags False in odd steps; else (the graph fails so) True
        rng = np.random.RandomState(seed)
        steps_feeds = [synthetic.make_feed(specs, batch, rng, overrides=feeds, step=i if flags else 0)
                       for i in range(steps)]

        def reorder(feed: dict[str, Any]) -> dict[str, Any]:
            return synthetic.permute(specs, feed, rng.permutation(batch))
        try:
            # the loss fetched beside the train op, as drivers do: its merge across the towers
            # must run too (review 41: a loss whose merge failed passed a check of the train op)
            comparison = compare(meta, replicated, analysis.train_op, steps_feeds, cpus=towers,
                                 soft_placement=True, reference=reorder if batched else None,
                                 fetch=(analysis.loss,) if analysis.loss else ())
            break
        except (tf.errors.OpError, ValueError, TypeError) as exc:
            # a graph that asserts its flag (review 42) runs with it True in every step
            if flags and steps > 1 and any(s.mode is not None or s.dtype == "bool" and not s.shape
                                           and s.batch_axis is None for s in specs):
                continue
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

    from replicate.graph import ops
    from replicate.graph.ir import node_of

    if "trainable_variables" in meta.collection_def:
        return [node_of(variable_pb2.VariableDef.FromString(raw).variable_name)
                for raw in meta.collection_def["trainable_variables"].bytes_list.value]
    reads = ir.ancestors([node_of(analysis.loss)]) if analysis.loss else set()
    return [n for n in ir.nodes if n in reads and ir.nodes[n].op in ops.VARIABLE_OPS
            and dtypes.as_dtype(ir.nodes[n].attr("dtype", 1)).base_dtype.is_floating]
