"""Fed vectors of a fixed length beside a batch of any size.

Multi-task programs feed their loss weights (``lw = tf.placeholder(tf.float32, [n])``), and
some seed stateless noise from a fed ``[2]`` vector. Such an input was taken for a batch of
its own and split over the towers: the transform was refused ("static batch size of 2, fewer
than the 3 towers", "joins copies of a trained value") or inexact ("picks one example", 0.74
off), each for a cause the split itself made (review 11). When a batch of a dynamic size is
there and the split of the fixed-size input is what keeps the result from being exact, every
tower now reads it whole, and a warning says so. (With no batch of a dynamic size there is
no telling which is the batch: that case is unchanged.)"""

import numpy as np
import pytest
import tensorflow as tf

import replicate
from replicate.check.equivalence import compare

v1 = tf.compat.v1
D, H, C = 6, 5, 3
DEVICES = ["/cpu:1", "/cpu:2", "/cpu:3"]


def _graph(use: str, n: int) -> tf.Graph:
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, D], name="x")
        y = v1.placeholder(tf.int32, [None], name="y")
        lw = v1.placeholder(tf.float32, [n], name="lw")
        init = v1.glorot_uniform_initializer(seed=1)
        h = tf.nn.relu(tf.matmul(x, v1.get_variable("w1", [D, H], initializer=init)))
        logits = tf.matmul(h, v1.get_variable("w2", [H, C], initializer=init), name="logits")
        xent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
        terms = [tf.reduce_mean(xent), tf.reduce_mean(tf.square(logits)), tf.reduce_mean(tf.abs(h)),
                 tf.reduce_mean(h)][:n]
        if use == "stack":
            loss = tf.reduce_sum(lw * tf.stack(terms))
        elif use == "index":
            loss = lw[0] * terms[0] + lw[1] * terms[1]
        else:           # stateless noise seeded by the fed vector
            seed = tf.cast(lw[:2] * 100, tf.int64)
            noisy = logits + 0.1 * tf.random.stateless_normal(tf.shape(logits), seed=seed)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=noisy))
        loss = tf.identity(loss, name="loss")
        v1.train.GradientDescentOptimizer(0.5).minimize(loss, name="train")
    return g


def _feeds(n: int, batches=(7, 5, 2)):
    rng = np.random.default_rng(5)
    return [{"x:0": rng.normal(size=(b, D)).astype(np.float32), "y:0": rng.integers(0, C, b).astype(np.int32),
             "lw:0": np.linspace(1.0, 0.1, n).astype(np.float32)} for b in batches]


@pytest.mark.parametrize("use,n", [("stack", 4), ("index", 2), ("index", 7), ("seed", 2)])
def test_a_fixed_length_vector_is_read_whole_by_every_tower(use, n):
    res = replicate.transform(_graph(use, n), DEVICES)
    assert res.report.exact, res.report.reasons
    assert [b.tensor for b in res.analysis.batch_inputs] == ["x:0", "y:0"]
    assert any("'lw:0' is taken to be read whole by every tower" in w for w in res.report.warnings)
    r = compare(_graph(use, n), res.graph, "train", _feeds(n), fetch=("loss:0", "logits:0"), cpus=4)
    assert r.max_rel <= 1e-5, (r.max_rel, r.worst)



def _fine_tune():
    """Fine-tuning the top layer from cached features: the driver feeds 'features:0' (a ReLU's
    output) instead of 'x:0', and only the top layer trains."""
    graph = tf.Graph()
    with graph.as_default():
        v1.set_random_seed(1)
        x = v1.placeholder(tf.float32, [None, 5], name="x")
        y = v1.placeholder(tf.int32, [None], name="y")
        base = v1.get_variable("base_w", [5, 7], initializer=v1.truncated_normal_initializer(seed=1))
        h = tf.nn.relu(tf.matmul(x, base), name="features")
        top = v1.get_variable("top_w", [7, 3], initializer=v1.truncated_normal_initializer(seed=2))
        logits = tf.matmul(h, top, name="logits")
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits),
                              name="loss")
        v1.train.GradientDescentOptimizer(0.2).minimize(loss, var_list=[top], name="train")
    return graph


def test_an_inner_tensor_named_as_a_batch_input_can_be_fed_in_place_of_the_inputs():
    """Review 26: a driver feeding cached features in place of the images got "You must feed a
    value for placeholder 'x'" from the rewrite. Named with batch_inputs=, the towers start at
    the features: exact when the driver feeds them (batches of 7 and 2 on 3 towers), and the
    inputs still work where it feeds those instead."""
    from replicate.check.equivalence import compare
    graph = _fine_tune()
    res = replicate.transform(graph, ["/cpu:0", "/cpu:1", "/cpu:2"],
                              batch_inputs=["features:0", "y:0"])
    assert res.report.exact, res.report.reasons
    assert {b.tensor for b in res.analysis.batch_inputs} == {"features:0", "y:0"}
    rng = np.random.RandomState(0)
    for batch in (7, 2):
        fed = [{"features:0": rng.rand(batch, 7), "y:0": rng.randint(0, 3, batch)} for _ in range(3)]
        assert compare(graph, res.meta_graph_def, "train", fed).max_rel <= 1e-5
    raw = [{"x:0": rng.randn(7, 5), "y:0": rng.randint(0, 3, 7)} for _ in range(3)]
    assert compare(graph, res.meta_graph_def, "train", raw).max_rel <= 1e-5


def test_a_batch_input_of_a_multi_output_op_is_refused_naming_it():
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 4], name="x")
        a, b = tf.split(x, 2, axis=1, name="halves")
        w = v1.get_variable("w", [2, 1])
        loss = tf.reduce_mean(tf.matmul(a, w) + tf.matmul(b, w), name="loss")
        v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
    with pytest.raises(replicate.AnalysisError, match="one of several outputs of 'halves'"):
        replicate.transform(graph, ["/cpu:0", "/cpu:1"], batch_inputs=["halves:1"])
