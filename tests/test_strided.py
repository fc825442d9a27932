"""Gathers from a flattened batch at ``range(batch) * stride + offset``.

The last relevant output of an RNN (``tf.gather(tf.reshape(out, [-1, H]), tf.range(B) * T +
length - 1)``) and contrib's CRF sequence score (``tf.gather(tf.reshape(scores, [-1]),
reshape(range(B)[:, None] * T * C + range(T) * C + tags, [-1]))``) were inexact ("computes with
row numbers local to each tower", and the CRF's ``reshape(scores, [-1])`` over a dynamic
length "splits or scatters the examples"), although every tower picks its own examples'
entries. They are exact now, with a check in every tower that each offset stays within its
own example (one device would read a neighbour's entries otherwise). Forms that are not
that one stay inexact. Every exact case is compared with one device under SGD, with a tower
left empty and with accumulation."""

import numpy as np
import pytest
import tensorflow as tf

import replicate
from replicate.batchflow.rules.layout import map_reshape
from replicate.check.equivalence import compare
from replicate.errors import RewriteError

v1 = tf.compat.v1
T, D, C = 5, 3, 4
DEVICES = ["/cpu:1", "/cpu:2", "/cpu:3"]
BATCHES = (7, 5, 2)         # the last leaves a tower empty


def _graph(kind: str) -> tf.Graph:
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, None if kind == "crf" else T, D], name="x")
        lengths = v1.placeholder(tf.int32, [None], name="lengths")
        tags = v1.placeholder(tf.int32, [None, None if kind == "crf" else T], name="tags")
        w = v1.get_variable("w", [D, C], initializer=v1.glorot_uniform_initializer(seed=3))
        steps = tf.shape(x)[1]
        h = tf.tanh(tf.reshape(tf.matmul(tf.reshape(x, [-1, D]), w), [-1, steps, C]))
        batch = tf.shape(h)[0]
        if kind == "crf":               # contrib's crf_sequence_score, unary part
            classes = tf.shape(h)[2]
            offsets = tf.expand_dims(tf.range(batch) * steps * classes, 1)
            offsets += tf.expand_dims(tf.range(steps) * classes, 0)
            picked = tf.gather(tf.reshape(h, [-1]), tf.reshape(offsets + tags, [-1]))
            mask = tf.sequence_mask(lengths, maxlen=steps, dtype=tf.float32)
            score = tf.reduce_sum(tf.reshape(picked, [batch, steps]) * mask, 1)
        else:
            stride = {"last": T, "last_dynamic": steps, "wrong_stride": T - 1}.get(kind, T)
            index = tf.range(0, batch) * stride + (lengths - 1)
            if kind == "minus_rows":
                index = (lengths - 1) - tf.range(0, batch)
            table = v1.get_variable("table", [64, C]) if kind == "shared_table" else tf.reshape(h, [-1, C])
            score = tf.reduce_sum(tf.square(tf.gather(table, index)), 1) + tf.reduce_sum(h, [1, 2])
        loss = tf.reduce_mean(score, name="loss")
        v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
    return g


def _feeds(lengths=None):
    rng = np.random.default_rng(5)
    return [{"x:0": rng.standard_normal((b, T, D)).astype(np.float32),
             "lengths:0": rng.integers(1, T + 1, b).astype(np.int32) if lengths is None else lengths(b),
             "tags:0": rng.integers(0, C, (b, T)).astype(np.int32)} for b in BATCHES]


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("kind", ["last", "last_dynamic", "crf"])
def test_a_gather_of_the_flattened_batch_by_offsets_trains_exactly(kind, accumulate):
    res = replicate.transform(_graph(kind), DEVICES, accumulate=accumulate)
    assert res.report.exact, res.report.reasons
    said = [w for w in res.report.warnings if "gathers from a flattened batch" in w]
    assert len(said) == 1 and "GatherV2/replicate/offsets/check" in said[0]
    checks = [n.name for n in res.graph_def.node if n.name.endswith("replicate/offsets/check")]
    assert len(checks) == len(DEVICES) * accumulate
    r = compare(_graph(kind), res.graph, "train", _feeds(), fetch=("loss:0",), cpus=4)
    assert r.max_rel <= 1e-5, (r.max_rel, r.worst)
    for one, towers in r.fetched:
        np.testing.assert_allclose(towers[0], one[0], rtol=1e-5)


def test_an_offset_outside_its_example_stops_the_step():
    """Example 2, the last of tower 0, reads example 3's first entry on one device (a length
    one too long): a tower holds no example 3, so the check stops the step."""
    def lengths(b):
        out = np.full(b, T, np.int32)
        out[min(2, b - 1)] = T + 1
        return out

    res = replicate.transform(_graph("last"), DEVICES)
    assert res.report.exact
    with pytest.raises(RewriteError, match="offset into a flattened batch leaves its example"):
        compare(_graph("last"), res.graph, "train", _feeds(lengths)[:1], cpus=4)


@pytest.mark.parametrize("kind,why", [
    ("wrong_stride", "picks examples of the batch by position"),
    ("minus_rows", "computes with row numbers local to each tower"),
    ("shared_table", "looks a shared table up by row numbers"),
])
def test_other_offsets_stay_inexact(kind, why):
    res = replicate.transform(_graph(kind), DEVICES)
    assert not res.report.exact
    assert any(why in str(r) for r in res.report.reasons), res.report.reasons
    assert not [n for n in res.graph_def.node if "replicate/offsets" in n.name]


def test_a_dynamic_length_flattened_with_the_classes_keeps_its_examples():
    """``[B, T, 4] -> [-1]`` holds ``T * 4`` entries of each example, and back to ``[-1, 4]``
    ``T`` rows: the product of a named dimension and an integer is kept (it was lost, and the
    reshape was said to scatter the examples)."""
    assert map_reshape([None, "x:0#1", 4], 0, 1, 1, None, [None]) == (0, 1, "x:0#1*4")
    assert map_reshape([None], 0, 1, "x:0#1*4", None, [None, 4]) == (0, 1, "x:0#1")
    assert map_reshape([None, None, 4], 0, 1, 1, None, [None]) is None     # an anonymous dimension
