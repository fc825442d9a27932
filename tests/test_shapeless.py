"""Placeholders declared without a shape.

The autoencoder examples corrupt their input with ``x + scale * tf.random_normal((n,))`` where
``scale = tf.placeholder(tf.float32)`` has no shape; programs feed class weights, a feature
mean and deviation, or a mask per example through such placeholders too. Without a rank the
layout of everything after them was unknown, and the report said inexact although every step
is exact. Ops that broadcast such a placeholder against a tensor of rank 1 or more now read it
as a vector (``Reshape(p, [-1])``: a scalar is one entry), which gives the same values, so the
proof holds for any scalar or vector fed; the emitted graph checks the rank. A call (a v2
``tf.cond`` branch reading a dropout's ``keep_prob``) reads it so when its functions do. One
that lines up with the batch (``xent * w``) must be split when fed one number per example and
must not be when fed a single number; only the feed tells, so each tower reads its rows of the
view broadcast to the batch, which is right both ways. Where no op can read it as a vector
(class weights gathered by label), nothing changes; the reason says which shape to declare.

Earlier in this session the placeholder was taken to be a scalar (``EnsureShape([])``): the
graphs fed vectors were then claimed exact and stopped at step 1 (review 11); then a view
lined up with the batch made the placeholder a batch input, and a single number fed there
stopped at step 1 under an exact claim (review 12)."""

import numpy as np
import pytest
import tensorflow as tf

import replicate
from replicate.check.equivalence import compare

v1 = tf.compat.v1
D, H, C = 10, 8, 4
DEVICES = ["/cpu:1", "/cpu:2", "/cpu:3"]
BATCHES = (7, 5, 2)         # the last leaves a tower empty


def _dense(x, n, name, d):
    w = v1.get_variable(name, [d, n], initializer=v1.glorot_uniform_initializer(seed=3))
    return tf.matmul(x, w)


def _graph(kind: str) -> tf.Graph:
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, D], name="x")
        y = v1.placeholder(tf.int32, [None], name="y")
        p = v1.placeholder(tf.float32, name="p")            # no shape
        if kind == "cond_dropout":          # the training flag's branch reads keep_prob
            training = v1.placeholder(tf.bool, [], name="training")
            h = tf.nn.relu(_dense(x, H, "w1", D))
            h = v1.cond(training, lambda: v1.nn.dropout(h, keep_prob=p, seed=7), lambda: h)
            logits = tf.identity(_dense(h, C, "w2", H), name="out")
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits),
                                  name="loss")
        elif kind == "autoencoder":
            noisy = x + p * v1.random_normal((D,), seed=1)
            recon = _dense(tf.nn.softplus(_dense(noisy, H, "w1", D)), D, "w2", H)
            tf.identity(recon, name="out")
            loss = tf.multiply(0.5, tf.reduce_sum(tf.pow(recon - x, 2.0)), name="loss")
        else:
            inputs = (x - p) / (p + 1.0) if kind == "normalized" else x
            logits = tf.identity(_dense(tf.nn.relu(_dense(inputs, H, "w1", D)), C, "w2", H), name="out")
            xent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
            if kind == "class_weights":
                xent = xent * tf.reduce_sum(tf.one_hot(y, C) * p, 1)
            elif kind == "gathered":
                xent = xent * tf.gather(p, y)
            if kind == "mask":
                loss = tf.identity(tf.reduce_sum(xent * p) / tf.maximum(tf.reduce_sum(p), 1.0), name="loss")
            else:
                loss = tf.reduce_mean(xent, name="loss")
        v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
    return g


def _feeds(value, kind=""):
    rng = np.random.default_rng(3)
    flag = {"training:0": True} if kind == "cond_dropout" else {}
    return [{"x:0": rng.random((b, D), dtype=np.float32), "y:0": rng.integers(0, C, b).astype(np.int32),
             "p:0": value(rng, b), **flag} for b in BATCHES]


