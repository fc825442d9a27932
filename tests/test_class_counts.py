"""Class counts of the labels as loss weights ("balanced" weights ``total / (C * count_c)``):
by one-hot sums, by ``unsorted_segment_sum``, by ``tf.math.bincount``. Each tower counts its
own labels; the counts are synchronized, so the weights are the batch's. ``bincount`` sizes its
output from the batch's largest label unless ``minlength == maxlength`` fixes it (no rule
before: "DenseBincount of batch values it cannot follow")."""

import numpy as np
import pytest
import tensorflow as tf

import replicate
from replicate.check.equivalence import compare

v1 = tf.compat.v1
D, C = 4, 3


def _counts(kind: str, y):
    if kind == "one_hot":
        return tf.reduce_sum(tf.one_hot(y, C), 0)
    if kind == "segment_sum":
        return tf.math.unsorted_segment_sum(tf.ones_like(y, tf.float32), y, C)
    lengths = {"minlength": C, "maxlength": C} if kind == "bincount" else {}
    return tf.cast(tf.math.bincount(tf.cast(y, tf.int32), **lengths), tf.float32)


def _graph(kind: str) -> tf.Graph:
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, D], name="x")
        y = v1.placeholder(tf.int64, [None], name="y")
        counts = _counts(kind, y)
        weights = tf.reduce_sum(counts) / (C * tf.maximum(counts, 1.0))
        logits = v1.layers.dense(x, C, kernel_initializer=v1.glorot_uniform_initializer(seed=1))
        xent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
        loss = tf.reduce_mean(xent * tf.gather(weights, y), name="loss")
        v1.train.GradientDescentOptimizer(0.5).minimize(loss, name="train")
    return g


@pytest.mark.parametrize("kind", ["one_hot", "segment_sum", "bincount"])
@pytest.mark.parametrize("batch_norm", ["tower0", "sync"])
def test_class_counts_of_the_labels_weigh_exactly(kind, batch_norm):
    res = replicate.transform(_graph(kind), ["/cpu:1", "/cpu:2", "/cpu:3"], batch_norm=batch_norm)
    assert res.report.exact, res.report.reasons
    rng = np.random.default_rng(2)
    feeds = [{"x:0": rng.normal(size=(b, D)).astype(np.float32),
              "y:0": rng.integers(0, C, b).astype(np.int64)} for b in (7, 5, 2)]
    assert compare(_graph(kind), res.graph, "train", feeds, fetch=("loss:0",), cpus=4).max_rel < 1e-5


def test_bincount_sized_by_the_batch_largest_label_is_a_reason():
    res = replicate.transform(_graph("bincount_unbounded"), ["/cpu:1", "/cpu:2", "/cpu:3"])
    assert not res.report.exact
    assert any("DenseBincount" in r.node for r in res.report.reasons)


def _scaled(scale_of) -> tf.Graph:
    """Each example's cross entropy divided by ``scale_of(labels)`` (int32 labels), averaged."""
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, D], name="x")
        y = v1.placeholder(tf.int32, [None], name="y")
        logits = v1.layers.dense(x, C, kernel_initializer=v1.glorot_uniform_initializer(seed=1))
        l = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
        v1.train.GradientDescentOptimizer(0.5).minimize(tf.reduce_mean(l / scale_of(y)), name="train")
    return g


def _counted(y):
    return tf.gather(tf.math.bincount(y, dtype=tf.float32), y)


def test_labels_gathering_their_own_counts_run():
    """Review 34: ``l / tf.gather(tf.math.bincount(y), y)``, the batch's largest label
    synchronized to size the counts: the labels read behind the gather's check fed the
    counts the check reads (a cycle). Inexact, and it runs, an empty tower included."""
    res = replicate.transform(_scaled(_counted), ["/cpu:1", "/cpu:2", "/cpu:3"])
    assert not res.report.exact
    rng = np.random.default_rng(3)
    feeds = [{"x:0": rng.normal(size=(b, D)).astype(np.float32), "y:0": rng.integers(0, C, b).astype(np.int32)}
             for b in (7, 2)]
    assert np.isfinite(compare(_scaled(_counted), res.graph, "train", feeds, cpus=4).max_rel)


@pytest.mark.parametrize("use", ["counts", "positions"])
def test_what_unique_numbers_per_tower_is_a_reason(use):
    """Review 34: ``tf.unique_with_counts(y)``'s counts gathered back by its ``idx``
    (``l / count[idx]``) were taken for each example's own value, and ``idx`` itself (the order
    in which the batch first meets each label) used as a value: both claimed exact, 0.01-0.1
    off. Each tower counts and numbers its own labels."""
    def scale(y):
        _, idx, count = tf.unique_with_counts(y)
        return tf.cast(tf.gather(count, idx), tf.float32) if use == "counts" else 1.0 + tf.cast(idx, tf.float32)
    res = replicate.transform(_scaled(scale), ["/cpu:1", "/cpu:2", "/cpu:3"])
    assert not res.report.exact
    assert any("counts values" in r.what or "row numbers local" in r.what for r in res.report.reasons), \
        res.report.reasons
