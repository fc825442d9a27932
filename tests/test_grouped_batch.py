"""Batches whose examples an op regroups: siamese pairs and triplets (``tf.reshape(e, [-1, 2,
d])``), a legacy program's own towers (``tf.split(x, 2)``). The analysis cannot follow such
groups, so the rewrite is inexact and says why; but it must run: each tower gets a multiple of
the group size (a tower of 3 rows failed "the requested shape requires a multiple of 2" at
step 1), and the report says so."""

import numpy as np
import pytest
import tensorflow as tf

import replicate
from replicate.check.equivalence import compare

v1 = tf.compat.v1
D, H, C = 4, 6, 3


def _dense(x, n, name):
    return v1.layers.dense(x, n, name=name, kernel_initializer=v1.glorot_uniform_initializer(seed=3))


def _pairs(x, y):
    e = tf.reshape(_dense(x, H, "embed"), [-1, 2, H])
    yy = tf.reshape(y, [-1, 2])
    d = tf.reduce_sum(tf.square(e[:, 0] - e[:, 1]), 1)
    same = tf.cast(tf.equal(yy[:, 0], yy[:, 1]), tf.float32)
    return tf.reduce_mean(same * d + (1 - same) * tf.nn.relu(1.0 - d))


def _triplets(x, y):
    e = tf.reshape(tf.nn.l2_normalize(_dense(x, H, "embed"), 1), [-1, 3, H])
    near = tf.reduce_sum(tf.square(e[:, 0] - e[:, 1]), 1)
    far = tf.reduce_sum(tf.square(e[:, 0] - e[:, 2]), 1)
    return tf.reduce_mean(tf.nn.relu(near - far + 0.5))


def _own_towers(x, y):
    losses = []
    for i, (xi, yi) in enumerate(zip(tf.split(x, 2), tf.split(y, 2))):
        with v1.variable_scope("model", reuse=i > 0):
            losses.append(tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=yi, logits=_dense(xi, C, "logits"))))
    return tf.add_n(losses) / 2


KINDS = {"pairs": (_pairs, 2), "triplets": (_triplets, 3), "own_towers": (_own_towers, 2)}


def _graph(kind: str, static: int | None = None) -> tf.Graph:
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [static, D], name="x")
        y = v1.placeholder(tf.int64, [static], name="y")
        loss = tf.identity(KINDS[kind][0](x, y), name="loss")
        v1.train.GradientDescentOptimizer(0.5).minimize(loss, name="train")
    return g


def _feeds(batch: int, steps: int = 2):
    rng = np.random.default_rng(batch)
    return [{"x:0": rng.normal(size=(batch, D)).astype(np.float32),
             "y:0": rng.integers(0, 2, batch).astype(np.int64)} for _ in range(steps)]


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("accumulate", [1, 2])
def test_regrouped_examples_give_each_tower_whole_groups(kind, accumulate):
    group = KINDS[kind][1]
    res = replicate.transform(_graph(kind), ["/cpu:1", "/cpu:2", "/cpu:3"], accumulate=accumulate)
    assert not res.report.exact and res.report.reasons
    assert any(f"multiple of {group} examples" in w for w in res.report.warnings)
    for batch in (4 * group, 5 * group, group):     # even, uneven, towers without examples
        compare(_graph(kind), res.graph, "train", _feeds(batch), fetch=("loss:0",), cpus=4)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_static_batch_of_groups_is_refused_with_the_fix(kind):
    """The number of groups a static batch bakes in is no multiple of the batch size, so no
    tower could run it; the transform says so instead of emitting a graph that fails."""
    group = KINDS[kind][1]
    with pytest.raises(replicate.errors.AnalysisError, match="give the batch inputs a dynamic batch"):
        replicate.transform(_graph(kind, static=4 * group), ["/cpu:1", "/cpu:2", "/cpu:3"])
