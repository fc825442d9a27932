"""Time-major inputs whose layout only the feed decides.

With a dynamic number of steps a ``[T, B]`` label and a ``[B, T]`` one look alike
(``[None, None]``). Moved to axis 1 together with the time-major ``x`` a loop unstacks, a
``[B, T]`` label transposed in the graph was split by its time steps: inexact, and the
rewrite failed at step 1. The analysis now also tries the loop's inputs alone, and a looped
input is never split along its time steps when moving it proves as much (that split makes
the towers run different numbers of steps). Where only the feed can tell (a program pairing
time-major rows with batch-major labels), the rewrite checks the guess before splitting and
stops with a message that names it."""

import numpy as np
import pytest
import tensorflow as tf

import replicate
from replicate.check.equivalence import compare

v1 = tf.compat.v1
T, D, H, C = 4, 5, 6, 3
DEVICES = ["/cpu:1", "/cpu:2", "/cpu:3"]


def _graph(kind: str, steps) -> tf.Graph:
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [steps, None, D], name="x")            # time-major
        labels = [None] if kind == "pooled" else [None, steps]
        y = v1.placeholder(tf.int64, labels, name="y")                         # batch-major
        cell = v1.nn.rnn_cell.BasicRNNCell(H)
        outputs, _ = v1.nn.dynamic_rnn(cell, x, dtype=tf.float32, time_major=True)
        w = v1.get_variable("w", [H, C], initializer=v1.random_normal_initializer(seed=3))
        flat = tf.reshape(outputs, [-1, H])                                    # [T * B, H]
        if kind == "transposed":            # labels brought to the rows' order: right
            logits = tf.matmul(flat, w, name="logits")
            labels = tf.reshape(tf.transpose(y), [-1])
        elif kind == "crossed":             # time-major rows against batch-major labels
            logits = tf.matmul(flat, w, name="logits")
            labels = tf.reshape(y, [-1])
        else:                               # flattened, reshaped back and averaged over time
            back = tf.reshape(tf.tanh(flat), [tf.shape(x)[0], -1, H])
            logits = tf.matmul(tf.reduce_mean(back, 0), w, name="logits")
            labels = y
        xent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
        loss = tf.reduce_mean(xent, name="loss")
        v1.train.GradientDescentOptimizer(0.5).minimize(loss, name="train")
    return g


def _feeds(kind: str):
    rng = np.random.default_rng(4)
    return [{"x:0": rng.normal(size=(T, b, D)).astype(np.float32),
             "y:0": rng.integers(0, C, b if kind == "pooled" else (b, T))} for b in (7, 5, 2)]


def _axes(res) -> dict[str, int]:
    return {b.tensor: b.axis for b in res.analysis.batch_inputs}


def test_batch_major_labels_beside_a_dynamic_time_major_input_are_exact():
    res = replicate.transform(_graph("transposed", None), DEVICES)
    assert res.report.exact, res.report.reasons
    assert _axes(res) == {"x:0": 1, "y:0": 0}
    r = compare(_graph("transposed", None), res.graph, "train", _feeds("transposed"),
                fetch=("loss:0", "logits:0"), cpus=4)
    assert r.max_rel <= 1e-5, (r.max_rel, r.worst)


def test_a_looped_input_is_not_split_by_its_steps_where_the_report_is_inexact():
    res = replicate.transform(_graph("crossed", T), DEVICES)
    assert not res.report.exact
    assert _axes(res)["x:0"] == 1
    compare(_graph("crossed", T), res.graph, "train", _feeds("crossed"), fetch=("loss:0",), cpus=4)


def test_outputs_folded_and_unfolded_by_the_dynamic_time_axis_are_exact():
    """``tf.reshape(flat, [tf.shape(x)[0], -1, H])`` of the loop's flattened outputs: the
    target's first element is proved to be the fold's time axis (through the loop's
    TensorList, tests/test_named_dims.py), so the -1 holds each tower's examples. It was
    inexact while that dimension had no name to compare."""
    res = replicate.transform(_graph("pooled", None), DEVICES)
    assert res.report.exact, res.report.reasons
    assert _axes(res)["x:0"] == 1
    r = compare(_graph("pooled", None), res.graph, "train", _feeds("pooled"), fetch=("loss:0",), cpus=4)
    assert r.max_rel <= 1e-5, (r.max_rel, r.worst)


def test_a_wrong_guess_of_the_layout_stops_with_a_message_naming_it():
    res = replicate.transform(_graph("crossed", None), DEVICES)
    assert any("'y:0' is taken to be time-major" in w for w in res.report.warnings)
    with res.graph.as_default():
        init = v1.global_variables_initializer()
    with v1.Session(graph=res.graph, config=v1.ConfigProto(device_count={"CPU": 4})) as sess:
        sess.run(init)
        with pytest.raises(tf.errors.InvalidArgumentError, match="y:0.* holds another number of examples"):
            sess.run(res.train_op, _feeds("crossed")[0])


def _tagger(steps):
    """A sequence tagger fed padded batches: token ids ``[None, steps]``, their lengths, per-token
    tags, batch-major ``dynamic_rnn`` with ``sequence_length``, a loss masked by the lengths."""
    graph = tf.Graph()
    with graph.as_default():
        v1.set_random_seed(31)
        words = v1.placeholder(tf.int32, [None, steps], name="words")
        lengths = v1.placeholder(tf.int32, [None], name="lengths")
        tags = v1.placeholder(tf.int32, [None, steps], name="tags")
        x = tf.nn.embedding_lookup(v1.get_variable("emb", [20, 5]), words)
        out, _ = v1.nn.dynamic_rnn(v1.nn.rnn_cell.BasicRNNCell(4), x, sequence_length=lengths,
                                   dtype=tf.float32)
        logits = tf.reshape(tf.matmul(tf.reshape(out, [-1, 4]), v1.get_variable("w", [4, 3])),
                            [-1, tf.shape(words)[1], 3])
        mask = tf.sequence_mask(lengths, tf.shape(words)[1], dtype=tf.float32)
        loss = v1.losses.sparse_softmax_cross_entropy(tags, logits, weights=mask)
        v1.train.GradientDescentOptimizer(0.5).minimize(loss, name="train")
    return graph


@pytest.mark.parametrize("steps", [None, 6])
def test_token_ids_with_both_axes_dynamic_are_not_split_by_their_time_steps(steps):
    """Review 26: ``words`` declared ``[None, None]`` beside its lengths was taken to be
    time-major (a lone label) and split by its time steps, apart from its lengths: the rewrite
    failed at step 1 where one device runs. It now stays with its lengths on axis 0."""
    graph = _tagger(steps)
    res = replicate.transform(graph, DEVICES)
    assert _axes(res) == {"words:0": 0, "lengths:0": 0, "tags:0": 0}
    rng = np.random.RandomState(0)
    feeds = [{"words:0": rng.randint(0, 20, (7, 6)), "lengths:0": rng.randint(1, 7, 7),
              "tags:0": rng.randint(0, 3, (7, 6))} for _ in range(2)]
    result = compare(graph, res.graph, "train", feeds)
    # exact with the time axis dynamic as well: the reshape by tf.shape(words)[1] is proved to
    # undo the fold of the rnn's outputs (tests/test_named_dims.py)
    assert res.report.exact and result.max_rel <= 1e-5
