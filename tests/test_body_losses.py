"""A loss computed inside a function body: a v2 ``tf.cond`` on a fed flag choosing between two
plain means (distillation on or off), a ``tf.function`` returning a mean plus a regularizer.
The gradient goes through the body's reduction, weighed like a top-level mean: exact (both
were reported "If of a value reduced over the batch"). Branches weighed differently (a mean
and a masked mean) stay a reason."""

import numpy as np
import pytest
import tensorflow as tf

import replicate
from replicate.check.equivalence import compare

v1 = tf.compat.v1
D, C = 4, 3


def _graph(kind: str) -> tf.Graph:
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, D], name="x")
        y = v1.placeholder(tf.int64, [None], name="y")
        flag = v1.placeholder(tf.bool, [], name="flag")
        init = v1.glorot_uniform_initializer
        logits = v1.layers.dense(x, C, kernel_initializer=init(seed=1), name="student")
        teacher = v1.layers.dense(x, C, kernel_initializer=init(seed=2), trainable=False, name="teacher")
        xent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
        soft = tf.nn.softmax_cross_entropy_with_logits(labels=tf.nn.softmax(teacher), logits=logits)
        if kind == "cond":
            loss = tf.cond(flag, lambda: tf.reduce_mean(soft), lambda: tf.reduce_mean(xent))
        elif kind == "cond_masked":
            m = tf.cast(y > 0, tf.float32)
            loss = tf.cond(flag, lambda: tf.reduce_sum(soft * m) / tf.maximum(tf.reduce_sum(m), 1.0),
                           lambda: tf.reduce_mean(xent))
        elif kind == "function_parts":

            @tf.function
            def parts(values):
                return tf.reduce_mean(values), tf.reduce_sum(values)

            mean, total = parts(xent)
            loss = mean + 0.01 * total
        else:
            kernel = [v for v in v1.trainable_variables() if "kernel" in v.name][0]

            @tf.function
            def regularized(values, w):
                return tf.reduce_mean(values) + 0.01 * tf.reduce_sum(tf.square(w))

            loss = regularized(xent, kernel)
        loss = tf.identity(loss, name="loss")
        v1.train.GradientDescentOptimizer(0.5).minimize(loss, name="train")
    return g


def _feeds(flag: bool):
    rng = np.random.default_rng(5)
    return [{"x:0": rng.normal(size=(b, D)).astype(np.float32), "flag:0": flag,
             "y:0": rng.integers(0, C, b).astype(np.int64)} for b in (7, 5, 2)]


@pytest.mark.parametrize("kind,flag", [("cond", True), ("cond", False), ("function", True)])
@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_mean_returned_by_a_body_is_exact(kind, flag, accumulate):
    res = replicate.transform(_graph(kind), ["/cpu:1", "/cpu:2", "/cpu:3"], accumulate=accumulate)
    assert res.report.exact, res.report.reasons
    r = compare(_graph(kind), res.graph, "train", _feeds(flag), fetch=("loss:0",), cpus=4)
    assert r.max_rel < 1e-5


def test_branches_weighed_differently_are_a_reason():
    res = replicate.transform(_graph("cond_masked"), ["/cpu:1", "/cpu:2", "/cpu:3"])
    assert not res.report.exact


def test_a_mean_and_a_sum_returned_by_one_call_are_a_reason_that_says_so():
    """Their gradients enter the call's gradient function together: no weighing apart (the
    reason said "report this graph")."""
    res = replicate.transform(_graph("function_parts"), ["/cpu:1", "/cpu:2", "/cpu:3"])
    assert not res.report.exact
    assert any("results of the call" in r.what and "return one loss" in r.fix
               for r in res.report.reasons)


@pytest.mark.parametrize("form", ["captured", "loop_variable"])
def test_a_loss_out_of_a_v2_loop_is_the_loop_s_value_not_its_counter(form):
    """Review 44: ``_, a = tf.while_loop(...)`` over a batch mean, ``a`` the loss. The loss was
    found as the loop op's output 0 (the iteration counter), whose fact is shared: every
    tower's gradient weighed alike, claimed exact and 0.09-0.25 off at uneven batches (and
    refused without ``batch_inputs=``). The loss is the loop output that leaves the loop."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 4], name="x")
        y = tf.compat.v1.placeholder(tf.int64, [None], name="y")
        w = tf.compat.v1.get_variable("w", [4, 3], initializer=tf.compat.v1.glorot_uniform_initializer(seed=1))
        m = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=tf.matmul(x, w)))
        if form == "captured":
            _, a = tf.while_loop(lambda i, a: i < 2, lambda i, a: (i + 1, a * 0.5 + m), [0, 0.0])
        else:
            _, a = tf.while_loop(lambda i, a: i < 2, lambda i, a: (i + 1, a * 0.9), [0, m])
        loss = tf.identity(a, name="loss")
        tf.compat.v1.train.GradientDescentOptimizer(0.4).minimize(loss, name="train")
    rng = np.random.RandomState(0)
    feeds = [{"x:0": rng.randn(b, 4).astype(np.float32), "y:0": rng.randint(0, 3, b)} for b in (7, 2, 5)]
    for options in ({}, {"accumulate": 2}):
        res = replicate.transform(graph, ["/cpu:1", "/cpu:2", "/cpu:3"], **options)
        assert res.report.exact, res.report.reasons
        assert compare(graph, res.graph, "train", feeds, fetch=("loss:0",)).max_rel < 1e-5


@pytest.mark.parametrize("options", [{}, {"batch_norm": "sync"}, {"accumulate": 2}])
def test_a_guarded_masked_mean_in_a_v2_cond_stays_finite(options):
    """``cond(sum(m) > 0, sum(ce * m) / sum(m), 0.0)`` as a v2 cond: the ratio's sums are in the
    branch's body, where they cannot be synchronized, so the rewrite is inexact. The predicate's
    ``sum(m)`` (a statistic of the labels) used to be read as the batch's in every tower: a
    tower whose examples are all masked out took the ratio's branch and divided 0 by 0, and
    every variable became NaN where one device trains (review 45 C2). Each tower now decides
    on its own count: inexact, finite."""
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, D], name="x")
        y = v1.placeholder(tf.int64, [None], name="y")
        logits = v1.layers.dense(x, C, kernel_initializer=v1.glorot_uniform_initializer(seed=1))
        ce = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
        m = tf.cast(y > 0, tf.float32)
        loss = tf.cond(tf.reduce_sum(m) > 0, lambda: tf.reduce_sum(ce * m) / tf.reduce_sum(m),
                       lambda: tf.constant(0.0))
        v1.train.GradientDescentOptimizer(0.5).minimize(tf.identity(loss, name="loss"), name="train")
    res = replicate.transform(g, ["/cpu:1", "/cpu:2", "/cpu:3"], **options)
    assert not res.report.exact
    assert any("disable_control_flow_v2" in r.fix for r in res.report.reasons), res.report.reasons
    rng = np.random.default_rng(3)
    feeds = []
    for b in (7, 6, 5):
        labels = rng.integers(0, C, b).astype(np.int64)
        labels[:3] = 0                  # tower 0's examples all masked out
        feeds.append({"x:0": rng.normal(size=(b, D)).astype(np.float32), "y:0": labels})
    cmp = compare(g, res.graph, "train", feeds, fetch=("loss:0",))
    assert np.isfinite(cmp.max_rel), (cmp.worst, cmp.max_rel)
