"""Optimizers chained in one step (pix2pix-style GANs): the generator's gradients wait for the
discriminator's update by a control edge. The towers compute the discriminator's gradients,
the merged update runs once, then the towers compute the generator's gradients against the
updated discriminator. Checked against one device with plain SGD (a misweighted gradient
shows in the update), uneven batches, an empty tower and accumulation."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import replicate
from replicate.check.equivalence import compare
from replicate.errors import AnalysisError

v1 = tf.compat.v1
CPUS = ["/cpu:0", "/cpu:1", "/cpu:2"]
RTOL = 1e-5


def _gan(resource=True, bn=False, global_step_in_d=False, ema=False, chained=True):
    graph = tf.Graph()
    with graph.as_default():
        v1.set_random_seed(1)
        x = v1.placeholder(tf.float32, [None, 4], name="x")
        z = v1.placeholder(tf.float32, [None, 3], name="z")
        step = v1.train.get_or_create_global_step()
        with v1.variable_scope("gen", use_resource=resource):
            h = v1.layers.dense(z, 6, use_bias=not bn)
            if bn:
                h = v1.layers.batch_normalization(h, training=True)
            fake = v1.layers.dense(tf.nn.relu(h), 4)
        with v1.variable_scope("disc", use_resource=resource):
            def disc(t, reuse):
                with v1.variable_scope("d", reuse=reuse):
                    hidden = tf.nn.tanh(v1.layers.dense(t, 5, name="h"))
                    # a bias far from 0: its relative error is not float noise around 0
                    return tf.squeeze(v1.layers.dense(hidden, 1, name="o",
                                                      bias_initializer=v1.constant_initializer(0.5)), 1)
            real, fake_logit = disc(x, False), disc(fake, True)
        xent = tf.nn.sigmoid_cross_entropy_with_logits
        d_loss = tf.reduce_mean(xent(labels=tf.ones_like(real), logits=real)
                                + xent(labels=tf.zeros_like(fake_logit), logits=fake_logit), name="d_loss")
        g_loss = tf.reduce_mean(xent(labels=tf.ones_like(fake_logit), logits=fake_logit)
                                + 0.1 * tf.reduce_mean(tf.abs(fake - x), 1), name="g_loss")
        with tf.name_scope("disc_train"):
            opt = v1.train.GradientDescentOptimizer(0.3)
            d_vars = [v for v in v1.trainable_variables() if v.name.startswith("disc")]
            d_train = opt.apply_gradients(opt.compute_gradients(d_loss, var_list=d_vars),
                                          global_step=step if global_step_in_d else None)
        with tf.name_scope("gen_train"):
            waits = ([d_train] if chained else []) + (v1.get_collection(v1.GraphKeys.UPDATE_OPS) if bn else [])
            with tf.control_dependencies(waits):
                opt = v1.train.GradientDescentOptimizer(0.3)
                g_vars = [v for v in v1.trainable_variables() if v.name.startswith("gen")]
                g_train = opt.apply_gradients(opt.compute_gradients(g_loss, var_list=g_vars))
        extra = [v1.train.ExponentialMovingAverage(0.9).apply([d_loss, g_loss])] if ema else []
        if not global_step_in_d:
            extra.append(v1.assign_add(step, 1))
        tf.group(g_train, *extra, name="train")
    return graph


def _check(graph, towers, accumulate=1, **options):
    res = replicate.transform(graph, CPUS[:towers], accumulate=accumulate, **options)
    rng = np.random.RandomState(0)
    sizes = (7, 2, 5) if towers == 3 else (7, 5, 3)
    feeds = [{"x:0": rng.randn(b, 4).astype("f"), "z:0": rng.randn(b, 3).astype("f")} for b in sizes]
    result = compare(graph, res.meta_graph_def, "train", feeds, cpus=towers, fetch=("d_loss:0", "g_loss:0"))
    return res, result


#: Every variant and every configuration at least once (not crossed: suite time).
_CHAINED = [("plain", 2, 1), ("plain", 2, 2), ("global_step_in_d", 3, 1), ("ema", 2, 2)]


@pytest.mark.parametrize("variant,towers,accumulate", _CHAINED)
def test_chained_optimizers_are_exact(variant, towers, accumulate):
    options = {"global_step_in_d": variant == "global_step_in_d", "ema": variant == "ema"}
    res, result = _check(_gan(**options), towers, accumulate)
    assert res.report.exact, res.report.reasons
    assert res.report.phases == ["disc_train/GradientDescent"]
    assert "phases        2 in one step" in str(res.report)
    assert result.max_rel <= RTOL, (result.worst, result.max_rel)
    for single, replicated in result.fetched:
        np.testing.assert_allclose(replicated, single, rtol=1e-5, atol=1e-6)


def test_chained_optimizers_with_synchronized_batch_norm():
    res, result = _check(_gan(bn=True), 3, batch_norm="sync")
    assert res.report.exact, res.report.reasons
    assert result.max_rel <= RTOL, (result.worst, result.max_rel)


def test_the_phases_are_what_makes_it_exact():
    """Without the control edge the generator's gradients read the discriminator before its
    update: a different training run, which the transform also reproduces."""
    chained, _ = _check(_gan(), 2)
    free, result = _check(_gan(chained=False), 2)
    assert free.report.exact and not free.report.phases
    assert chained.report.phases
    assert result.max_rel <= RTOL


@pytest.mark.parametrize("towers,accumulate", [(2, 1), (3, 1), (2, 2)])
def test_reference_variables_are_read_again_after_the_earlier_phase(towers, accumulate):
    """On one device the generator's gradient code reads the discriminator's reference
    variables through ``read`` identities that alias their buffers, so it sees the values
    the discriminator's update wrote in place; each tower reads them again after the
    update (without that, 1.6e-5 off on pix2pix at 3 towers)."""
    res, result = _check(_gan(resource=False), towers, accumulate)
    assert res.report.exact, res.report.reasons
    late = [n for n in res.graph_def.node if "/replicate/phase_read/" in n.name]
    assert late and all(any(c.startswith("^disc_train") for c in n.input) for n in late)
    assert result.max_rel <= RTOL, (result.worst, result.max_rel)


def _two_steps(after_update):
    """A second loss that reads ``after_update(x, w)``, built after the first update."""
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 4], name="x")
        w = v1.get_variable("w", [4, 1], use_resource=True)
        v = v1.get_variable("v", [4, 1], use_resource=True)
        first = v1.train.GradientDescentOptimizer(0.1).minimize(tf.reduce_mean(tf.square(x @ w)), var_list=[w])
        with tf.control_dependencies([first]):
            late = after_update(x, w)
        loss = tf.reduce_mean(tf.square(x @ v + late), name="loss")
        second = v1.train.GradientDescentOptimizer(0.1).minimize(loss, var_list=[v])
        tf.group(first, second, name="train")
    return graph


def test_a_variable_read_after_the_update_is_shared():
    """The second loss reads ``w`` after its update (a read under the control edge): the read
    runs once after the update and every tower reads its value."""
    graph = _two_steps(lambda x, w: tf.reduce_sum(w.read_value()))
    res = replicate.transform(graph, CPUS[:2])
    assert res.report.exact, res.report.reasons
    rng = np.random.RandomState(0)
    feeds = [{"x:0": rng.randn(b, 4).astype("f")} for b in (7, 5, 3)]
    assert compare(graph, res.meta_graph_def, "train", feeds, cpus=2).max_rel <= RTOL


def test_batch_values_computed_after_an_update_wait_in_the_towers():
    """A value of the batch computed under the control edge runs in each tower after the
    update (the first loss's gradients do not need it)."""
    graph = _two_steps(lambda x, w: 2.0 * x[:, :1] @ tf.transpose(w))
    res = replicate.transform(graph, CPUS[:2])
    assert res.report.exact, res.report.reasons
    assert res.report.phases
    rng = np.random.RandomState(0)
    feeds = [{"x:0": rng.randn(b, 4).astype("f")} for b in (7, 5, 3)]
    assert compare(graph, res.meta_graph_def, "train", feeds, cpus=2).max_rel <= RTOL


def test_a_gradient_reading_a_state_update_by_data_is_refused():
    """The value of an update op itself (a counter's new value) in a later gradient: the
    towers would read an op that runs once after them; refused, saying how to chain phases."""
    def after(x, w):
        counter = v1.get_variable("c", [], initializer=v1.zeros_initializer(), use_resource=False)
        return x[:, :1] * v1.assign_add(counter, 1.0)
    with pytest.raises(AnalysisError, match="control edges only"):
        replicate.transform(_two_steps(after), CPUS[:2])


def test_inspect_shows_the_phases(tmp_path, capsys):
    from replicate import cli

    path = str(tmp_path / "gan.meta")
    graph = _gan()
    v1.train.export_meta_graph(filename=path, graph=graph)
    assert cli.main(["inspect", path, "--devices", "/cpu:0,/cpu:1"]) == 0
    text = capsys.readouterr().out
    assert "Phases: 2 in one step; the towers' later gradients wait for disc_train/GradientDescent" in text


@pytest.mark.parametrize("guard", ["flag", "grads_finite", "switch"])
def test_apply_gradients_inside_a_tf1_cond_is_aggregated(guard):
    """``apply_gradients`` inside a TF1 ``tf.cond`` (a NaN guard on the gradients, a flag, an
    optimizer switched by the global step): the cond's switches of the gradients were taken
    into the towers, each tower's gradient went to the update merged as a forward mean, and
    the report said "gradients none" and exact (1.2 off one device in an independent review).
    The switches now read the aggregated gradients."""
    from breadth_models import control_flow_v1

    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 4], name="x")
        y = v1.placeholder(tf.int64, [None], name="y")
        h = v1.layers.dense(x, 5, tf.nn.relu, kernel_initializer=v1.glorot_uniform_initializer(seed=1))
        logits = v1.layers.dense(h, 3, kernel_initializer=v1.glorot_uniform_initializer(seed=2))
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits),
                              name="loss")
        step = v1.train.get_or_create_global_step()
        sgd = v1.train.GradientDescentOptimizer(0.5)
        pairs = sgd.compute_gradients(loss)
        with control_flow_v1():
            if guard == "switch":
                momentum = v1.train.MomentumOptimizer(0.2, 0.9)
                update = tf.cond(step < 2, lambda: tf.group(sgd.apply_gradients(pairs, global_step=step)),
                                 lambda: tf.group(momentum.apply_gradients(pairs, global_step=step)))
            else:
                ok = (v1.placeholder_with_default(True, [], name="apply") if guard == "flag" else
                      tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g, _ in pairs]))
                update = tf.cond(ok, lambda: tf.group(sgd.apply_gradients(pairs)), tf.no_op)
        tf.group(update, name="train")
    res = replicate.transform(graph, ["/cpu:1", "/cpu:2", "/cpu:3"])
    assert res.report.exact, res.report.reasons
    assert sum(res.report.gradients.values()) == 4, res.report.gradients
    rng = np.random.RandomState(0)
    feeds = [{"x:0": rng.randn(b, 4).astype(np.float32), "y:0": rng.randint(0, 3, b)} for b in (7, 5, 2, 6)]
    cmp = compare(graph, res.graph, "train", feeds, fetch=("loss:0",))
    assert cmp.max_rel <= 1e-5, (cmp.worst, cmp.max_rel)


