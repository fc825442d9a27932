"""Forward code that reads a gradient: adversarial training. A tower's gradient of its own
mean loss with respect to its inputs is one device's times ``B / n_k``; the fast gradient
sign method takes only its sign, which that positive factor does not change, so it is exact.
The raw gradient of a mean (``x + eps * dL/dx``), or the sign of a gradient of two terms
weighed unalike, is not, and says why."""

import numpy as np
import pytest
import tensorflow as tf

import replicate
from replicate.check.equivalence import compare

v1 = tf.compat.v1
D, C = 4, 3


def _net(x, reuse=None):
    with v1.variable_scope("net", reuse=reuse):
        init = v1.glorot_uniform_initializer
        h = tf.tanh(v1.layers.dense(x, 5, kernel_initializer=init(seed=1), name="l1"))
        return v1.layers.dense(h, C, kernel_initializer=init(seed=2), name="l2")


def _graph(kind: str) -> tf.Graph:
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, D], name="x")
        y = v1.placeholder(tf.int64, [None], name="y")
        xent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=_net(x))
        if kind == "two_terms_sign":     # a masked mean beside the mean
            m = tf.cast(y > 0, tf.float32)
            clean = tf.reduce_mean(xent) + 3.0 * tf.reduce_sum(xent * m) / tf.maximum(tf.reduce_sum(m), 1.0)
        else:
            clean = tf.reduce_mean(xent)
        step, = tf.gradients(clean, x)
        step = step if kind == "raw" else tf.sign(step)
        adversarial = tf.stop_gradient(x + 0.1 * step)
        loss = tf.add(0.5 * clean, 0.5 * tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=y, logits=_net(adversarial, True))), name="loss")
        v1.train.GradientDescentOptimizer(0.5).minimize(loss, name="train")
    return g


def _feeds():
    rng = np.random.default_rng(4)
    return [{"x:0": rng.normal(size=(b, D)).astype(np.float32),
             "y:0": rng.integers(0, C, b).astype(np.int64)} for b in (7, 5, 2)]


@pytest.mark.parametrize("kind", ["sign"])
@pytest.mark.parametrize("accumulate", [1, 2])
def test_the_sign_of_an_input_gradient_is_exact(kind, accumulate):
    res = replicate.transform(_graph(kind), ["/cpu:1", "/cpu:2", "/cpu:3"], accumulate=accumulate)
    assert res.report.exact, res.report.reasons
    assert compare(_graph(kind), res.graph, "train", _feeds(), fetch=("loss:0",), cpus=4).max_rel < 1e-5


@pytest.mark.parametrize("kind", ["raw", "two_terms_sign"])
def test_a_raw_input_gradient_or_the_sign_of_two_terms_is_a_reason(kind):
    """Two terms weigh a tower's rows unalike (``1 / n_k`` and a count's share), so even
    the sign may differ."""
    res = replicate.transform(_graph(kind), ["/cpu:1", "/cpu:2", "/cpu:3"])
    assert not res.report.exact
    assert any("forward code reads gradient" in r.what for r in res.report.reasons)
    if kind == "raw":               # the reason is real: the check can see it
        r = compare(_graph(kind), res.graph, "train", _feeds(), fetch=("loss:0",), cpus=4)
        assert r.max_rel > 1e-4


def _fetched(kind: str) -> tf.Graph:
    """A driver's own ``tf.gradients``, fetched by name and applied by nothing: a saliency map
    of a summed loss, the gradient of the logits, a gradient norm to log."""
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, D], name="x")
        y = v1.placeholder(tf.int64, [None], name="y")
        logits = _net(x)
        xent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
        weights = [v for v in v1.trainable_variables() if v.op.name == "net/l2/kernel"]
        seen = {"sum": lambda: tf.gradients(tf.reduce_sum(xent), x)[0],
                "logits": lambda: tf.gradients(logits, x)[0],
                "mean": lambda: tf.gradients(tf.reduce_mean(xent), x)[0],
                "norm": lambda: tf.linalg.global_norm(tf.gradients(tf.reduce_sum(xent), weights)),
                "max": lambda: tf.gradients(tf.reduce_max(xent), weights)[0],
                "product": lambda: tf.gradients(tf.reduce_mean(xent) * tf.reduce_mean(
                    tf.square(logits)), weights)[0]}[kind]()
        tf.identity(seen, name="seen")
        loss = tf.reduce_mean(xent, name="loss")
        v1.train.GradientDescentOptimizer(0.5).minimize(loss, name="train")
    return g


@pytest.mark.parametrize("kind", ["sum", "logits", "mean", "norm"])
@pytest.mark.parametrize("accumulate", [1, 2])
def test_gradients_a_driver_fetches_are_one_device_s(kind, accumulate):
    """They were weighed as shares of a mean's whatever their loss (a third of the gradient of
    a sum on 3 towers, claimed exact); each is now weighed by its own loss."""
    res = replicate.transform(_fetched(kind), ["/cpu:1", "/cpu:2", "/cpu:3"], accumulate=accumulate)
    assert res.report.exact, res.report.reasons
    r = compare(_fetched(kind), res.graph, "train", _feeds(), fetch=("seen:0",), cpus=4)
    assert r.max_rel < 1e-5
    for single, multi in r.fetched:
        np.testing.assert_allclose(single[0], multi[0], rtol=1e-5, atol=1e-7)


def test_a_fetched_gradient_of_a_batch_maximum_is_a_reason():
    res = replicate.transform(_fetched("max"), ["/cpu:1", "/cpu:2", "/cpu:3"])
    assert not res.report.exact
    assert any("fetched, applied by no train op" in r.what for r in res.report.reasons)


def test_the_loss_of_a_seed_that_reaches_several_terms_is_their_sum():
    """``tf.gradients(mean + 0.01 * reduce_sum(x ** 2), x)`` of scalars: the add's gradient
    makes no op, so the seed is read by both terms' gradient code. The loss was taken to be
    the first term alone, and the sign of that gradient was claimed exact (0.035 off)."""
    from replicate.batchflow.roles import scope_seeds
    from replicate.graph.ir import IR

    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, D], name="x")
        y = v1.placeholder(tf.int64, [None], name="y")
        mean = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=_net(x)))
        total = tf.add(mean, 0.01 * tf.reduce_sum(tf.square(x)), name="total")
        tf.gradients(total, x)
    ir = IR.from_graph_def(g.as_graph_def())
    assert [loss for _, loss in scope_seeds(ir, "gradients")] == ["total:0"]


def test_a_fetched_gradient_of_a_product_of_means_is_a_reason_and_training_stays_exact():
    """Its loss is a nonlinear function of batch means; synchronizing them for it had changed
    the training loss's own mean in the forward pass (variables 1.5 off, claimed exact)."""
    res = replicate.transform(_fetched("product"), ["/cpu:1", "/cpu:2", "/cpu:3"])
    assert not res.report.exact
    assert any("fetched, applied by no train op" in r.what for r in res.report.reasons)
    r = compare(_fetched("product"), res.graph, "train", _feeds(), fetch=("loss:0",), cpus=4)
    assert r.max_rel < 1e-5
