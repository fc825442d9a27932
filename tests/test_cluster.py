"""Clusters: reading cluster specs, resolving job/task devices, loopback servers, training
over 1 ps + 2 workers in-graph, and recovery from a killed worker.

The server tests start their own ``tf.distribute.Server`` processes on free 127.0.0.1 ports
(loopback only: the tests check the listening sockets) and stop them; each is bounded by
pytest-timeout. A session to a master must be closed before its servers stop (closing it
afterwards blocks), so every session here is a context manager inside the cluster's life.
"""

import argparse
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import models
import numpy as np
import pytest
import tensorflow as tf

import replicate
from replicate import cli
from replicate.cli.commands._cluster_args import (
    add_cluster_arguments,
    cluster_value,
    default_devices,
    resolve_devices,
)
from replicate.errors import DeviceError, InputError, ReplicateError
from replicate.runtime.cluster import expand, load, resolve
from replicate.runtime.cluster_server import (
    LocalCluster,
    _decode,
    _loopback_only,
    is_loopback_host,
    listening_addresses,
    shim_path,
)

v1 = tf.compat.v1
RTOL = 1e-5
SPEC = {"ps": ["127.0.0.1:2222"], "worker": ["127.0.0.1:2223", "127.0.0.1:2224"]}
TWO_PS = {"ps": ["127.0.0.1:2220", "127.0.0.1:2221"],
          "worker": ["127.0.0.1:2223", "127.0.0.1:2224"]}
SERVER_TIMEOUT = 200.0


