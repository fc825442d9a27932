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
                index = (batch - 1 - tf.range(0, batch)) * T + (lengths - 1)
            elif kind == "batch_in_offset":     # each tower's own count in the offset
                index = tf.range(0, batch) * T + tf.minimum(lengths - 1, batch)
            elif kind == "masked":              # offsets of some examples only
                index = tf.boolean_mask(index, lengths > 2)
            elif kind == "concat_rows":         # T offsets into 2 * T rows per example
                h = tf.concat([h, 2.0 * h], 1)
                index = tf.range(0, batch) * steps + (lengths - 1)
            table = v1.get_variable("table", [64, C]) if kind == "shared_table" else tf.reshape(h, [-1, C])
            picked = tf.reduce_sum(tf.square(tf.gather(table, index)), 1)
            score = tf.reduce_mean(picked) + tf.reduce_mean(tf.reduce_sum(h, [1, 2]))
        loss = tf.reduce_mean(score, name="loss")
        v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
    return g


def _feeds(lengths=None):
    rng = np.random.default_rng(5)
    return [{"x:0": rng.standard_normal((b, T, D)).astype(np.float32),
             "lengths:0": rng.integers(1, T + 1, b).astype(np.int32) if lengths is None else lengths(b),
             "tags:0": rng.integers(0, C, (b, T)).astype(np.int32)} for b in BATCHES]


def _matches_one_device(graph: tf.Graph, res) -> None:
    """Three SGD steps of the rewrite match one device's, and so does the fetched loss."""
    r = compare(graph, res.graph, "train", _feeds(), fetch=("loss:0",), cpus=4)
    assert r.max_rel <= 1e-5, (r.max_rel, r.worst)
    for one, towers in r.fetched:
        np.testing.assert_allclose(towers[0], one[0], rtol=1e-5)


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("kind", ["last", "last_dynamic", "crf"])
def test_a_gather_of_the_flattened_batch_by_offsets_trains_exactly(kind, accumulate):
    res = replicate.transform(_graph(kind), DEVICES, accumulate=accumulate)
    assert res.report.exact, res.report.reasons
    said = [w for w in res.report.warnings if "gathers from a flattened batch" in w]
    assert len(said) == 1 and "GatherV2/replicate/offsets/check" in said[0]
    checks = [n.name for n in res.graph_def.node if n.name.endswith("replicate/offsets/check")]
    assert len(checks) == len(DEVICES) * accumulate
    _matches_one_device(_graph(kind), res)


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
    # review 16: the offset read each tower's own count (claimed exact, 0.015 off); offsets
    # filtered by a mask and a dynamic stride beside twice as many rows per example passed
    # the analysis and stopped every step at the check
    ("batch_in_offset", "batch size used as a value"),
    ("masked", "picks examples of the batch by position"),
    ("concat_rows", "picks examples of the batch by position"),
])
def test_other_offsets_stay_inexact(kind, why):
    res = replicate.transform(_graph(kind), DEVICES)
    assert not res.report.exact
    assert any(why in str(r) for r in res.report.reasons), res.report.reasons
    assert not [n for n in res.graph_def.node if "replicate/offsets" in n.name]
    compare(_graph(kind), res.graph, "train", _feeds()[:2], cpus=4)      # and the rewrite runs


def test_an_integer_per_example_value_plus_the_batch_size_reads_the_batch_s():
    """``tf.cast(lengths + B, tf.float32)`` as a weight: only float results were checked for
    the batch size used as a value (claimed exact, 0.56 off; review 16), and it was inexact
    since. The towers now read the batch's size (synchronized: it is only a value here)."""
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, D], name="x")
        lengths = v1.placeholder(tf.int32, [None], name="lengths")
        w = v1.get_variable("w", [D, C], initializer=v1.glorot_uniform_initializer(seed=3))
        weight = tf.cast(lengths + tf.shape(x)[0], tf.float32)
        loss = tf.reduce_mean(tf.reduce_sum(tf.square(tf.matmul(x, w)), 1) * weight, name="loss")
        v1.train.GradientDescentOptimizer(0.01).minimize(loss, name="train")
    res = replicate.transform(g, DEVICES)
    assert res.report.exact, res.report.reasons
    rng = np.random.RandomState(4)
    feeds = [{"x:0": rng.randn(b, D), "lengths:0": rng.randint(1, 5, b)} for b in (7, 2)]
    assert compare(g, res.graph, "train", feeds, cpus=4).max_rel < 1e-5


