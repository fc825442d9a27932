"""The rewrite behind :func:`replicate.transform`: load, analyze, run the passes, check the output.

:func:`rewrite` turns a graph and an :class:`~replicate.options.Options` into a
:class:`~replicate.result.Result`: it loads the graph into the IR with TensorFlow's static
shapes (:func:`prepare`), runs the passes in order (:mod:`replicate.passes.pipeline`), imports
the output with TensorFlow's C++ importer so that nothing fails after it returns, and builds
the report. The numeric certificate runs on top of it (:mod:`replicate.api`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

from replicate.batchflow.facts import Analysis, Towers
from replicate.batchflow.inputs import columns_advice, one_per_column
from replicate.errors import REPORT, AnalysisError, DeviceError, InternalError, ReplicateError
from replicate.graph import io, meta, ops, registry
from replicate.graph.ir import IR
from replicate.graph.kernels import host_of
from replicate.options import COLLECTION, Options
from replicate.passes.accumulate import Accumulate
from replicate.passes.defer import Defer
from replicate.passes.aggregate import Aggregate
from replicate.passes.analyze import Analyze
from replicate.passes.clone import Clone
from replicate.passes.draw import Draw
from replicate.passes.guard import Guard
from replicate.passes._logged import warnings as logged_warnings
from replicate.passes.mirror import Mirror
from replicate.passes.pipeline import PassRecord, run_pipeline
from replicate.passes.place import Place
from replicate.passes.rebatch import Rebatch
from replicate.passes.rewire import Rewire
from replicate.passes.split import Split
from replicate.passes.sync import Sync
from replicate.passes.validate import Validate
from replicate.passes.weigh import Weigh
from replicate.report import Report
from replicate.result import Result

__all__ = ["rewrite", "prepare", "analyze_only", "normalize_device", "MAX_DEVICE_INDEX",
           "MAX_TASK_INDEX"]

log = logging.getLogger(__name__)

#: The largest device index accepted (``/gpu:4095``): no machine has more devices of a kind.
MAX_DEVICE_INDEX = 4095
#: The largest task or replica index accepted in a device string.
MAX_TASK_INDEX = 2**20 - 1


def normalize_device(device: str, what: str = "device") -> str:
    """The canonical spelling of ``device`` (``/gpu:0`` -> ``/device:GPU:0``).

    Raises:
        DeviceError: the string is empty or not a TensorFlow device, or a device, task or
            replica index is negative or beyond :data:`MAX_DEVICE_INDEX` /
            :data:`MAX_TASK_INDEX`.
    """
    import tensorflow as tf

    if not isinstance(device, str) or not device.strip():
        raise DeviceError(f"{what} {device!r} is empty; use e.g. '/gpu:0' or '/cpu:0'")
    try:
        spec = tf.DeviceSpec.from_string(device.strip())
    except (ValueError, TypeError):
        raise DeviceError(f"{what} '{device}' is not a TensorFlow device (e.g. '/gpu:0', "
                          "'/job:worker/task:0/device:GPU:0')") from None
    if spec.device_type is None and spec.job is None:
        raise DeviceError(f"{what} '{device}' names no device type or job")
    for field, value, bound in (("device index", spec.device_index, MAX_DEVICE_INDEX),
                                ("task", spec.task, MAX_TASK_INDEX),
                                ("replica", spec.replica, MAX_TASK_INDEX)):
        if value is not None and not 0 <= value <= bound:
            raise DeviceError(f"{what} '{device}': {field} {value} is out of range "
                              f"(0 to {bound})")
    return spec.to_string()


def _devices(devices: Sequence[str], controller: str) -> tuple[list[str], str]:
    if isinstance(devices, str):
        devices = [d for d in devices.split(",") if d.strip()] or [devices]
    devices = list(devices)
    if not devices:
        raise DeviceError("devices is empty; give at least one tower device")
    normal = [normalize_device(d) for d in devices]
    seen: dict[str, str] = {}
    for raw, dev in zip(devices, normal):
        if dev in seen:
            raise DeviceError(f"device '{raw}' is listed twice (as '{seen[dev]}' and '{raw}')")
        seen[dev] = raw
    return normal, normalize_device(controller, "controller")


def prepare(graph: Any, *, train_op: str | None = None, loss: str | None = None,
            outputs: Sequence[str] = (), merge_forward: bool = True,
            batch_inputs: Any = None, sync: bool = False,
            shared_inputs: Any = None) -> tuple[IR, io.Loaded, Analyze]:
    """Load ``graph`` into an IR with static shapes, and build the analyze pass for it."""
    loaded = io.load(graph)
    tf_graph = loaded.graph if loaded.graph is not None else registry.import_checked(
        loaded.graph_def, loaded.origin)
    ir = IR.from_graph_def(loaded.graph_def, loaded.meta, hubs=True)
    ir.load_static_shapes(tf_graph)
    ir.tf_graph = tf_graph          # library functions' bodies are analysed in it
    external = frozenset(meta.referenced_names(loaded.meta))
    analyze = Analyze(train_op=train_op, loss=loss, outputs=tuple(outputs or ()),
                      merge_forward=merge_forward, external=external, batch_inputs=batch_inputs,
                      sync=sync, shared_inputs=shared_inputs)
    return ir, loaded, analyze


def analyze_only(graph: Any, **options: Any) -> IR:
    """Run only the analysis; return the IR with ``ir.facts["analysis"]`` set."""
    ir, _, analyze = prepare(graph, **options)
    run_pipeline(ir, [analyze])
    return ir


@contextlib.contextmanager
def _gc_paused():
    """Pause Python's cyclic garbage collector: a transform allocates hundreds of thousands of
    small objects and holds them all, so collections would only rescan them (measured: a
    36,688-node graph transformed in 12.7 s with collections, 7.6 s without)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def rewrite(graph: Any, devices: Sequence[str], options: Options) -> Result:
    """Load ``graph``, run the pass pipeline for one tower per device in ``devices`` with
    ``options``, check that the output imports, and build the report. No numeric check
    (:func:`replicate.transform` adds it); every error is a :class:`ReplicateError`."""
    with _gc_paused():
        return _rewrite(graph, devices, options)


