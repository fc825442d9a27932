"""Batches whose examples an op regroups: siamese pairs and triplets (``tf.reshape(e, [-1, 2,
d])``), a legacy program's own towers (``tf.split(x, 2)``). The analysis cannot follow such
groups, so the rewrite is inexact and says why; but it must run: each tower gets a multiple of
the group size (a tower of 3 rows failed "the requested shape requires a multiple of 2" at
step 1), and the report says so."""

import numpy as np
import pytest
import tensorflow as tf

import replicate
from replicate.check.equivalence import compare

v1 = tf.compat.v1
D, H, C = 4, 6, 3


def _dense(x, n, name):
    return v1.layers.dense(x, n, name=name, kernel_initializer=v1.glorot_uniform_initializer(seed=3))


def _pairs(x, y):
    e = tf.reshape(_dense(x, H, "embed"), [-1, 2, H])
    yy = tf.reshape(y, [-1, 2])
    d = tf.reduce_sum(tf.square(e[:, 0] - e[:, 1]), 1)
    same = tf.cast(tf.equal(yy[:, 0], yy[:, 1]), tf.float32)
    return tf.reduce_mean(same * d + (1 - same) * tf.nn.relu(1.0 - d))


def _triplets(x, y):
    e = tf.reshape(tf.nn.l2_normalize(_dense(x, H, "embed"), 1), [-1, 3, H])
    near = tf.reduce_sum(tf.square(e[:, 0] - e[:, 1]), 1)
    far = tf.reduce_sum(tf.square(e[:, 0] - e[:, 2]), 1)
    return tf.reduce_mean(tf.nn.relu(near - far + 0.5))


def _own_towers(x, y):
    losses = []
    for i, (xi, yi) in enumerate(zip(tf.split(x, 2), tf.split(y, 2))):
        with v1.variable_scope("model", reuse=i > 0):
            losses.append(tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=yi, logits=_dense(xi, C, "logits"))))
    return tf.add_n(losses) / 2


KINDS = {"pairs": (_pairs, 2), "triplets": (_triplets, 3), "own_towers": (_own_towers, 2)}


def _graph(kind: str, static: int | None = None) -> tf.Graph:
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [static, D], name="x")
        y = v1.placeholder(tf.int64, [static], name="y")
        loss = tf.identity(KINDS[kind][0](x, y), name="loss")
        v1.train.GradientDescentOptimizer(0.5).minimize(loss, name="train")
    return g


def _feeds(batch: int, steps: int = 2):
    rng = np.random.default_rng(batch)
    return [{"x:0": rng.normal(size=(batch, D)).astype(np.float32),
             "y:0": rng.integers(0, 2, batch).astype(np.int64)} for _ in range(steps)]


_GROUPED = [(kind, 1) for kind in sorted(KINDS)] + [(sorted(KINDS)[0], 2)]     # (suite time)


@pytest.mark.parametrize("kind,accumulate", _GROUPED)
def test_regrouped_examples_give_each_tower_whole_groups(kind, accumulate):
    group = KINDS[kind][1]
    res = replicate.transform(_graph(kind), ["/cpu:1", "/cpu:2", "/cpu:3"], accumulate=accumulate)
    assert not res.report.exact and res.report.reasons
    assert any(f"multiple of {group} examples" in w for w in res.report.warnings)
    for batch in (4 * group, 5 * group, group):     # even, uneven, towers without examples
        compare(_graph(kind), res.graph, "train", _feeds(batch), fetch=("loss:0",), cpus=4)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_static_batch_of_groups_is_refused_with_the_fix(kind):
    """The number of groups a static batch bakes in is no multiple of the batch size, so no
    tower could run it; the transform says so instead of emitting a graph that fails."""
    group = KINDS[kind][1]
    with pytest.raises(replicate.errors.AnalysisError, match="give the batch inputs a dynamic batch"):
        replicate.transform(_graph(kind, static=4 * group), ["/cpu:1", "/cpu:2", "/cpu:3"])


