"""TensorFlow clusters: read a cluster description and resolve device names against it.

A cluster maps job names to task addresses, as ``tf.train.ClusterSpec`` does::

    {"ps": ["10.0.0.1:2222"], "worker": ["10.0.0.2:2222", "10.0.0.3:2222"]}

:func:`load` reads one from a dict (task lists, or ``{index: address}`` for sparse jobs), a
``tf.train.ClusterSpec``, a JSON file or JSON text (either the plain mapping above or a
``TF_CONFIG``-style object with a ``"cluster"`` field), or the string ``"TF_CONFIG"``, meaning
the ``"cluster"`` field of the environment variable of that name.

:func:`resolve` turns the ``devices``, ``controller`` and ``param_devices`` that
:func:`replicate.transform` takes into canonical device strings of that cluster:

- A bare job name (``"worker"``) or a device naming a job but no task
  (``"/job:worker/device:GPU:0"``, also written ``/job:worker/task:*/device:GPU:0``) stands
  for every task of the job, in task order.
- A device naming no job (``"/cpu:0"``) is on the *master* task, the one an in-graph client
  session connects to (see :meth:`Cluster.master_task`), as TensorFlow places such ops.
- Tower devices without a device type stay so (``/job:worker/task:1``): TensorFlow picks the
  task's GPU when it has one. The controller and parameter devices default to ``CPU:0``.
- When the controller stands for several tasks (``"ps"`` with two ps tasks), the first is the
  controller and, unless ``param_devices`` is given, the variables are spread over all of
  them by byte size.
- Every job and task named must exist in the cluster; otherwise a
  :class:`~replicate.errors.DeviceError` names the device.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

from replicate.errors import DeviceError, InputError

__all__ = ["Cluster", "load", "resolve", "expand", "ENV_VAR", "MASTER_JOBS"]

log = logging.getLogger(__name__)

#: The environment variable ``load("TF_CONFIG")`` reads.
ENV_VAR = "TF_CONFIG"

#: Jobs whose first task is the master (the in-graph client's session target), in order.
MASTER_JOBS = ("chief", "master", "worker")

_JOB = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")
_ADDRESS = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[^:\[\]\s]+):(\d{1,5})$")


@dataclasses.dataclass(frozen=True)
class Cluster:
    """Jobs and the addresses of their tasks.

    Attributes:
        jobs: job name -> task index -> ``host:port``.
    """

    jobs: Mapping[str, Mapping[int, str]]

    def as_dict(self) -> dict[str, Any]:
        """A ClusterSpec-style dict: a list of addresses per job (a dict when tasks are sparse)."""
        out: dict[str, Any] = {}
        for job, tasks in self.jobs.items():
            dense = sorted(tasks) == list(range(len(tasks)))
            ordered = {i: tasks[i] for i in sorted(tasks)}
            out[job] = list(ordered.values()) if dense else ordered
        return out

    def to_json(self) -> str:
        """The cluster as ClusterSpec-style JSON (what ``replicate cluster --json`` writes)."""
        return json.dumps({j: ({str(k): v for k, v in t.items()} if isinstance(t, dict) else t)
                           for j, t in self.as_dict().items()}, sort_keys=True)

    def cluster_spec(self):
        """The same cluster as a ``tf.train.ClusterSpec``."""
        import tensorflow as tf

        return tf.train.ClusterSpec(self.as_dict())

    def tasks(self, job: str) -> list[int]:
        """Task indices of ``job``, sorted."""
        return sorted(self.jobs[job])

    def address(self, job: str, task: int) -> str:
        """``host:port`` of one task."""
        return self.jobs[job][task]

    def master_task(self) -> tuple[str, int]:
        """(job, task) of the master: the first task of ``chief``, ``master`` or ``worker``,
        else of the only job.

        Raises:
            DeviceError: no such job and several jobs, so the master is ambiguous.
        """
        for job in MASTER_JOBS:
            if job in self.jobs:
                return job, self.tasks(job)[0]
        if len(self.jobs) == 1:
            job = next(iter(self.jobs))
            return job, self.tasks(job)[0]
        raise DeviceError(f"the cluster (jobs {', '.join(sorted(self.jobs))}) has no "
                          f"{', '.join(MASTER_JOBS[:-1])} or {MASTER_JOBS[-1]} job to act as "
                          "master")

    def master(self) -> str:
        """The session target of the master task, e.g. ``grpc://127.0.0.1:2223``."""
        return "grpc://" + self.address(*self.master_task())

    def describe(self) -> str:
        """One line: ``ps:0=host:port worker:0=host:port ...``."""
        return " ".join(f"{j}:{t}={a}" for j, tasks in sorted(self.jobs.items())
                        for t, a in sorted(tasks.items()))


