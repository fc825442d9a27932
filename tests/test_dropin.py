"""Drop-in behaviour: an unchanged legacy driver trains on `replicate convert`'s output.

A "legacy script" saves a single-device model (.meta, text .pbtxt, GraphDef .pb or
SavedModel) and a checkpoint; the CLI converts it; the same driver code then runs on the
input and on the output: it imports the graph, restores the checkpoint, feeds
placeholders by name, runs ``train`` by name and fetches the loss, logits, predictions
and accuracy by name. Variables after 3 steps must agree within a relative 1e-5 and the
fetched values must be the global-batch values. Checkpoints move both ways.
"""

import os

import models
import numpy as np
import pytest
import tensorflow as tf

from replicate import cli
from replicate.check.equivalence import relative_difference, session_config
from replicate.graph import io, meta

v1 = tf.compat.v1
RTOL = 1e-5
FETCH = ["loss:0", "logits:0", "predictions:0", "accuracy:0"]
DEVICES = "/cpu:0,/cpu:1,/cpu:2"


# ---------------------------------------------------------------- the legacy side
def save_legacy(graph, directory, fmt="meta"):
    """What the legacy training script did: initialize, save a checkpoint, export the graph."""
    os.makedirs(directory, exist_ok=True)
    with graph.as_default():
        saver = v1.train.Saver()
        with v1.Session(config=session_config()) as sess:
            sess.run(v1.global_variables_initializer())
            ckpt = saver.save(sess, os.path.join(directory, "ckpt", "model"))
            if fmt == "savedmodel":
                builder = v1.saved_model.Builder(os.path.join(directory, "saved"))
                builder.add_meta_graph_and_variables(sess, ["train"], saver=saver)
                builder.save()
                return os.path.join(directory, "saved"), ckpt
    if fmt in ("pb", "pbtxt"):
        path = os.path.join(directory, f"model.{fmt}")
        tf.io.write_graph(graph.as_graph_def(), directory, f"model.{fmt}", as_text=fmt == "pbtxt")
    else:
        path = os.path.join(directory, "model.meta" if fmt == "meta" else "model.pbtxt")
        v1.train.export_meta_graph(path, graph=graph, as_text=fmt == "metatxt")
    return path, ckpt


def convert(path, out, *extra):
    """``replicate convert`` (in-process); the output must hold a copy per tower."""
    assert cli.main(["convert", path, "-o", out, "--devices", DEVICES, "-q", "--no-check", *extra]) == 0
    nodes = {n.name.split("/", 1)[0] for n in io.load(out).graph_def.node}
    assert {"tower_0", "tower_1", "tower_2"} <= nodes
    return out


def driver(path, ckpt, feeds, fetch=(), save_to=None, fmt="meta", before=None):
    """The untouched legacy driver: returns (fetched values per step, variables by name)."""
    graph = tf.Graph()
    fetched = []
    with graph.as_default(), v1.Session(config=session_config()) as sess:
        if fmt == "savedmodel":
            v1.saved_model.loader.load(sess, ["train"], path)
        elif fmt in ("pb", "pbtxt"):
            graph_def = io.load(path).graph_def
            tf.graph_util.import_graph_def(graph_def, name="")
            sess.run("save/restore_all", {"save/Const:0": ckpt})
        else:
            v1.train.import_meta_graph(path).restore(sess, ckpt)
        stop = before(sess) if before is not None else None
        for feed in feeds:
            fetched.append(sess.run(["train"] + list(fetch), feed)[1:])
        if stop is not None:
            stop()
        if fmt in ("pb", "pbtxt"):
            sess.run("save/control_dependency:0", {"save/Const:0": save_to})
        else:
            v1.train.Saver().save(sess, save_to)
    reader = tf.train.load_checkpoint(save_to)
    values = {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()}
    return fetched, values


def assert_same_training(single, multi, rtol=RTOL):
    (fetched_a, values_a), (fetched_b, values_b) = single, multi
    assert sorted(values_a) == sorted(values_b)
    worst = max(values_a, key=lambda n: relative_difference(values_a[n], values_b[n]))
    assert relative_difference(values_a[worst], values_b[worst]) <= rtol, worst
    assert len(fetched_a) == len(fetched_b)
    for step_a, step_b in zip(fetched_a, fetched_b):
        for a, b in zip(step_a, step_b):
            assert np.shape(a) == np.shape(b)
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


def trained_something(start_ckpt, values):
    reader = tf.train.load_checkpoint(start_ckpt)
    return [n for n in values if not np.array_equal(reader.get_tensor(n), values[n])]