def _rewrite(graph: Any, devices: Sequence[str], options: Options) -> Result:
    start = time.perf_counter()
    micro = options.accumulate
    controller, cluster, aggregation = options.controller, options.cluster, options.aggregation
    param_devices = None if options.mirrored else options.param_devices
    between = None
    if options.between_graph:
        from replicate.passes.between import Between
        from replicate.runtime import between as between_rt

        devices, controller, workers, ps = between_rt.plan(cluster, devices, controller)
        cluster = None
        aggregation = ("packed_allreduce" if aggregation.startswith("packed") and len(devices) > 1
                       else "allreduce")
    if cluster is not None:
        from replicate.runtime.cluster import resolve

        devices, controller, param_devices = resolve(cluster, devices, controller, param_devices)
    devices, controller = _devices(devices, controller)
    params = [normalize_device(d, "parameter device") for d in (param_devices or [])]
    if options.mirrored and not aggregation.endswith("allreduce"):   # every device's sum
        aggregation = "packed_allreduce" if aggregation == "packed" else "allreduce"
    sync = options.batch_norm == "sync"
    try:
        ir, loaded, analyze = prepare(graph, train_op=options.train_op, loss=options.loss,
                                      outputs=options.outputs, merge_forward=options.merge_forward,
                                      batch_inputs=options.batch_inputs, sync=sync,
                                      shared_inputs=options.shared_inputs)
        validator = Validate()
        passes = [analyze, Place(controller, params),
                  Split([d for d in devices for _ in range(micro)], controller, micro), Clone(),
                  Sync(controller, full=sync), Rebatch(), Draw(), Weigh(controller),
                  Aggregate(controller, aggregation), Rewire(controller), Guard(), Accumulate(), Defer()]
        if options.between_graph:
            seed = loaded.graph_def.SerializeToString(deterministic=True) + repr(
                (devices, controller, workers, ps, aggregation, options.sparse_on_ps,
                 options.outputs, options.train_op, options.loss, options.batch_inputs,
                 options.shared_inputs)).encode()
            between = Between(workers, controller, ps, options.sparse_on_ps, seed)
            passes.append(between)
        passes += [Mirror(), validator] if options.mirrored and len(devices) > 1 else [validator]
        ir, records = run_pipeline(ir, passes, verify_each=options.verify_each, validator=validator,
                                   dump_dir=options.dump_dir, progress=options.progress)
        analysis: Analysis = ir.facts["analysis"]
        warnings = list(analysis.warnings)
        if aggregation.endswith("allreduce") and len({host_of(d) for d in devices}) > 1:
            warnings.append("collective all-reduce spans several tasks: start every server with "
                            "ConfigProto.experimental.collective_group_leader set to the master "
                            "task, or the first step waits forever (replicate cluster does this)")
        if between is not None:
            warnings.extend(between_rt.notes(ir.facts))
        if ir.facts.get("min_batch"):
            need = ir.facts["min_batch"]
            warnings.append(f"the rewrite needs at least {need['batch']} examples per step: "
                            f"'{need['ops'][0]}' reads examples of each tower's batch by position; "
                            "a smaller step stops with an assertion that says so")
        warnings.extend(logged_warnings(ir.facts.get("logged_picks", {})))
        warnings.extend(_empty_convolutions(ir, devices, options.accumulate))
        graph_def = ir.to_graph_def()
        meta_out = meta.rewrite(loaded.meta, graph_def, ir.facts.get("renamed", {}), warnings.append)
        meta_out.collection_def[COLLECTION].bytes_list.value[:] = [options.to_json().encode()]
        if between is not None:
            meta_out = between_rt.finish(meta_out, ir.facts["between"], options.task_index)
            graph_def = meta_out.graph_def
    except ReplicateError:
        raise
    except Exception as exc:  # noqa: BLE001 - the contract: only ReplicateError escapes
        origin = graph if isinstance(graph, str) else type(graph).__name__
        first = (str(exc).strip().splitlines() or [""])[0]
        raise InternalError(f"{origin}: internal error while replicating ({type(exc).__name__}: "
                            f"{first}); {REPORT}") from exc
    try:
        _import_result(graph_def, meta_out)
    except InternalError as exc:
        if not analysis.reasons and analysis.static_batch is None:
            raise
        first = str(exc).split(": ", 1)[1].split("; this is a bug")[0]
        if not analysis.reasons:
            # a static batch baked in where the analysis did not see it (an unstack of
            # num=B in a stack's gradient): refused, naming the node, not an internal error
            raise AnalysisError(f"cannot replicate this graph: it bakes its static batch size "
                                f"({analysis.static_batch}) into a shape the rewrite does not "
                                f"resize per tower ({first}); give the batch inputs a dynamic "
                                "batch dimension ([None, ...])") from None
        # the reason's own fix is for an inexact rewrite, which this one cannot be (review 30:
        # a static BERT gather_indexes was told to reduce a loss it already reduced)
        reason = analysis.reasons[0]
        static = f"its static batch size ({analysis.static_batch}) is baked into shapes and " \
            "constants, and " if analysis.static_batch is not None else ""
        raise AnalysisError(f"cannot replicate this graph: {static}where the analysis could not "
                            f"establish its batch semantics ('{reason.node}': {reason.what}) it "
                            f"cannot tell which batch sizes to rewrite per tower ({first}); give "
                            "the batch inputs a dynamic batch dimension ([None, ...]) and compute "
                            "sizes with tf.shape(x)[0]" + columns_advice(
                                [b.tensor for b in analysis.batch_inputs
                                 if one_per_column(ir.static_shape(b.tensor))])) from None
    towers: Towers = ir.facts["towers"]
    seconds = time.perf_counter() - start
    report = _report(ir, analysis, towers, devices, controller, records, len(loaded.graph_def.node),
                     warnings, options.batch_norm)
    report.accumulate = ir.facts.get("accumulate", {})
    groups = {tuple(sorted({read, *extra})) for read, extra in report.accumulate.get("feeds", {}).items()}
    for group in sorted(groups):
        names = ", ".join(f"'{g}'" for g in group)
        report.warnings.append(
            f"with accumulate={options.accumulate}, a run that reads any of {names} must feed all "
            "of them: each micro-batch waits for the previous one's gradients, which read them "
            "(a prediction run that feeds only some asks for the rest; feed a batch of each of "
            "the same size, or predict with the original graph)")
    report.options = options.recorded()
    return Result(graph_def, meta_out, report, analysis, towers, records,
                  ir.facts.get("aggregates", {}), seconds, options)