def example():
    """examples/distributed/train.py as a module."""
    path = os.path.join(os.path.dirname(__file__), "..", "examples", "distributed", "train.py")
    spec = importlib.util.spec_from_file_location("distributed_train", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------ reading clusters
def test_load_every_form_gives_the_same_cluster(tmp_path, monkeypatch):
    plain = tmp_path / "cluster.json"
    plain.write_text(json.dumps(SPEC))
    styled = tmp_path / "tf_config.json"
    styled.write_text(json.dumps({"cluster": SPEC, "task": {"type": "worker", "index": 0}}))
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": SPEC}))
    forms = [SPEC, tf.train.ClusterSpec(SPEC), str(plain), plain, str(styled), "TF_CONFIG",
             json.dumps(SPEC)]
    loaded = [load(f) for f in forms]
    assert all(c == loaded[0] for c in loaded)
    assert loaded[0].jobs == {"ps": {0: "127.0.0.1:2222"},
                              "worker": {0: "127.0.0.1:2223", 1: "127.0.0.1:2224"}}
    assert load(loaded[0].to_json()) == loaded[0]
    assert loaded[0].cluster_spec().as_dict() == SPEC
    assert loaded[0].master() == "grpc://127.0.0.1:2223"


def test_sparse_tasks_round_trip():
    cluster = load({"worker": {"0": "127.0.0.1:1", "3": "127.0.0.1:2"}})
    assert cluster.tasks("worker") == [0, 3]
    assert load(cluster.to_json()) == cluster
    assert cluster.as_dict() == {"worker": {0: "127.0.0.1:1", 3: "127.0.0.1:2"}}


@pytest.mark.parametrize("raw,words", [
    ({}, "map job names"),
    ({"ps": []}, "has no tasks"),
    ({"ps": ["nohost"]}, "'host:port'"),
    ({"ps": ["h:99999999"]}, "'host:port'"),
    ({"bad-job": ["h:1"]}, "not a TensorFlow job name"),
    ({"ps": ["h:1"], "worker": ["h:1"]}, "given to both ps:0 and worker:0"),
    ({"ps": 3}, "list of 'host:port'"),
])
def test_bad_clusters_are_refused(raw, words):
    with pytest.raises(InputError, match=words):
        load(raw)


def test_unreadable_sources_name_themselves(tmp_path, monkeypatch):
    with pytest.raises(InputError, match="nope.json: cannot read"):
        load(str(tmp_path / "nope.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(InputError, match="bad.json: not valid JSON"):
        load(str(bad))
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(InputError, match="TF_CONFIG: the environment variable is not set"):
        load("TF_CONFIG")
    with pytest.raises(InputError, match="expected a dict"):
        load(42)


def test_master_task_prefers_chief_then_worker():
    assert load({"chief": ["h:1"], "worker": ["h:2"]}).master_task() == ("chief", 0)
    assert load({"worker": {"2": "h:2", "1": "h:1"}}).master_task() == ("worker", 1)
    assert load({"trainer": ["h:1"]}).master_task() == ("trainer", 0)
    with pytest.raises(DeviceError, match="no chief, master or worker job"):
        load({"ps": ["h:1"], "eval": ["h:2"]}).master_task()


# ------------------------------------------------------------------ resolving devices
def test_job_shorthand_resolves_to_every_task():
    devices, controller, params = resolve(SPEC, "worker", "ps")
    assert devices == ["/job:worker/task:0", "/job:worker/task:1"]
    assert controller == "/job:ps/task:0/device:CPU:0"
    assert params is None


def test_several_ps_tasks_spread_the_variables():
    devices, controller, params = resolve(TWO_PS, ["worker"], "ps")
    assert controller == "/job:ps/task:0/device:CPU:0"
    assert params == ["/job:ps/task:0/device:CPU:0", "/job:ps/task:1/device:CPU:0"]
    _, _, given = resolve(TWO_PS, "worker", "ps", param_devices=["/job:ps/task:1"])
    assert given == ["/job:ps/task:1/device:CPU:0"]


@pytest.mark.parametrize("item,expected", [
    ("/job:worker/device:GPU:0",
     ["/job:worker/task:0/device:GPU:0", "/job:worker/task:1/device:GPU:0"]),
    ("/job:worker/task:*/gpu:1",
     ["/job:worker/task:0/device:GPU:1", "/job:worker/task:1/device:GPU:1"]),
    ("/job:worker/task:1/device:GPU:0", ["/job:worker/task:1/device:GPU:0"]),
    ("/gpu:0", ["/job:worker/task:0/device:GPU:0"]),
    ("/job:worker/replica:0/task:1/cpu:2", ["/job:worker/replica:0/task:1/device:CPU:2"]),
])
def test_device_forms(item, expected):
    assert expand(load(SPEC), item) == expected


def test_device_without_job_is_on_the_master_and_order_is_kept():
    devices, controller, _ = resolve(SPEC, "/job:worker/task:1,/job:worker/task:0", "/cpu:0")
    assert devices == ["/job:worker/task:1", "/job:worker/task:0"]
    assert controller == "/job:worker/task:0/device:CPU:0"


def test_resolve_is_idempotent():
    first = resolve(TWO_PS, "worker", "ps")
    assert resolve(TWO_PS, first[0], first[1], first[2]) == first


@pytest.mark.parametrize("devices,controller,words", [
    ("/job:trainer/task:0", "ps",
     "device '/job:trainer/task:0' names job 'trainer'.*jobs: ps, worker"),
    ("/job:worker/task:5", "ps",
     "device '/job:worker/task:5' names task 5 of job 'worker', which has tasks 0, 1"),
    ("worker", "/job:ps/task:1", "controller '/job:ps/task:1' names task 1"),
    ("workers", "ps", "names job 'workers'"),
    ("/job:worker/foo:1", "ps", "not a TensorFlow device"),
    ("/job:worker/replica:1/task:0", "ps", "replica 1"),
    ("worker,", "ps", "empty"),
])
def test_unknown_jobs_and_tasks_are_named(devices, controller, words):
    with pytest.raises(DeviceError, match=words):
        resolve(SPEC, devices, controller)


def test_transform_places_towers_on_workers_and_variables_on_ps():
    model = models.mlp("adam")
    res = replicate.transform(model.graph, "worker", controller="ps", cluster=SPEC)
    assert res.report.devices == ["/job:worker/task:0", "/job:worker/task:1"]
    ps = "/job:ps/task:0/device:CPU:0"
    nodes = res.graph_def.node
    assert {n.device for n in nodes if n.op == "VarHandleOp"} == {ps}
    for k in (0, 1):
        # Each tower computes on its worker; it reads the variables where they live.
        tower = [n for n in nodes if n.name.startswith(f"tower_{k}/")]
        assert {n.device for n in tower if n.op != "ReadVariableOp"} == {f"/job:worker/task:{k}"}
        assert {n.device for n in tower if n.op == "ReadVariableOp"} == {ps}


def test_transform_spreads_variables_over_ps_tasks_and_checks_the_cluster():
    res = replicate.transform(models.cnn().graph, "worker", controller="ps", cluster=TWO_PS)
    placed = {n.device for n in res.graph_def.node if n.op == "VarHandleOp"}
    assert placed == {"/job:ps/task:0/device:CPU:0", "/job:ps/task:1/device:CPU:0"}
    with pytest.raises(DeviceError, match="task 2 of job 'worker'"):
        replicate.transform(models.mlp().graph, ["/job:worker/task:2/cpu:0"], cluster=SPEC)


# ------------------------------------------------------------------ --cluster
def _args(*argv):
    parser = argparse.ArgumentParser()
    add_cluster_arguments(parser)
    return parser.parse_args(list(argv))


def test_cluster_argument(tmp_path, monkeypatch):
    assert cluster_value(_args()) is None
    path = tmp_path / "c.json"
    path.write_text(json.dumps(SPEC))
    cluster = cluster_value(_args("--cluster", str(path)))
    assert cluster == load(SPEC)
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": TWO_PS}))
    assert cluster_value(_args("--cluster", "TF_CONFIG")) == load(TWO_PS)
    assert default_devices(cluster) == "worker"
    assert resolve_devices(cluster, "worker", "ps") == resolve(SPEC, "worker", "ps")
    with pytest.raises(InputError, match=r"^--cluster .*missing.json: cannot read"):
        cluster_value(_args("--cluster", str(tmp_path / "missing.json")))
    with pytest.raises(DeviceError, match=r"^--devices: device '/job:worker/task:9'"):
        resolve_devices(cluster, "/job:worker/task:9", "ps")
    with pytest.raises(DeviceError, match=r"^--controller: controller 'chief'"):
        resolve_devices(cluster, "worker", "chief")


# ------------------------------------------------------------------ loopback servers
def test_loopback_helpers():
    assert is_loopback_host("127.0.0.1") and is_loopback_host("localhost")
    assert is_loopback_host("[::1]") and not is_loopback_host("10.1.2.3")
    assert not is_loopback_host("example.com")
    assert str(_decode("0100007F")) == "127.0.0.1"
    assert str(_decode("0000000000000000FFFF00000100007F")) == "::ffff:7f00:1"
    assert _loopback_only(["127.0.0.1", "::ffff:7f00:1", "::1"])
    assert not _loopback_only(["0.0.0.0"]) and not _loopback_only(["::"])
    assert not _loopback_only([])


_BIND = """
import socket
for family, host in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
    s = socket.socket(family, socket.SOCK_STREAM)
    s.bind((host, 0))
    s.listen()
    print(s.getsockname()[0])
"""


def test_shim_rewrites_wildcard_binds_to_loopback():
    shim = shim_path()
    env = dict(os.environ, LD_PRELOAD=shim)
    out = subprocess.run([sys.executable, "-c", _BIND], env=env, capture_output=True, text=True,
                         timeout=60, check=True).stdout.split()
    assert out == ["127.0.0.1", "::ffff:127.0.0.1"]
    plain = subprocess.run([sys.executable, "-c", _BIND], capture_output=True, text=True,
                           timeout=60, check=True).stdout.split()
    assert plain == ["0.0.0.0", "::"]


def test_server_entry_point_refuses_an_unknown_task(capsys):
    from replicate.runtime.cluster_server import main

    assert main(["--cluster", json.dumps(SPEC), "--job", "worker", "--task", "7"]) == 2
    assert "worker:7" in capsys.readouterr().err


def test_cluster_command_refuses_bad_options(tmp_path, capsys):
    for argv, words in ((["--workers", "0"], "--workers 0"),
                        (["--port-base", "80"], "--port-base 80"),
                        (["--json", str(tmp_path / "no" / "c.json")], "does not exist")):
        assert cli.main(["cluster", *argv]) == 2
        assert words in capsys.readouterr().err
    with pytest.raises(ReplicateError, match="at least one worker"):
        LocalCluster(ps=1, workers=0)


def _assert_loopback(cluster):
    for job, tasks in cluster.jobs.items():
        for task, address in tasks.items():
            seen = listening_addresses(int(address.rsplit(":", 1)[1]))
            assert _loopback_only(seen), f"{job}:{task} listens on {seen}"


def _remote_devices(master):
    with v1.Session(master, graph=tf.Graph()) as sess:
        return {d.name for d in sess.list_devices()}


@pytest.mark.timeout(400)
def test_cluster_command_serves_restarts_and_stops_on_ctrl_c(tmp_path):
    spec = tmp_path / "cluster.json"
    cmd = [sys.executable, "-m", "replicate", "cluster", "--ps", "1", "--workers", "2",
           "--json", str(spec), "--restart"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")),
                              daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + SERVER_TIMEOUT
        while not any("Ctrl-C" in ln for ln in lines):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.5)
        cluster = load(str(spec))
        assert sorted(cluster.jobs) == ["ps", "worker"] and len(cluster.jobs["worker"]) == 2
        _assert_loopback(cluster)
        pids = {ln.split()[0]: int(ln.split("pid ")[1].split()[0]) for ln in lines if " pid " in ln}
        assert sorted(pids) == ["ps:0", "worker:0", "worker:1"]
        devices = _remote_devices(cluster.master())
        for task in ("ps/replica:0/task:0", "worker/replica:0/task:0", "worker/replica:0/task:1"):
            assert f"/job:{task}/device:CPU:0" in devices
        os.kill(pids["worker:1"], signal.SIGKILL)
        while not any("worker:1 restarted" in ln for ln in lines):
            assert proc.poll() is None, "".join(lines)
            assert time.monotonic() < deadline + SERVER_TIMEOUT, "".join(lines)
            time.sleep(0.5)
        _assert_loopback(cluster)
        restarted = next(ln for ln in lines if "worker:1 restarted" in ln)
        new_pid = int(re.search(r"\(pid (\d+)\)", restarted).group(1))
        assert new_pid != pids["worker:1"]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(timeout=10)
    assert "stopped 3 servers (SIGINT)" in lines[-1]
    assert not spec.exists()
    for pid in [*pids.values(), new_pid]:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


class _ClashingCluster(LocalCluster):
    """A LocalCluster whose first start-up gets a port some other program holds."""

    def __init__(self, *args, held: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.held = held
        self.starts = 0

    def _ports(self):
        self.starts += 1
        ports = super()._ports()
        return [self.held, *ports[1:]] if self.starts == 1 else ports


@pytest.fixture(scope="module")
def local_cluster():
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    cluster = _ClashingCluster(1, 2, held=holder.getsockname()[1], timeout=SERVER_TIMEOUT)
    try:
        cluster.start()
    finally:
        holder.close()
    yield cluster
    cluster.stop()
    assert not cluster.procs


@pytest.mark.timeout(400)
def test_local_cluster_retries_a_taken_port(local_cluster):
    assert local_cluster.starts == 2
    ports = [int(a.rsplit(":", 1)[1]) for t in local_cluster.cluster.jobs.values()
             for a in t.values()]
    assert local_cluster.held not in ports
    assert not local_cluster.poll()
    _assert_loopback(local_cluster.cluster)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("placement", [None, "mirrored"], ids=["ps", "mirrored"])
def test_in_graph_training_over_ps_and_workers_equals_one_device(local_cluster, placement):
    train = example()
    model = replicate.demo.build_cnn(train.SIZES["tiny"])
    feeds = train.make_feeds(model, batch=32, steps=3, data_source="synthetic")
    single, single_losses = train.train_single(model, feeds)
    res = replicate.transform(model.graph, "worker", controller="ps", cluster=local_cluster.cluster,
                              param_devices=placement)
    assert ("collective_group_leader" in str(res.report)) == (placement == "mirrored")
    multi, losses = train.train_in_graph(res, local_cluster.cluster.master(), feeds, single[0])
    diff, worst = train.largest_difference(single[3], multi[3])
    assert diff <= RTOL, f"{worst} differs by {diff:.3g}"
    changed = [n for n in single[3] if not np.array_equal(single[3][n], single[0][n])]
    assert len(changed) == len(single[0]), "training left variables unchanged"
    np.testing.assert_allclose(losses, single_losses, rtol=1e-5)   # global-batch losses


@pytest.mark.timeout(400)
def test_example_script_against_a_running_cluster(local_cluster, capsys):
    code = example().main(["--cluster", local_cluster.spec_file, "--size", "tiny", "--steps", "4",
                           "--data", "synthetic", "--rtol", str(RTOL)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "towers on /job:worker/task:0, /job:worker/task:1; variables on /job:ps/task:0" in out
    assert "step 3 vs one device" in out and ": agree" in out


@pytest.mark.timeout(500)
@pytest.mark.parametrize("job,task", [("worker", 1), ("worker", 0)], ids=["worker1", "master"])
def test_killed_task_resumes_from_the_last_checkpoint(local_cluster, tmp_path, job, task):
    """SIGKILL a task after step 7 (checkpoints every 3 steps), restart it on its port: the
    session recovers, restores step 6 and ends exactly where an uninterrupted run ends. (A
    killed ps is test_recovery_drills' first drill.)"""
    train = example()
    steps, save_steps, kill_after = 12, 3, 7
    model = replicate.demo.build_cnn(train.SIZES["tiny"])
    feeds = train.make_feeds(model, batch=32, steps=steps, data_source="synthetic")
    single, _ = train.train_single(model, feeds)
    res = replicate.transform(model.graph, "worker", controller="ps", cluster=local_cluster.cluster)
    master = local_cluster.cluster.master()
    uninterrupted, _ = train.train_in_graph(res, master, feeds, single[0])
    old_pid = local_cluster.procs[(job, task)].pid
    fault = train.once_at(kill_after, lambda: train.kill_and_restart(local_cluster, job, task))
    ckpt = str(tmp_path / "ckpt")
    feeder = train.train_monitored(res, master, feeds, ckpt, save_steps, on_step=fault)

    assert fault.done, "the worker was never killed"
    fault.done[0].join(timeout=SERVER_TIMEOUT)
    assert not local_cluster.poll() and local_cluster.procs[(job, task)].pid != old_pid
    _assert_loopback(local_cluster.cluster)
    # The first session began at 0; every later one restored the checkpoint of step 6,
    # not the ps's in-memory state of step 7.
    assert feeder.starts[0] == 0 and len(feeder.starts) >= 2
    assert set(feeder.starts[1:]) == {6}, feeder.starts
    saved = train.checkpoint_steps(ckpt)          # each readable, steps increasing
    assert {6, 9, 12} <= set(saved) and saved[-1] == steps
    state = tf.train.get_checkpoint_state(ckpt)
    assert state.model_checkpoint_path == state.all_model_checkpoint_paths[-1]
    final = train.checkpoint_values(ckpt)
    diff, worst = train.largest_difference(uninterrupted[steps], final)
    assert diff <= 1e-6, f"{worst} differs from the uninterrupted run by {diff:.3g}"
    assert int(final["global_step"]) == steps