def _from_mapping(raw: Mapping[str, Any], origin: str) -> Cluster:
    inner = raw.get("cluster") if isinstance(raw, Mapping) else None
    if isinstance(inner, Mapping):
        raw = inner
    if not isinstance(raw, Mapping) or not raw:
        raise InputError(f"{origin}: a cluster must map job names to task addresses, "
                         'e.g. {"ps": ["host:2222"], "worker": ["host:2223"]}')
    jobs: dict[str, dict[int, str]] = {}
    for job, tasks in raw.items():
        if not isinstance(job, str) or not _JOB.match(job):
            raise InputError(f"{origin}: job name {job!r} is not a TensorFlow job name "
                             "(letters, digits, '_', starting with a letter)")
        if isinstance(tasks, str):
            tasks = [tasks]
        if isinstance(tasks, Mapping):
            try:
                items = [(int(k), v) for k, v in tasks.items()]
            except (TypeError, ValueError):
                raise InputError(f"{origin}: job '{job}': task indices must be integers") from None
        elif isinstance(tasks, Sequence):
            items = list(enumerate(tasks))
        else:
            raise InputError(f"{origin}: job '{job}': expected a list of 'host:port' addresses")
        if not items:
            raise InputError(f"{origin}: job '{job}' has no tasks")
        for index, address in items:
            if index < 0 or not isinstance(address, str) or not _ADDRESS.match(address.strip()):
                raise InputError(f"{origin}: job '{job}' task {index}: {address!r} is not a "
                                 "'host:port' address")
        jobs[job] = {i: a.strip() for i, a in sorted(items)}
    seen: dict[str, str] = {}
    for job, tasks in jobs.items():
        for index, address in tasks.items():
            if address in seen:
                raise InputError(f"{origin}: address {address} is given to both {seen[address]} "
                                 f"and {job}:{index}")
            seen[address] = f"{job}:{index}"
    return Cluster(jobs)


def _parse_json(text: str, origin: str) -> Cluster:
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"{origin}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    return _from_mapping(raw, origin)


def load(source: Any) -> Cluster:
    """Read a cluster description.

    Args:
        source: a :class:`Cluster`; a ``tf.train.ClusterSpec``; a dict of job -> addresses
            (or a ``TF_CONFIG``-style dict with a ``"cluster"`` field); ``"TF_CONFIG"`` for the
            environment variable; JSON text; or the path of a JSON file holding either form.

    Raises:
        InputError: the source cannot be read or is not a cluster; the message names it.
    """
    if isinstance(source, Cluster):
        return source
    if isinstance(source, Mapping):
        return _from_mapping(source, "cluster")
    if hasattr(source, "as_dict") and hasattr(source, "jobs"):
        return _from_mapping(source.as_dict(), "ClusterSpec")
    if isinstance(source, os.PathLike):
        source = os.fspath(source)
    if not isinstance(source, str) or not source.strip():
        raise InputError(f"cluster {source!r}: expected a dict, a tf.train.ClusterSpec, "
                         f"a JSON file or '{ENV_VAR}'")
    text = source.strip()
    if text == ENV_VAR:
        value = os.environ.get(ENV_VAR)
        if not value:
            raise InputError(f"{ENV_VAR}: the environment variable is not set")
        cluster = _parse_json(value, ENV_VAR)
    elif text.startswith("{"):
        cluster = _parse_json(text, "cluster JSON")
    else:
        try:
            with open(text, encoding="utf-8") as f:
                content = f.read()
        except OSError as exc:
            raise InputError(f"{text}: cannot read the cluster file ({exc.strerror})") from None
        cluster = _parse_json(content, text)
    log.info("cluster: %s", cluster.describe())
    return cluster