_MAKERS = (("replicate/split/weights/", "aggregate"), ("replicate/split/", "split"),
           ("replicate/aggregate/", "aggregate"), ("replicate/sync/", "sync"),
           ("replicate/rebatch/", "rebatch"), ("replicate/mirror", "mirror"),
           ("replicate/weigh/", "weigh"), ("replicate/guard/", "guard"),
           ("replicate/between", "between"))


def _import_result(graph_def, meta_out) -> None:
    """Import the output with TensorFlow's shape inference (its C++ importer) and check that
    every collection entry names a node, so that nothing fails after ``transform`` returns: a
    failure names the first bad node and the pass that made it, as an internal error."""
    import re

    import tensorflow as tf

    try:
        registry.cpp_import(graph_def)
    except (ValueError, TypeError, tf.errors.OpError) as exc:
        text = " ".join(str(exc).split()) or type(exc).__name__
        found = re.search(r"node '?([^\s}'\]]+)", text)
        node = found.group(1) if found else "?"
        raise InternalError(f"the rewritten graph does not import: node '{node}' (made by the "
                            f"{_maker(node)} pass): {text[:300]}; {REPORT}") from None
    problems = meta.dangling(meta_out)
    if problems:
        raise InternalError(f"the rewritten metagraph is inconsistent: {problems[0]}; {REPORT}")