def test_gradients_post_processed_in_a_tf1_while_loop_are_aggregated_first():
    """A TF1 ``tf.while_loop`` scaling a gradient between ``compute_gradients`` and
    ``apply_gradients``: half of the loop (its switches) was pulled into the towers with the
    gradients, and the rewrite mixed frames (failed at step 1). A loop that only reads the
    towers' values stays shared and reads the aggregated gradients: exact."""
    from breadth_models import control_flow_v1

    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 4], name="x")
        y = v1.placeholder(tf.int64, [None], name="y")
        logits = v1.layers.dense(x, 3, kernel_initializer=v1.glorot_uniform_initializer(seed=1))
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits),
                              name="loss")
        sgd = v1.train.GradientDescentOptimizer(0.5)
        (g0, v0), rest = sgd.compute_gradients(loss)[0], sgd.compute_gradients(loss)[1:]
        with control_flow_v1():
            _, g0 = tf.while_loop(lambda i, a: i < 2, lambda i, a: (i + 1, a * 0.9), [0, g0])
        sgd.apply_gradients([(g0, v0)] + rest, name="train")
    res = replicate.transform(graph, ["/cpu:1", "/cpu:2", "/cpu:3"])
    assert res.report.exact, res.report.reasons
    rng = np.random.RandomState(0)
    feeds = [{"x:0": rng.randn(b, 4).astype(np.float32), "y:0": rng.randint(0, 3, b)} for b in (7, 5, 2)]
    cmp = compare(graph, res.graph, "train", feeds, fetch=("loss:0",))
    assert cmp.max_rel <= 1e-5, (cmp.worst, cmp.max_rel)
