"""Batches trimmed to their longest sequence: ``x[:, :tf.reduce_max(lengths)]`` through
``dynamic_rnn``, labels tiled to that length (``tf.tile(y[:, None], [1, max_len])``), a
masked mean over the steps. Each tower reads the batch's longest length (an integer maximum,
synchronized), so the towers' steps line up with one device's. The tile was "repeats the
examples of the batch" (its multiples are known only at run time), then a coupling through
the ``Pack`` of ``[1, max_len]``, which cannot be synchronized: now exact."""

import numpy as np
import pytest
import tensorflow as tf

import replicate
from replicate.check.equivalence import compare

v1 = tf.compat.v1
T, D, H, C = 5, 3, 4, 3


def _graph() -> tf.Graph:
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, T, D], name="x")
        y = v1.placeholder(tf.int64, [None], name="y")
        lengths = v1.placeholder(tf.int32, [None], name="lengths")
        longest = tf.reduce_max(lengths)
        cell = v1.nn.rnn_cell.GRUCell(H, kernel_initializer=v1.glorot_uniform_initializer(seed=1))
        out, _ = v1.nn.dynamic_rnn(cell, x[:, :longest], sequence_length=lengths, dtype=tf.float32)
        w = v1.get_variable("w", [H, C], initializer=v1.glorot_uniform_initializer(seed=2))
        xent = tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=tf.tile(y[:, None], [1, longest]), logits=tf.tensordot(out, w, 1))
        mask = tf.sequence_mask(lengths, longest, dtype=tf.float32)
        loss = tf.identity(tf.reduce_sum(xent * mask) / tf.reduce_sum(mask), name="loss")
        tf.identity(tf.shape(out)[1], name="steps")
        v1.train.GradientDescentOptimizer(0.5).minimize(loss, name="train")
    return g


@pytest.mark.parametrize("accumulate", [1, 2])
def test_labels_tiled_to_the_longest_sequence_train_exactly(accumulate):
    res = replicate.transform(_graph(), ["/cpu:1", "/cpu:2", "/cpu:3"], accumulate=accumulate)
    assert res.report.exact, res.report.reasons
    rng = np.random.default_rng(6)
    feeds = [{"x:0": rng.normal(size=(b, T, D)).astype(np.float32),
              "y:0": rng.integers(0, C, b).astype(np.int64),
              "lengths:0": rng.integers(1, T + 1, b).astype(np.int32)} for b in (7, 5, 2)]
    r = compare(_graph(), res.graph, "train", feeds, fetch=("loss:0", "steps:0"), cpus=4)
    assert r.max_rel < 1e-5
    for single, multi in r.fetched:
        np.testing.assert_allclose(single, multi, rtol=1e-5)


def _trimmed(how: str) -> tf.Graph:
    """Padding trimmed to (or padded up to) the batch's longest sequence over a dynamic time
    axis, then a softmax over the steps, which sees as many padded steps as the trim keeps."""
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, None, 4], name="x")
        lengths = v1.placeholder(tf.int32, [None], name="lengths")
        w = v1.get_variable("w", [4], initializer=v1.random_normal_initializer(seed=1))
        longest = tf.reduce_max(lengths)
        if how == "strided":
            x2 = x[:, :longest]
        elif how == "slice":
            x2 = tf.slice(x, [0, 0, 0], tf.stack([-1, longest, -1]))
        else:                                   # padded by the batch's longest, then cut back
            x2 = tf.pad(x, tf.stack([[0, 0], tf.stack([0, longest]), [0, 0]]))[:, :tf.shape(x)[1] + 1]
        mask = tf.sequence_mask(lengths, tf.shape(x2)[1], tf.float32)
        probs = tf.nn.softmax(tf.reduce_sum(x2 * w, 2) * mask, axis=1)
        v1.train.GradientDescentOptimizer(0.5).minimize(tf.reduce_mean(tf.square(probs - 0.5)), name="train")
    return g


@pytest.mark.parametrize("how", ["strided", "slice", "pad"])
def test_bounds_from_the_longest_sequence_are_the_batch_s(how):
    """Review 29: with a dynamic time axis the slice's bound, a batch maximum, was dropped from
    the slice's facts; each tower trimmed to its own longest sequence and the softmax over the
    steps was claimed exact (up to 1.6 off on a padded tagger). The bound is a coupling now,
    synchronized: every tower trims to the batch's longest."""
    res = replicate.transform(_trimmed(how), ["/cpu:0", "/cpu:1", "/cpu:2"])
    assert res.report.exact, res.report.reasons
    rng = np.random.RandomState(0)
    feeds = [{"x:0": rng.randn(b, 6, 4).astype(np.float32), "lengths:0": np.r_[[6], rng.randint(1, 4, b - 1)]}
             for b in (7, 2)]
    assert compare(_trimmed(how), res.graph, "train", feeds).max_rel <= 1e-5
