"""convert/inspect options beyond the basics: strategies and --cluster (in-process CLI)."""

import json

import tensorflow as tf

import breadth_models as bm
from replicate.cli import main


def _meta(tmp_path):
    path = tmp_path / "bn.meta"
    tf.compat.v1.train.export_meta_graph(str(path), graph=bm.batch_norm_cnn(True).graph)
    return path


def test_strategies_reach_the_transform(tmp_path, capsys):
    path, out = _meta(tmp_path), tmp_path / "out.meta"
    code = main(["convert", str(path), "-o", str(out), "--no-check", "--devices", "/cpu:0,/cpu:1",
                 "--batch-norm", "sync", "--aggregation", "packed_allreduce",
                 "--param-devices", "/cpu:2,/cpu:3"])
    assert code == 0
    report = capsys.readouterr().out
    assert "mode sync" in report and "exact         yes" in report
    meta = tf.compat.v1.MetaGraphDef()
    meta.ParseFromString(out.read_bytes())
    ops = {n.op for n in meta.graph_def.node}
    assert "CollectiveReduceV2" in ops
    assert {n.device for n in meta.graph_def.node if n.op == "VarHandleOp"} <= {
        "/device:CPU:2", "/device:CPU:3"}


def test_cluster_names_tasks(tmp_path, capsys):
    path, out = _meta(tmp_path), tmp_path / "out.meta"
    spec = tmp_path / "cluster.json"
    spec.write_text(json.dumps({"ps": ["127.0.0.1:1", "127.0.0.1:2"],
                                "worker": ["127.0.0.1:3", "127.0.0.1:4"]}))
    assert main(["convert", str(path), "-o", str(out), "--no-check", "--cluster", str(spec), "--devices", "worker",
                 "--controller", "ps", "-q"]) == 0
    meta = tf.compat.v1.MetaGraphDef()
    meta.ParseFromString(out.read_bytes())
    devices = {n.name: n.device for n in meta.graph_def.node}
    assert devices["tower_1/conv/Conv2D"].startswith("/job:worker/task:1")
    assert {d for n, d in devices.items() if n.endswith("/kernel") or n.endswith("/gamma")} <= {
        "/job:ps/task:0/device:CPU:0", "/job:ps/task:1/device:CPU:0"}
    assert main(["inspect", str(path), "--cluster", str(spec), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["devices_assumed"] is False
    assert main(["convert", str(path), "-o", str(out), "--no-check", "--force", "--cluster", str(spec),
                 "--devices", "/job:chief/task:0"]) == 2
    assert "--devices" in capsys.readouterr().err


def test_batch_and_shared_inputs_reach_the_transform(tmp_path, capsys):
    """``--shared-inputs`` and ``--batch-inputs`` name the same tensor: exit 2 with one line,
    nothing written; a shared input that is no tensor of the graph: exit 2 naming it (the API
    test is tests/test_idioms.py::test_shared_inputs_are_never_split)."""
    path, out = _meta(tmp_path), tmp_path / "out.meta"
    code = main(["convert", str(path), "-o", str(out), "--no-check", "--devices", "/cpu:0,/cpu:1",
                 "--batch-inputs", "x:0", "--shared-inputs", "x:0"])
    assert code == 2 and not out.exists()
    assert "both a batch input and a shared input" in capsys.readouterr().err
    code = main(["inspect", str(path), "--devices", "/cpu:0,/cpu:1", "--shared-inputs", "nope:0"])
    assert code == 2
    assert "shared input 'nope:0' is not a tensor of the graph" in capsys.readouterr().err