def _spec(item: str, what: str):
    import tensorflow as tf

    text = item.strip()
    if _JOB.match(text):
        text = f"/job:{text}"
    text = text.replace("/task:*", "")
    try:
        return tf.DeviceSpec.from_string(text)
    except (ValueError, TypeError):
        raise DeviceError(f"{what} '{item}' is not a TensorFlow device or job name (e.g. "
                          "'worker', '/job:worker/task:0/device:GPU:0')") from None


def expand(cluster: Cluster, item: str, what: str = "device",
           default_type: str | None = None) -> list[str]:
    """The canonical devices ``item`` stands for in ``cluster`` (see the module docstring).

    Args:
        cluster: the cluster.
        item: a job name or a device string.
        what: how errors call the item (``device``, ``controller``, ``parameter device``).
        default_type: device type (``"CPU"``) given index 0 when ``item`` names none.

    Raises:
        DeviceError: the item is malformed, or names a job or task the cluster lacks.
    """
    if not isinstance(item, str) or not item.strip():
        raise DeviceError(f"{what} {item!r} is empty; name a job or a device, e.g. 'worker'")
    spec = _spec(item, what)
    if spec.job is None:
        job, task = cluster.master_task()
        spec = spec.replace(job=job, task=task)
    if spec.job not in cluster.jobs:
        raise DeviceError(f"{what} '{item}' names job '{spec.job}', which the cluster does not "
                          f"have (jobs: {', '.join(sorted(cluster.jobs))})")
    tasks = cluster.tasks(spec.job)
    if spec.task is not None and spec.task not in tasks:
        raise DeviceError(f"{what} '{item}' names task {spec.task} of job '{spec.job}', which "
                          f"has tasks {', '.join(map(str, tasks))}")
    if spec.replica not in (None, 0):
        raise DeviceError(f"{what} '{item}' names replica {spec.replica}; a cluster task has "
                          "only replica 0")
    if spec.device_type is None and default_type is not None:
        spec = spec.replace(device_type=default_type, device_index=0)
    chosen = [spec.task] if spec.task is not None else tasks
    return [spec.replace(task=t).to_string() for t in chosen]


def _items(value: Any) -> list[str]:
    if isinstance(value, str):
        return [p for p in value.split(",")] if "," in value else [value]
    return list(value)


def resolve(cluster: Any, devices: Any, controller: str,
            param_devices: Sequence[str] | None = None
            ) -> tuple[list[str], str, list[str] | None]:
    """Resolve tower devices, the controller and parameter devices against ``cluster``.

    Args:
        cluster: anything :func:`load` reads.
        devices: tower devices or job names (a list, or one comma-separated string).
        controller: the controller device, or a job name (``"ps"``).
        param_devices: parameter devices or job names, or None.

    Returns:
        (devices, controller, param_devices), canonical and checked; ``param_devices`` is the
        controller's tasks when the controller stands for several and none were given.

    Raises:
        DeviceError: a device names a job or task the cluster lacks, or is malformed.
        InputError: the cluster cannot be read.
    """
    found = load(cluster)
    towers = [d for item in _items(devices) for d in expand(found, item, "device")]
    if not towers:
        raise DeviceError("devices is empty; name tower devices or a job, e.g. 'worker'")
    controllers = expand(found, controller, "controller", default_type="CPU")
    params = None
    if param_devices is not None:
        params = [d for item in _items(param_devices)
                  for d in expand(found, item, "parameter device", default_type="CPU")]
    elif len(controllers) > 1:
        params = controllers
    log.info("cluster devices: towers %s, controller %s, parameters %s", towers, controllers[0],
             params or "on the controller")
    return towers, controllers[0], params
