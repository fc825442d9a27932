"""``replicate.transform``: the public entry point that runs the pass pipeline."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from tensorflow.core.framework import graph_pb2
from tensorflow.core.protobuf import meta_graph_pb2

from replicate.batchflow.facts import Analysis, Reason, Towers
from replicate.errors import (
    REPORT,
    AnalysisError,
    DeviceError,
    InputError,
    InternalError,
    ReplicateError,
)
from replicate.graph import io, meta, ops, registry
from replicate.graph.ir import IR, parse_tensor
from replicate.graph.kernels import host_of
from replicate.passes.accumulate import Accumulate
from replicate.passes.aggregate import STRATEGIES, Aggregate
from replicate.passes.analyze import Analyze
from replicate.passes.clone import Clone
from replicate.passes.draw import Draw
from replicate.passes.guard import Guard
from replicate.passes.mirror import MIRRORED, Mirror
from replicate.passes.pipeline import PassRecord, run_pipeline
from replicate.passes.place import Place
from replicate.passes.rebatch import Rebatch
from replicate.passes.rewire import Rewire
from replicate.passes.split import Split
from replicate.passes.sync import Sync
from replicate.passes.validate import Validate
from replicate.passes.weigh import Weigh
from replicate.report import Report

__all__ = ["transform", "Result", "normalize_device", "analyze_only", "BATCH_NORM_MODES", "STRATEGIES", "MIRRORED"]

#: Batch-norm modes of :func:`transform`.
BATCH_NORM_MODES = ("tower0", "sync")

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


@dataclasses.dataclass
class Result:
    """The replicated graph and handles into it.

    Attributes:
        graph_def: the rewritten GraphDef.
        meta_graph_def: the same with collections, saver and signatures carried over.
        report: what was found and whether the result is exact.
        analysis: the analyze pass's facts (for tools).
        records: timing of each pass.
    """

    graph_def: graph_pb2.GraphDef
    meta_graph_def: meta_graph_pb2.MetaGraphDef
    report: Report
    analysis: Analysis
    towers: Towers
    records: list[PassRecord]
    aggregates: dict[str, str]
    transform_seconds: float

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


def prepare(graph: Any, *, train_op: str | None = None, loss: str | None = None,
            outputs: Sequence[str] = (), merge_forward: bool = True,
            batch_inputs: Any = None, sync: bool = False,
            shared_inputs: Any = None) -> tuple[IR, io.Loaded, Analyze]:
    """Load ``graph`` into an IR with static shapes, and build the analyze pass for it."""
    loaded = io.load(graph)
    tf_graph = loaded.graph if loaded.graph is not None else registry.import_checked(
        loaded.graph_def, loaded.origin)
    ir = IR.from_graph_def(loaded.graph_def, loaded.meta)
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


def transform(graph: Any, devices: Sequence[str], *, controller: str = "/cpu:0",
              train_op: str | None = None, loss: str | None = None,
              outputs: Sequence[str] | None = None, merge_forward: bool = True,
              param_devices: Sequence[str] | None = None, aggregation: str = "add_n",
              batch_norm: str = "tower0", batch_inputs: Any = None,
              cluster: Any = None, verify_each: bool = False,
              dump_dir: str | None = None,
              progress: Callable[[str, int, int], None] | None = None,
              between_graph: bool = False, task_index: int | None = None,
              sparse_on_ps: bool = True,
              accumulate: int = 1, check: bool = False, shared_inputs: Any = None) -> Result:
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
            :func:`replicate.runtime.between.for_task` (see :mod:`replicate.passes.between`).
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

    Returns:
        A :class:`Result`; the input is never modified.

    Raises:
        ReplicateError: for any bad input; the message names the file, node or option.
    """
    with _gc_paused():
        return _transform(graph, devices, controller=controller, train_op=train_op, loss=loss,
                          outputs=outputs, merge_forward=merge_forward, param_devices=param_devices,
                          aggregation=aggregation, batch_norm=batch_norm, batch_inputs=batch_inputs,
                          cluster=cluster, verify_each=verify_each, dump_dir=dump_dir,
                          progress=progress, between_graph=between_graph, task_index=task_index,
                          sparse_on_ps=sparse_on_ps, accumulate=accumulate, check=check,
                          shared_inputs=shared_inputs)


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