CASES = {
    "autoencoder": lambda r, b: 0.1,                                        # the driver's float
    "cond_dropout": lambda r, b: 0.6,                                       # keep_prob in a v2 cond
    "normalized": lambda r, b: np.linspace(0.0, 1.0, D).astype(np.float32),  # a feature vector
    "class_weights": lambda r, b: np.array([1.0, 2.0, 0.5, 1.5], np.float32),
}


def _matches_one_device(kind: str, res, feeds) -> None:
    """Three SGD steps of the rewrite match one device's, fetched loss and outputs too."""
    r = compare(_graph(kind), res.graph, "train", feeds, fetch=("loss:0", "out:0"), cpus=4)
    assert r.max_rel <= 1e-5, (r.max_rel, r.worst)
    for one, towers in r.fetched:
        for a, b in zip(one, towers):
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("kind", sorted(CASES))
def test_a_shapeless_placeholder_read_as_a_vector_trains_exactly(kind, accumulate):
    res = replicate.transform(_graph(kind), DEVICES, accumulate=accumulate)
    assert res.report.exact, res.report.reasons
    viewed = [w for w in res.report.warnings if "has no static shape" in w]
    assert len(viewed) == 1 and "'p:0'" in viewed[0] and "p/replicate_vector/check" in viewed[0]
    assert not any("has unknown rank" in w for w in res.report.warnings)
    _matches_one_device(kind, res, _feeds(CASES[kind], kind))


def test_the_autoencoder_scale_fed_as_a_vector_trains_exactly_too():
    res = replicate.transform(_graph("autoencoder"), DEVICES)
    r = compare(_graph("autoencoder"), res.graph, "train",
                _feeds(lambda r, b: np.linspace(0.0, 0.2, D).astype(np.float32)), fetch=("loss:0",), cpus=4)
    assert r.max_rel <= 1e-5, (r.max_rel, r.worst)


def test_a_step_fed_a_matrix_stops_at_the_check():
    res = replicate.transform(_graph("autoencoder"), DEVICES)
    with res.graph.as_default():
        init = v1.global_variables_initializer()
    with v1.Session(graph=res.graph, config=v1.ConfigProto(device_count={"CPU": 4})) as sess:
        sess.run(init)
        feed = _feeds(lambda r, b: np.full([1, D], 0.1, np.float32))[0]
        with pytest.raises(tf.errors.InvalidArgumentError, match="declared without a shape"):
            sess.run(res.train_op, feed)


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("value", [lambda r, b: 0.5, lambda r, b: (r.random(b) > 0.3).astype(np.float32)],
                         ids=["one value", "one per example"])
def test_a_placeholder_lined_up_with_the_batch_is_exact_fed_either_way(value, accumulate):
    """``xent * w`` with ``w`` fed one number must not be split, with ``w`` fed one number
    per example must be: only the feed tells. Each tower reads its rows of the view broadcast
    to the batch, right both ways. (Split as a batch input, the single number stopped at step 1
    under an exact claim, review 12; shared, the mask failed at step 1, review 11.)"""
    res = replicate.transform(_graph("mask"), DEVICES, accumulate=accumulate)
    assert res.report.exact, res.report.reasons
    _matches_one_device("mask", res, _feeds(value))


def test_nothing_changes_where_no_op_broadcasts_the_placeholder():
    res = replicate.transform(_graph("gathered"), DEVICES)
    assert not res.report.exact
    assert any("'p' has no static shape" in str(r) and "shape=[None]" in str(r) for r in res.report.reasons)
    assert not [n for n in res.graph.as_graph_def().node if "replicate_vector" in n.name]


def _tokens() -> tf.Graph:
    """Token losses flattened with their steps, weighted by a shapeless placeholder."""
    steps = 4
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, steps, D], name="x")
        y = v1.placeholder(tf.int32, [None, steps], name="y")
        p = v1.placeholder(tf.float32, name="p")
        logits = tf.identity(_dense(tf.reshape(x, [-1, D]), C, "w", D), name="out")
        xent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=tf.reshape(y, [-1]), logits=logits)
        loss = tf.identity(tf.reduce_sum(xent * p) / tf.maximum(tf.reduce_sum(p), 1.0), name="loss")
        v1.train.GradientDescentOptimizer(0.5).minimize(loss, name="train")
    return g


