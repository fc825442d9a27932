"""TF1 conds whose branches are constants (review 46).

In a TF1 ``tf.cond`` every tensor a branch reads from outside passes through a ``Switch`` of
the predicate, which is how the analysis saw that a predicate decided per tower (a batch mean,
an argmax, the batch size) decides the values. A constant made in a branch reads nothing: it
waits for the branch's pivot by control edge only, so ``mean(ce) * cond(p, 1.0, 3.0)`` looked
like a mean times a shared scale and was claimed exact while each tower chose its own scale
(0.72 off one device; by the batch size, 0.71 off). The cond's ``Merge`` now carries its
predicate's fact."""

from models import control_flow_v1
import numpy as np
import pytest
import tensorflow as tf

import replicate
from replicate.check.equivalence import compare

v1 = tf.compat.v1
DEVICES = ["/cpu:1", "/cpu:2", "/cpu:3"]


def _graph(predicate: str) -> tf.Graph:
    g = tf.Graph()
    with control_flow_v1(), g.as_default():
        x = v1.placeholder(tf.float32, [None, 4], name="x")
        y = v1.placeholder(tf.int64, [None], name="y")
        w = v1.get_variable("w", [4, 3], initializer=v1.glorot_uniform_initializer(seed=1))
        ce = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=tf.matmul(x, w))
        decides = {"mean": lambda: tf.reduce_mean(tf.stop_gradient(ce)) > 1.1,
                   "size": lambda: tf.shape(x)[0] > 4,
                   "flag": lambda: v1.placeholder_with_default(True, [], name="flag")}[predicate]()
        scale = tf.cond(decides, lambda: tf.constant(1.0), lambda: tf.constant(3.0))
        loss = tf.identity(tf.reduce_mean(ce) * scale, name="loss")
        v1.train.GradientDescentOptimizer(0.4).minimize(loss, name="train")
    return g


def _feeds(batches):
    rng = np.random.default_rng(0)
    return [{"x:0": rng.normal(size=(b, 4)).astype(np.float32), "y:0": rng.integers(0, 3, b)}
            for b in batches]


def test_constant_branches_chosen_by_each_tower_s_mean_are_a_reason():
    graph = _graph("mean")
    res = replicate.transform(graph, DEVICES)
    assert not res.report.exact
    cmp = compare(graph, res.graph, "train", _feeds([7, 6, 5]), fetch=("loss:0",))
    assert cmp.max_rel > 1e-2, cmp          # the reason is true: the towers choose otherwise


@pytest.mark.parametrize("predicate,options", [("mean", {"batch_norm": "sync"}), ("size", {}),
                                               ("size", {"accumulate": 2})])
def test_constant_branches_on_a_synchronized_value_are_exact(predicate, options):
    """The value the predicate reads is a coupling like any other: a batch mean under sync, the
    batch size always (claimed exact before, 0.71 off one device): every tower reads the
    batch's, chooses one device's branch, and trains as one device."""
    graph = _graph(predicate)
    res = replicate.transform(graph, DEVICES, **options)
    assert res.report.exact, res.report.reasons
    for batches in ([7, 2, 5], [3, 5, 9]):
        cmp = compare(graph, res.graph, "train", _feeds(batches), fetch=("loss:0",))
        assert cmp.max_rel < 1e-5, (batches, cmp)


def test_constant_branches_on_a_fed_flag_stay_exact():
    graph = _graph("flag")
    res = replicate.transform(graph, DEVICES)
    assert res.report.exact, res.report.reasons
    feeds = _feeds([7, 2, 5])
    feeds[1]["flag:0"] = False
    cmp = compare(graph, res.graph, "train", feeds, fetch=("loss:0",))
    assert cmp.max_rel < 1e-5, cmp