# ---------------------------------------------------------------- formats
@pytest.mark.parametrize("fmt", ["meta", "metatxt", "pb", "pbtxt", "savedmodel"])
def test_unchanged_driver_trains_exactly_on_every_format(tmp_path, fmt):
    model = models.mlp("adam", resource=fmt != "pb")
    path, ckpt = save_legacy(model.graph, str(tmp_path / "legacy"), fmt)
    out = convert(path, str(tmp_path / ("out" if fmt == "savedmodel" else "out." + path.rsplit(".", 1)[-1])))
    assert io.load(out).format == fmt
    feeds = model.feeds(10, steps=3)
    single = driver(path, ckpt, feeds, FETCH, str(tmp_path / "a" / "m"), fmt)
    multi = driver(out, ckpt, feeds, FETCH, str(tmp_path / "b" / "m"), fmt)
    assert_same_training(single, multi)
    assert {"model/w1", "model/b2", "global_step"} <= set(trained_something(ckpt, multi[1]))
    assert multi[1]["global_step"] == 3
    logits = multi[0][0][1]
    assert logits.shape == (10, 3), "per-example outputs are the global batch, in order"


def _static_batch_check(tmp_path, batch):
    model = models.cnn(filters=(2, 4), dense=8, batch=batch, size=8, optimizer="momentum")
    path, ckpt = save_legacy(model.graph, str(tmp_path / "legacy"))
    out = convert(path, str(tmp_path / "out.meta"))
    feeds = model.feeds(batch, steps=3)
    fetch = ["loss:0", "logits:0", "accuracy:0"]
    assert_same_training(driver(path, ckpt, feeds, fetch, str(tmp_path / "a" / "m")),
                         driver(out, ckpt, feeds, fetch, str(tmp_path / "b" / "m")))


def test_static_batch_model_with_uneven_split(tmp_path):
    _static_batch_check(tmp_path, batch=11)


def test_static_batch_equal_to_a_model_dimension(tmp_path):
    _static_batch_check(tmp_path, batch=10)


# ---------------------------------------------------------------- checkpoints both ways
def test_checkpoints_move_both_ways(tmp_path):
    model = models.mlp("rmsprop_momentum", resource=False)
    path, ckpt = save_legacy(model.graph, str(tmp_path / "legacy"))
    out = convert(path, str(tmp_path / "out.meta"))
    feeds = model.feeds(7, steps=4)
    straight = driver(path, ckpt, feeds, ["loss:0"], str(tmp_path / "straight" / "m"))
    # Replicated for two steps, its checkpoint restored into the single-device graph...
    first = driver(out, ckpt, feeds[:2], ["loss:0"], str(tmp_path / "multi" / "m"))
    second = driver(path, str(tmp_path / "multi" / "m"), feeds[2:], ["loss:0"],
                    str(tmp_path / "single" / "m"))
    assert_same_training(straight, (first[0] + second[0], second[1]))
    # ...and a single-device checkpoint mid-way restored into the replicated graph.
    third = driver(path, ckpt, feeds[:2], ["loss:0"], str(tmp_path / "single2" / "m"))
    fourth = driver(out, str(tmp_path / "single2" / "m"), feeds[2:], ["loss:0"],
                    str(tmp_path / "multi2" / "m"))
    assert_same_training(straight, (third[0] + fourth[0], fourth[1]))


def test_monitored_training_session_driver(tmp_path):
    """A driver built on MonitoredTrainingSession (scaffold, ready op, saver from collections)."""
    import shutil

    model = models.mlp("adam")
    path, ckpt = save_legacy(model.graph, str(tmp_path / "legacy"))
    out = convert(path, str(tmp_path / "out.meta"))
    feeds = model.feeds(10, steps=3)
    losses, values = [], []
    for name, source in (("a", path), ("b", out)):
        shutil.copytree(os.path.dirname(ckpt), str(tmp_path / name))
        with tf.Graph().as_default():
            v1.train.import_meta_graph(source)
            reads = {v.op.name: v.value() for v in v1.trainable_variables()}
            with v1.train.MonitoredTrainingSession(
                    checkpoint_dir=str(tmp_path / name), config=session_config(),
                    save_summaries_steps=None, save_checkpoint_secs=None) as sess:
                losses.append([sess.run(["train", "loss:0"], feed)[1] for feed in feeds])
                values.append(sess.run(reads))
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)
    for name in values[0]:
        assert relative_difference(values[0][name], values[1][name]) <= RTOL, name


