"""Ops over the innermost axes of a batch: audio frames, FFTs, image patches, matrix algebra.

Review 28: ``tf.signal.frame`` and ``tf.signal.stft`` were refused as "counting up to the batch
size minus a constant" (a shape vector split into its outer dimensions, the frame axis and the
inner ones lost the values of its pieces, and the frame count looked computed from the batch);
the gradient of ``tf.image.extract_patches`` likewise (its shape unstacked). FFTs and
``MatrixInverse`` had no rule. They are per example when the batch is one of the outer axes,
and mix examples when it is one of the axes they work on.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import replicate
from replicate.check.equivalence import compare

v1 = tf.compat.v1
DEVICES = ["/cpu:0", "/cpu:1", "/cpu:2"]


def _model(front):
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 8, 8, 2] if front == "patches" else [None, 64], name="x")
        y = v1.placeholder(tf.int32, [None], name="y")
        if front == "frame":
            f = tf.reshape(tf.signal.frame(x, 16, 8), [-1, 7 * 16])
        elif front == "stft":
            f = tf.reshape(tf.abs(tf.signal.stft(x, 16, 8, 16)), [-1, 7 * 9])
        elif front == "patches":
            k = v1.get_variable("k", [3, 3, 2, 2], initializer=v1.glorot_uniform_initializer(seed=7))
            conv = tf.nn.conv2d(x, k, [1, 1, 1, 1], "SAME")
            f = tf.reshape(tf.image.extract_patches(conv, [1, 2, 2, 1], [1, 2, 2, 1], [1, 1, 1, 1], "VALID"),
                           [-1, 4 * 4 * 8])
        else:                                               # a 4 x 4 matrix per example
            m = tf.reshape(x[:, :16], [-1, 4, 4]) + 4.0 * tf.eye(4)
            f = tf.reshape(tf.linalg.inv(m), [-1, 16])
        w = v1.get_variable("w", [f.shape[-1], 3], initializer=v1.glorot_uniform_initializer(seed=2))
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=tf.matmul(f, w)))
        v1.train.GradientDescentOptimizer(0.3).minimize(loss, name="train")
    return graph


@pytest.mark.parametrize("front", ["frame", "stft", "patches", "inverse"])
def test_per_example_inner_axis_ops_are_exact(front):
    graph = _model(front)
    res = replicate.transform(graph, DEVICES)
    assert res.report.exact, res.report.reasons
    rng = np.random.RandomState(0)
    shape = (8, 8, 2) if front == "patches" else (64,)
    feeds = [{"x:0": rng.rand(b, *shape).astype(np.float32), "y:0": rng.randint(0, 3, b)} for b in (7, 2)]
    assert compare(graph, res.graph, "train", feeds).max_rel <= 1e-5


@pytest.mark.parametrize("op", ["fft", "inverse"])
def test_an_inner_axis_op_over_the_examples_mixes_them(op):
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 3], name="x")
        w = v1.get_variable("w", [3, 3])
        h = tf.matmul(x, w)
        if op == "fft":                                     # along the batch axis
            out = tf.abs(tf.signal.fft(tf.complex(h[:, 0], 0.0)))
        else:                                               # a [B, B] Gram matrix
            out = tf.linalg.inv(tf.matmul(h, h, transpose_b=True) + tf.eye(tf.shape(x)[0]))
        v1.train.GradientDescentOptimizer(0.1).minimize(tf.reduce_sum(out), name="train")
    res = replicate.transform(graph, DEVICES)
    assert not res.report.exact
