"""`replicate verify`: N towers against one device on synthetic inputs; synthetic feeds;
refusal of graphs that would touch files, the network or Python."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import models
import numpy as np
import pytest
import tensorflow as tf

from replicate import api, cli, rewrite
from replicate.check import synthetic
from replicate.errors import InputError

v1 = tf.compat.v1
DEVICES = "/gpu:0,/gpu:1,/gpu:2"


def _save(graph: tf.Graph, path, saver: bool = False) -> str:
    if saver:
        with graph.as_default():
            v1.train.Saver()
    v1.train.export_meta_graph(graph=graph, filename=str(path))
    return str(path)


def _verify(capsys, *args: str) -> tuple[int, str, str]:
    code = cli.main(["verify", *args])
    out, err = capsys.readouterr()
    return code, out, err


def seed_graph(printing: bool = False) -> tf.Graph:
    """The first seed's mistakes: a float, trainable global step and a layer left out of
    var_list (neither gets a gradient), dropout fed through a shapeless keep_prob."""
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 6], name="x")
        y = v1.placeholder(tf.float32, [None, 3], name="y")
        keep = v1.placeholder(tf.float32, name="keep_prob")
        step = v1.get_variable("global_step", [], initializer=v1.constant_initializer(0))
        frozen = v1.get_variable("frozen/w", [6, 6])
        head = v1.get_variable("head/w", [6, 3])
        hidden = tf.nn.dropout(tf.nn.relu(tf.matmul(x, frozen)), rate=1 - keep)
        if printing:  # the head's gradient reads hidden, so the print runs every step
            with tf.control_dependencies([tf.print(tf.shape(hidden), name="show_hidden")]):
                hidden = tf.identity(hidden)
        logits = tf.matmul(hidden, head)
        loss = tf.reduce_mean(tf.nn.softmax_cross_entropy_with_logits(labels=y, logits=logits), name="loss")
        v1.train.AdamOptimizer(0.01).minimize(loss, global_step=step, var_list=[head], name="train")
    return graph


def test_verify_agrees_and_reports_json(tmp_path, capsys):
    path = _save(models.mlp("adam").graph, tmp_path / "mlp.meta", saver=True)
    code, out, _ = _verify(capsys, path, "--devices", DEVICES, "--steps", "2", "--json")
    info = json.loads(out)
    assert code == 0 and info["ok"]
    assert info["devices"] == ["/cpu:0", "/cpu:1", "/cpu:2"] and info["batch"] == 11
    assert info["max_rel_difference"] <= 1e-5 and info["rounding_reference"] is not None
    assert info["inputs"] == ["x:0 float32 [?, 8] (batch)", "y:0 int64 [?] (batch) in [0, 3)"]
    assert info["exact"] and info["no_gradient"] == [] and info["unchanged"] == []


def test_verify_bare_graph_def_with_iterator_input(tmp_path, capsys):
    path = tmp_path / "data.pb"
    path.write_bytes(models.dataset_mlp().graph.as_graph_def().SerializeToString())
    code, out, _ = _verify(capsys, str(path), "--devices", "/gpu:0,/gpu:1", "--steps", "2",
                           "--batch", "5")
    assert code == 0, out
    assert "IteratorGetNext:1 int64 [?] (batch) in [0, 3)" in out
    assert "global batch 5 (3 + 2)" in out and "verdict: agrees" in out


def test_verify_finds_the_seed_mistakes(tmp_path, capsys):
    path = _save(seed_graph(), tmp_path / "seed.meta")
    code, out, _ = _verify(capsys, path, "--devices", "/gpu:0,/gpu:1", "--json",
                           "--feed", "keep_prob=1.0")
    info = json.loads(out)
    assert code == 0, info
    assert info["no_gradient"] == ["global_step", "frozen/w"]
    assert info["unchanged"] == ["frozen/w"]
    assert "keep_prob:0 float32 ?" in info["inputs"] and "y:0 float32 [?, 3] (batch) one-hot" in info["inputs"]
    code, out, _ = _verify(capsys, path, "--devices", "/gpu:0,/gpu:1")
    assert code == 1, "dropout with keep_prob 0.1 cannot agree"
    assert "verdict: DIFFERS" in out and "--feed keep_prob=1.0" in out
    assert "2 trainable variables get no gradient" in out


def test_verify_detects_a_wrong_conversion(tmp_path, capsys, monkeypatch):
    path = _save(models.mlp("sgd").graph, tmp_path / "mlp.meta")
    real = rewrite.rewrite

    def doubled_learning_rate(*args, **kwargs):
        res = real(*args, **kwargs)
        for node in res.meta_graph_def.graph_def.node:
            if node.name == "train/learning_rate":
                node.attr["value"].tensor.float_val[:] = [0.2]
        return res
    monkeypatch.setattr(rewrite, "rewrite", doubled_learning_rate)
    code, out, _ = _verify(capsys, path, "--devices", DEVICES)
    assert code == 1 and "verdict: DIFFERS" in out


def test_verify_refuses_unsafe_ops_unless_allowed(tmp_path, capsys):
    path = _save(seed_graph(printing=True), tmp_path / "print.meta")
    code, _, err = _verify(capsys, path, "--devices", "/gpu:0,/gpu:1", "--feed", "keep_prob:0=1")
    assert code == 2
    assert err.strip().splitlines() == [
        f"replicate verify: error: {path}: refusing to run node 'show_hidden' (PrintV2): it touches "
        "files, the network or Python; pass --allow-unsafe-ops to run it anyway"]
    code, out, _ = _verify(capsys, path, "--devices", "/gpu:0,/gpu:1", "--feed", "keep_prob:0=1",
                           "--allow-unsafe-ops")
    assert code == 0, out


def test_unsafe_ops_only_counts_what_runs():
    graph = tf.Graph()
    with graph.as_default():
        files = tf.data.TFRecordDataset(["/nonexistent.tfrecord"]).map(
            lambda r: (tf.reshape(tf.io.parse_tensor(r, tf.float32), [4]),
                       tf.reshape(tf.io.parse_tensor(r, tf.int64), []))).batch(4)
        x, y = v1.data.make_one_shot_iterator(files).get_next()
        w = v1.get_variable("w", [4, 3], use_resource=True)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=y, logits=tf.matmul(x, w)), name="loss")
        v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
        v1.train.Saver()
        read = tf.io.read_file("/etc/hostname", name="read")
    meta = v1.train.export_meta_graph(graph=graph)
    ir = api.analyze_only(meta)
    fed = [s.tensor for s in synthetic.input_specs(ir, ["train"], ["IteratorGetNext:0"])]
    assert fed == ["IteratorGetNext:0", "IteratorGetNext:1"]
    assert synthetic.unsafe_ops(ir, ["train", "w/Assign"], fed) == []
    assert ("TFRecordDatasetV2" in {op for _, op in synthetic.unsafe_ops(ir, ["train"])}
            or "TFRecordDataset" in {op for _, op in synthetic.unsafe_ops(ir, ["train"])})
    assert synthetic.unsafe_ops(ir, ["train", read.op.name], fed) == [("read", "ReadFile")]
    assert ("save/SaveV2", "SaveV2") in synthetic.unsafe_ops(ir, ["save/control_dependency"], fed)


def test_synthetic_feeds_keep_labels_and_ids_in_range():
    graph = tf.Graph()
    with graph.as_default():
        ids = v1.placeholder(tf.int64, [None, 3], name="ids")
        labels = v1.placeholder(tf.int32, [None], name="labels")
        rate = v1.placeholder(tf.float32, [], name="rate")
        table = v1.get_variable("table", [11, 4], use_resource=True)
        w = v1.get_variable("w", [4, 5], use_resource=False)
        logits = tf.matmul(tf.reduce_mean(tf.nn.embedding_lookup(table, ids), 1), w)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=tf.cast(labels, tf.int64), logits=logits), name="loss")
        v1.train.GradientDescentOptimizer(rate).minimize(loss, name="train")
    ir = api.analyze_only(graph)
    specs = synthetic.input_specs(ir, ["train"], ["ids:0", "labels:0"])
    assert [s.describe() for s in specs] == [
        "ids:0 int64 [?, 3] (batch) in [0, 11)", "labels:0 int32 [?] (batch) in [0, 5)",
        "rate:0 float32 []"]
    feed = synthetic.make_feed(specs, 200, np.random.RandomState(0), overrides={"rate:0": 0.5})
    assert feed["ids:0"].shape == (200, 3) and feed["ids:0"].min() == 0 and feed["ids:0"].max() == 10
    assert feed["labels:0"].dtype == np.int32 and feed["labels:0"].max() == 4
    assert feed["rate:0"] == np.float32(0.5)
    assert synthetic.make_feed(specs, 2, np.random.RandomState(0))["rate:0"] == np.float32(0.1)
    fixed = [synthetic.InputSpec("x:0", "float32", [8, 2], 0)]
    with pytest.raises(InputError, match="input 'x:0' fixes the batch size at 8; use --batch 8"):
        synthetic.make_feed(fixed, 5, np.random.RandomState(0))
    shapeless = [synthetic.InputSpec("x:0", "float32", None, 0)]
    with pytest.raises(InputError, match="unknown rank"):
        synthetic.make_feed(shapeless, 5, np.random.RandomState(0))


@pytest.mark.parametrize("argv,message", [
    (["--steps", "0"], "--steps 0: must be at least 1"),
    (["--feed", "keep_prob"], "--feed 'keep_prob': expected NAME=VALUE"),
    (["--feed", "x=open('f')"], "is not a number or a list"),
    (["--devices", "/gpu:0,/gpu:0"], "listed twice"),
])
def test_verify_bad_options_exit_2_with_one_line(tmp_path, capsys, argv, message):
    path = _save(models.mlp("sgd").graph, tmp_path / "mlp.meta")
    args = [path, "--devices", "/gpu:0,/gpu:1"] + argv if "--devices" not in argv else [path] + argv
    code, out, err = _verify(capsys, *args)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and message in err


def test_verify_command_line_in_eager_mode(tmp_path):
    """The installed command runs with TensorFlow's default (eager) mode."""
    path = _save(models.mlp("momentum").graph, tmp_path / "mlp.meta")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    done = subprocess.run([sys.executable, "-m", "replicate", "verify", path, "--devices", "/gpu:0,/gpu:1",
                           "--steps", "2"], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "verdict: agrees" in done.stdout


@pytest.mark.parametrize("strategy", [["--param-devices", "mirrored"],
                                      ["--aggregation", "packed_allreduce"]],
                         ids=["mirrored", "packed_allreduce"])
def test_verify_proves_a_strategy(tmp_path, capsys, strategy):
    path = _save(models.mlp("momentum", resource=False).graph, tmp_path / "mlp.meta", saver=True)
    code, out, _ = _verify(capsys, path, "--devices", DEVICES, "--steps", "2", "--json", *strategy)
    info = json.loads(out)
    assert code == 0 and info["ok"] and info["max_rel_difference"] <= 1e-5, info
