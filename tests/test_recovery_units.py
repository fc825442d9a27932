"""The pieces of between-graph recovery, in one process: who watches whom (linear in the number
of workers), the watch against a real gRPC server that stops or restarts, the bounded close,
the restart count's reset, and replay by global step (StepFeeder)."""

from __future__ import annotations

import os
import re
import socket
import time
from concurrent import futures

import grpc
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import device_attributes_pb2

from replicate.errors import ReplicateError
from replicate.runtime.recovery import (
    RESTARTS_ENV,
    bound_close,
    peer_watch_hook,
    reset_restarts,
    restarts,
)
from replicate.runtime.step_feeder import StepFeeder
from replicate.runtime.watch import PeerWatch, incarnations, polls_per_interval, watched_tasks

v1 = tf.compat.v1


def _cluster(workers: int, ps: int = 0, chief: bool = False) -> dict:
    ports = iter(range(20000, 20000 + workers + ps + 1))
    out = {"worker": [f"127.0.0.1:{next(ports)}" for _ in range(workers)]}
    if ps:
        out["ps"] = [f"127.0.0.1:{next(ports)}" for _ in range(ps)]
    if chief:
        out["chief"] = [f"127.0.0.1:{next(ports)}"]
    return out


@pytest.mark.parametrize("workers,ps", [(2, 0), (8, 1), (16, 2), (256, 1)])
def test_each_task_watches_a_fixed_set_so_polls_grow_linearly(workers, ps):
    cluster = _cluster(workers, ps)
    pss = [("ps", t) for t in range(ps)]
    assert watched_tasks(cluster, "worker", 0) == [("worker", t) for t in range(1, workers)] + pss
    for t in range(1, workers):
        assert watched_tasks(cluster, "worker", t) == [("worker", 0)] + pss
    counts = polls_per_interval(cluster)
    assert sum(counts.values()) == (workers - 1) * (2 + ps) + ps
    assert max(n for (_, t), n in counts.items() if t) == 1 + ps        # not growing with W
    # Every task that can be lost is watched by someone, and the chief by everyone.
    watched = {key for j, t in counts for key in watched_tasks(cluster, j, t)}
    assert watched == {("worker", t) for t in range(workers)} | set(pss)


def test_a_chief_job_is_the_hub():
    cluster = _cluster(2, 1, chief=True)
    assert watched_tasks(cluster, "chief", 0) == [("worker", 0), ("worker", 1), ("ps", 0)]
    assert watched_tasks(cluster, "worker", 1) == [("chief", 0), ("ps", 0)]


class _StatusServer:
    """A real gRPC server answering WorkerService/GetStatus as a TensorFlow task does."""

    def __init__(self, port: int, incarnation: int):
        reply = device_attributes_pb2.DeviceAttributes(
            name="/job:ps/replica:0/task:0/device:CPU:0", device_type="CPU",
            incarnation=incarnation).SerializeToString()
        body = b"\x0a" + bytes([len(reply)]) + reply
        handler = grpc.method_handlers_generic_handler("tensorflow.WorkerService", {
            "GetStatus": grpc.unary_unary_rpc_method_handler(
                lambda request, context: body, request_deserializer=None,
                response_serializer=None)})
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2),
                                  handlers=[handler])
        assert self.server.add_insecure_port(f"127.0.0.1:{port}") == port
        self.server.start()

    def stop(self) -> None:
        self.server.stop(None).wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_watch_names_a_lost_or_restarted_ps_within_its_bound():
    port = _free_port()
    cluster = {"worker": ["127.0.0.1:1", "127.0.0.1:2"], "ps": [f"127.0.0.1:{port}"]}
    server = _StatusServer(port, incarnation=7)
    reports: list[tuple[float, str]] = []
    watch = PeerWatch(cluster, 1, lambda m: reports.append((time.monotonic(), m)),
                      interval=0.05, peers=[("ps", 0)])
    try:
        watch.arm()
        assert watch.baseline[("ps", 0)] == {"/job:ps/replica:0/task:0/device:CPU:0": 7}
        # a few polls of a healthy ps report nothing (waited for by count, not by time: a
        # loaded machine ran 3 polls in 0.3 s, and the test failed once in CI)
        deadline = time.monotonic() + 5
        while watch.polls < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not reports and watch.polls >= 4
        server.stop()
        lost = time.monotonic()
        deadline = lost + 5
        while not reports and time.monotonic() < deadline:
            time.sleep(0.01)
        assert reports, "a stopped ps was never reported"
        at, message = reports[0]
        assert re.match(rf"between-graph: ps:0 \(127\.0\.0\.1:{port}\) stopped answering", message)
        assert "the variables it held are gone" in message
        assert at - lost < 3 * 0.05 + 0.5, at - lost       # misses x interval, plus slack
        # Restarted on its port with new incarnations: reported as such.
        server = _StatusServer(port, incarnation=8)
        again = PeerWatch(cluster, 1, reports.append, interval=0.05, peers=[("ps", 0)])
        again.baseline[("ps", 0)] = watch.baseline[("ps", 0)]
        deadline = time.monotonic() + 10                 # gRPC's reconnect backoff
        while incarnations(f"127.0.0.1:{port}", timeout=0.5) is None:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        found = again.check()
        assert found and re.match(rf"between-graph: ps:0 \(127\.0\.0\.1:{port}\) restarted", found)
    finally:
        watch.stop()
        server.stop()


