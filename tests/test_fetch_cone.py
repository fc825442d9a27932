"""A driver's metric of values the towers cannot merge runs.

Logits that mix the examples (mixup by a shuffled copy of the batch) cannot be merged across
towers: fetched by name, tower 0's value stands in for them, and the report warns. An accuracy
of them against the fed labels ran once outside the towers, meeting tower 0's rows and the
whole batch's labels, and the rewrite failed where one device runs ("Incompatible shapes:
[3] vs. [7]"). Such fetch-only ops now run in the towers: the training runs, and the metric
gives a value of the right shape (inexact, as the report says)."""

import numpy as np
import pytest
import tensorflow as tf

import replicate
from replicate.check.equivalence import compare

v1 = tf.compat.v1
D, C = 4, 3


def _graph() -> tf.Graph:
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, D], name="x")
        y = v1.placeholder(tf.int64, [None], name="y")
        perm = tf.random.shuffle(tf.range(tf.shape(x)[0]), seed=4)
        mixed = 0.7 * x + 0.3 * tf.gather(x, perm)
        logits = v1.layers.dense(mixed, C, kernel_initializer=v1.glorot_uniform_initializer(seed=1))
        tf.reduce_mean(tf.cast(tf.equal(tf.argmax(logits, 1), y), tf.float32), name="acc")
        tf.reduce_sum(tf.nn.softmax(logits) * tf.one_hot(y, C), name="hits")
        xent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
        loss = tf.reduce_mean(xent, name="loss")
        v1.train.GradientDescentOptimizer(0.5).minimize(loss, name="train")
    return g


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_metric_of_unmergeable_logits_runs(accumulate):
    res = replicate.transform(_graph(), ["/cpu:1", "/cpu:2", "/cpu:3"], accumulate=accumulate)
    assert not res.report.exact
    rng = np.random.default_rng(2)
    feeds = [{"x:0": rng.normal(size=(b, D)).astype(np.float32),
              "y:0": rng.integers(0, C, b).astype(np.int64)} for b in (7, 5, 2)]
    r = compare(_graph(), res.graph, "train", feeds, fetch=("loss:0", "acc:0", "hits:0"), cpus=4)
    for one, towers in r.fetched:
        assert [np.shape(v) for v in towers] == [np.shape(v) for v in one]
        assert 0.0 <= towers[1] <= 1.0
