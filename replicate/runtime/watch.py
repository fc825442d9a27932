"""Watching the tasks a between-graph worker depends on: who watches whom, and how.

A worker of a between-graph job depends on every other worker (they all-reduce together) and on
every parameter server (sparse variables live there, and the chief's checkpoints write shards
there). Losing any of them must end in a report, never in a silent wait.

Asking every worker about every other one costs ``W * (W - 1)`` polls per interval; instead
:func:`watched_tasks` gives each task a fixed set, so the total grows linearly with ``W``:

- the *chief* (``chief:0``, else ``worker:0``) watches every other worker and every ps task;
- every other worker watches the chief and every ps task.

A lost non-chief worker is therefore seen by the chief, which restarts (or exits); the other
workers see the chief go and follow it, one hop later. A lost ps or a lost chief is seen by
every worker directly. Polls per interval: ``(W - 1) + P`` on the chief, ``1 + P`` on every
other worker, ``(W - 1) * (2 + P) + P`` in all.

:func:`incarnations` asks one server for its devices' incarnations (``WorkerService/GetStatus``,
the RPC TensorFlow's own master uses); :class:`PeerWatch` polls the watched tasks in a daemon
thread, all at once (one RPC each on a kept channel, issued together), and reports the first that
stops answering or comes back with new incarnations.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

__all__ = ["incarnations", "watched_tasks", "chief_task", "PeerWatch", "polls_per_interval"]

log = logging.getLogger(__name__)

_GET_STATUS = "/tensorflow.WorkerService/GetStatus"


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buf[i]
        i += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, i


def _device_attributes(buf: bytes) -> list:
    """``GetStatusResponse`` (``repeated DeviceAttributes device_attributes = 1``) decoded by
    hand: TensorFlow's wheel ships ``DeviceAttributes`` but not the worker service's messages."""
    from tensorflow.core.framework import device_attributes_pb2

    out, i = [], 0
    while i < len(buf):
        key, i = _varint(buf, i)
        if key & 7 != 2:
            raise ValueError(f"GetStatusResponse: unexpected wire type {key & 7}")
        size, i = _varint(buf, i)
        if key >> 3 == 1:
            out.append(device_attributes_pb2.DeviceAttributes.FromString(buf[i:i + size]))
        i += size
    return out


def _status_call(channel):
    return channel.unary_unary(_GET_STATUS, request_serializer=lambda raw: raw,
                               response_deserializer=_device_attributes)


def incarnations(address: str, timeout: float = 2.0, channel=None) -> dict[str, int] | None:
    """``{device name: incarnation}`` of the TensorFlow server at ``address`` (``host:port``),
    or ``None`` when it does not answer within ``timeout`` seconds. ``channel``: an open
    ``grpc`` channel to ``address`` to reuse (otherwise one is opened and closed)."""
    import grpc

    if channel is None:
        with grpc.insecure_channel(address) as own:
            return incarnations(address, timeout, own)
    try:
        devices = _status_call(channel)(b"", timeout=timeout)
    except grpc.RpcError:
        return None
    return {d.name: d.incarnation for d in devices}


def chief_task(cluster) -> tuple[str, int]:
    """(job, task) of the between-graph chief: ``chief:0`` when there is a chief job, else
    ``worker:0`` (the collective group leader of :func:`replicate.runtime.between.server_config`)."""
    from replicate.runtime.cluster import load

    spec = load(cluster)
    job = "chief" if "chief" in spec.jobs else "worker"
    return job, spec.tasks(job)[0]


def watched_tasks(cluster, job: str, task: int) -> list[tuple[str, int]]:
    """The tasks ``job:task`` watches (see the module docstring): the chief watches every other
    worker and every ps task; any other worker watches the chief and every ps task."""
    from replicate.runtime.cluster import load

    spec = load(cluster)
    chief = chief_task(spec)
    ps = [("ps", t) for t in spec.tasks("ps")] if "ps" in spec.jobs else []
    if (job, task) == chief:
        trainers = [(j, t) for j in ("chief", "worker") if j in spec.jobs for t in spec.tasks(j)]
        return [key for key in trainers if key != chief] + ps
    return [chief] + ps


def polls_per_interval(cluster) -> dict[tuple[str, int], int]:
    """How many peers each training task polls per interval under :func:`watched_tasks`."""
    from replicate.runtime.cluster import load

    spec = load(cluster)
    return {(j, t): len(watched_tasks(spec, j, t)) for j in ("chief", "worker") if j in spec.jobs
            for t in spec.tasks(j)}


class PeerWatch:
    """Polls the tasks ``job:task_index`` depends on every ``interval`` seconds in a daemon
    thread.

    Until :meth:`arm` nothing is reported (peers may still be starting or restarting); ``arm``
    records every watched task's incarnations (the ones this worker's session was formed with)
    and from then on the first task that answers with other incarnations, or does not answer
    ``misses`` polls in a row (a dead server refuses at once; a busy one may be slow), is
    reported once, by calling ``on_failure(message)`` from the watch thread. The message names
    the task as ``job:index`` with its address.

    Args:
        cluster: anything :func:`replicate.runtime.cluster.load` reads.
        task_index: this worker's index.
        on_failure: called once, from the watch thread, with the report.
        interval: seconds between two polls.
        job: this task's job.
        misses: polls without an answer before a task counts as lost.
        peers: the (job, task) pairs to watch; :func:`watched_tasks` when None.
    """

    def __init__(self, cluster, task_index: int, on_failure: Callable[[str], None],
                 interval: float = 0.2, job: str = "worker", misses: int = 3,
                 peers: list[tuple[str, int]] | None = None):
        from replicate.runtime.cluster import load

        spec = load(cluster)
        chosen = watched_tasks(spec, job, task_index) if peers is None else peers
        self.peers = {key: spec.address(*key) for key in chosen}
        self.job, self.task = job, task_index
        self.on_failure = on_failure
        self.interval = interval
        self.misses = misses
        self.timeout = max(2.0, 5 * interval)
        self.baseline: dict[tuple[str, int], dict[str, int]] = {}
        self.polls = 0
        self._missed = {key: 0 for key in self.peers}
        self._calls: dict[tuple[str, int], object] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _call(self, key: tuple[str, int]):
        import grpc

        if key not in self._calls:
            channel = grpc.insecure_channel(self.peers[key])
            self._calls[key] = _status_call(channel)
        return self._calls[key]

    def ask_all(self) -> dict[tuple[str, int], dict[str, int] | None]:
        """Every watched task's incarnations (``None``: no answer), asked all at once."""
        import grpc

        futures = {key: self._call(key).future(b"", timeout=self.timeout) for key in self.peers}
        out: dict[tuple[str, int], dict[str, int] | None] = {}
        for key, future in futures.items():
            try:
                out[key] = {d.name: d.incarnation for d in future.result()}
            except grpc.RpcError:
                out[key] = None
        self.polls += len(futures)
        return out

    def arm(self) -> None:
        """Record the watched tasks' incarnations now and start watching them. Once armed,
        arming again (a session created anew in the same process) keeps the first baseline."""
        if self._thread is not None:
            return
        for key, seen in self.ask_all().items():
            if seen is None:
                self._report(self.describe(key, "stopped answering before training began"))
                return
            self.baseline[key] = seen
        self._thread = threading.Thread(target=self._run, name="replicate-peer-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop polling (nothing more is reported)."""
        self._stop.set()

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def check(self) -> str | None:
        """One poll: a message naming the first watched task lost or restarted, else ``None``."""
        for key, seen in self.ask_all().items():
            if seen is None:
                self._missed[key] += 1
                if self._missed[key] >= self.misses:
                    return self.describe(key, "stopped answering (its process died or hangs)")
                continue
            self._missed[key] = 0
            if seen != self.baseline[key]:
                return self.describe(key, "restarted (its devices have new incarnations)")
        return None

    def describe(self, key: tuple[str, int], what: str) -> str:
        """The report for task ``key``: what happened and why this worker must act."""
        job, task = key
        if job == "ps":
            why = ("the variables it held are gone until it is restarted on its port and the "
                   "chief restores the last checkpoint, so this worker must restart too")
        else:
            why = ("TensorFlow's collectives cannot take a restarted member back into servers "
                   "that formed a group with its previous incarnation, so this worker's server "
                   "must restart too")
        return f"between-graph: {job}:{task} ({self.peers[key]}) {what}; {why}"

    def _report(self, message: str) -> None:
        self._stop.set()
        self.on_failure(message)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            message = self.check()
            if message is not None and not self._stop.is_set():
                self._report(message)
                return
