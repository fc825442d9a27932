"""Fault drills of between-graph training with a parameter server: losing the ps, or a worker
the chief must notice for the others, ends in exact recovery or a clear exit within the bound
docs/distributed.md gives, never in a silent hang.

Each drill runs real processes on loopback (examples/between_graph/worker.py and
``python -m replicate.runtime.cluster_server``): an embedding table on ``ps:0`` (sparse Momentum) and a
dense layer on every worker.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import signal
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

import replicate
import replicate.demo
from replicate.runtime.recovery import EXIT_CODE

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(os.path.dirname(HERE), "examples", "between_graph")
#: Seconds from a task's death to a survivor's report, per hop (docs/distributed.md: interval
#: 0.2 s x 3 misses + 1 s grace + one poll), and the chief's hop on top for a non-chief worker.
HOP_BOUND = 2.0


def _launch():
    if EXAMPLE not in sys.path:
        sys.path.insert(0, EXAMPLE)
    return importlib.import_module("launch")


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """A cluster of 1 ps + 2 workers on free loopback ports and the embedding template."""
    launch = _launch()
    work = tmp_path_factory.mktemp("ps_drill")
    ports = launch.free_ports(3)
    jobs = {"ps": [f"127.0.0.1:{ports[0]}"], "worker": [f"127.0.0.1:{p}" for p in ports[1:]]}
    spec = work / "cluster.json"
    spec.write_text(json.dumps(jobs))
    graph = launch.embedding_model()
    res = replicate.transform(graph, "worker", between_graph=True, cluster=str(spec))
    table = [n for n in res.meta_graph_def.graph_def.node if n.name == "embedding"]
    assert table and table[0].device.startswith("/job:ps"), table     # the ps holds the table
    template = work / "template.meta"
    template.write_bytes(res.meta_graph_def.SerializeToString())
    return launch, work, str(spec), str(template), graph


def _ps(procs, spec, name):
    return procs.start(name, [sys.executable, "-m", "replicate.runtime.cluster_server", "--cluster", spec,
                              "--job", "ps", "--task", "0", "--parent", str(os.getpid())])


def _ready(procs, work, name, timeout=60.0):
    """Wait until the ps named ``name`` prints its ready line."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if "ready ps:0" in (work / f"{name}.log").read_text(errors="replace"):
            return
        assert procs.procs[name].poll() is None, procs.tail(name)
        time.sleep(0.1)
    raise AssertionError(f"{name} not ready: {procs.tail(name)}")


def _worker(procs, spec, template, task, out, ckpt, *extra, steps=8, name=None):
    return procs.start(name or f"worker-{task}", [
        sys.executable, os.path.join(EXAMPLE, "worker.py"), "--cluster", spec, "--task",
        str(task), "--template", template, "--kind", "embedding", "--steps", str(steps),
        "--batch", "8,4", "--out", out, "--checkpoint-dir", ckpt, "--save-steps", "3",
        "--wait", "40", *extra])


def _text(path) -> str:
    return path.read_text(errors="replace")


def _final(path):
    return {k.replace("|", "/"): v for k, v in np.load(path).items()}


