"""Row numbers of the whole batch fed to a gather (passes/_rows.py).

A DQN driver feeds ``[[0, a0], [1, a1], ...]`` beside the states, and the graph picks each
row's action value with ``tf.gather_nd(q, idx)``. Each tower holds only its rows of ``q``, so the
same numbers named other rows or none: the rewrite failed at step 1 with TensorFlow's "does not
index into param shape" where one device runs. Each tower now reads the numbers less its first
row's number, checked every step: exact for numbers within each example's own rows, and a
message naming the op and the input for numbers that cross towers.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import tensorflow as tf

import replicate
from replicate.check.equivalence import compare
from replicate.passes._rows import MARKER

from breadth_models import control_flow_v1

v1 = tf.compat.v1


def _dqn(op="gather_nd", computed=False):
    graph = tf.Graph()
    with graph.as_default():
        v1.set_random_seed(3)
        x = v1.placeholder(tf.float32, [None, 4], name="x")
        idx = v1.placeholder(tf.int32, [None, 2] if op == "gather_nd" else [None], name="idx")
        y = v1.placeholder(tf.float32, [None], name="y")
        w = v1.get_variable("w", [4, 3], initializer=v1.random_normal_initializer(seed=1))
        q = tf.matmul(x, w)
        if computed:                            # numbers computed from the examples' values
            idx = tf.cast(tf.argmax(x, 1), tf.int32)
        if op == "gather_nd":
            pick = tf.gather_nd(q, idx)
        else:
            pick = tf.reduce_sum(tf.gather(q, idx), 1)
        loss = tf.reduce_mean(tf.square(pick - y), name="loss")
        v1.train.GradientDescentOptimizer(0.3).minimize(loss, name="train")
    return graph


def _feeds(batch, op="gather_nd", crossing=False, steps=3):
    rng = np.random.RandomState(0)
    out = []
    for _ in range(steps):
        rows = np.arange(batch)[::-1] if crossing else np.arange(batch)
        idx = np.stack([rows, rng.randint(0, 3, batch)], 1) if op == "gather_nd" else rows
        out.append({"x:0": rng.randn(batch, 4).astype(np.float32), "idx:0": idx,
                    "y:0": rng.randn(batch).astype(np.float32)})
    return out


@pytest.mark.parametrize("op,devices,batch,accumulate", [
    ("gather_nd", 3, 7, 1), ("gather_nd", 3, 2, 1), ("gather_nd", 2, 5, 2), ("gather", 3, 7, 1)])
def test_rows_numbered_for_the_whole_batch_are_exact(op, devices, batch, accumulate):
    graph = _dqn(op)
    res = replicate.transform(graph, [f"/cpu:{i}" for i in range(devices)], accumulate=accumulate)
    assert res.report.exact, res.report.reasons
    if op == "gather_nd":
        assert any("row numbers fed in 'idx:0'" in w for w in res.report.warnings)
    else:
        # a vector of row numbers is no evidence that it numbers x's examples (a graph's
        # edges number its nodes): x is read whole by every tower, as a table
        assert "x:0" in res.analysis.shared_inputs
    result = compare(graph, res.meta_graph_def, "train", _feeds(batch, op))
    assert result.max_rel <= 1e-5, (result.worst, result.max_rel)


def test_numbers_that_name_another_towers_rows_stop_with_a_message():
    """Reversed rows: one device runs them; no tower holds the rows its numbers name."""
    graph = _dqn()
    res = replicate.transform(graph, ["/cpu:0", "/cpu:1"])
    with pytest.raises(replicate.ReplicateError, match=f"{MARKER[:30]}.*GatherNd.*idx:0"):
        compare(graph, res.meta_graph_def, "train", _feeds(6, crossing=True))


def test_numbers_computed_from_the_examples_are_not_taken_for_row_numbers():
    res = replicate.transform(_dqn("gather", computed=True), ["/cpu:0", "/cpu:1"])
    assert not res.report.exact
    assert "picks examples of the batch by position" in " ".join(str(r) for r in res.report.reasons)


def test_the_certificate_feeds_each_example_its_own_row_number():
    """The synthetic feed of ``replicate convert``'s check gives the row column each
    example's own number (random ones named other towers' rows, and the check failed)."""
    res = replicate.transform(_dqn(), ["/cpu:0", "/cpu:1", "/cpu:2"], check=True)
    assert res.report.exact, res.report.reasons
    assert all(run["max_rel"] <= 1e-5 for run in res.report.check["runs"]), res.report.check


def _variant(kind):
    """Review 29's variants: the numbers also look up a shared table, are cast, are stacked
    from two fed vectors, or number the rows of a folded ``[B * 2, 3]`` batch."""
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 4], name="x")
        y = v1.placeholder(tf.float32, [None], name="y")
        w = v1.get_variable("w", [4, 6], initializer=v1.random_normal_initializer(seed=1))
        q = tf.matmul(x, w)
        if kind == "stacked":
            rows = v1.placeholder(tf.int32, [None], name="rows")
            acts = v1.placeholder(tf.int32, [None], name="acts")
            idx = tf.stack([rows, acts], 1)
        else:
            idx = v1.placeholder(tf.int32, [None, 2], name="idx")
        if kind == "cast":
            idx = tf.cast(idx, tf.int64)
        if kind == "folded":
            q = tf.reshape(q, [-1, 3])
        per = tf.square(tf.gather_nd(q, idx) - y)
        if kind == "table":
            table = v1.get_variable("table", [16, 6], initializer=v1.random_normal_initializer(seed=2))
            per += tf.square(tf.gather_nd(table, idx))
        v1.train.GradientDescentOptimizer(0.3).minimize(tf.reduce_mean(per), name="train")
    return graph


def _variant_feeds(kind, batch):
    rng = np.random.RandomState(0)
    out = []
    for _ in range(3):
        rows, acts = np.arange(batch), rng.randint(0, 3, batch)
        feed = {"x:0": rng.randn(batch, 4).astype(np.float32), "y:0": rng.randn(batch).astype(np.float32)}
        if kind == "stacked":
            feed.update({"rows:0": rows, "acts:0": acts})
        else:
            feed["idx:0"] = np.stack([rows, acts], 1)
        out.append(feed)
    return out


@pytest.mark.parametrize("kind", ["table", "cast", "stacked"])
def test_fed_numbers_that_also_look_up_a_table_are_cast_or_stacked_are_exact(kind):
    """Review 29: the table's gradient got the tower's numbers too (its rows were updated at
    the tower's numbers: claimed exact, 0.07-0.34 off); numbers cast or stacked from two
    vectors were not recognized, and the step failed on "does not index into param shape"."""
    graph = _variant(kind)
    res = replicate.transform(graph, ["/cpu:0", "/cpu:1", "/cpu:2"])
    assert res.report.exact, res.report.reasons
    for batch in (7, 2):
        assert compare(graph, res.meta_graph_def, "train", _variant_feeds(kind, batch)).max_rel <= 1e-5


def test_fed_positions_in_a_folded_batch_are_refused_with_the_op():
    """Review 29: rows of ``reshape(q, [-1, 3])`` (two per example) numbered by fed tuples were
    taken for the examples' own rows; every step failed at the split's check."""
    with pytest.raises(replicate.ReplicateError, match="GatherNd picks rows of a batch tensor at positions fed in 'idx:0'"):
        replicate.transform(_variant("folded"), ["/cpu:0", "/cpu:1", "/cpu:2"])


def _in_cond(flow: str) -> tf.Graph:
    """The DQN pick in both branches of a training flag's cond (review 29)."""
    graph = tf.Graph()
    with graph.as_default(), (control_flow_v1() if flow == "v1" else contextlib.nullcontext()):
        x = v1.placeholder(tf.float32, [None, 4], name="x")
        idx = v1.placeholder(tf.int32, [None, 2], name="idx")
        y = v1.placeholder(tf.float32, [None], name="y")
        flag = v1.placeholder_with_default(True, [], name="flag")
        w = v1.get_variable("w", [4, 3], initializer=v1.random_normal_initializer(seed=1))
        q = tf.matmul(x, w)
        pick = tf.cond(flag, lambda: tf.gather_nd(q, idx), lambda: tf.gather_nd(2 * q, idx))
        v1.train.GradientDescentOptimizer(0.3).minimize(tf.reduce_mean(tf.square(pick - y)), name="train")
    return graph


def test_fed_rows_in_a_tf1_cond_are_exact_and_in_a_function_body_refused():
    """In a TF1 cond the pick reads the numbers past its ``Switch``: exact in either branch.
    In a cond_v2 branch (a function body) no tower can shift them, and the refusal names the
    op and the fed input; the pick was not seen there, and the rewrite failed at step 1."""
    graph = _in_cond("v1")
    res = replicate.transform(graph, ["/cpu:0", "/cpu:1", "/cpu:2"])
    assert res.report.exact, res.report.reasons
    for batch, flag in ((7, True), (2, False)):
        feeds = [dict(f, **{"flag:0": flag}) for f in _feeds(batch)]
        assert compare(graph, res.meta_graph_def, "train", feeds).max_rel <= 1e-5
    with pytest.raises(replicate.ReplicateError, match="GatherNd picks rows of a batch tensor at "
                       "positions fed in 'idx:0' inside a function body.*move the pick out"):
        replicate.transform(_in_cond("v2"), ["/cpu:0", "/cpu:1", "/cpu:2"])


def test_fed_rows_in_a_tf1_loop_are_refused_with_the_op():
    """Review 31: the pick inside a TF1 ``while_loop`` failed at step 1 with TensorFlow's
    "does not index into param shape"; the fed numbers are followed into the loop's frame."""
    graph = tf.Graph()
    with graph.as_default(), control_flow_v1():
        x = v1.placeholder(tf.float32, [None, 4], name="x")
        idx = v1.placeholder(tf.int32, [None, 2], name="idx")
        w = v1.get_variable("w", [4, 3], initializer=v1.random_normal_initializer(seed=1))
        q = tf.matmul(x, w)
        _, total = tf.while_loop(lambda i, t: i < 2, lambda i, t: (i + 1, t + tf.gather_nd(q, idx)),
                                 [tf.constant(0), tf.zeros_like(idx[:, 0], tf.float32)])
        v1.train.GradientDescentOptimizer(0.3).minimize(tf.reduce_mean(tf.square(total)), name="train")
    with pytest.raises(replicate.ReplicateError, match="positions fed in 'idx:0' inside a TF1 while loop"):
        replicate.transform(graph, ["/cpu:0", "/cpu:1", "/cpu:2"])


def test_positions_computed_from_fed_rows_through_a_tf1_cond_are_refused():
    """Review 31: the tuples chosen by a TF1 cond (``idx`` or ``idx * [1, 0]``) reach the pick
    through its ``Merge``; they were neither shifted nor refused, and every step failed with
    TensorFlow's "does not index into param shape"."""
    graph = tf.Graph()
    with graph.as_default(), control_flow_v1():
        x = v1.placeholder(tf.float32, [None, 4], name="x")
        idx = v1.placeholder(tf.int32, [None, 2], name="idx")
        flag = v1.placeholder_with_default(True, [], name="flag")
        w = v1.get_variable("w", [4, 3], initializer=v1.random_normal_initializer(seed=1))
        chosen = tf.cond(flag, lambda: tf.identity(idx), lambda: idx * tf.constant([1, 0]))
        pick = tf.gather_nd(tf.matmul(x, w), chosen)
        v1.train.GradientDescentOptimizer(0.3).minimize(tf.reduce_mean(tf.square(pick)), name="train")
    with pytest.raises(replicate.ReplicateError, match="positions computed from numbers fed in "
                       "'idx:0'.*pick with the fed tuples as they are"):
        replicate.transform(graph, ["/cpu:0", "/cpu:1", "/cpu:2"])


@pytest.mark.parametrize("path", ["reshape", "cond_v2", "where", "reverse"])
def test_positions_computed_from_fed_rows_on_other_paths_are_refused(path):
    """Review 32: fed tuples reshaped, returned by a cond_v2, chosen by ``tf.where`` or
    reversed before the pick failed at step 1 ("does not index into param shape")."""
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 4], name="x")
        idx = v1.placeholder(tf.int32, [None, 2], name="idx")
        flag = v1.placeholder_with_default(True, [], name="flag")
        w = v1.get_variable("w", [4, 3], initializer=v1.random_normal_initializer(seed=1))
        chosen = {"reshape": lambda: tf.reshape(tf.reshape(idx, [-1]), [-1, 2]),
                  "cond_v2": lambda: tf.cond(flag, lambda: tf.identity(idx), lambda: idx * tf.constant([1, 0])),
                  "where": lambda: tf.where(tf.fill(tf.shape(idx), flag), idx, idx * tf.constant([1, 0])),
                  "reverse": lambda: tf.reverse(idx, [0])}[path]()
        pick = tf.gather_nd(tf.matmul(x, w), chosen)
        v1.train.GradientDescentOptimizer(0.3).minimize(tf.reduce_mean(tf.square(pick)), name="train")
    with pytest.raises(replicate.ReplicateError, match="positions computed from numbers fed in 'idx:0'"):
        replicate.transform(graph, ["/cpu:0", "/cpu:1", "/cpu:2"])
