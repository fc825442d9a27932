"""docs/distributed.md's between-graph job runs as written: its ``make_template.py`` and
``train.py`` blocks are extracted to files and its shell block is run, on loopback, with free
ports in ``cluster.json`` (the docs' example file uses 2222-2224)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time

import pytest
import tensorflow as tf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "distributed.md")


def blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced code block."""
    return [(m.group(1), m.group(2)) for m in re.finditer(r"^```(\w*)\n(.*?)^```", text,
                                                          re.S | re.M)]


def named(text: str) -> dict[str, str]:
    """Python blocks whose first line names their file (``# train.py: ...``), by file name,
    and the shell block that runs them (first line ``# run it ...``) as ``run.sh``."""
    out = {}
    for language, body in blocks(text):
        first = body.splitlines()[0] if body.strip() else ""
        m = re.match(r"# (\w+\.py):", first)
        if language == "python" and m:
            out[m.group(1)] = body
        elif language == "sh" and first.startswith("# run it"):
            out["run.sh"] = body
    return out


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _listening(port: int) -> list[str]:
    from replicate.runtime.cluster_server import listening_addresses

    return listening_addresses(port)


def test_the_docs_name_the_blocks_they_promise():
    with open(DOC, encoding="utf-8") as f:
        found = named(f.read())
    assert set(found) == {"make_template.py", "train.py", "run.sh"}, sorted(found)
    assert "python train.py cluster.json 0 ckpt" in found["run.sh"]
    # The driver defines what it uses, and binds through start_server, not tf.distribute.Server.
    driver = found["train.py"]
    assert "spec = load(" in driver and "start_server(" in driver
    assert "tf.distribute.Server(" not in driver


@pytest.mark.timeout(300)
def test_the_between_graph_job_in_the_docs_runs_as_written(tmp_path):
    with open(DOC, encoding="utf-8") as f:
        found = named(f.read())
    for name, body in found.items():
        (tmp_path / name).write_text(body)
    ports = _free_ports(3)
    cluster = {"ps": [f"127.0.0.1:{ports[0]}"],
               "worker": [f"127.0.0.1:{p}" for p in ports[1:]]}
    (tmp_path / "cluster.json").write_text(json.dumps(cluster))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p), TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("LD_PRELOAD", None)
    log = open(tmp_path / "run.log", "w+b")
    job = subprocess.Popen(["sh", "-e", "run.sh"], cwd=tmp_path, stdout=log,
                           stderr=subprocess.STDOUT, env=env, start_new_session=True)
    exposed: set[str] = set()
    try:
        deadline = time.monotonic() + 240
        while job.poll() is None and time.monotonic() < deadline:
            for port in ports:
                exposed.update(a for a in _listening(port)
                               if a not in ("127.0.0.1", "::ffff:7f00:1", "::1"))
            time.sleep(0.2)
        code = job.wait(timeout=max(1.0, deadline - time.monotonic()))
        end = time.monotonic() + 30              # worker 1 ran in the background
        while b"worker 1: trained" not in (tmp_path / "run.log").read_bytes() \
                and time.monotonic() < end:
            time.sleep(0.2)
    finally:
        try:
            os.killpg(job.pid, signal.SIGTERM)   # the ps (and anything left) of this job only
        except ProcessLookupError:
            pass
        log.close()
    out = (tmp_path / "run.log").read_text(errors="replace")
    lines = [ln for ln in out.splitlines() if not ln.startswith(("I0000", "W0000", "E0000"))]
    assert code == 0, "\n".join(lines[-30:])
    for t in range(2):
        assert f"worker {t}: trained to global step 6" in out, "\n".join(lines[-30:])
    assert not exposed, f"a task listened beyond loopback: {exposed}"
    # The chief's checkpoints are sharded by device: one shard is written by the ps task
    # itself, which is why DIR must be reachable by the ps too.
    state = tf.train.get_checkpoint_state(str(tmp_path / "ckpt"))
    assert state.model_checkpoint_path.endswith("model.ckpt-6"), state
    shards = sorted(p.name for p in (tmp_path / "ckpt").glob("model.ckpt-6.data-*"))
    assert shards == [f"model.ckpt-6.data-0000{k}-of-00002" for k in range(2)], shards
    reader = tf.train.load_checkpoint(str(tmp_path / "ckpt"))
    assert reader.get_tensor("global_step") == 6
    assert reader.get_variable_to_shape_map()["embedding"] == [100, 8]
