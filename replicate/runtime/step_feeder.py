"""Feed each training step the batch of its global step, so a recovered run replays its data.

A job that restarts from a checkpoint resumes at the checkpoint's global step. If the driver
chose batches by counting its own loop iterations, the resumed run would feed the batches that
follow the ones it had already fed (the lost steps' batches are skipped) and end somewhere
else than an uninterrupted run. :class:`StepFeeder` reads the global step whenever a session is
created (the first start and every recovery, including a re-executed process) and feeds
``batch(step)``: the resumed run sees the same batches at the same steps, and ends exactly where
an uninterrupted run would::

    feeder = StepFeeder(lambda step: {"x:0": images[step], "y:0": labels[step]}, last_step=100)
    with tf.compat.v1.train.MonitoredTrainingSession(..., hooks=[feeder]) as sess:
        while not sess.should_stop():
            sess.run("train")

In a between-graph job each worker passes its own ``batch`` (its local data for that step).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from replicate.errors import ReplicateError

__all__ = ["StepFeeder"]

log = logging.getLogger(__name__)


def _hook_base():
    import tensorflow as tf

    return tf.compat.v1.train.SessionRunHook


class StepFeeder(_hook_base()):
    """A ``SessionRunHook`` feeding ``batch(step)`` to every run, ``step`` being the global step.

    The global step is read from the session in ``after_create_session`` and counted up after
    every run (every run is a train step that increments it once).

    Args:
        batch: global step -> feed dict for that step's run.
        last_step: stop after the run of this step count (``step == last_step``); a session
            created at or beyond it stops before running anything. None: never stop.
        on_step: called with the new step count after every run.

    Attributes:
        step: the global step the next run trains.
        starts: the global step each session began at (one entry per session created).
    """

    def __init__(self, batch: Callable[[int], dict], last_step: int | None = None,
                 on_step: Callable[[int], None] | None = None):
        self.batch = batch
        self.last_step = last_step
        self.on_step = on_step
        self.step = 0
        self.starts: list[int] = []
        self._global_step = None

    def begin(self) -> None:
        import tensorflow as tf

        self._global_step = tf.compat.v1.train.get_global_step()
        if self._global_step is None:
            raise ReplicateError("StepFeeder needs a global step in the graph "
                                 "(tf.compat.v1.train.get_or_create_global_step, passed to "
                                 "minimize or apply_gradients)")

    def after_create_session(self, session, coord) -> None:
        self.step = int(session.run(self._global_step))
        self.starts.append(self.step)
        log.info("session created at global step %d", self.step)
        if self.last_step is not None and self.step >= self.last_step:
            coord.request_stop()

    def before_run(self, run_context):
        import tensorflow as tf

        return tf.compat.v1.train.SessionRunArgs(None, feed_dict=self.batch(self.step))

    def after_run(self, run_context, run_values) -> None:
        self.step += 1
        if self.on_step is not None:
            self.on_step(self.step)
        if self.last_step is not None and self.step >= self.last_step:
            run_context.request_stop()