def _transform(graph: Any, devices: Sequence[str], *, controller: str, train_op, loss, outputs,
               merge_forward: bool, param_devices, aggregation: str, batch_norm: str, batch_inputs,
               cluster, verify_each: bool, dump_dir, progress, between_graph: bool = False,
               task_index: int | None = None, sparse_on_ps: bool = True,
               accumulate: int = 1, check: bool = False, shared_inputs: Any = None) -> Result:
    start = time.perf_counter()
    micro = _micro(accumulate)
    between = None
    if between_graph:
        if micro > 1:
            raise ReplicateError("between_graph with accumulate > 1 is not supported yet")
        from replicate.passes.between import Between
        from replicate.runtime import between as between_rt

        if param_devices is not None or batch_norm != "tower0":
            raise ReplicateError("between_graph: param_devices and batch_norm='sync' are not "
                                 "supported (each worker keeps its own copy of dense variables)")
        devices, controller, workers, ps = between_rt.plan(cluster, devices, controller)
        cluster = None
        aggregation = ("packed_allreduce" if aggregation.startswith("packed") and len(devices) > 1
                       else "allreduce")
    mirrored = param_devices == MIRRORED or (
        not isinstance(param_devices, str) and list(param_devices or []) == [MIRRORED])
    if mirrored:
        param_devices = None
    if cluster is not None:
        from replicate.runtime.cluster import resolve

        devices, controller, param_devices = resolve(cluster, devices, controller, param_devices)
    devices, controller = _devices(devices, controller)
    if isinstance(param_devices, str):
        raise ReplicateError(f"param_devices='{param_devices}': give a list of devices or "
                             f"'{MIRRORED}'")
    params = [normalize_device(d, "parameter device") for d in (param_devices or [])]
    if aggregation not in STRATEGIES:
        raise ReplicateError(f"aggregation='{aggregation}' is not one of {', '.join(STRATEGIES)}")
    if mirrored and not aggregation.endswith("allreduce"):   # mirrors need every device's sum
        aggregation = "packed_allreduce" if aggregation == "packed" else "allreduce"
    if batch_norm not in BATCH_NORM_MODES:
        raise ReplicateError(f"batch_norm='{batch_norm}' is not one of {', '.join(BATCH_NORM_MODES)}")
    try:
        ir, loaded, analyze = prepare(graph, train_op=train_op, loss=loss, outputs=outputs or (),
                                      merge_forward=merge_forward, batch_inputs=batch_inputs,
                                      sync=batch_norm == "sync", shared_inputs=shared_inputs)
        validator = Validate()
        passes = [analyze, Place(controller, params), Split([d for d in devices for _ in range(micro)], controller, micro), Clone(),
                  Sync(controller, full=batch_norm == "sync"), Rebatch(), Draw(), Weigh(controller),
                  Aggregate(controller, aggregation), Rewire(controller), Guard(), Accumulate()]
        if between_graph:
            seed = loaded.graph_def.SerializeToString(deterministic=True) + repr(
                (devices, controller, workers, ps, aggregation, sparse_on_ps, outputs, train_op,
                 loss, batch_inputs, shared_inputs)).encode()
            between = Between(workers, controller, ps, sparse_on_ps, seed)
            passes.append(between)
        passes += [Mirror(), validator] if mirrored and len(devices) > 1 else [validator]
        ir, records = run_pipeline(ir, passes, verify_each=verify_each, validator=validator,
                                   dump_dir=dump_dir, progress=progress)
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
                            f"'{need['ops'][0]}' picks examples of each tower's batch by position; "
                            "a smaller step stops with an assertion that says so")
        graph_def = ir.to_graph_def()
        meta_out = meta.rewrite(loaded.meta, graph_def, ir.facts.get("renamed", {}), warnings.append)
        if between is not None:
            meta_out = between_rt.finish(meta_out, ir.facts["between"], task_index)
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
        raise AnalysisError(f"cannot replicate this graph: the analysis could not establish its "
                            f"batch semantics ({analysis.reasons[0]}), so the batch sizes baked "
                            f"into it cannot all be rewritten per tower ({first}); give the batch "
                            "inputs a dynamic batch dimension") from None
    towers: Towers = ir.facts["towers"]
    seconds = time.perf_counter() - start
    report = _report(ir, analysis, towers, devices, controller, records, len(loaded.graph_def.node),
                     warnings, batch_norm)
    report.accumulate = ir.facts.get("accumulate", {})
    if check:
        _certify(report, graph, len(devices), train_op=analysis.train_op, loss=loss,
                 strategy={"aggregation": aggregation, "batch_norm": batch_norm,
                           "accumulate": micro, "batch_inputs": batch_inputs,
                           **({"shared_inputs": shared_inputs} if shared_inputs else {}),
                           **({"param_devices": "mirrored"} if mirrored else {})},
                 distributed=between_graph or cluster is not None)
    return Result(graph_def, meta_out, report, analysis, towers, records,
                  ir.facts.get("aggregates", {}), seconds)