@pytest.mark.parametrize("per_token", [True, False], ids=["a weight per token", "one weight"])
def test_token_weights_fed_without_a_shape_are_exact_either_way(per_token):
    """The view lines up with rows that hold several per example: it is broadcast to all the
    towers' rows and each tower takes its own."""
    rng = np.random.default_rng(6)
    feeds = [{"x:0": rng.random((b, 4, D), dtype=np.float32), "y:0": rng.integers(0, C, (b, 4)).astype(np.int32),
              "p:0": (rng.random(b * 4) > 0.3).astype(np.float32) if per_token else 0.5} for b in BATCHES]
    res = replicate.transform(_tokens(), DEVICES)
    assert res.report.exact, res.report.reasons
    r = compare(_tokens(), res.graph, "train", feeds, fetch=("loss:0", "out:0"), cpus=4)
    assert r.max_rel <= 1e-5, (r.max_rel, r.worst)


def test_a_single_weight_beside_tokens_of_a_dynamic_length_is_not_refused():
    """With the steps known only at run time the view's rows per example are unknown, so it
    cannot be cut per tower: the transform refused, where a single weight had run (inexact;
    review 13). It is a reason again, and the rewrite runs."""
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, None, D], name="x")
        y = v1.placeholder(tf.int32, [None, None], name="y")
        p = v1.placeholder(tf.float32, name="p")
        logits = _dense(tf.reshape(x, [-1, D]), C, "w", D)
        xent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=tf.reshape(y, [-1]), logits=logits)
        tf.reduce_mean(xent * p, name="loss")
        v1.train.GradientDescentOptimizer(0.5).minimize(g.get_tensor_by_name("loss:0"), name="train")
    res = replicate.transform(g, DEVICES)
    assert not res.report.exact
    rng = np.random.default_rng(7)
    feeds = [{"x:0": rng.random((b, 4, D), dtype=np.float32), "y:0": rng.integers(0, C, (b, 4)).astype(np.int32),
              "p:0": 0.5} for b in BATCHES]
    compare(g, res.graph, "train", feeds, fetch=("loss:0",), cpus=4)


def _masked(kind: str) -> tf.Graph:
    """A mask without a shape that reaches the loss through another op first: a cast of an
    integer mask, scalar arithmetic whose gradient reads the intermediate's shape, or
    ``tf.where``'s condition."""
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, D], name="x")
        y = v1.placeholder(tf.int32, [None], name="y")
        dtype = {"cast": tf.int32, "count": tf.int32, "where": tf.bool}.get(kind, tf.float32)
        p = v1.placeholder(dtype, name="p")
        logits = tf.identity(_dense(tf.nn.relu(_dense(x, H, "w1", D)), C, "w2", H), name="out")
        xent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
        if kind == "cast":
            loss = tf.reduce_mean(xent * tf.cast(p, tf.float32))
        elif kind == "count":   # the cast is also counted: that reader keeps the placeholder's
            w = tf.cast(p, tf.float32)
            loss = tf.reduce_sum(xent * w) / tf.maximum(tf.reduce_sum(w), 1.0)
        elif kind == "arithmetic":
            loss = tf.reduce_mean(xent * (1.0 + 2.0 * p))
        else:
            loss = tf.reduce_mean(tf.where(p, xent, tf.zeros_like(xent)))
        tf.identity(loss, name="loss")
        v1.train.GradientDescentOptimizer(0.5).minimize(loss, name="train")
    return g


#: Every kind fed either way at accumulate 1; two kinds, one per example, at 2 (suite time).
_MASKS = [(k, p, 1) for k in ("cast", "count", "arithmetic", "where") for p in (True, False)] + \
    [("count", True, 2), ("where", True, 2)]


