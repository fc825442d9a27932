"""Custom gradients (``tf.custom_gradient``, ``gradient_override_map``) that are not linear in
the gradient flowing into them.

Towers that differentiate their own share of the loss hand each example ``1/n_k`` of the
upstream instead of one device's ``1/B``; a clipped gradient then differs. When the custom
gradient is per-example, the towers weigh the loss instead (every term scaled by its tower
weight where its gradient enters, the towers' gradients summed), so each example receives
one device's upstream and the result is exact. A custom gradient that reduces over the batch
stays a reason. SGD, uneven batches and an empty tower; the clip threshold is chosen so that
some examples are clipped and some are not (weighed afterwards, as before, the clipped case
trained 1e-2 away from one device).
"""

import models
import numpy as np
import pytest
import tensorflow as tf

import replicate
from replicate.check.equivalence import compare

v1 = tf.compat.v1
DEVICES = ["/cpu:1", "/cpu:2", "/cpu:3"]


@tf.RegisterGradient("ReplicateTestSignedRoot")
def _signed_root(op, dy):
    """A per-example gradient nonlinear in ``dy``."""
    return tf.sign(dy) * tf.sqrt(tf.abs(dy) + 1e-12)


def _graph(kind: str) -> tf.Graph:
    graph = tf.Graph()
    with graph.as_default():
        p, y, m, w = models.masked_regression()

        @tf.custom_gradient
        def clipped(t):
            if kind == "clip_by_norm":
                return t, lambda dy: tf.clip_by_norm(dy, 0.05)
            if kind == "batch_size":     # review 33: a gradient reversal scaled by 1 / batch
                return t, lambda dy: -dy * 4.0 / tf.cast(tf.shape(t)[0], tf.float32)
            if kind == "batch_size_held":   # review 34: the size cast in the forward function
                n = tf.cast(tf.shape(t)[0], tf.float32)
                return t, lambda dy: -dy * 4.0 / n
            return t, lambda dy: tf.clip_by_value(dy, -0.08, 0.08)

        if kind == "override":
            with graph.gradient_override_map({"Identity": "ReplicateTestSignedRoot"}):
                e = tf.square(tf.identity(p) - y)
        else:
            e = tf.square(clipped(p) - y)
        if kind == "masked_plus_l2":
            loss = tf.reduce_sum(e * m) / tf.reduce_sum(m) + 0.01 * tf.nn.l2_loss(w)
        else:
            loss = tf.reduce_mean(e) + 0.01 * tf.nn.l2_loss(w)
        tf.identity(loss, name="loss")
        v1.train.GradientDescentOptimizer(0.3).minimize(loss, name="train")
    return graph


def _feeds():
    rng = np.random.RandomState(5)
    out = []
    for batch in (7, 2, 5):
        mask = (rng.rand(batch) > 0.5).astype(np.float32)
        mask[:2], mask[-1] = 0, 1        # a tower with examples but none masked in
        out.append({"x:0": rng.randn(batch, 4).astype(np.float32),
                    "y:0": 2 * rng.randn(batch).astype(np.float32), "m:0": mask})
    return out


@pytest.mark.parametrize("options", [{}, {"accumulate": 2}], ids=["plain", "accumulate"])
@pytest.mark.parametrize("kind", ["clip_by_value", "override", "masked_plus_l2"])
def test_a_per_example_custom_gradient_is_exact(kind, options):
    graph = _graph(kind)
    res = replicate.transform(graph, DEVICES, **options)
    assert res.report.exact, [str(r) for r in res.report.reasons]
    cmp = compare(graph, res.graph, "train", _feeds(), fetch=("loss:0",))
    assert cmp.max_rel <= 1e-5, (cmp.worst, cmp.max_rel)
    for single, multi in cmp.fetched:
        np.testing.assert_allclose(single, multi, rtol=1e-5)