def _certify(report: Report, graph: Any, towers: int, *, train_op: str, loss: str | None,
             strategy: dict[str, Any], distributed: bool) -> None:
    """Run the numeric certificate and record it; a claimed exact that fails becomes inexact."""
    from replicate.check.certificate import STEPS, Certificate, certify
    from replicate.errors import RewriteError

    if distributed:
        cert = Certificate(False, "devices of a cluster: run replicate verify on the single-machine graph")
    else:
        # An inexact rewrite runs one step per batch size: it must still run where the original
        # does (the differences are the reasons'; replicate verify measures them over more steps).
        try:
            cert = certify(graph, towers, train_op=train_op, loss=loss,
                           strategy={k: v for k, v in strategy.items() if v is not None},
                           yardstick=report.exact and not report.random.get("ops"),
                           steps=STEPS if report.exact else 1)
        except RewriteError as exc:
            raise RewriteError(f"{exc}; the split the analysis chose cannot run (the inputs named "
                               "with batch_inputs= or shared_inputs=, or an op it could not "
                               "prove, pairs a whole tensor with a tower's slice): name other "
                               "inputs, or train this graph on one device") from None
        if not report.exact and cert.ran:
            cert.notes.insert(0, "the report is inexact already (its reasons say why): one step "
                              "checked that the rewrite runs")
    report.check = cert.to_dict()
    report.check["summary"] = cert.describe()
    if cert.empty_tower:
        report.warnings.append(f"a step whose batch leaves a tower without examples (fewer than "
                               f"{towers} in a step) fails: {cert.empty_tower[:300]} (on CPU "
                               "builds this is usually oneDNN's kernels on an empty batch: set "
                               "TF_ENABLE_ONEDNN_OPTS=0; on GPUs they run)")
    if report.exact and cert.ran and not cert.ok:
        worst = cert.worst
        report.exact = False
        report.check["contradicted"] = True
        report.reasons.append(Reason(worst["worst"], f"the numeric check found '{worst['worst']}' "
                                     f"{worst['max_rel']:.2e} off one device after "
                                     f"{worst['steps']} steps at a global batch of {worst['batch']}, "
                                     "although the analysis found no reason",
                                     "please report the graph: the analysis missed what breaks "
                                     "exactness"))


def _micro(accumulate: Any) -> int:
    """The validated ``accumulate`` option."""
    if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
        raise ReplicateError(f"accumulate={accumulate!r}: give a whole number of micro-batches "
                             "per device, 1 or more")
    return accumulate


#: Which pass makes the nodes under each name scope of the output (for error messages).
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