@pytest.mark.parametrize("kind,per_example,accumulate", _MASKS)
def test_a_mask_that_reaches_the_loss_through_other_ops_is_exact_fed_either_way(kind, per_example, accumulate):
    """Fed one value per example, these were inexact and stopped at step 1 where one device
    runs (review 12): the view stopped at the first op that was not a broadcasting one. A
    cast or other one-operand op, scalar arithmetic read by a gradient's shape, and
    ``tf.where``'s condition read a one-entry vector as they read a scalar, so the mask is
    read as a vector through them, and each tower takes its rows of what they compute from
    it, broadcast to the batch (one value) or not (one per example). A cast that is also
    counted (``reduce_sum(w)``) is copied for the readers that read it alike; the count
    keeps reading the placeholder, whole in every tower: the global count either way."""
    rng = np.random.default_rng(11)
    dtype = {"cast": np.int32, "count": np.int32, "where": bool}.get(kind, np.float32)
    feeds = [{"x:0": rng.random((b, D), dtype=np.float32), "y:0": rng.integers(0, C, b).astype(np.int32),
              "p:0": (rng.random(b) > 0.3).astype(dtype) if per_example else np.asarray(1, dtype)}
             for b in BATCHES]
    res = replicate.transform(_masked(kind), DEVICES, accumulate=accumulate)
    assert res.report.exact, res.report.reasons
    r = compare(_masked(kind), res.graph, "train", feeds, fetch=("loss:0", "out:0"), cpus=4)
    assert r.max_rel <= 1e-5, (r.max_rel, r.worst)
    for one, towers in r.fetched:
        for a, b in zip(one, towers):
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("through", ["itself", "cast"])
def test_a_shape_the_model_reads_is_the_placeholders_not_the_views(through):
    """``tf.reshape(t, tf.shape(w))`` in the model takes ``w``'s rank: read of the view it had
    rank 1 where one device's has rank 0, and a loss that depends on it differed under an exact
    claim (review 15). Only the shapes a broadcasting op's gradient reads go through the view."""
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, D], name="x")
        y = v1.placeholder(tf.int32, [None], name="y")
        p = v1.placeholder(tf.int32 if through == "cast" else tf.float32, name="p")
        w = tf.cast(p, tf.float32) if through == "cast" else p
        logits = tf.identity(_dense(tf.nn.relu(_dense(x, H, "w1", D)), C, "w2", H), name="out")
        xent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
        z = tf.reshape(tf.reduce_mean(xent), tf.shape(w))
        loss = tf.identity(tf.reduce_mean(xent * w) + 0.1 * tf.cast(tf.rank(z), tf.float32), name="loss")
        v1.train.GradientDescentOptimizer(0.5).minimize(loss, name="train")
    rng = np.random.default_rng(12)
    value = np.int32(2) if through == "cast" else np.float32(0.7)
    feeds = [{"x:0": rng.random((b, D), dtype=np.float32), "y:0": rng.integers(0, C, b).astype(np.int32),
              "p:0": value} for b in BATCHES]
    res = replicate.transform(g, DEVICES)
    r = compare(g, res.graph, "train", feeds, fetch=("loss:0",), cpus=4)
    if res.report.exact:
        assert r.max_rel <= 1e-5, (r.max_rel, r.worst)
    for one, towers in r.fetched:
        np.testing.assert_allclose(towers[0], one[0], rtol=1e-5)


def _in_a_branch(kind: str) -> tf.Graph:
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, D], name="x")
        y = v1.placeholder(tf.int32, [None], name="y")
        p = v1.placeholder(tf.bool if kind == "select" else tf.float32, name="p")
        logits = tf.identity(_dense(tf.nn.relu(_dense(x, H, "w1", D)), C, "w2", H), name="out")
        xent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
        if kind == "select":        # v1 Select: a vector condition must match the values' rows
            loss = tf.reduce_mean(v1.where(p, xent, 2.0 * xent))
        else:                       # the mask decides the branch and weighs the examples in it
            loss = tf.cond(tf.reduce_sum(p) > 0.5, lambda: tf.reduce_mean(xent * p),
                           lambda: tf.reduce_mean(xent))
        tf.identity(loss, name="loss")
        v1.train.GradientDescentOptimizer(0.5).minimize(loss, name="train")
    return g