def test_in_a_tf1_while_loop_the_gather_is_inexact_and_runs():
    """No check can be added inside a TF1 loop frame: inexact. The assertion for ops that pick
    examples by position was then added outside the frame, and the step failed (review 16)."""
    from breadth_models import control_flow_v1

    g = tf.Graph()
    with g.as_default(), control_flow_v1():
        x = v1.placeholder(tf.float32, [None, T, D], name="x")
        lengths = v1.placeholder(tf.int32, [None], name="lengths")
        v1.placeholder(tf.int32, [None, T], name="tags")
        w = v1.get_variable("w", [D, C], initializer=v1.glorot_uniform_initializer(seed=3))
        h = tf.reshape(tf.matmul(tf.reshape(x, [-1, D]), w), [-1, T, C])
        flat, batch = tf.reshape(h, [-1, C]), tf.shape(h)[0]
        picks = v1.while_loop(lambda i, acc: i < 3, lambda i, acc: (i + 1, acc + tf.gather(
            flat, tf.range(batch) * T + tf.minimum(lengths - 1, i))), [0, tf.zeros_like(h[:, 0, :])])[1]
        loss = tf.reduce_mean(tf.square(picks), name="loss")
        v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
    res = replicate.transform(g, DEVICES)
    assert not res.report.exact
    assert any("inside a TF1 while loop" in str(r) for r in res.report.reasons), res.report.reasons
    compare(g, res.graph, "train", _feeds()[:2], cpus=4)


def test_a_dynamic_length_flattened_with_the_classes_keeps_its_examples():
    """``[B, T, 4] -> [-1]`` holds ``T * 4`` entries of each example, and back to ``[-1, 4]``
    ``T`` rows: the product of a named dimension and an integer is kept (it was lost, and the
    reshape was said to scatter the examples)."""
    assert map_reshape([None, "x:0#1", 4], 0, 1, 1, None, [None]) == (0, 1, "x:0#1*4")
    assert map_reshape([None], 0, 1, "x:0#1*4", None, [None, 4]) == (0, 1, "x:0#1")
    assert map_reshape([None, None, 4], 0, 1, 1, None, [None]) is None     # an anonymous dimension


