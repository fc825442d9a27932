"""Reading and writing every format, atomic writes, collection consistency, CLI helpers."""

import io as pyio
import os

import models
import pytest
import tensorflow as tf

import replicate
from replicate.cli.commands._common import Progress, parse_devices, relabel, table, train_op_hint
from replicate.errors import AnalysisError, DeviceError, InputError, OutputError
from replicate.graph import io, meta

v1 = tf.compat.v1
CPUS = ["/cpu:0", "/cpu:1"]


@pytest.fixture(scope="module")
def mlp_meta():
    model = models.mlp("sgd")
    with model.graph.as_default():
        v1.train.Saver()
    return v1.train.export_meta_graph(graph=model.graph)


@pytest.fixture(scope="module")
def result(mlp_meta):
    return replicate.transform(mlp_meta, CPUS)


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    """A TF1 SavedModel with a "train" and a "serve" meta graph sharing one checkpoint."""
    path = str(tmp_path_factory.mktemp("sm") / "model")
    model = models.mlp("momentum")
    with model.graph.as_default(), v1.Session() as sess:
        sess.run(v1.global_variables_initializer())
        builder = v1.saved_model.Builder(path)
        builder.add_meta_graph_and_variables(sess, ["train"])
        builder.add_meta_graph(["serve"])
        builder.save()
    return path


def names(graph_def):
    return sorted(n.name for n in graph_def.node)


@pytest.mark.parametrize("fmt,name", [("meta", "g.meta"), ("metatxt", "g.pbtxt"),
                                      ("pb", "g.pb"), ("pbtxt", "g.pbtxt")])
def test_save_then_load_round_trips(tmp_path, result, fmt, name):
    path = str(tmp_path / name)
    io.save(result.meta_graph_def, path, fmt)
    loaded = io.load(path)
    assert loaded.format == fmt
    assert names(loaded.graph_def) == names(result.graph_def)
    assert any(n.startswith("tower_1/") for n in names(loaded.graph_def))
    if fmt.startswith("meta"):
        assert set(loaded.meta.collection_def) == set(result.meta_graph_def.collection_def)
        assert loaded.meta.saver_def == result.meta_graph_def.saver_def
    else:
        assert loaded.meta is None
    assert [f for f in os.listdir(tmp_path) if f.startswith(".replicate-")] == []


def test_binary_output_is_deterministic(mlp_meta):
    first = io.encode(replicate.transform(mlp_meta, CPUS).meta_graph_def, "meta")
    second = io.encode(replicate.transform(mlp_meta, CPUS).meta_graph_def, "meta")
    assert first == second


@pytest.mark.parametrize("path,given,requested,expected", [
    ("out.meta", "meta", None, "meta"),
    ("out.pbtxt", "meta", None, "metatxt"),
    ("out", "metatxt", None, "meta"),
    ("out.pb", "pb", None, "pb"),
    ("out.pbtxt", "pb", None, "pbtxt"),
    ("out.pb", "pbtxt", None, "pb"),
    ("out_dir", "savedmodel", None, "savedmodel"),
    ("out.meta", "savedmodel", None, "meta"),
    ("out.pbtxt", "savedmodel", None, "metatxt"),
    ("out.meta", "meta", "pbtxt", "pbtxt"),
])
def test_output_format_keeps_the_input_kind(path, given, requested, expected):
    assert io.output_format(path, given, requested) == expected


def test_output_format_rejects_unknown_format():
    with pytest.raises(OutputError, match="--format 'onnx'"):
        io.output_format("x", "meta", "onnx")


def test_saved_model_round_trip_copies_variables_and_other_meta_graphs(tmp_path, saved_model):
    loaded = io.load(saved_model)
    assert loaded.format == "savedmodel" and list(loaded.meta.meta_info_def.tags) == ["train"]
    res = replicate.transform(loaded.meta, CPUS)
    out = str(tmp_path / "out")
    io.save(res.meta_graph_def, out, "savedmodel", source=loaded)
    again = io.load(out)
    assert names(again.graph_def) == names(res.graph_def)
    assert len(again.saved_model.meta_graphs) == 2
    serve = [m for m in again.saved_model.meta_graphs if "serve" in m.meta_info_def.tags][0]
    assert names(serve.graph_def) == names(loaded.saved_model.meta_graphs[1].graph_def)
    for name in os.listdir(os.path.join(saved_model, "variables")):
        with open(os.path.join(saved_model, "variables", name), "rb") as a, \
                open(os.path.join(out, "variables", name), "rb") as b:
            assert a.read() == b.read()


def test_saved_model_failed_replace_keeps_the_old_output(tmp_path, saved_model):
    loaded = io.load(saved_model)
    source = tmp_path / "source"
    os.makedirs(source / "variables")
    os.symlink(str(tmp_path / "nowhere"), str(source / "variables" / "broken"))
    loaded.origin = str(source)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("old")
    with pytest.raises(OutputError, match="cannot write"):
        io.save(loaded.meta, str(out), "savedmodel", force=True, source=loaded)
    assert os.listdir(out) == ["keep.txt"]
    assert sorted(os.listdir(tmp_path)) == ["out", "source"]