@pytest.mark.parametrize("per_example", [True, False], ids=["one per example", "one value"])
def test_a_mask_in_a_cond_branch_is_read_as_a_vector_by_the_gradient_too(per_example):
    """The branch's ``xent * p`` reads the view; the cond's gradient, a call of the branches'
    gradients, read the placeholder whole, so a mask fed per example stopped at step 1 under
    an exact claim (review 15). The gradient call of a call that reads it alike reads it so."""
    rng = np.random.default_rng(13)
    feeds = [{"x:0": rng.random((b, D), dtype=np.float32), "y:0": rng.integers(0, C, b).astype(np.int32),
              "p:0": rng.random(b).astype(np.float32) if per_example else np.float32(0.8)}
             for b in BATCHES]
    for accumulate in (1, 2):
        res = replicate.transform(_in_a_branch("cond"), DEVICES, accumulate=accumulate)
        assert res.report.exact, res.report.reasons
        r = compare(_in_a_branch("cond"), res.graph, "train", feeds, fetch=("loss:0",), cpus=4)
        assert r.max_rel <= 1e-5, (r.max_rel, r.worst)


def test_a_v1_select_on_a_shapeless_condition_is_not_claimed_exact():
    """v1 ``Select`` keeps its values' shape whatever its condition's, so its output rank was
    known and the condition of unknown rank went unexamined: claimed exact, and a mask fed per
    example stopped at step 1 (review 15). A shared operand of unknown rank beside the batch is
    a reason in every broadcasting op; the rewrite runs fed one value."""
    res = replicate.transform(_in_a_branch("select"), DEVICES)
    assert not res.report.exact
    assert any("'p' has no static shape" in str(r) for r in res.report.reasons), res.report.reasons
    rng = np.random.default_rng(14)
    feeds = [{"x:0": rng.random((b, D), dtype=np.float32), "y:0": rng.integers(0, C, b).astype(np.int32),
              "p:0": True} for b in BATCHES]
    compare(_in_a_branch("select"), res.graph, "train", feeds, fetch=("loss:0",), cpus=4)


def _overridable(shape):
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 5, 4], name="x")
        y = v1.placeholder(tf.float32, [None], name="y")
        w = v1.get_variable("w", [4, 3], initializer=v1.glorot_uniform_initializer(seed=1))
        h = v1.placeholder_with_default(tf.tensordot(x, w, 1), shape, name="h")
        p = tf.reduce_sum(tf.reduce_max(h, axis=1), -1)
        v1.train.GradientDescentOptimizer(0.1).minimize(tf.reduce_mean(tf.square(p - y)), name="train")
    return graph


def test_an_overridable_activation_without_a_shape_is_refused_and_with_one_is_exact():
    """``placeholder_with_default(h, ...)`` over an activation a driver may override is an
    input; without a shape it was shared whole, every tower computed on the whole batch's
    activation beside its own rows and the inexact rewrite failed at step 1 ("Incompatible
    shapes: [7] vs. [2]"). It is refused, naming the shape to give; with the shape it is split
    and exact, fed by its name or not (making it an op of the towers instead lost the feed:
    review 35)."""
    with pytest.raises(replicate.ReplicateError, match="placeholder_with_default without a shape.*shape=\\[None"):
        replicate.transform(_overridable(None), DEVICES)
    graph = _overridable([None, 5, 3])
    res = replicate.transform(graph, DEVICES)
    assert res.report.exact, res.report.reasons
    rng = np.random.RandomState(0)
    for batch in (7, 2):
        feeds = [{"x:0": rng.randn(batch, 5, 4).astype("f"), "y:0": rng.randn(batch).astype("f")}
                 for _ in range(3)]
        feeds[1]["h:0"] = rng.randn(batch, 5, 3).astype("f")       # the driver overrides a step
        result = compare(graph, res.meta_graph_def, "train", feeds)
        assert result.max_rel <= 1e-5, (batch, result.worst, result.max_rel)
