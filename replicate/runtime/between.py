"""Between-graph replication at run time: pin the template to a task, configure servers.

``replicate.transform(graph, devices, between_graph=True, cluster=...)`` (CLI: ``replicate
convert IN -o OUT --between-graph --cluster cluster.json``) writes one metagraph, a *template*
every worker imports. :func:`for_task` (or :func:`import_meta_graph`, which calls it) pins it to
one worker task: worker devices get the task index, the ops that update variables on the ps
tasks stay only on the chief (task 0), and the other workers contribute zeros to the initial
broadcast of the chief's values. The task index comes from the argument or from ``TF_CONFIG``
(``{"cluster": ..., "task": {"type": "worker", "index": 1}}``).

Every server of the cluster needs ``experimental.collective_group_leader`` set to the same task
(:func:`server_config`); :func:`wait_for_cluster` fails with a clear error when a task does not
answer within a timeout instead of letting the first session wait forever. Losing a task
during training: :mod:`replicate.runtime.recovery` (survivors notice it and restart themselves,
so only the lost worker needs starting again).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import time
from typing import Any

from tensorflow.core.protobuf import meta_graph_pb2

from replicate.errors import DeviceError, InputError, ReplicateError
from replicate.passes.between import BROADCAST_OP  # the op each worker runs after a restore

__all__ = ["for_task", "import_meta_graph", "task_index_from_env", "server_config",
           "wait_for_cluster", "CHIEF", "BROADCAST_OP"]

log = logging.getLogger(__name__)

#: Index of the worker task that initializes, restores, saves and updates ps variables.
CHIEF = 0
_ROLE = "_replicate_role"


def task_index_from_env(default: int | None = None) -> int:
    """The worker index in ``TF_CONFIG`` (``task.index`` of ``task.type`` ``worker``)."""
    raw = os.environ.get("TF_CONFIG")
    if not raw:
        if default is not None:
            return default
        raise ReplicateError("between-graph: no task index given and TF_CONFIG is not set; pass "
                             "task_index= (CLI: --task-index) or set TF_CONFIG's task")
    try:
        task = json.loads(raw).get("task") or {}
    except (ValueError, AttributeError):
        raise InputError("TF_CONFIG is not a JSON object") from None
    if task.get("type", "worker") not in ("worker", "chief"):
        raise ReplicateError(f"between-graph: TF_CONFIG's task is of type '{task.get('type')}'; "
                             "only worker tasks run the training graph")
    if "index" not in task:
        if default is not None:
            return default
        raise ReplicateError("between-graph: TF_CONFIG has no task.index")
    return int(task["index"])


def _pin(device: str, task: int) -> str:
    import tensorflow as tf

    if not device:
        return f"/job:worker/replica:0/task:{task}"
    spec = tf.DeviceSpec.from_string(device)
    if spec.job == "worker" and spec.task is None:
        spec = spec.replace(task=task)
    return spec.to_string()


def for_task(meta_graph_def: meta_graph_pb2.MetaGraphDef, task_index: int,
             workers: int | None = None) -> meta_graph_pb2.MetaGraphDef:
    """The between-graph template pinned to worker ``task_index`` (a new MetaGraphDef).

    Raises:
        DeviceError: the task index is negative or not below the number of workers.
    """
    info = _info(meta_graph_def)
    workers = workers or info.get("workers")
    if not isinstance(task_index, int) or task_index < 0 or (workers and task_index >= workers):
        raise DeviceError(f"between-graph: task index {task_index!r} is not one of the "
                          f"{workers} worker tasks")
    out = meta_graph_pb2.MetaGraphDef()
    out.CopyFrom(meta_graph_def)
    chief = task_index == CHIEF
    for node in out.graph_def.node:
        node.device = _pin(node.device, task_index)
        role = node.attr[_ROLE].s.decode() if _ROLE in node.attr else ""
        if not role or chief:
            continue
        scope = node.name.rsplit("/", 1)[0]
        if role == "chief_only":
            # Its inputs still run (as control inputs): every worker joins the same collectives.
            control = list(dict.fromkeys(i if i.startswith("^") else "^" + i.split(":")[0]
                                         for i in node.input))
            keep_device, name = node.device, node.name
            node.Clear()
            node.name, node.op, node.device = name, "NoOp", keep_device
            node.input.extend(control)
        elif role == "broadcast_value":
            dtype = node.attr["dtype"].type if "dtype" in node.attr else node.attr["T"].type
            keep_device, name = node.device, node.name
            node.Clear()
            node.name, node.op, node.device = name, "Fill", keep_device
            node.input.extend([f"{scope}/zeros_shape", f"{scope}/zero"])
            node.attr["T"].type = dtype
            node.attr["index_type"].type = 9          # int64
    for key in ("task_index",):
        out.collection_def[f"replicate_between_{key}"].int64_list.value[:] = [task_index]
    return out


def _info(meta_graph_def) -> dict[str, Any]:
    col = meta_graph_def.collection_def.get("replicate_between")
    if col is None or not col.bytes_list.value:
        raise InputError("this metagraph is not a between-graph template (convert it with "
                         "--between-graph)")
    return json.loads(col.bytes_list.value[0].decode())


def import_meta_graph(source: Any, task_index: int | None = None, **kwargs: Any):
    """Import the between-graph template ``source`` (path or MetaGraphDef) for this worker into
    the default graph, as ``tf.compat.v1.train.import_meta_graph`` does; returns its saver.

    ``task_index`` defaults to ``TF_CONFIG``'s task index.
    """
    import tensorflow as tf

    if isinstance(source, (str, os.PathLike)):
        from replicate.graph import io

        loaded = io.load(os.fspath(source))
        source = loaded.meta
    if task_index is None:
        task_index = task_index_from_env()
    pinned = for_task(source, task_index)
    return tf.compat.v1.train.import_meta_graph(pinned, clear_devices=False, **kwargs)


def server_config(cluster: Any, threads: int | None = None, cpus: int | None = None):
    """A ConfigProto for every server of the cluster: the collective group leader is worker 0
    (the chief), the same on every task."""
    import tensorflow as tf

    from replicate.runtime.cluster import load

    spec = load(cluster)
    config = tf.compat.v1.ConfigProto()
    job = "chief" if "chief" in spec.jobs else "worker"
    config.experimental.collective_group_leader = f"/job:{job}/replica:0/task:0"
    if threads:
        config.intra_op_parallelism_threads = threads
        config.inter_op_parallelism_threads = threads
    if cpus:
        config.device_count["CPU"] = cpus
    return config


def wait_for_cluster(cluster: Any, timeout: float = 60.0, jobs: tuple[str, ...] = ("ps", "worker"),
                     interval: float = 0.2, announce_after: float = 2.0) -> None:
    """Return once every task of ``jobs`` accepts connections; otherwise raise, within
    ``timeout`` seconds, an error naming the tasks that never came up.

    TensorFlow itself would wait forever: a session's first step blocks until every task of
    the collective group answers. A wait longer than ``announce_after`` seconds is announced
    once on stderr (``between-graph: waiting up to 60 s for ps:0 (127.0.0.1:PORT) ...``), so
    a worker waiting for a lost task to be restarted says so.
    """
    from replicate.runtime.cluster import load

    spec = load(cluster)
    pending = {(job, task): spec.jobs[job][task] for job in jobs if job in spec.jobs
               for task in spec.jobs[job]}
    start = time.monotonic()
    deadline = start + timeout
    announced = False
    while pending:
        for key, address in list(pending.items()):
            host, port = address.rsplit(":", 1)
            try:
                with socket.create_connection((host.strip("[]"), int(port)), timeout=1.0):
                    pending.pop(key)
            except OSError:
                pass
        if not pending:
            if announced:
                print(f"between-graph: every task answers after {time.monotonic() - start:.1f} s",
                      file=sys.stderr, flush=True)
            return
        names = ", ".join(f"{j}:{t} ({a})" for (j, t), a in sorted(pending.items()))
        if time.monotonic() >= deadline:
            raise ReplicateError(f"between-graph: {names} did not come up within {timeout:g} s; "
                                 "start its server (every task needs "
                                 "collective_group_leader set, see server_config) or check "
                                 "the cluster file")
        if not announced and time.monotonic() - start >= announce_after:
            announced = True
            print(f"between-graph: waiting up to {timeout:g} s for {names} to answer (start or "
                  "restart it on its port)", file=sys.stderr, flush=True)
        time.sleep(interval)


def plan(cluster: Any, devices: Any, controller: str) -> tuple[list[str], str, int, list[str]]:
    """Tower devices (inside each worker task), the worker's controller, the worker count and
    the ps devices of a between-graph transform.

    ``devices`` name devices *inside* a worker task: ``"worker"`` (one tower per worker, the
    default device), ``"/gpu:0,/gpu:1"`` or ``["/job:worker/device:GPU:0", ...]``; a task index
    is not allowed (every worker runs the same towers on its own task).
    """
    import tensorflow as tf

    from replicate.runtime.cluster import load

    if cluster is None:
        raise ReplicateError("between-graph replication needs a cluster (cluster=, CLI --cluster)")
    spec = load(cluster)
    if "worker" not in spec.jobs:
        raise DeviceError(f"between-graph: the cluster has no 'worker' job ({spec.describe()})")
    workers = len(spec.jobs["worker"])
    if isinstance(devices, str):
        devices = [d for d in devices.split(",") if d.strip()] or [devices]

    def local(device: str, what: str) -> str:
        device = device.strip()
        if device in ("worker", "/job:worker"):
            return "/job:worker"
        try:
            spec_ = tf.DeviceSpec.from_string(device)
        except (ValueError, TypeError):
            raise DeviceError(f"{what} '{device}' is not a TensorFlow device") from None
        if spec_.job not in (None, "worker") or spec_.task is not None:
            raise DeviceError(f"between-graph: {what} '{device}' must name a device inside every "
                              "worker task (e.g. '/gpu:0' or 'worker'), not another job or a task")
        return spec_.replace(job="worker").to_string()

    towers = [local(d, "device") for d in devices]
    control = local(controller, "controller")
    if tf.DeviceSpec.from_string(control).device_type is None:
        control = f"{control}/device:CPU:0"
    ps = [f"/job:ps/replica:0/task:{t}/device:CPU:0" for t in sorted(spec.jobs.get("ps", {}))]
    return towers, control, workers, ps


def notes(facts: dict[str, Any]) -> list[str]:
    """Report lines of a between-graph transform (what each worker must know)."""
    info = facts["between"]
    out = [f"between-graph: {info['workers']} workers x {info['towers_per_worker']} towers, one "
           "template for every worker (pin it with replicate.between.for_task or --task-index); "
           "every server needs collective_group_leader set (replicate.between.server_config)"]
    if info["on_ps"]:
        out.append(f"between-graph: {len(info['on_ps'])} variables on ps tasks, updated by the "
                   f"chief: {', '.join(info['on_ps'][:4])}{' ...' if len(info['on_ps']) > 4 else ''}")
    for var in facts.get("between_local_sparse", []):
        out.append(f"between-graph: '{var}' has sparse gradients but its optimizer also writes it "
                   "(or its slots) densely, so every worker keeps a copy and applies the "
                   "all-gathered rows")
    return out


def finish(meta_out: meta_graph_pb2.MetaGraphDef, facts: dict[str, Any],
           task_index: int | None) -> meta_graph_pb2.MetaGraphDef:
    """Record the template's facts and Scaffold collections; pin to ``task_index`` if given."""
    from replicate.passes.between import LOCAL_INIT, READY_FOR_LOCAL_INIT

    info = {k: facts[k] for k in ("workers", "towers_per_worker", "group_size", "group_key",
                                  "on_ps", "per_worker")}
    meta_out.collection_def["replicate_between"].bytes_list.value[:] = [json.dumps(info).encode()]
    meta_out.collection_def["local_init_op"].node_list.value[:] = [LOCAL_INIT]
    meta_out.collection_def["ready_for_local_init_op"].node_list.value[:] = [
        f"{READY_FOR_LOCAL_INIT}:0"]
    if task_index is not None:
        meta_out = for_task(meta_out, task_index)
    return meta_out