class _SlowSession:
    def __init__(self, seconds: float, error: Exception | None = None):
        self.seconds, self.error, self.closed = seconds, error, 0
        self._closed = False

    def close(self) -> None:
        time.sleep(self.seconds)
        self.closed += 1
        self._closed = True
        if self.error:
            raise self.error


def test_a_close_that_blocks_is_reported_after_its_deadline():
    reports = []
    blocked = _SlowSession(5.0)
    bound_close(blocked, 0.3, reports.append)
    start = time.monotonic()
    blocked.close()
    took = time.monotonic() - start
    assert 0.25 < took < 1.5, took
    assert reports and "closing the session did not finish within 0.3 s" in reports[0]

    quick = _SlowSession(0.0)
    bound_close(quick, 2.0, reports.append)
    quick.close()
    quick.close()                   # the second close is the plain one again
    assert quick.closed == 2 and len(reports) == 1

    failing = _SlowSession(0.0, error=ValueError("boom"))
    bound_close(failing, 2.0, reports.append)
    with pytest.raises(ValueError, match="boom"):
        failing.close()
    assert len(reports) == 1


def _counter_model():
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None], name="x")
        w = v1.get_variable("w", [], initializer=v1.zeros_initializer())
        loss = tf.reduce_mean(tf.square(w - x), name="loss")
        step = v1.train.get_or_create_global_step()
        train = v1.train.GradientDescentOptimizer(0.1).minimize(loss, global_step=step,
                                                                name="train")
    return graph, train, w


def test_the_restart_count_resets_after_healthy_steps(monkeypatch):
    monkeypatch.setenv(RESTARTS_ENV, "4")
    graph, train, _ = _counter_model()
    seen = []
    with graph.as_default():
        hook = peer_watch_hook({"worker": ["127.0.0.1:1"]}, 0, seen.append, reset_after=3)
        feeder = StepFeeder(lambda step: {"x:0": np.ones(2, np.float32)}, last_step=5,
                            on_step=lambda step: seen.append((step, restarts())))
        with v1.train.MonitoredTrainingSession(hooks=[hook, feeder], save_summaries_steps=None,
                                               save_summaries_secs=None,
                                               log_step_count_steps=None) as sess:
            while not sess.should_stop():
                sess.run(train)
    assert hook.watch.peers == {}                    # a lone worker watches nobody
    # StepFeeder runs after the watch hook: its step 3 already sees the reset count.
    assert seen == [(1, 4), (2, 4), (3, 0), (4, 0), (5, 0)], seen
    assert os.environ[RESTARTS_ENV] == "0"
    reset_restarts()
    assert restarts() == 0


def test_step_feeder_replays_the_batches_of_the_global_step(tmp_path):
    """Train 6 steps with a checkpoint every 2; lose the process after step 5; a new session
    resumes at step 4 and feeds batches 4 and 5 again, ending where an uninterrupted run does.
    A feeder counting its own steps would end elsewhere."""
    batches = [np.full(2, float(k), np.float32) for k in range(6)]

    class Crash(Exception):
        """The process dies: no final checkpoint, no hooks' end."""

    def train(ckpt, feeder, crash_after=None):
        graph, train_op, _ = _counter_model()
        with graph.as_default():
            feeder = feeder()
            try:
                with v1.train.MonitoredTrainingSession(
                        checkpoint_dir=ckpt, save_checkpoint_steps=2, save_checkpoint_secs=None,
                        save_summaries_steps=None, save_summaries_secs=None,
                        log_step_count_steps=None, hooks=[feeder]) as sess:
                    while not sess.should_stop():
                        sess.run(train_op)
                        if crash_after is not None and feeder.step == crash_after:
                            raise Crash
            except Crash:
                pass
        return feeder, None

    def by_step():
        return StepFeeder(lambda step: {"x:0": batches[step]}, last_step=6)

    clean, _ = train(str(tmp_path / "clean"), by_step)
    expected = tf.train.load_checkpoint(str(tmp_path / "clean")).get_tensor("w")
    assert clean.starts == [0] and clean.step == 6

    ckpt = str(tmp_path / "crash")
    train(ckpt, by_step, crash_after=5)
    assert tf.train.get_checkpoint_state(ckpt).model_checkpoint_path.endswith("-4")
    resumed, _ = train(ckpt, by_step)
    assert resumed.starts == [4] and resumed.step == 6
    got = tf.train.load_checkpoint(ckpt).get_tensor("w")
    assert got == expected

    # Counting loop iterations instead (the batch of iteration k): the resumed run differs.
    class Counting(StepFeeder):
        def after_create_session(self, session, coord):
            super().after_create_session(session, coord)
            self.iteration = 0

        def before_run(self, run_context):
            self.iteration += 1
            return v1.train.SessionRunArgs(None, feed_dict={"x:0": batches[self.iteration - 1]})

    naive = str(tmp_path / "naive")
    train(naive, lambda: Counting(None, last_step=6), crash_after=5)
    train(naive, lambda: Counting(None, last_step=6))
    assert tf.train.load_checkpoint(naive).get_tensor("w") != expected

    # A session created at or after the last step runs nothing.
    done, _ = train(ckpt, by_step)
    assert done.starts == [6] and done.step == 6


def test_step_feeder_needs_a_global_step():
    graph = tf.Graph()
    with graph.as_default():
        v1.placeholder(tf.float32, [None], name="x")
        with pytest.raises(ReplicateError, match="global step"):
            StepFeeder(lambda step: {}).begin()