def test_saved_model_output_needs_a_saved_model_input(tmp_path, result):
    with pytest.raises(OutputError, match="only from a SavedModel input"):
        io.save(result.meta_graph_def, str(tmp_path / "sm"), "savedmodel")
    assert os.listdir(tmp_path) == []


def test_write_atomic_refuses_existing_unless_forced(tmp_path):
    path = tmp_path / "out.meta"
    path.write_bytes(b"old")
    with pytest.raises(OutputError, match="already exists"):
        io.write_atomic(str(path), b"new")
    assert path.read_bytes() == b"old"
    io.write_atomic(str(path), b"new", force=True)
    assert path.read_bytes() == b"new"
    mask = os.umask(0)
    os.umask(mask)
    assert os.stat(path).st_mode & 0o777 == 0o666 & ~mask


@pytest.mark.parametrize("where,message", [("missing/out.meta", "does not exist"),
                                           ("afile/out.meta", "is not a directory")])
def test_write_atomic_unwritable_leaves_nothing(tmp_path, where, message):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(OutputError, match=message):
        io.write_atomic(str(tmp_path / where), b"data")
    assert sorted(os.listdir(tmp_path)) == ["afile"]


def test_check_writable_never_allows_the_input(tmp_path, saved_model):
    path = tmp_path / "in.meta"
    path.write_bytes(b"x")
    with pytest.raises(OutputError, match="is the input"):
        io.check_writable(str(path), force=True, source=str(path))
    with pytest.raises(OutputError, match="is the input"):
        io.check_writable(saved_model, force=True, source=os.path.join(saved_model, "saved_model.pb"))


@pytest.mark.parametrize("content,name,message", [
    (None, "missing.meta", "no such file"),
    (b"", "empty.meta", "empty"),
    (b"just text", "notes.pbtxt", "not a text GraphDef"),
    (b"\x08\x96\x01" * 5, "garbage.pb", "not a TensorFlow graph"),
])
def test_load_errors_name_the_file(tmp_path, content, name, message):
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(InputError, match=message) as info:
        io.load(str(path))
    assert str(info.value).startswith(str(path))


def test_dangling_finds_broken_references(result):
    assert meta.dangling(result.meta_graph_def) == []
    broken = type(result.meta_graph_def)()
    broken.CopyFrom(result.meta_graph_def)
    broken.collection_def["train_op"].node_list.value.append("gone")
    broken.saver_def.restore_op_name = "save/missing"
    problems = meta.dangling(broken)
    assert any("'gone'" in p and "train_op" in p for p in problems)
    assert any("restore_op_name" in p for p in problems)


def test_collection_ops_lists_distinct_names(mlp_meta):
    assert meta.collection_ops(mlp_meta, "train_op") == ["train"]
    assert meta.collection_ops(mlp_meta, "no_such_key") == []
    assert meta.collection_ops(None, "train_op") == []


def test_progress_appears_only_after_the_delay():
    now = [0.0]
    out = pyio.StringIO()
    progress = Progress("replicate convert", out, delay=1.0, clock=lambda: now[0])
    progress("analyze", 0, 3)
    progress.note("checking")
    progress.done("done")
    assert out.getvalue() == ""
    now[0] = 1.5
    progress("clone", 1, 3)
    now[0] = 2.25
    progress.note("writing out.meta")
    progress.done("done")
    assert out.getvalue().splitlines() == ["replicate convert: [2/3] clone (1.5 s)",
                                           "replicate convert: writing out.meta (2.2 s)",
                                           "replicate convert: done (2.2 s)"]


def test_relabel_names_the_file_and_the_option():
    err = relabel(AnalysisError("several candidate train ops ('a', 'b'); choose one with train_op="),
                  "m.meta")
    assert isinstance(err, AnalysisError)
    assert str(err) == "m.meta: several candidate train ops ('a', 'b'); choose one with --train-op NAME"
    assert str(relabel(InputError("MetaGraphDef: node 'x' is bad"), "m.meta")) == "m.meta: node 'x' is bad"
    same = InputError("m.meta: corrupt")
    assert relabel(same, "m.meta") is same


def test_parse_devices():
    assert parse_devices("/gpu:0, /gpu:1") == ["/device:GPU:0", "/device:GPU:1"]
    with pytest.raises(DeviceError, match="listed twice"):
        parse_devices("/gpu:0,/device:GPU:0")
    with pytest.raises(DeviceError, match="empty device"):
        parse_devices("/gpu:0,")
    with pytest.raises(DeviceError, match="'gpu0' is not a TensorFlow device"):
        parse_devices("gpu0")


