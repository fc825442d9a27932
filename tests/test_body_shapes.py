"""Function bodies keep the shapes of the variables and lists they are passed.

A linear-chain CRF's forward recursion by ``tf.scan`` over time steps (the 2017 taggers' way
without contrib) reads each step's scores from a TensorList and the transitions from a
captured variable. TensorFlow's import of the loop body gives both an unknown rank (their
handle data is not serialized), so the recursion was "AddV2 of a tensor of unknown rank":
inexact, and a driver's accuracy of the recursion's last step failed at run time (tower 0's
rows against the whole batch's labels). With the shapes given to the import, the loss is a mean
of per-sentence values: exact, with the fetched values merged, also when the scan runs inside
a ``tf.function`` that captures the transitions (the handle passes through two bodies)."""

import numpy as np
import pytest
import tensorflow as tf

import replicate
from replicate.check.equivalence import compare

v1 = tf.compat.v1
D, C, T = 4, 3, 3
FETCH = ("loss:0", "logZ:0", "acc:0")


def _graph(kind: str) -> tf.Graph:
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, T, D], name="x")
        y = v1.placeholder(tf.int64, [None], name="y")
        init = v1.glorot_uniform_initializer
        scores = tf.reshape(v1.layers.dense(tf.reshape(x, [-1, D]), C, kernel_initializer=init(seed=1)),
                            [-1, T, C])
        trans = v1.get_variable("trans", [C, C], initializer=init(seed=2))

        def forward(steps):
            return tf.scan(lambda a, e: tf.reduce_logsumexp(a[:, :, None] + trans[None], 1) + e,
                           steps[1:], initializer=steps[0])

        steps = tf.transpose(scores, [1, 0, 2])
        alphas = tf.function(forward)(steps) if kind == "function" else forward(steps)
        log_z = tf.reduce_logsumexp(alphas[-1], 1, name="logZ")
        hit = tf.equal(tf.argmax(alphas[-1], 1), y)
        tf.reduce_mean(tf.cast(hit, tf.float32), name="acc")
        gold = tf.reduce_sum(tf.one_hot(y, C) * scores[:, -1], 1)
        loss = tf.reduce_mean(log_z - gold, name="loss")
        v1.train.GradientDescentOptimizer(0.5).minimize(loss, name="train")
    return g


def _feeds():
    rng = np.random.default_rng(3)
    return [{"x:0": rng.normal(size=(b, T, D)).astype(np.float32),
             "y:0": rng.integers(0, C, b).astype(np.int64)} for b in (7, 5, 2)]


@pytest.mark.parametrize("kind,accumulate", [("scan", 1), ("function", 2)])   # crossed: suite time
def test_a_scan_crf_recursion_is_exact_with_its_fetches_merged(kind, accumulate):
    _exact_and_matching(lambda: _graph(kind), accumulate, FETCH)


def _exact_and_matching(build, accumulate: int, fetch) -> None:
    """Claimed exact, and three SGD steps match one device's, fetched values too."""
    res = replicate.transform(build(), ["/cpu:1", "/cpu:2", "/cpu:3"], accumulate=accumulate)
    assert res.report.exact, res.report.reasons
    r = compare(build(), res.graph, "train", _feeds(), fetch=fetch, cpus=4)
    assert r.max_rel < 1e-5
    for one, towers in r.fetched:
        for a, b in zip(one, towers):
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


def _nested() -> tf.Graph:
    """A ``tf.function`` calling another one twice, both reading captured resource variables:
    the inner call's results had an unknown rank in the outer body ("Mul of a tensor of
    unknown rank", inexact, the fetched features tower 0's; review 10). The functions a body
    calls now go along with its import, which infers through them."""
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, T, D], name="x")
        y = v1.placeholder(tf.int64, [None], name="y")
        init = v1.glorot_uniform_initializer
        w = v1.get_variable("w", [D, D], initializer=init(seed=1), use_resource=True)
        u = v1.get_variable("u", [D, D], initializer=init(seed=2), use_resource=True)

        @tf.function
        def inner(v):
            return tf.nn.relu(tf.matmul(v, w))

        @tf.function
        def outer(v):
            return inner(v) * 2.0 + tf.matmul(inner(v), u)

        feat = tf.identity(outer(tf.reduce_mean(x, 1)), name="feat")
        logits = tf.identity(v1.layers.dense(feat, C, kernel_initializer=init(seed=3)), name="logits")
        xent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
        loss = tf.reduce_mean(xent, name="loss")
        v1.train.GradientDescentOptimizer(0.5).minimize(loss, name="train")
    return g


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_function_calling_another_is_exact_with_its_fetches_merged(accumulate):
    _exact_and_matching(_nested, accumulate, ("loss:0", "feat:0", "logits:0"))
