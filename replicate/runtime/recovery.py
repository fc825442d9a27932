"""Losing a task of a between-graph job (a worker, the chief or a ps): notice it within a bound,
and recover without the operator.

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

- :class:`~replicate.runtime.watch.PeerWatch` (with :func:`~replicate.runtime.watch.incarnations`)
  polls the tasks this worker depends on, chosen by
  :func:`~replicate.runtime.watch.watched_tasks` so the cost grows linearly with the number of
  workers: the chief watches every worker and every ps task, the other workers watch the chief
  and every ps task. Once this worker's session exists (:meth:`PeerWatch.arm`) a watched task
  that stops answering or answers with new incarnations is reported through ``on_failure`` with
  a message naming it (``worker:1 (127.0.0.1:PORT)``, ``ps:0 (...)``);
- :func:`restart_process` re-executes this worker's own command line in the same process (same
  pid, same port, a new TensorFlow runtime), so the survivors of a lost task restart themselves
  and only the lost task needs starting again; the chief then restores the newest checkpoint
  and every worker takes its values (``local_init_op``). :func:`recover` is the usual
  ``on_failure``: restart, or exit with :data:`EXIT_CODE` and the reason. The restart count
  (:data:`RESTARTS_ENV`) goes back to 0 after ``reset_after`` healthy steps;
- :func:`bound_close` makes closing a session wait at most a deadline (closing a session whose
  ps or master is gone blocks until it answers), then reports;
- :func:`peer_watch_hook` is the ``MonitoredTrainingSession`` hook that arms a watch when the
  session exists, stops it after the last step, bounds the session's close and resets the
  restart count.

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
from replicate.runtime.watch import PeerWatch, incarnations, watched_tasks

__all__ = ["incarnations", "PeerWatch", "watched_tasks", "peer_watch_hook", "recover",
           "restart_process", "restarts", "reset_restarts", "bound_close", "error_reason",
           "RESTARTS_ENV", "EXIT_CODE"]

log = logging.getLogger(__name__)

#: Environment variable counting the self-restarts of a worker process.
RESTARTS_ENV = "REPLICATE_BETWEEN_RESTARTS"
#: Exit status of :func:`recover` when it does not (or may no longer) restart the process.
EXIT_CODE = 75


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


def restarts() -> int:
    """How many times this process restarted itself since the count was last reset."""
    try:
        return int(os.environ.get(RESTARTS_ENV, "0"))
    except ValueError:
        return 0


def reset_restarts(reason: str = "") -> None:
    """Set the restart count back to 0 (inherited by the next :func:`restart_process`)."""
    if restarts():
        log.info("between-graph: restart count reset to 0%s", f" ({reason})" if reason else "")
        print(f"between-graph: restart count reset to 0{f' ({reason})' if reason else ''}",
              file=sys.stderr, flush=True)
    os.environ[RESTARTS_ENV] = "0"


def recover(reason: str, restart: bool = True, limit: int = 10) -> None:
    """What a worker does when a watched task is lost or a step fails: :func:`restart_process`
    (with ``restart``), else, or once ``limit`` restarts are spent, print ``reason`` and exit the
    process at once with :data:`EXIT_CODE` (from any thread; a supervisor's cue)."""
    if restart:
        try:
            restart_process(reason, limit=limit)        # does not return
        except ReplicateError as exc:
            reason = str(exc)
    print(f"{reason}; exiting with status {EXIT_CODE} (restart the lost task, then every "
          "worker, to resume)", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(EXIT_CODE)


def bound_close(session, seconds: float, on_failure: Callable[[str], None] = recover) -> None:
    """Make ``session.close()`` wait at most ``seconds``: the close runs in a daemon thread, and
    if it has not returned by then ``on_failure`` is called with a message saying so (from the
    closing thread; :func:`recover` restarts or exits the process).

    TensorFlow's close blocks until every task of the session answers: with a lost ps or master
    it would wait for as long as the task stays away.
    """
    close = session.close

    def bounded() -> None:
        # Only the first close is bounded: a closed session's close returns at once, and the
        # one from ``__del__`` may run while the interpreter shuts down (no new threads then).
        session.__dict__.pop("close", None)
        if getattr(session, "_closed", False) or sys.is_finalizing():
            close()
            return
        done = threading.Event()
        errors: list[BaseException] = []

        def run() -> None:
            try:
                close()
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                errors.append(exc)
            finally:
                done.set()

        threading.Thread(target=run, name="replicate-bounded-close", daemon=True).start()
        if not done.wait(seconds):
            on_failure(f"between-graph: closing the session did not finish within {seconds:g} s "
                       "(a task it uses is gone or hangs)")
            return
        if errors:
            raise errors[0]

    session.close = bounded


def peer_watch_hook(cluster, task_index: int, on_failure: Callable[[str], None] = recover,
                    interval: float = 0.2, grace: float = 1.0, misses: int = 3,
                    close_timeout: float | None = 30.0, reset_after: int | None = 100,
                    create_timeout: float | None = 600.0, job: str = "worker"):
    """A ``SessionRunHook`` that keeps a between-graph worker from waiting silently.

    - From the moment the session exists until a run requests stop (the last step), it watches
      the tasks :func:`~replicate.runtime.watch.watched_tasks` gives this worker (the chief: every
      worker and ps; the others: the chief and every ps), every ``interval`` seconds; a task that
      does not answer ``misses`` polls in a row or restarted is reported through ``on_failure``.
      A worker that exits right after the last, collective, step is not a failure: each report
      waits ``grace`` seconds and is dropped if this worker's last step has finished by then.
    - Creating the session (``begin`` to ``after_create_session``: on a worker other than the
      chief, ``MonitoredTrainingSession`` waits up to 2 hours for the chief to initialize or
      restore, logging at INFO level only) takes at most ``create_timeout`` seconds, else
      ``on_failure`` is called.
    - The session's close waits at most ``close_timeout`` seconds (:func:`bound_close`).
    - After ``reset_after`` steps in a row without a failure, the restart count goes back to 0
      (:func:`reset_restarts`), so ``limit`` counts restarts close together, not over the job's
      whole life.
    """
    import tensorflow as tf

    class _PeerWatchHook(tf.compat.v1.train.SessionRunHook):
        def __init__(self):
            self.finished = False
            self.steps = 0
            self.created = threading.Event()
            self.watch = PeerWatch(cluster, task_index, self._lost, interval=interval, job=job,
                                   misses=misses)

        def _lost(self, message: str) -> None:
            time.sleep(grace)
            if not self.finished:
                on_failure(message)

        def begin(self) -> None:
            if create_timeout is not None:
                threading.Thread(target=self._creation_deadline, daemon=True,
                                 name="replicate-create-deadline").start()

        def _creation_deadline(self) -> None:
            if not self.created.wait(create_timeout):
                on_failure(f"between-graph: {job}:{task_index}: the session was not created "
                           f"within {create_timeout:g} s (a worker waits for the chief to "
                           "initialize or restore; is the chief's client running?)")

        def after_create_session(self, session, coord) -> None:
            self.created.set()
            if close_timeout is not None:
                bound_close(session, close_timeout, on_failure)
            self.watch.arm()

        def after_run(self, run_context, run_values) -> None:
            self.steps += 1
            if reset_after is not None and self.steps == reset_after:
                reset_restarts(f"{reset_after} steps without a failure")
            if run_context.stop_requested:
                self.finished = True
                self.watch.stop()

        def end(self, session) -> None:
            self.watch.stop()

    return _PeerWatchHook()
