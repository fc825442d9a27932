"""Losing one worker of a between-graph job: notice it at once, and recover without the operator.

Why the survivors cannot keep their TensorFlow runtime (TF 2.21, measured and read in the source):
every server keeps a ``DeviceResolverDistributed`` (created once, in ``GrpcServer::Init``, with
the server's ``RpcCollectiveExecutorMgr``) whose table of remote device attributes only grows.
When a collective group forms, every member stores the other members' incarnations there; a
worker process that restarts has new incarnations, and ``UpdateDeviceAttributes`` refuses them
for good (``FAILED_PRECONDITION: /job:worker/replica:0/task:1/device:CPU:0exists in cache with a
different incarnation. This usually means the remote worker has restarted``), *whatever the group
key* (a fresh key, from a "generation" input, fails the same way). The failing op then calls
``BaseCollectiveExecutor::StartAbort``, which poisons the server's param resolver: every later
collective fails with ``Collective ops is aborted by: ... Restart your program to reset``.
Meanwhile a survivor in the middle of an all-reduce waits for the dead peer until its step's
timeout (no error arrives by itself). So after one worker restarts, every worker's server must be
a new one too.

What this module does instead of a hang:

- :func:`incarnations` asks a worker's server for its devices' incarnations
  (``WorkerService/GetStatus``, the RPC TensorFlow's own master uses; a millisecond on loopback,
  ``None`` at once when nothing answers);
- :class:`PeerWatch` polls every other worker; once this worker's collective group has formed
  (:meth:`PeerWatch.arm`, after the session is created) a peer that stops answering or answers
  with new incarnations is reported through ``on_failure`` with a message naming it;
- :func:`restart_process` re-executes this worker's own command line in the same process (same
  pid, same port, a new TensorFlow runtime), so the survivors of a lost worker restart themselves
  and only the lost worker needs starting again; the chief then restores the newest checkpoint
  and every worker takes its values (``local_init_op``). :func:`recover` is the usual
  ``on_failure``: restart, or exit with :data:`EXIT_CODE` and the reason;
- :func:`peer_watch_hook` is the ``MonitoredTrainingSession`` hook that arms a watch when the
  session exists and stops it after the last step.

A driver::

    hooks = [..., peer_watch_hook(cluster, task, recover)]
    try:
        with tf.compat.v1.train.MonitoredTrainingSession(..., hooks=hooks) as sess:
            ...
    except tf.errors.OpError as exc:
        recover(f"worker {task}: a step failed ({error_reason(exc)})")
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable

from replicate.errors import ReplicateError

__all__ = ["incarnations", "PeerWatch", "peer_watch_hook", "recover", "restart_process",
           "error_reason", "RESTARTS_ENV", "EXIT_CODE"]

log = logging.getLogger(__name__)

#: Environment variable counting the self-restarts of a worker process.
RESTARTS_ENV = "REPLICATE_BETWEEN_RESTARTS"
#: Exit status of :func:`recover` when it does not (or may no longer) restart the process.
EXIT_CODE = 75
_GET_STATUS = "/tensorflow.WorkerService/GetStatus"


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


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buf[i]
        i += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, i


def incarnations(address: str, timeout: float = 2.0, channel=None) -> dict[str, int] | None:
    """``{device name: incarnation}`` of the TensorFlow server at ``address`` (``host:port``),
    or ``None`` when it does not answer within ``timeout`` seconds. ``channel``: an open
    ``grpc`` channel to ``address`` to reuse (otherwise one is opened and closed)."""
    import grpc

    if channel is None:
        with grpc.insecure_channel(address) as own:
            return incarnations(address, timeout, own)
    call = channel.unary_unary(_GET_STATUS, request_serializer=lambda raw: raw,
                               response_deserializer=_device_attributes)
    try:
        devices = call(b"", timeout=timeout)
    except grpc.RpcError:
        return None
    return {d.name: d.incarnation for d in devices}


class PeerWatch:
    """Polls the other worker tasks of ``cluster`` every ``interval`` seconds in a daemon thread.

    Until :meth:`arm` nothing is reported (peers may still be starting or restarting); ``arm``
    records every peer's incarnations (the ones this worker's collective group was formed with)
    and from then on the first peer that answers with other incarnations, or does not answer
    ``misses`` polls in a row (a dead server refuses at once; a busy one may be slow), is
    reported once, by calling ``on_failure(message)`` from the watch thread. Each poll is one
    small RPC per peer on a kept channel.
    """

    def __init__(self, cluster, task_index: int, on_failure: Callable[[str], None],
                 interval: float = 0.2, job: str = "worker", misses: int = 3):
        from replicate.cluster import load

        spec = load(cluster)
        self.peers = {task: address for task, address in sorted(spec.jobs[job].items())
                      if task != task_index}
        self.job = job
        self.on_failure = on_failure
        self.interval = interval
        self.misses = misses
        self.baseline: dict[int, dict[str, int]] = {}
        self._missed = {task: 0 for task in self.peers}
        self._channels: dict[int, object] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _ask(self, task: int) -> dict[str, int] | None:
        import grpc

        if task not in self._channels:
            self._channels[task] = grpc.insecure_channel(self.peers[task])
        return incarnations(self.peers[task], timeout=max(2.0, 5 * self.interval),
                            channel=self._channels[task])

    def arm(self) -> None:
        """Record the peers' incarnations now and start watching them."""
        for task in self.peers:
            seen = self._ask(task)
            if seen is None:
                self._report(task, "stopped answering before training began")
                return
            self.baseline[task] = seen
        self._thread = threading.Thread(target=self._run, name="replicate-peer-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def check(self) -> str | None:
        """One poll: a message naming the first peer lost or restarted, else ``None``."""
        for task in self.peers:
            seen = self._ask(task)
            if seen is None:
                self._missed[task] += 1
                if self._missed[task] >= self.misses:
                    return self._describe(task, "stopped answering (its process died or hangs)")
                continue
            self._missed[task] = 0
            if seen != self.baseline[task]:
                return self._describe(task, "restarted (its devices have new incarnations)")
        return None

    def _describe(self, task: int, what: str) -> str:
        return (f"between-graph: {self.job}:{task} ({self.peers[task]}) {what}; TensorFlow's "
                "collectives cannot take a restarted member back into servers that formed a group "
                "with its previous incarnation, so this worker's server must restart too")

    def _report(self, task: int, what: str) -> None:
        self._stop.set()
        self.on_failure(self._describe(task, what))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            message = self.check()
            if message is not None and not self._stop.is_set():
                self._stop.set()
                self.on_failure(message)
                return


_NOISE = ("Graph execution error", "Detected at node", "Node:", "From /job:", "[[", "Original stack",
          "Recent warning", "Additional GRPC", ":UNKNOWN:", "Traceback", "File ")


def error_reason(exc: BaseException, limit: int = 300) -> str:
    """The line of a TensorFlow error that says what went wrong (not its graph-execution
    header, node names or stack lines), at most ``limit`` characters."""
    lines = [line.strip() for line in str(exc).splitlines()
             if line.strip() and not line.startswith((" ", "\t"))]
    useful = [line for line in lines if not line.startswith(_NOISE)]
    return (useful or lines or [type(exc).__name__])[0][:limit]


def restart_process(reason: str, limit: int = 10, argv: list[str] | None = None) -> None:
    """Re-execute this process's command line (``sys.orig_argv``, or ``argv``) in place: same pid,
    same arguments and environment (plus the restart count in :data:`RESTARTS_ENV`), a new
    TensorFlow runtime. Logs ``reason`` first. After ``limit`` restarts it raises instead.

    Raises:
        ReplicateError: this process already restarted ``limit`` times.
    """
    count = int(os.environ.get(RESTARTS_ENV, "0"))
    if count >= limit:
        raise ReplicateError(f"{reason}; this worker already restarted {count} times, giving up")
    os.environ[RESTARTS_ENV] = str(count + 1)
    print(f"{reason}; restarting this worker process (restart {count + 1} of at most {limit}) "
          "to resume from the chief's last checkpoint", file=sys.stderr, flush=True)
    sys.stdout.flush()
    if argv is not None:
        args = argv
    else:       # the interpreter's own arguments too (``-m module``), where Python keeps them
        args = [sys.executable] + list(getattr(sys, "orig_argv", [None] + sys.argv)[1:])
    time.sleep(0.1)          # let the log line reach its pipe or file
    os.execv(args[0], args)


def recover(reason: str, restart: bool = True, limit: int = 10) -> None:
    """What a worker does when a peer is lost or a step fails: :func:`restart_process` (with
    ``restart``), else, or once ``limit`` restarts are spent, print ``reason`` and exit the
    process at once with :data:`EXIT_CODE` (from any thread; a supervisor's cue)."""
    if restart:
        try:
            restart_process(reason, limit=limit)        # does not return
        except ReplicateError as exc:
            reason = str(exc)
    print(f"{reason}; exiting (restart every worker to resume)", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(EXIT_CODE)


def peer_watch_hook(cluster, task_index: int, on_failure: Callable[[str], None] = recover,
                    interval: float = 0.2, grace: float = 1.0):
    """A ``SessionRunHook`` watching the other workers (:class:`PeerWatch`) from the moment the
    session exists (its collective group has formed) until a run requests stop (the last step).
    A peer that exits right after the last, collective, step is not a failure: each report waits
    ``grace`` seconds and is dropped if this worker's last step has finished by then."""
    import tensorflow as tf

    class _PeerWatchHook(tf.compat.v1.train.SessionRunHook):
        def __init__(self):
            self.finished = False
            self.watch = PeerWatch(cluster, task_index, self._lost, interval=interval)

        def _lost(self, message: str) -> None:
            time.sleep(grace)
            if not self.finished:
                on_failure(message)

        def after_create_session(self, session, coord) -> None:
            self.watch.arm()

        def after_run(self, run_context, run_values) -> None:
            if run_context.stop_requested:
                self.finished = True
                self.watch.stop()

        def end(self, session) -> None:
            self.watch.stop()

    return _PeerWatchHook()
