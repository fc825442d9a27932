"""Placeholders declared without a shape and fed a scalar.

The autoencoder examples corrupt their input with ``x + scale * tf.random_normal((n,))`` where
``scale = tf.placeholder(tf.float32)`` has no shape. Without a rank the layout of everything
after it was unknown, and the report said inexact although every step is exact. The analysis
now takes such a placeholder for a scalar when that proves more, says so in a warning, and
the emitted graph checks it (``EnsureShape``): a step fed anything else stops naming the
check instead of training on an unproved layout. Where an op cannot read a scalar (class
weights gathered by label), nothing is pinned and the reason stays."""

import numpy as np
import pytest
import tensorflow as tf

import replicate
from replicate.equivalence import compare

v1 = tf.compat.v1
D, H, C = 10, 8, 4
DEVICES = ["/cpu:1", "/cpu:2", "/cpu:3"]


def _autoencoder() -> tf.Graph:
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, D], name="x")
        scale = v1.placeholder(tf.float32, name="scale")
        noisy = x + scale * v1.random_normal((D,), seed=1)
        rng = np.random.RandomState(0)
        w1 = tf.Variable(rng.randn(D, H).astype(np.float32) * 0.3)
        w2 = tf.Variable(rng.randn(H, D).astype(np.float32) * 0.3)
        hidden = tf.nn.softplus(tf.matmul(noisy, w1))
        reconstruction = tf.matmul(hidden, w2, name="reconstruction")
        cost = tf.multiply(0.5, tf.reduce_sum(tf.pow(reconstruction - x, 2.0)), name="cost")
        v1.train.GradientDescentOptimizer(0.01).minimize(cost, name="train")
    return g


def _class_weighted() -> tf.Graph:
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, D], name="x")
        y = v1.placeholder(tf.int32, [None], name="y")
        weights = v1.placeholder(tf.float32, name="class_weights")       # fed a [C] vector
        w = tf.Variable(np.random.RandomState(0).randn(D, C).astype(np.float32) * 0.3)
        xent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=tf.matmul(x, w))
        loss = tf.reduce_mean(xent * tf.gather(weights, y), name="loss")
        v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
    return g


def _feeds(scale, batches=(7, 5, 0)):
    rng = np.random.default_rng(3)
    return [{"x:0": rng.random((b, D), dtype=np.float32), "scale:0": scale} for b in batches]


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_shapeless_scale_is_taken_for_a_scalar_and_exact(accumulate):
    res = replicate.transform(_autoencoder(), DEVICES, accumulate=accumulate)
    assert res.report.exact, res.report.reasons
    pinned = [w for w in res.report.warnings if "taken to be a scalar" in w]
    assert len(pinned) == 1 and "'scale:0'" in pinned[0] and "scale/replicate_scalar" in pinned[0]
    assert not any("has unknown rank" in w for w in res.report.warnings)
    r = compare(_autoencoder(), res.graph, "train", _feeds(0.1), fetch=("cost:0", "reconstruction:0"),
                cpus=4)
    assert r.max_rel <= 1e-5, (r.max_rel, r.worst)
    for one, towers in r.fetched:
        for a, b in zip(one, towers):
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


def test_a_step_fed_anything_but_a_scalar_stops_at_the_check():
    res = replicate.transform(_autoencoder(), DEVICES)
    with res.graph.as_default():
        init = v1.global_variables_initializer()
    with v1.Session(graph=res.graph, config=v1.ConfigProto(device_count={"CPU": 4})) as sess:
        sess.run(init)
        feed = _feeds(np.full([D], 0.1, np.float32))[0]
        with pytest.raises(tf.errors.InvalidArgumentError, match="replicate_scalar"):
            sess.run(res.train_op, feed)


def test_nothing_is_pinned_where_an_op_cannot_read_a_scalar():
    res = replicate.transform(_class_weighted(), DEVICES)
    assert not res.report.exact
    assert any("'class_weights' has no static shape" in str(r) for r in res.report.reasons)
    assert not [n for n in res.graph.as_graph_def().node if "replicate_scalar" in n.name]
