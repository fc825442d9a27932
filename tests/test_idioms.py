"""Everyday idioms that once converted and then failed at run time (or were refused), each
checked against one device with plain SGD at 3 towers on an uneven batch."""

import numpy as np
import pytest
import tensorflow as tf

import replicate
from replicate.equivalence import compare

v1 = tf.compat.v1


def _graph(kind: str, batch=None) -> tf.Graph:
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [batch, 4], name="x")
        y = v1.placeholder(tf.float32, [batch], name="y")
        w = v1.get_variable("w", [4], initializer=v1.glorot_uniform_initializer(seed=2),
                            use_resource=True)
        pred = tf.reduce_sum(x * w, axis=1)
        if kind == "huber":
            # the gradient of a count-normalized loss, tiled over the examples, was split
            # again as if it held the global batch ("Determined shape must either match")
            loss = v1.losses.huber_loss(y, pred)
        elif kind == "cond_static":
            # tf.cond over a static batch: the If's output_shapes said [8] in every tower
            flag = v1.placeholder_with_default(True, [], name="flag")
            loss = tf.reduce_mean(tf.square(tf.cond(flag, lambda: pred * 2.0, lambda: pred) - y))
        elif kind == "class_weights":
            # a [3] class-weights table fed beside a batch of 3 was split as a second batch
            table = v1.placeholder(tf.float32, [3], name="class_weights")
            loss = tf.reduce_mean(tf.gather(table, tf.cast(y, tf.int32) % 3) * tf.square(pred - y))
        elif kind == "grad_scope":
            # gradients under a scope of another name were not found ("no train op found")
            loss = tf.identity(tf.reduce_mean(tf.square(pred - y)), name="loss")
            grads = tf.gradients(loss, [w], name="grads_custom")
            v1.train.GradientDescentOptimizer(0.2).apply_gradients(zip(grads, [w]), name="train")
            return graph
        v1.train.GradientDescentOptimizer(0.2).minimize(tf.identity(loss, name="loss"), name="train")
    return graph


@pytest.mark.parametrize("kind,batch,static", [("huber", 7, False), ("cond_static", 8, True),
                                               ("class_weights", 3, False),
                                               ("class_weights", 7, False),
                                               ("grad_scope", 7, False)])
def test_idiom_trains_exactly(kind, batch, static):
    graph = _graph(kind, batch if static else None)
    res = replicate.transform(graph, ["/cpu:1", "/cpu:2", "/cpu:3"])
    assert res.report.exact, res.report.reasons
    rng = np.random.RandomState(0)
    feeds = [{"x:0": rng.randn(batch, 4).astype(np.float32),
              "y:0": rng.randint(0, 3, batch).astype(np.float32)} for _ in range(3)]
    if kind == "class_weights":
        assert "class_weights:0" in res.report.shared_inputs
        for f in feeds:
            f["class_weights:0"] = np.array([1.0, 2.0, 0.5], np.float32)
    cmp = compare(graph, res.graph, "train", feeds, fetch=("loss:0",))
    assert cmp.max_rel <= 1e-5, (cmp.worst, cmp.max_rel)
    for single, multi in cmp.fetched:
        np.testing.assert_allclose(single[0], multi[0], rtol=1e-5)
