"""Embedding lookups of a variable on a partitioner (the word2vec tutorial's layout):
``DynamicPartition`` of the ids and of their row numbers, a gather per shard, and
``DynamicStitch`` back to each row's place. Each tower's rows return to their own places, so
the towers train exactly as one device does (review 26: reported inexact, "DynamicStitch
interleaves rows by position"); a stitch that does not put rows back is still not claimed
exact."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import replicate
from replicate.check.equivalence import compare

v1 = tf.compat.v1
V, E = 30, 4


def _model(strategy="mod", ids_shape=(None,), head="softmax", optimizer="sgd", shards=3, where="top"):
    graph = tf.Graph()
    with graph.as_default():
        v1.set_random_seed(7)
        ids = v1.placeholder(tf.int32, list(ids_shape), name="ids")
        labels = v1.placeholder(tf.int32, [None, 1], name="labels")
        emb = v1.get_variable("emb", [V, E], partitioner=v1.fixed_size_partitioner(shards),
                              initializer=v1.random_uniform_initializer(-1, 1, seed=1))
        rows = _lookup(emb, ids, strategy, where)
        if len(ids_shape) == 2:
            rows = tf.reduce_mean(rows, 1)                     # a bag of words per example
        w = v1.get_variable("out_w", [V, E], initializer=v1.random_uniform_initializer(-1, 1, seed=2))
        b = v1.get_variable("out_b", [V], initializer=v1.zeros_initializer())
        if head == "nce":
            per = v1.nn.nce_loss(w, b, labels, rows, num_sampled=4, num_classes=V)
        else:
            per = tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=labels[:, 0], logits=tf.matmul(rows, w, transpose_b=True) + b)
        loss = tf.reduce_mean(per, name="loss")
        opt = {"sgd": v1.train.GradientDescentOptimizer(0.5),
               "adagrad": v1.train.AdagradOptimizer(0.5)}[optimizer]
        opt.minimize(loss, name="train")
    return graph


def _lookup(emb, ids, strategy, where):
    """The lookup at the top level, in both branches of a v2 cond, or in a defun's body."""
    def look(i):
        return v1.nn.embedding_lookup(emb, i, partition_strategy=strategy)
    if where == "cond":
        training = v1.placeholder_with_default(True, [], name="training")
        return tf.cond(training, lambda: look(ids), lambda: 0.5 * look(ids))
    if where == "defun":
        return tf.function(look)(ids)
    return look(ids)


def _feeds(batch, ids_shape=(None,), steps=3):
    rng = np.random.RandomState(0)
    shape = (batch,) if len(ids_shape) == 1 else (batch, 3)   # 3 ids per example
    # repeated ids: several rows of one shard row, in several towers
    return [{"ids:0": rng.randint(0, 8, shape), "labels:0": rng.randint(0, V, (batch, 1))}
            for _ in range(steps)]


@pytest.mark.parametrize("case", [
    dict(), dict(strategy="div"), dict(ids_shape=(None, 3)), dict(head="nce"),
    dict(optimizer="adagrad"), dict(shards=2, accumulate=2), dict(where="cond"),
    dict(where="defun", strategy="div"),
])
def test_a_partitioned_lookup_is_exact(case):
    case = dict(case)
    accumulate = case.pop("accumulate", 1)
    graph = _model(**case)
    for devices, batch in ((3, 7), (3, 2)):
        res = replicate.transform(graph, [f"/cpu:{i}" for i in range(devices)],
                                  accumulate=accumulate)
        assert res.report.exact, res.report.reasons
        result = compare(graph, res.meta_graph_def, "train",
                         _feeds(batch, case.get("ids_shape", (None,))))
        assert result.max_rel <= 1e-5, (batch, result.worst, result.max_rel)


def _swapped():
    """Two shards' rows stitched into each other's places: no lookup puts rows back so."""
    graph = tf.Graph()
    with graph.as_default():
        v1.set_random_seed(7)
        ids = v1.placeholder(tf.int32, [None], name="ids")
        y = v1.placeholder(tf.float32, [None], name="y")
        w = v1.get_variable("w", [V, E], initializer=v1.random_uniform_initializer(-1, 1, seed=1))
        which = tf.math.floormod(ids, 2)
        numbers = tf.dynamic_partition(tf.range(tf.size(ids)), which, 2)
        parts = tf.dynamic_partition(ids, which, 2)
        rows = [tf.gather(w, parts[1]), tf.gather(w, parts[0])]
        out = tf.dynamic_stitch(numbers, rows)
        loss = tf.reduce_mean(tf.square(tf.reduce_sum(out, 1) - y), name="loss")
        v1.train.GradientDescentOptimizer(0.5).minimize(loss, name="train")
    return graph


def test_a_stitch_that_moves_rows_is_not_claimed_exact():
    res = replicate.transform(_swapped(), ["/cpu:0", "/cpu:1"])
    assert not res.report.exact
    assert "DynamicStitch" in " ".join(str(r) for r in res.report.reasons)


def test_ids_with_a_dynamic_second_axis_run_and_are_not_claimed_exact_when_they_differ():
    """``[None, None]`` ids: the count the row numbers run to has no symbolic value, so the
    stitch is not followed (inexact), and the rewrite still runs."""
    graph = _model(ids_shape=(None, None))
    res = replicate.transform(graph, ["/cpu:0", "/cpu:1", "/cpu:2"])
    result = compare(graph, res.meta_graph_def, "train", _feeds(7, (None, None)))
    assert result.max_rel <= 1e-5 or not res.report.exact


def test_a_range_over_a_size_without_a_symbolic_value_is_per_tower():
    """``tf.range(tf.size(x))`` for ``x`` of shape ``[None, None]``: each tower numbers its own
    elements. It was taken for the same in every tower, and a loss term of those numbers was
    claimed exact (0.02 off after 3 steps)."""
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, None], name="x")
        w = v1.get_variable("w", [1], initializer=v1.ones_initializer())
        numbers = tf.cast(tf.range(tf.size(x)), tf.float32)
        loss = tf.add(tf.reduce_mean(x * w), 0.01 * tf.reduce_mean(numbers * w), name="loss")
        v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
    res = replicate.transform(graph, ["/cpu:0", "/cpu:1", "/cpu:2"])
    assert not res.report.exact
    # (the size is the batch size times a length the same in every tower, so the numbers
    # are the tower's own: computing with them as values mixes the examples)
    assert "computes with row numbers local to each tower" in str(res.report.reasons)