def _wait_for(path, what, procs, names, timeout=90.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if what():
            return
        for name in names:
            assert procs.procs[name].poll() is None, f"{name} ended early:\n{procs.tail(name)}"
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {path}")


@pytest.mark.timeout(300)
def test_a_killed_ps_restarted_on_its_port_recovers_exactly(job):
    """SIGKILL the ps in the middle of training (after the step-3 checkpoint, steps 0.2 s
    apart). Both workers report ``ps:0`` by name within one hop's bound. The chief (restart
    mode) re-executes itself and announces that it waits for the ps; worker 1 (exit mode)
    exits 75 with the report, as a supervisor would see it. The ps is started again on its
    port, then worker 1: the chief restores the step-3 checkpoint (its ps shard included) and
    both workers end equal to each other and to one device trained from the chief's step-0
    values on their batches concatenated (the lost steps' batches replayed once)."""
    launch, work, spec, template, graph = job
    procs = launch.Processes(str(work))
    try:
        ckpt = work / "ckpt"
        _ps(procs, spec, "ps")
        _ready(procs, work, "ps")
        _worker(procs, spec, template, 0, str(work / "final_0.npz"), str(ckpt),
                "--step-delay", "0.2", name="w0")
        _worker(procs, spec, template, 1, str(work / "final_1.npz"), str(ckpt),
                "--step-delay", "0.2", "--on-peer-failure", "exit", name="w1")
        _wait_for(ckpt, lambda: (ckpt / "checkpoint").exists()
                  and "model.ckpt-3" in (ckpt / "checkpoint").read_text(), procs, ["w0", "w1"])
        time.sleep(0.3)                                       # into step 4 or 5
        procs.procs["ps"].send_signal(signal.SIGKILL)
        procs.procs["ps"].wait()
        killed = time.monotonic()
        seen = {}
        while len(seen) < 2 and time.monotonic() - killed < 20:
            for t in range(2):
                if t not in seen and re.search(r"ps:0 \(127\.0\.0\.1:\d+\) stopped answering",
                                               (work / f"w{t}.log").read_text(errors="replace")):
                    seen[t] = time.monotonic() - killed
            time.sleep(0.02)
        assert len(seen) == 2, procs.tail("w0") + procs.tail("w1")
        print("seconds from the kill to each worker's report (then re-exec):", seen)
        assert max(seen.values()) < HOP_BOUND, seen
        exited = _exits(procs, ["w1"], killed)
        print("worker 1 (exit mode):", exited)
        assert exited["w1"][0] == EXIT_CODE and exited["w1"][1] < HOP_BOUND + 0.5, exited
        assert f"exiting with status {EXIT_CODE}" in procs.tail("w1"), procs.tail("w1")
        _wait_for(work, lambda: "waiting up to 40 s for ps:0" in
                  (work / "w0.log").read_text(errors="replace"), procs, ["w0"], timeout=60)
        _ps(procs, spec, "ps-again")
        _worker(procs, spec, template, 1, str(work / "final_1.npz"), str(ckpt), name="w1-again")
        for name in ("w0", "w1-again"):
            assert procs.procs[name].wait(timeout=120) == 0, procs.tail(name)
        logs = [(work / f"{name}.log").read_text(errors="replace") for name in ("w0", "w1-again")]
    finally:
        procs.stop()
    assert "restarting this worker process (restart 1 " in logs[0], logs[0]
    assert "restart 2 " not in logs[0], logs[0]
    for t, log in enumerate(logs):
        assert f"worker {t}: session at global step 3" in log, log
    finals = [_final(work / f"final_{t}.npz") for t in range(2)]
    assert int(finals[0]["global_step"]) == 8
    for name in finals[0]:
        np.testing.assert_array_equal(finals[1][name], finals[0][name], err_msg=name)
    from replicate.runtime.driver import largest_difference

    expected = _single_device(graph, str(ckpt), 8, "embedding", [8, 4])
    diff, worst = largest_difference(finals[0], expected)
    print(f"max rel diff vs one device: {diff:.3g} ({worst})")
    assert diff <= 1e-5, f"{worst} differs from one device by {diff:.3g}"
    start = tf.train.load_checkpoint(str(ckpt / "model.ckpt-0")).get_tensor("embedding")
    assert not np.array_equal(finals[0]["embedding"], start), "the table on the ps never trained"


def _exits(procs, names, since, timeout=60.0) -> dict[str, tuple[int, float]]:
    """Exit code and seconds after ``since`` of each process named."""
    out = {}
    deadline = time.monotonic() + timeout
    while len(out) < len(names) and time.monotonic() < deadline:
        for name in names:
            code = procs.procs[name].poll()
            if name not in out and code is not None:
                out[name] = (code, time.monotonic() - since)
        time.sleep(0.02)
    assert len(out) == len(names), {n: procs.tail(n) for n in names if n not in out}
    return out


def _single_device(graph, ckpt, steps, kind, sizes):
    """One device from the chief's step-0 checkpoint on the workers' batches concatenated."""
    worker = importlib.import_module("worker")
    reader = tf.train.load_checkpoint(os.path.join(ckpt, "model.ckpt-0"))
    with graph.as_default():
        variables = tf.compat.v1.global_variables()
        config = tf.compat.v1.ConfigProto(intra_op_parallelism_threads=1,
                                          inter_op_parallelism_threads=1)
        with tf.compat.v1.Session(config=config) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for v in variables:
                v.load(reader.get_tensor(v.op.name), sess)
            for step in range(steps):
                parts = [worker.local_batch(kind, t, step, size) for t, size in enumerate(sizes)]
                sess.run("train", {k: np.concatenate([p[k] for p in parts]) for k in parts[0]})
            return {v.op.name: x for v, x in zip(variables, sess.run(variables))}


@pytest.mark.timeout(300)
def test_a_lost_worker_reaches_the_other_workers_through_the_chief(tmp_path):
    """3 workers, no ps: only the chief watches worker 2. Worker 2 dies after step 4 of 8
    (checkpoints every 3). The chief reports ``worker:2`` and re-executes itself within one
    hop's bound; worker 1, which watches only the chief, follows within two, here with
    ``--on-peer-failure exit`` (status 75, naming ``worker:0``), as a supervisor would see it.
    Workers 1 and 2 are started again: all three resume at step 3 and end equal to each other
    and to one device trained on the concatenated batches."""
    launch = _launch()
    jobs = {"worker": [f"127.0.0.1:{p}" for p in launch.free_ports(3)]}
    spec = tmp_path / "cluster.json"
    spec.write_text(json.dumps(jobs))
    model = replicate.demo.build_cnn((4, 8, 32))
    res = replicate.transform(model.graph, "worker", between_graph=True, cluster=str(spec))
    template = tmp_path / "template.meta"
    template.write_bytes(res.meta_graph_def.SerializeToString())
    ckpt = str(tmp_path / "ckpt")

    def worker(t, name, *extra):
        return procs.start(name, [
            sys.executable, os.path.join(EXAMPLE, "worker.py"), "--cluster", str(spec), "--task",
            str(t), "--template", str(template), "--steps", "8", "--batch", "4", "--out",
            str(tmp_path / f"final_{t}.npz"), "--checkpoint-dir", ckpt, "--save-steps", "3",
            "--step-delay", "0.1", *extra])

    procs = launch.Processes(str(tmp_path))
    try:
        worker(0, "w0")
        worker(1, "w1", "--on-peer-failure", "exit")
        worker(2, "w2", "--die-after", "4")
        assert procs.procs["w2"].wait(timeout=150) == 9, procs.tail("w2")
        died = time.monotonic()
        chief_seen = None
        while chief_seen is None and time.monotonic() - died < 10:
            if "restarting this worker process" in _text(tmp_path / "w0.log"):
                chief_seen = time.monotonic() - died
            time.sleep(0.02)
        exits = _exits(procs, ["w1"], died)
        print("chief restarted after", chief_seen, "s; worker 1 exited:", exits)
        code, seconds = exits["w1"]
        tail1 = procs.tail("w1")
        assert code == EXIT_CODE and seconds < 2 * HOP_BOUND + 0.5, (exits, tail1)
        assert re.search(r"worker:0 \(127\.0\.0\.1:\d+\) (stopped answering|restarted)",
                         tail1), tail1
        assert chief_seen is not None and chief_seen < HOP_BOUND + 0.5, chief_seen
        worker(1, "w1-again")
        worker(2, "w2-again")
        for name in ("w0", "w1-again", "w2-again"):
            assert procs.procs[name].wait(timeout=150) == 0, procs.tail(name)
        logs = {name: (tmp_path / f"{name}.log").read_text(errors="replace")
                for name in ("w0", "w1-again", "w2-again")}
    finally:
        procs.stop()
    assert re.search(r"worker:2 \(127\.0\.0\.1:\d+\) stopped answering", logs["w0"]), logs["w0"]
    assert "restart 1 " in logs["w0"] and "restart 2 " not in logs["w0"], logs["w0"]
    for t, name in enumerate(("w0", "w1-again", "w2-again")):
        assert f"worker {t}: session at global step 3" in logs[name], logs[name]
    finals = [_final(tmp_path / f"final_{t}.npz") for t in range(3)]
    assert int(finals[0]["global_step"]) == 8
    for t in (1, 2):
        for name in finals[0]:
            np.testing.assert_array_equal(finals[t][name], finals[0][name], err_msg=name)
    from replicate.runtime.driver import largest_difference

    expected = _single_device(model.graph, ckpt, 8, "cnn", [4, 4, 4])
    diff, worst = largest_difference(finals[0], expected)
    assert diff <= 1e-5, f"{worst} differs from one device by {diff:.3g}"


@pytest.mark.timeout(200)
def test_a_worker_whose_chief_never_trains_fails_within_the_create_timeout(tmp_path):
    """The chief's server is up (so wait_for_cluster passes) but its client never starts:
    MonitoredTrainingSession on worker 1 would wait up to 2 hours for the chief to initialize,
    logging at INFO level only; the hook's create_timeout ends it with a clear line instead."""
    launch = _launch()
    jobs = {"worker": [f"127.0.0.1:{p}" for p in launch.free_ports(2)]}
    spec = tmp_path / "cluster.json"
    spec.write_text(json.dumps(jobs))
    res = replicate.transform(replicate.demo.build_cnn((4, 8, 32)).graph, "worker",
                              between_graph=True, cluster=str(spec))
    template = tmp_path / "template.meta"
    template.write_bytes(res.meta_graph_def.SerializeToString())
    procs = launch.Processes(str(tmp_path))
    try:
        procs.start("chief-server", [sys.executable, "-m", "replicate.runtime.cluster_server", "--cluster",
                                     str(spec), "--job", "worker", "--task", "0", "--parent",
                                     str(os.getpid())])
        w1 = procs.start("w1", [
            sys.executable, os.path.join(EXAMPLE, "worker.py"), "--cluster", str(spec), "--task",
            "1", "--template", str(template), "--steps", "2", "--batch", "4", "--out",
            str(tmp_path / "w1.npz"), "--on-peer-failure", "exit", "--create-timeout", "3"])
        code = w1.wait(timeout=120)
    finally:
        procs.stop()
    tail = procs.tail("w1")
    assert code == EXIT_CODE, tail
    assert "worker:1: the session was not created within 3 s" in tail, tail