#: Convolutions whose oneDNN CPU kernels give an empty batch the wrong depth.
_CONVOLUTIONS = frozenset({"Conv2D", "Conv3D", "DepthwiseConv2dNative", "Conv2DBackpropInput",
                           "_FusedConv2D"})


def _empty_convolutions(ir: IR, devices: list[str], micro: int) -> list[str]:
    """A warning where a tower without examples would stop in a convolution: TensorFlow's oneDNN
    kernels (CPU builds, on unless TF_ENABLE_ONEDNN_OPTS=0) give a convolution of an empty batch
    its input's depth, and the next op fails. The numeric check saw it; the report did not say
    so (review 40)."""
    need = len(devices) * max(1, micro)        # examples for every tower and micro-batch
    if need < 2 or os.environ.get("TF_ENABLE_ONEDNN_OPTS") == "0" \
            or not any("CPU" in d.upper() for d in devices):
        return []
    conv = next((n.name for n in ir if n.op in _CONVOLUTIONS), None)      # the towers' copies
    if conv is None:
        return []
    return [f"a step with fewer than {need} examples leaves a tower without one, and on CPU "
            f"TensorFlow's oneDNN convolutions ('{conv}') fail on an empty batch: feed at least "
            "that many, or set TF_ENABLE_ONEDNN_OPTS=0 before importing TensorFlow (GPUs are "
            "not affected)"]


def _maker(node: str) -> str:
    """The pass that makes nodes named like ``node``."""
    head, _, rest = node.partition("/")
    inner = rest if head.startswith(("tower_", "replicate_tower_")) and rest else node
    return next((p for prefix, p in _MAKERS if inner.startswith(prefix)),
                "clone" if inner != node else "rewire")


def _report(ir: IR, analysis: Analysis, towers: Towers, devices: list[str], controller: str,
            records: list[PassRecord], input_nodes: int, warnings: list[str],
            batch_norm: str = "tower0") -> Report:
    grads: dict[str, int] = {}
    for f in analysis.frontier:
        grads[f.role] = grads.get(f.role, 0) + 1
    per_tower = len(analysis.needed) if len(towers.devices) > 1 else len(analysis.region)
    tower_nodes = sum(1 for n in ir.nodes if n.split("/", 1)[0] in towers.prefixes)
    return Report(
        devices=devices, controller=controller, train_op=analysis.train_op, loss=analysis.loss,
        loss_reductions={s.prefix: s.kind for s in analysis.scopes},
        inputs=[{"tensor": b.tensor, "axis": b.axis, "static_size": b.static_size, "class": b.cls,
                 **({"sparse": ops.sparse_role(b.sparse.index(b.tensor))}
                    if b.sparse else {})}
                for b in analysis.batch_inputs],
        shared_inputs=list(analysis.shared_inputs), optimizers=list(analysis.optimizers),
        updates=len(analysis.apply_ops), variables=len(analysis.variables),
        trainable_variables=sum(1 for v in analysis.variables.values() if v.trainable),
        variable_bytes=sum(v.bytes for v in analysis.variables.values()),
        global_step=analysis.global_step, input_nodes=input_nodes, nodes_per_tower=per_tower,
        shared_nodes=len(ir.nodes) - tower_nodes, output_nodes=len(ir.nodes), gradients=grads,
        merged_outputs=sum(f.role != "first" for f in analysis.outputs), update_ops=list(analysis.update_ops),
        batch_norm={"mode": batch_norm, "ops": list(analysis.couplings)},
        random={"ops": list(analysis.random_ops),
                "reproduced": {n: d.kind for n, d in analysis.draws.items()}},
        synced=list(ir.facts.get("synced", [])),
        rebatched=list(ir.facts.get("rebatched", [])), exact=not analysis.reasons,
        reasons=list(analysis.reasons), warnings=warnings,
        passes=[dataclasses.asdict(r) for r in records],
        mirrored=list(ir.facts.get("mirrored", [])),
        shared_why=dict(analysis.demoted), train_ops=list(analysis.train_ops),
        tower0_values=list(analysis.tower0_values), phases=list(analysis.phases))