def test_table_aligns_columns():
    text = table(["a", "long header"], [["xxxx", 1], ["y", None]])
    assert text.splitlines() == ["  a     long header", "  ----  -----------", "  xxxx  1",
                                 "  y"]


def test_train_op_hint_prefers_the_option_then_the_saved_model_collection(mlp_meta):
    hinted = type(mlp_meta)()
    hinted.CopyFrom(mlp_meta)
    assert train_op_hint(None, hinted) is None
    hinted.collection_def["saved_model_train_op"].node_list.value.extend(["train", "train"])
    assert train_op_hint(None, hinted) == "train"
    assert train_op_hint("other", hinted) == "other"
    hinted.collection_def["saved_model_train_op"].node_list.value.append("else")
    assert train_op_hint(None, hinted) is None
    assert train_op_hint(None, None) is None


EAGER_SCRIPT = r"""
import numpy as np, tensorflow as tf
import replicate
v1 = tf.compat.v1
assert tf.executing_eagerly()                      # TF2's default: the user never disabled it
graph = tf.Graph()
with graph.as_default():
    x = v1.placeholder(tf.float32, [None, 3], name="x")
    w = v1.get_variable("w", initializer=np.ones((3, 1), np.float32))
    loss = tf.reduce_mean(tf.square(tf.matmul(x, w)), name="loss")
    v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
res = replicate.transform(graph, ["/cpu:0", "/cpu:1"])
feed = {"x:0": np.arange(12, dtype=np.float32).reshape(4, 3) / 10}
out = []
for g in (graph, res.graph):
    with v1.Session(graph=g, config=v1.ConfigProto(device_count={"CPU": 2})) as s:
        s.run(v1.global_variables_initializer())
        s.run("train", feed)
        out.append(s.run("loss:0", feed))          # after one step: reads the updated w
print("exact", res.report.exact, "diff", float(np.abs(out[0] - out[1]).max()))
"""


def test_transform_of_a_tf_graph_with_eager_execution_on(tmp_path):
    """TF2 users build a ``tf.Graph`` with eager execution still on (the tests turn it off):
    exporting that graph must not need graph mode (it raised an InternalError)."""
    import subprocess
    import sys

    script = tmp_path / "eager.py"
    script.write_text(EAGER_SCRIPT)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=240, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert done.returncode == 0, done.stderr[-2000:]
    words = done.stdout.split()
    assert words[:2] == ["exact", "True"] and float(words[3]) < 1e-6


def test_a_graph_whose_collections_name_ops_of_function_bodies_exports_importably():
    """``tf.compat.v1.layers.batch_normalization`` inside a v2 ``tf.cond`` puts its branch's
    moving-average updates in the graph's UPDATE_OPS; exported as is, the MetaGraphDef did not
    import ("refers to an Operation not in the graph"), and ``equivalence.compare`` let the
    KeyError through. The body's names are dropped; the top-level ones are kept."""
    v1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 3], name="x")
        flag = v1.placeholder_with_default(True, [], name="flag")
        h = tf.cond(flag, lambda: v1.layers.batch_normalization(x, training=True, name="bn"),
                    lambda: x)
        top = v1.assign_add(v1.get_variable("count", [], initializer=v1.zeros_initializer()), 1.0)
        v1.add_to_collection(v1.GraphKeys.UPDATE_OPS, top.op)
        tf.identity(h, name="out")
        names = [op.name for op in v1.get_collection(v1.GraphKeys.UPDATE_OPS)]
    assert len(names) == 3 and sum(n in {o.name for o in graph.get_operations()} for n in names) == 1
    exported = io.export_graph(graph)
    assert list(exported.collection_def[v1.GraphKeys.UPDATE_OPS].node_list.value) == [top.op.name]
    with tf.Graph().as_default():
        v1.train.import_meta_graph(exported)


def test_a_saved_metagraph_naming_ops_of_function_bodies_converts_and_checks():
    """TensorFlow's own export keeps such names; the certificate imported the file as it was
    and ``replicate convert`` stopped in a KeyError traceback."""
    v1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 3], name="x")
        y = v1.placeholder(tf.int64, [None], name="y")
        flag = v1.placeholder_with_default(True, [], name="flag")
        h = tf.cond(flag, lambda: v1.layers.batch_normalization(x, training=True, name="bn"),
                    lambda: x)
        logits = v1.layers.dense(h, 2, kernel_initializer=v1.glorot_uniform_initializer(seed=1))
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits),
                              name="loss")
        v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
        raw = v1.train.export_meta_graph()
    assert "bn/AssignMovingAvg/AssignSubVariableOp" in \
        raw.collection_def[v1.GraphKeys.UPDATE_OPS].node_list.value
    res = replicate.transform(raw, ["/cpu:0", "/cpu:1"], check=True)
    assert res.report.check["ran"] and not res.report.exact