def _negatives():
    """NCF with in-graph negatives: the loss is a mean over ``concat([positives, negatives])``,
    the negatives each user tiled twice beside seeded random items."""
    graph = tf.Graph()
    with graph.as_default():
        v1.set_random_seed(1)
        user = v1.placeholder(tf.int32, [None], name="user")
        item = v1.placeholder(tf.int32, [None], name="item")
        n = tf.shape(user)[0]
        users = tf.concat([user, tf.reshape(tf.tile(user[:, None], [1, 2]), [-1])], 0)
        items = tf.concat([item, tf.reshape(v1.random_uniform([n, 2], 0, 20, dtype=tf.int32, seed=4), [-1])], 0)
        labels = tf.concat([tf.ones([n]), tf.zeros([n * 2])], 0)
        p = v1.get_variable("P", [10, 4], initializer=v1.random_normal_initializer(0, 0.3, seed=1))
        q = v1.get_variable("Q", [20, 4], initializer=v1.random_normal_initializer(0, 0.3, seed=2))
        logit = tf.reduce_sum(tf.nn.embedding_lookup(p, users) * tf.nn.embedding_lookup(q, items), 1)
        loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=logit), name="loss")
        v1.train.GradientDescentOptimizer(0.5).minimize(loss, name="train")
    return graph


def test_in_graph_negatives_concatenated_after_the_positives_are_found_and_exact():
    """Review 28 P11: the inputs were set aside ("the loss does not reduce over its leading
    dimension": it reduces the concatenation, a batch holding theirs) and the transform was
    refused unless they were named with batch_inputs=."""
    res = replicate.transform(_negatives(), ["/cpu:0", "/cpu:1", "/cpu:2"])
    assert res.report.exact, res.report.reasons
    for batch in (7, 2):
        rng = np.random.RandomState(batch)
        feeds = [{"user:0": rng.randint(0, 10, batch), "item:0": rng.randint(0, 20, batch)} for _ in range(2)]
        result = compare(_negatives(), res.graph, "train", feeds, fetch=("loss:0",))
        assert result.max_rel <= 1e-5, (batch, result.worst, result.max_rel)


def _halves(how: str) -> tf.Graph:
    """A batch concatenated with a second view of itself and taken apart again by slices at the
    batch size (a siamese difference), or by a slice that does not fall between the copies."""
    graph = tf.Graph()
    with graph.as_default():
        v1.set_random_seed(3)
        x = v1.placeholder(tf.float32, [None, D], name="x")
        y = v1.placeholder(tf.int64, [None], name="y")
        h = tf.tanh(_dense(x, H, "embed"))
        b = tf.shape(x)[0]
        both = tf.nn.dropout(tf.concat([h, h * 0.5 + 0.1], 0), rate=0.4, seed=5)
        h = both[:b] - both[b:] if how == "copies" else both[1:b + 1] - both[:b]
        logits = _dense(h, C, "out")
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits),
                              name="loss")
        v1.train.GradientDescentOptimizer(0.5).minimize(loss, name="train")
    return graph


@pytest.mark.parametrize("how", ["copies", "shifted"])
def test_slices_at_the_batch_size_take_whole_copies(how):
    """Review 41: ``both[:B]`` of ``concat([a, b])`` was taken for both copies (a batch-sized
    bound counted as the whole axis): reported inexact, its fetched merge read two copies where
    there was one and ``sess.run([train, loss])`` failed at step 1. A bound at a multiple of
    the batch size keeps those copies: exact, the loss fetched. A bound between copies stays a
    reason."""
    res = replicate.transform(_halves(how), ["/cpu:1", "/cpu:2", "/cpu:3"])
    assert res.report.exact is (how == "copies"), res.report.reasons
    if how == "shifted":
        return
    for batch in (7, 2):
        rng = np.random.RandomState(batch)
        feeds = [{"x:0": rng.randn(batch, D).astype(np.float32), "y:0": rng.randint(0, C, batch)}
                 for _ in range(3)]
        result = compare(_halves(how), res.graph, "train", feeds, fetch=("loss:0",))
        assert result.max_rel <= 1e-5, (batch, result.worst, result.max_rel)
        for single, multi in result.fetched:
            np.testing.assert_allclose(single[0], multi[0], rtol=1e-5)