def _tokens(kind: str) -> tf.Graph:
    """Token losses ``[B, T]`` summed per example by segment ids that name each token's
    example (``tf.range(B)`` tiled, repeated or broadcast over the tokens)."""
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, T, D], name="x")
        v1.placeholder(tf.int32, [None], name="lengths")          # fed, unused
        tags = v1.placeholder(tf.int32, [None, T], name="tags")
        w = v1.get_variable("w", [D, C], initializer=v1.glorot_uniform_initializer(seed=3))
        logits = tf.reshape(tf.matmul(tf.reshape(x, [-1, D]), w), [-1, T, C])
        xent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=tags, logits=logits)
        batch = tf.shape(x)[0]
        ids = {"tile": lambda: tf.reshape(tf.tile(tf.expand_dims(tf.range(batch), 1), [1, T]), [-1]),
               "broadcast": lambda: tf.reshape(tf.range(batch)[:, None] + tf.zeros([1, T], tf.int32), [-1])
               }.get(kind, lambda: tf.repeat(tf.range(batch), T))()
        tokens = tf.reshape(xent, [-1])
        if kind == "mean":
            per = tf.math.segment_mean(tokens, ids)
        elif kind == "fixed_count":     # review 17: the count pinned the batch size
            per = tf.math.unsorted_segment_sum(tokens, ids, 7)
        elif kind == "sentences":       # ids of [B * S] sentences of T // S words, softmax per sentence
            sentence = tf.repeat(tf.range(batch * 5), T // 5)
            scores = tf.reshape(tf.reduce_sum(logits, 2), [-1])
            top = tf.gather(tf.math.unsorted_segment_max(scores, sentence, batch * 5), sentence)
            e = tf.exp(scores - top)
            attention = e / tf.gather(tf.math.unsorted_segment_sum(e, sentence, batch * 5), sentence)
            per = tf.reduce_sum(tf.reshape(attention * tokens, [-1, T]), 1)
        elif kind == "spread":          # a value per example gathered back to its tokens
            weight = tf.gather(tf.reduce_sum(tf.nn.softmax(tf.reduce_sum(logits, 2)), 1), ids)
            per = tf.math.unsorted_segment_sum(weight * tokens, ids, batch)
        elif kind == "time_major":      # tokens flattened time-major, ids example-major
            per = tf.math.unsorted_segment_sum(tf.reshape(tf.transpose(xent), [-1]), ids, batch)
        elif kind == "as_values":
            per = tf.reduce_sum(xent, 1) * tf.cast(tf.range(batch), tf.float32)
        else:
            per = tf.math.unsorted_segment_sum(tokens, ids, batch)
        loss = tf.reduce_mean(tf.square(per), name="loss")
        v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
    return g


#: Every kind at accumulate 1, two at 2 (suite time).
_SEGMENT_KINDS = [(k, 1) for k in ("tile", "repeat", "broadcast", "mean", "spread", "sentences")] + \
    [("tile", 2), ("sentences", 2)]


@pytest.mark.parametrize("kind,accumulate", _SEGMENT_KINDS)
def test_segment_ids_naming_each_tokens_example_are_exact(kind, accumulate):
    """They were "computes with row numbers local to each tower" (the tag was lost at the
    first ExpandDims or Tile), and SegmentMean had no rule."""
    res = replicate.transform(_tokens(kind), DEVICES, accumulate=accumulate)
    assert res.report.exact, res.report.reasons
    _matches_one_device(_tokens(kind), res)


@pytest.mark.parametrize("kind,why", [
    ("time_major", "do not pair with the data's examples"),
    ("fixed_count", "number of segments that is not the batch size"),
    ("as_values", "computes with row numbers local to each tower"),
])
def test_example_numbers_that_do_not_pair_with_the_data_stay_inexact(kind, why):
    res = replicate.transform(_tokens(kind), DEVICES)
    assert not res.report.exact
    assert any(why in str(r) for r in res.report.reasons), res.report.reasons


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("kind", ["last", "last_dynamic", "tags"])
def test_a_gather_per_example_with_batch_dims_is_exact(kind, accumulate):
    """``tf.gather(out, length - 1, batch_dims=1)`` was "GatherV2 with batch_dims", and the
    rewrite failed at step 1: the assertion for ops that pick examples took the lengths for
    positions of examples. Its gradient flattens with ``range(B) * T`` offsets."""
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, None if kind == "last_dynamic" else T, D], name="x")
        lengths = v1.placeholder(tf.int32, [None], name="lengths")
        tags = v1.placeholder(tf.int32, [None, T], name="tags")
        w = v1.get_variable("w", [D, C], initializer=v1.glorot_uniform_initializer(seed=3))
        h = tf.tanh(tf.reshape(tf.matmul(tf.reshape(x, [-1, D]), w), [-1, tf.shape(x)[1], C]))
        if kind == "tags":                  # each step's score of its tag
            picked = tf.gather(h, tags, batch_dims=2)
        else:
            picked = tf.gather(h, lengths - 1, batch_dims=1)
        loss = tf.reduce_mean(tf.square(picked), name="loss")
        v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
    res = replicate.transform(g, DEVICES, accumulate=accumulate)
    assert res.report.exact, res.report.reasons
    _matches_one_device(g, res)


def test_a_per_example_gather_by_row_numbers_is_inexact():
    """``tf.gather(h, tf.range(B), batch_dims=1)`` picks ``h[b, b]``: each tower numbers its
    examples from 0 (claimed exact, 0.018 off; review 17)."""
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, T, D], name="x")
        w = v1.get_variable("w", [D, C], initializer=v1.glorot_uniform_initializer(seed=3))
        h = tf.tanh(tf.reshape(tf.matmul(tf.reshape(x, [-1, D]), w), [-1, T, C]))
        loss = tf.reduce_mean(tf.square(tf.gather(h, tf.range(tf.shape(x)[0]), batch_dims=1)), name="loss")
        v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
    res = replicate.transform(g, DEVICES)
    assert not res.report.exact
    assert any("batch_dims by row numbers" in str(r) for r in res.report.reasons), res.report.reasons


def test_identity_n_names_each_output_like_its_own_input():
    """A stride read from ``tf.identity_n([h, q])[1]`` (``T - 1`` steps) was named like ``h``'s
    ``T`` and "proved" equal to the flattened rows: claimed exact, then the check stopped every
    step (review 17)."""
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, None, D], name="x")
        w = v1.get_variable("w", [D, C], initializer=v1.glorot_uniform_initializer(seed=3))
        h = tf.tanh(tf.reshape(tf.matmul(tf.reshape(x, [-1, D]), w), tf.stack([-1, tf.shape(x)[1], C])))
        _, shorter = tf.identity_n([h, h[:, 1:]])
        pick = tf.gather(tf.reshape(h, [-1, C]), tf.range(tf.shape(h)[0]) * tf.shape(shorter)[1])
        loss = tf.add(tf.reduce_mean(tf.square(pick)), tf.reduce_mean(tf.square(h)), name="loss")
        v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
    res = replicate.transform(g, DEVICES)
    assert not res.report.exact