@pytest.mark.parametrize("kind", ["clip_by_norm", "batch_size", "batch_size_held"])
def test_a_custom_gradient_over_the_batch_is_a_reason(kind):
    """Also one that divides the incoming gradient by the tower's batch size (review 33:
    claimed exact, 0.05-0.8 off): each tower divides by its own count."""
    graph = _graph(kind)
    res = replicate.transform(graph, DEVICES)
    assert not res.report.exact
    assert any("reduces over the batch" in r.what for r in res.report.reasons), res.report.reasons
    cmp = compare(graph, res.graph, "train", _feeds())
    assert cmp.max_rel > 1e-4            # and the graph does train differently


def _seeded(seed: str) -> tf.Graph:
    """A summed loss differentiated from a given seed: ``1 / n`` of the batch size, or the
    per-example gradients a DDPG actor is fed (``-dQ/da``), as such or divided by ``n``."""
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 4], name="x")
        y = v1.placeholder(tf.float32, [None], name="y")
        w = v1.get_variable("w", [4], initializer=v1.glorot_uniform_initializer(seed=1))
        p = tf.tanh(tf.reduce_sum(x * w, 1))
        loss = tf.reduce_sum(tf.square(p - y), name="loss")
        n = tf.cast(tf.shape(x)[0], tf.float32)
        if seed == "one_over_n":
            grads = tf.gradients(loss, [w], grad_ys=1.0 / n)
        elif seed == "critic_mean":     # a DDPG actor seeded by the gradient of a batch mean
            grads = tf.gradients(p, [w], -tf.gradients(tf.reduce_mean(tf.square(p - y)), p)[0])
        else:       # y stands for the fed action gradients
            grads = tf.gradients(p, [w], -y / n if seed == "actions_over_n" else -y)
        v1.train.GradientDescentOptimizer(0.3).apply_gradients(zip(grads, [w]), name="train")
    return graph


@pytest.mark.parametrize("seed,exact", [("one_over_n", False), ("actions_over_n", False),
                                        ("critic_mean", False), ("actions", True)])
def test_a_seed_given_to_the_gradients_must_be_the_same_or_per_example(seed, exact):
    """Review 33: ``tf.gradients(sum_loss, params, grad_ys=1/n)`` (and ``minimize``'s
    ``grad_loss``, and a DDPG actor's fed action gradients divided by the batch size) was
    claimed exact, 0.2-1.0 off: each tower seeded its gradients with its own ``1/n_k``. Such a
    seed is now a reason that names it; fed per-example seeds stay exact."""
    res = replicate.transform(_seeded(seed), DEVICES)
    assert res.report.exact == exact, [str(r) for r in res.report.reasons]
    feeds = [{k: v for k, v in f.items() if k != "m:0"} for f in _feeds()]
    cmp = compare(_seeded(seed), res.graph, "train", feeds, fetch=("loss:0",))
    if exact:
        assert cmp.max_rel <= 1e-5, (cmp.worst, cmp.max_rel)
    else:
        assert any("start from '" in r.what and "grad_ys" in r.what for r in res.report.reasons)
        assert cmp.max_rel > 1e-4            # and the graph does train differently


def test_recompute_grad_is_named_as_the_reason():
    """Review 21: ``tf.recompute_grad`` (its function differentiated again inside the custom
    gradient) was reported as "the loss ... was not recognized (gradients seeded by a given
    grad_ys?)", with loss= as the fix, which does not help."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 3], name="x")
        y = tf.compat.v1.placeholder(tf.float32, [None], name="y")
        w = tf.compat.v1.get_variable("w", [3, 4], use_resource=True)

        @tf.recompute_grad
        def block(h):
            return tf.nn.relu(tf.matmul(h, w))
        loss = tf.reduce_mean(tf.square(tf.reduce_sum(block(x), 1) - y), name="loss")
        tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
    res = replicate.transform(graph, ["/cpu:0", "/cpu:1"])
    assert not res.report.exact
    reason = next(r for r in res.report.reasons if "custom gradient, seeded by" in r.what)
    assert "tf.recompute_grad" in reason.fix
    assert not any("was not recognized" in r.what for r in res.report.reasons)
