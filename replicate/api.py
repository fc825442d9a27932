"""``replicate.transform``: the public entry point.

It gathers the options into one :class:`~replicate.options.Options` (validated once), runs the
rewrite (:mod:`replicate.rewrite`: load, analyze, the pass pipeline, the output's import check,
the report) and, with ``check=True``, the numeric certificate
(:mod:`replicate.check.certificate`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from replicate.options import AGGREGATIONS as STRATEGIES
from replicate.options import BATCH_NORM_MODES, MIRRORED, Options
from replicate.result import Result
from replicate.rewrite import analyze_only, normalize_device, prepare, rewrite

__all__ = ["transform", "Result", "Options", "normalize_device", "analyze_only", "prepare",
           "BATCH_NORM_MODES", "STRATEGIES", "MIRRORED"]


def transform(graph: Any, devices: Sequence[str], options: Options | None = None,
              **keywords: Any) -> Result:
    """Rewrite a single-device training graph into in-graph data-parallel training.

    Args:
        graph: a tf.Graph, GraphDef, MetaGraphDef, or a path (.meta, .pb, .pbtxt, SavedModel dir).
        devices: one device per tower, e.g. ``["/gpu:0", "/gpu:1"]``.
        controller: device holding the variables and running the optimizer.
        train_op: the train op's name, when the graph has several candidates.
        loss: the loss tensor's name, when it cannot be recovered from the gradients.
        outputs: more tensor names to keep fetchable (merged over towers) under their names.
        merge_forward: merge every per-example forward tensor under its name (default True).
        param_devices: spread variables over these devices by size instead of the controller;
            or ``"mirrored"``: a copy of every trained variable (and its optimizer state) on
            each tower device, gradients all-reduced and the update applied on every device
            (the original names, on tower 0's device, are what checkpoints hold).
        aggregation: ``"add_n"`` (each gradient summed on its variable's device), ``"packed"``
            (small dense gradients flattened into a few buffers per tower before summing),
            ``"allreduce"`` or ``"packed_allreduce"`` (the sums done by collective all-reduce
            among the towers, NCCL on GPUs).
        batch_norm: ``"tower0"`` (each tower normalizes with its slice's statistics; moving
            averages are updated once, from tower 0) or ``"sync"`` (statistics over the global
            batch, forward and backward: batch norm trains exactly as on one device).
        batch_inputs: the input tensors to split, as names (``"x:0"``, ``"x:0@1"`` for axis 1)
            or a dict name -> axis, instead of the ones the analysis finds.
        shared_inputs: input tensors every tower reads whole, never split, whatever their
            leading dimension (a table fed each step whose length may equal the batch size).
        cluster: a cluster description (ClusterSpec-style dict or JSON file, a
            ``tf.train.ClusterSpec``, or ``"TF_CONFIG"``): devices and the controller may then
            name its tasks, and are checked against it (see :mod:`replicate.runtime.cluster`).
        verify_each: validate the IR after every pass.
        dump_dir: write the IR after each pass to this directory.
        progress: called with (pass name, index, total) before each pass.
        between_graph: between-graph replication over ``cluster``: ``devices`` are the towers
            inside each worker task; the result is one template every worker imports through
            :func:`replicate.between.for_task` (see :mod:`replicate.passes.between`).
        task_index: with ``between_graph``, pin the result to this worker task.
        sparse_on_ps: with ``between_graph`` and ps tasks, keep sparsely trained variables on
            the ps tasks (else every worker keeps a copy, updated from all-gathered gradients).
        accumulate: gradient accumulation: each device processes its slice of the global batch
            as this many micro-batches, one after the other within the same step, adding their
            gradients; the aggregation and the optimizer run once (see
            :mod:`replicate.passes.accumulate`).
        check: the numeric certificate: run the original and the rewrite a few steps side by
            side on logical CPUs with synthetic inputs (an uneven split, an empty tower); a
            claimed exact that differs is reported inexact (:mod:`replicate.check.certificate`).
            This executes the graph, except graphs with file, Python or process ops.

        options: an :class:`~replicate.options.Options` holding any of the above; keyword
            arguments given beside it replace its fields.

    Returns:
        A :class:`Result`; the input is never modified. ``result.options`` (and the report's
        ``options``, and the output metagraph's ``replicate_options`` collection) record the
        options it ran with.

    Raises:
        ReplicateError: for any bad input (a misspelt or invalid option included); the
            message names the file, node or option.
    """
    options = Options.build(options, **keywords)
    result = rewrite(graph, devices, options)
    if options.check:
        from replicate.check.certificate import attach

        attach(result.report, graph, len(result.report.devices), options, result)
    return result
