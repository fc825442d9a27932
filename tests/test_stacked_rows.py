"""Each entry's example number stacked beside other indices: a pointer network's
``scatter_nd(stack([tile(range(B)[:, None], [1, k]), ids], 2), attn, [B, V])`` and feature
columns' ``indicator_column(bucketized_column(...))``, whose sparse indices are
``transpose(stack([example numbers, positions]))`` built inside TensorFlow. Each entry's row is
its own example's, so the towers place their own examples' values (review 28: "Pack computes
with row numbers local to each tower", inexact). Numbers that are not each entry's own example
stay inexact."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import replicate
from replicate.check.equivalence import compare

v1 = tf.compat.v1


def _model(kind):
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 4], name="x")
        y = v1.placeholder(tf.int32, [None], name="y")
        ids = v1.placeholder(tf.int32, [None, 3], name="ids")
        w = v1.get_variable("w", [4, 6], initializer=v1.glorot_uniform_initializer(seed=2))
        logits = tf.matmul(x, w)
        n = tf.shape(x)[0]
        if kind == "bucket":
            net = v1.feature_column.input_layer({"x": x}, [v1.feature_column.indicator_column(
                v1.feature_column.bucketized_column(v1.feature_column.numeric_column("x", [4]), [-0.5, 0.5]))])
            logits += tf.matmul(net, v1.get_variable("v", [12, 6]))
        else:
            rows = tf.range(n) if kind == "scatter" else tf.reverse(tf.range(n), [0])
            idx = tf.stack([tf.tile(rows[:, None], [1, 3]), ids], 2)
            attn = tf.nn.softmax(tf.matmul(x, v1.get_variable("a", [4, 3])))
            logits += tf.scatter_nd(idx, attn, [n, 6])
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
        v1.train.GradientDescentOptimizer(0.3).minimize(loss, name="train")
    return graph


def _feeds(batch):
    rng = np.random.RandomState(0)
    return [{"x:0": rng.randn(batch, 4).astype(np.float32), "y:0": rng.randint(0, 6, batch),
             "ids:0": rng.randint(0, 6, (batch, 3))} for _ in range(2)]


@pytest.mark.parametrize("kind", ["scatter", "bucket"])
@pytest.mark.parametrize("batch", [7, 2])
def test_example_numbers_stacked_into_indices_are_exact(kind, batch):
    graph = _model(kind)
    res = replicate.transform(graph, ["/cpu:0", "/cpu:1", "/cpu:2"])
    assert res.report.exact, res.report.reasons
    assert compare(graph, res.graph, "train", _feeds(batch)).max_rel <= 1e-5


def test_numbers_of_other_examples_stay_inexact():
    res = replicate.transform(_model("reversed"), ["/cpu:0", "/cpu:1", "/cpu:2"])
    assert not res.report.exact


def test_a_mean_over_one_pick_per_example_is_a_batch_mean():
    """Review 28: ``mean(ce) + mean(square(gather_nd(pred, stack([range(B), pos], 1))))`` was
    inexact, the picks taken for a masked selection whose count the data decides; there is one
    pick per example, so their mean is a batch mean."""
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 4], name="x")
        y = v1.placeholder(tf.int32, [None], name="y")
        ids = v1.placeholder(tf.int32, [None, 3], name="ids")
        logits = tf.matmul(x, v1.get_variable("w", [4, 6], initializer=v1.glorot_uniform_initializer(seed=2)))
        picked = tf.gather_nd(logits, tf.stack([tf.range(tf.shape(x)[0]), ids[:, 0]], 1))
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)) \
            + 0.5 * tf.reduce_mean(tf.square(picked))
        v1.train.GradientDescentOptimizer(0.3).minimize(loss, name="train")
    res = replicate.transform(graph, ["/cpu:0", "/cpu:1", "/cpu:2"], accumulate=2)
    assert res.report.exact, res.report.reasons
    assert compare(graph, res.graph, "train", _feeds(7) + _feeds(2)).max_rel <= 1e-5
