"""Ops that move spatial blocks through the batch axis or crop boxes out of images
(rules/spatial.py). Review 28: ``tf.nn.atrous_conv2d`` (``SpaceToBatchND`` /
``BatchToSpaceND``) and ``tf.image.crop_and_resize`` with ``box_ind = tf.range(batch)`` had no
rule, and the report said inexact though each example's result is its own. Exact now, with an
uneven split, an empty tower and ``accumulate=2``; blocks regrouped across examples and crops
of other examples' images are not."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import replicate
from replicate.check.equivalence import compare

v1 = tf.compat.v1


def _model(kind: str) -> tf.Graph:
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 8, 8, 3], name="x")
        y = v1.placeholder(tf.int32, [None], name="y")
        k = v1.get_variable("k", [3, 3, 3, 4], initializer=v1.glorot_uniform_initializer(seed=1))
        n = tf.shape(x)[0]
        if kind == "atrous":
            f = tf.nn.atrous_conv2d(x, k, 2, "SAME")
        elif kind == "regrouped":           # the 4 blocks' rows read as one example each
            blocks = tf.space_to_batch_nd(tf.nn.conv2d(x, k, 1, "SAME"), [2, 2], [[0, 0], [0, 0]])
            f = tf.reshape(blocks, [n, 4 * 4 * 4 * 4])
        else:
            boxes = tf.tile(tf.constant([[0.1, 0.1, 0.8, 0.9]]), [n, 1])
            index = tf.range(n) if kind == "crop" else tf.reverse(tf.range(n), [0])
            f = tf.image.crop_and_resize(tf.nn.conv2d(x, k, 1, "SAME"), boxes, index, [4, 4])
        f = tf.reshape(f, [n, int(np.prod(f.shape.as_list()[1:]))]) if kind != "regrouped" else f
        logits = v1.layers.dense(f, 3, kernel_initializer=v1.glorot_uniform_initializer(seed=2), name="out")
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits), name="loss")
        v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
    return graph


def _feeds(batch):
    rng = np.random.RandomState(batch)
    return [{"x:0": rng.rand(batch, 8, 8, 3).astype(np.float32), "y:0": rng.randint(0, 3, batch)}
            for _ in range(2)]


@pytest.mark.parametrize("kind", ["atrous", "crop"])
def test_blocks_and_crops_of_each_example_are_exact(kind):
    for devices, batch, accumulate in ((3, 7, 1), (3, 2, 1), (2, 5, 2)):
        res = replicate.transform(_model(kind), [f"/cpu:{i}" for i in range(devices)], accumulate=accumulate)
        assert res.report.exact, res.report.reasons
        result = compare(_model(kind), res.graph, "train", _feeds(batch), fetch=("loss:0",))
        assert result.max_rel <= 1e-5, (kind, devices, batch, result.worst, result.max_rel)


@pytest.mark.parametrize("kind,op", [("regrouped", "Reshape"), ("reversed", "ReverseV2")])
def test_blocks_regrouped_and_crops_of_other_examples_are_not_exact(kind, op):
    res = replicate.transform(_model(kind), ["/cpu:0", "/cpu:1", "/cpu:2"])
    assert not res.report.exact
    assert any(op in str(r) for r in res.report.reasons), res.report.reasons


def test_crops_by_fed_image_numbers_are_refused_and_a_mosaic_runs():
    """Review 31: ``crop_and_resize`` with image numbers fed for the whole batch failed at step
    1 ("box_index outside [0, batch_size)"): refused, naming the input. ``batch_to_space``
    merging 4 examples into one (inexact) failed in its kernel with 8 examples over 3 towers:
    each tower now gets a multiple of 4, and the rewrite runs."""
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 8, 8, 3], name="x")
        boxes = v1.placeholder(tf.float32, [None, 4], name="boxes")
        index = v1.placeholder(tf.int32, [None], name="index")
        k = v1.get_variable("k", [3, 3, 3, 2], initializer=v1.glorot_uniform_initializer(seed=1))
        crops = tf.image.crop_and_resize(tf.nn.conv2d(x, k, 1, "SAME"), boxes, index, [4, 4])
        v1.train.GradientDescentOptimizer(0.1).minimize(tf.reduce_mean(tf.square(crops)), name="train")
    with pytest.raises(replicate.ReplicateError, match="CropAndResize crops images numbered by 'index:0'"):
        replicate.transform(graph, ["/cpu:0", "/cpu:1", "/cpu:2"])
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 4, 4, 3], name="x")
        k = v1.get_variable("k", [3, 3, 3, 2], initializer=v1.glorot_uniform_initializer(seed=1))
        mosaic = tf.compat.v1.batch_to_space_nd(tf.nn.conv2d(x, k, 1, "SAME"), [2, 2], [[0, 0], [0, 0]])
        v1.train.GradientDescentOptimizer(0.1).minimize(tf.reduce_mean(tf.square(mosaic)), name="train")
    res = replicate.transform(graph, ["/cpu:0", "/cpu:1", "/cpu:2"])
    assert not res.report.exact
    assert any("multiple of 4" in w for w in res.report.warnings), res.report.warnings
    feeds = [{"x:0": np.random.RandomState(s).rand(8, 4, 4, 3).astype(np.float32)} for s in range(2)]
    compare(graph, res.graph, "train", feeds)           # runs