# ---------------------------------------------------------------- input pipelines
def _pipeline_model(kind, examples=48, batch=10):
    rng = np.random.RandomState(1)
    xs = rng.randn(examples, 8).astype(np.float32)
    ys = rng.randint(0, 3, examples).astype(np.int64)
    graph = tf.Graph()
    with graph.as_default():
        v1.set_random_seed(1)
        if kind == "initializable":
            xp = v1.placeholder(tf.float32, [None, 8], name="xs")
            yp = v1.placeholder(tf.int64, [None], name="ys")
            data = tf.data.Dataset.from_tensor_slices((xp, yp)).batch(batch)
            iterator = v1.data.make_initializable_iterator(data)
            v1.add_to_collection("iterator_init", iterator.initializer)
            x, y = iterator.get_next()
        elif kind == "one_shot":
            data = tf.data.Dataset.from_tensor_slices((xs, ys)).batch(batch)
            x, y = v1.data.make_one_shot_iterator(data).get_next()
        else:
            upto = kind == "queue_upto"
            one = v1.train.slice_input_producer([tf.constant(xs), tf.constant(ys)], shuffle=False,
                                                num_epochs=1 if upto else None)
            x, y = v1.train.batch(one, batch_size=batch, num_threads=1,
                                  allow_smaller_final_batch=upto)
        with v1.variable_scope("model"):
            w1 = v1.get_variable("w1", [8, 16])
            w2 = v1.get_variable("w2", [16, 3])
        logits = tf.matmul(tf.nn.relu(tf.matmul(x, w1)), w2, name="logits")
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits),
                              name="loss")
        v1.train.AdamOptimizer(0.01).minimize(loss, global_step=v1.train.get_or_create_global_step(),
                                              name="train")
    return graph, {"xs:0": xs, "ys:0": ys}


def _start_input(data):
    """The driver's input start-up: local variables, iterator initializers, queue runners."""
    def before(sess):
        sess.run(v1.local_variables_initializer())
        if v1.get_collection("iterator_init"):
            sess.run(v1.get_collection("iterator_init"), data)
        coord = v1.train.Coordinator()
        threads = v1.train.start_queue_runners(sess, coord)
        return lambda: (coord.request_stop(), coord.join(threads))
    return before


@pytest.mark.parametrize("kind,steps", [("one_shot", 5), ("initializable", 5), ("queue", 3),
                                        ("queue_upto", 5)])
def test_input_pipelines_split_every_global_batch(tmp_path, kind, steps):
    graph, data = _pipeline_model(kind)
    path, ckpt = save_legacy(graph, str(tmp_path / "legacy"))
    out = convert(path, str(tmp_path / "out.meta"))
    towers = [f"tower_{k}/logits:0" for k in range(3)]
    results = [driver(path, ckpt, [None] * steps, ["loss:0", "logits:0"], str(tmp_path / "a" / "m"),
                      before=_start_input(data)),
               driver(out, ckpt, [None] * steps, ["loss:0", "logits:0"] + towers,
                      str(tmp_path / "b" / "m"), before=_start_input(data))]
    assert_same_training(*results)
    sizes = [step[1].shape[0] for step in results[1][0]]
    assert sizes == [10, 10, 10, 10, 8][:steps], "each step sees the whole global batch"
    shares = [[t.shape[0] for t in step[2:]] for step in results[1][0]]
    assert shares == [[4, 3, 3]] * min(steps, 4) + [[3, 3, 2]] * (steps - 4), "each tower its share"
    for step in results[1][0]:
        np.testing.assert_array_equal(np.concatenate(step[2:]), step[1])
    original, converted = io.load(path).meta, io.load(out).meta
    assert meta.dangling(converted) == []
    for key in ("queue_runners", "iterators", "iterator_init", "local_variables"):
        assert (key in original.collection_def) == (key in converted.collection_def), key
        if key in original.collection_def:
            assert original.collection_def[key] == converted.collection_def[key], key


# ---------------------------------------------------------------- the example
def _example(name):
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "examples", "retrofit_legacy", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"retrofit_legacy_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_retrofit_legacy_example(tmp_path):
    work = str(tmp_path)
    ckpt = _example("legacy_train").main(["--out", work, "--steps", "2", "--batch", "32"])
    out = convert(os.path.join(work, "model.meta"), os.path.join(work, "model_x3.meta"))
    driver_main = _example("driver").main
    common = ["--data", os.path.join(work, "data.npz"), "--steps", "3", "--batch", "50"]
    one = driver_main([os.path.join(work, "model.meta"), ckpt, *common, "--save", f"{work}/one/m"])
    three = driver_main([out, ckpt, *common, "--save", f"{work}/three/m"])
    np.testing.assert_allclose(three, one, rtol=1e-5)
    worst, name = _example("compare").max_relative_difference(f"{work}/one/m", f"{work}/three/m")
    assert worst <= RTOL, name
    back = driver_main([os.path.join(work, "model.meta"), f"{work}/three/m", *common[:2],
                        "--steps", "1", "--save", f"{work}/back/m"])
    assert len(back) == 1 and np.isfinite(back[0])
