"""Picks of the batch's examples that only logging reads (review 45, B2, B4, B6, B8, B9).

A print, summary or assertion message of ``tf.argmax(losses)`` or ``x[0]`` reached by a route
that replicate cannot compute once from the batch's values -- a NaN check's output printed, the
legacy ``tf.compat.v1.Print``'s data, an ``Assert``'s data, a print inside a ``tf.function`` or
a ``tf.cond`` branch -- was claimed exact, and a tower without examples stopped the step (at
replicate's "too few examples" assertion, or in TensorFlow's kernel) where one device runs.
Such a pick now reads its input padded with zeros up to what it picks: the step trains as one
device's, each tower logs its own value, and the report says so."""

from models import control_flow_v1
import numpy as np
import pytest
import tensorflow as tf

import replicate
from replicate.check.equivalence import compare

v1 = tf.compat.v1
DEVICES = ["/cpu:1", "/cpu:2", "/cpu:3"]
NULL = "file:///dev/null"


def _graph(kind: str, stream: str = NULL) -> tf.Graph:
    g = tf.Graph()
    with control_flow_v1(kind == "tf1_loop"), g.as_default():
        x = v1.placeholder(tf.float32, [None, 4], name="x")
        y = v1.placeholder(tf.int64, [None], name="y")
        w = v1.get_variable("w", [4, 5], initializer=v1.glorot_uniform_initializer(seed=1))
        b = v1.get_variable("b", [5], initializer=v1.constant_initializer(0.1))
        out = v1.get_variable("out", [5, 3], initializer=v1.glorot_uniform_initializer(seed=2))
        logits = tf.matmul(tf.tanh(tf.matmul(x, w) + b), out)
        ce = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
        c = tf.stop_gradient(ce)
        if kind == "v1_print_data":         # the TF1 idiom: pass the losses through a Print
            ce = v1.Print(ce, [tf.argmax(c), x[0]], "ce ")
        elif kind == "logits_print_data":   # the logits passed through, a pick of them printed
            logits = v1.Print(logits, [tf.argmax(logits[:, 0]), logits[0]], "logits ")
            ce = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
        logged = {
            "printed_check": lambda: _checked_then_printed(tf.math.top_k(c, 1).values[0], stream),
            "assert_data": lambda: [tf.debugging.Assert(tf.reduce_all(tf.math.is_finite(c)),
                                                        [c[:3], tf.argmax(c)])],
            "print_in_function": lambda: [_printing_mean(c, stream)],
            "print_first_loss": lambda: [_printing_first(c, stream)],
            # the smallest loss added up in a TF1 loop (its frame), printed after it
            "tf1_loop": lambda: [tf.print("smallest", tf.while_loop(
                lambda i, a: i < 2, lambda i, a: (i + 1, a + tf.sort(c)[0]), [0, 0.0])[1],
                output_stream=stream)],
        }.get(kind, lambda: [])()
        if kind == "print_in_cond_branch":
            flag = v1.placeholder_with_default(True, [], name="flag")

            def branch():
                with tf.control_dependencies([tf.print("worst", tf.argmax(c), output_stream=stream)]):
                    return tf.reduce_mean(ce)
            logged = [tf.cond(flag, branch, lambda: tf.reduce_mean(ce))]
        with tf.control_dependencies(logged):      # the loss waits for the logging
            loss = tf.identity(logged[0] if kind == "print_in_cond_branch" else tf.reduce_mean(ce),
                               name="loss")
        v1.train.GradientDescentOptimizer(0.4).minimize(loss, name="train")
    return g


def _checked_then_printed(value, stream):
    """Check it, then log it: the usual order in training scripts."""
    checked = tf.debugging.check_numerics(value, "nan")
    return [checked, tf.print("worst", checked, output_stream=stream)]


@tf.function
def _printing_first(c, stream):
    tf.print("first", c[0], tf.shape(c)[0], output_stream=stream)
    return tf.reduce_sum(c)


@tf.function
def _printing_mean(c, stream):
    tf.print("worst", tf.argmax(c), output_stream=stream)
    return tf.reduce_mean(c)


def _feeds(batches):
    rng = np.random.default_rng(0)
    return [{"x:0": rng.normal(size=(b, 4)).astype(np.float32), "y:0": rng.integers(0, 3, b)}
            for b in batches]


KINDS = ["printed_check", "v1_print_data", "logits_print_data", "assert_data", "print_in_function",
         "print_in_cond_branch", "tf1_loop"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_pick_only_logged_runs_in_an_empty_tower_and_trains_as_one_device(kind):
    graph = _graph(kind)
    res = replicate.transform(graph, DEVICES)
    assert res.report.exact, res.report.reasons
    # 7, 2, 5 examples on 3 towers: the second step leaves tower 2 without examples; the
    # loss is fetched every step (a print in a cond branch runs only then)
    cmp = compare(graph, res.graph, "train", _feeds([7, 2, 5]), fetch=("loss:0",))
    assert cmp.max_rel < 1e-5, cmp
    warnings = res.report.warnings
    assert any("only logg" in w and "zeros padded in" in w for w in warnings), warnings
    assert not any("examples per step" in w for w in warnings), warnings


@pytest.mark.parametrize("kind", ["v1_print_data", "print_in_function", "tf1_loop"])
def test_a_pick_only_logged_runs_with_accumulation(kind):
    graph = _graph(kind)
    res = replicate.transform(graph, DEVICES, accumulate=2)
    cmp = compare(graph, res.graph, "train", _feeds([7, 2, 5]), fetch=("loss:0",))
    assert cmp.max_rel < 1e-5, cmp


def test_each_tower_logs_its_own_pick_and_an_empty_one_logs_zeros(tmp_path):
    """What the warning says: a tower logs the loss of its first example; one without
    examples logs 0 (its count, 0, beside it), and training is one device's."""
    log = tmp_path / "printed.txt"
    graph = _graph("print_first_loss", f"file://{log}")
    res = replicate.transform(graph, DEVICES)
    cmp = compare(graph, res.graph, "train", _feeds([2]), fetch=("loss:0",))
    assert cmp.max_rel < 1e-5, cmp
    lines = log.read_text().splitlines()
    # "first <loss of the first example> <examples>": one device's lines (2 examples), then
    # the towers' (1, 1 and 0 examples), each run of the step
    printed = [(float(v), int(n)) for _, v, n in (line.split() for line in lines)]
    by = {n: [v for v, m in printed if m == n] for n in (0, 1, 2)}
    runs = len(by[2])
    assert runs and len(by[1]) == 2 * runs and len(by[0]) == runs, lines
    assert all(v == 0.0 for v in by[0]), lines                 # the empty tower: zeros padded in
    first = by[2][0]        # tower 0's first example is the batch's first, tower 1's another
    assert sum(abs(v - first) < 1e-5 for v in by[1]) == runs and all(v > 0 for v in by[1]), lines


def _kept(res) -> None:
    """The pick kept its assertion and was neither padded nor said to be only logged."""
    assert not any("zeros padded in" in w for w in res.report.warnings), res.report.warnings
    asserts = [n.name for n in res.graph_def.node if n.op == "Assert" and "replicate/examples" in n.name]
    assert asserts, "the pick lost its assertion"
    pads = [n.name for n in res.graph_def.node if "/replicate/empty/pad_" in n.name]
    assert not pads, pads


@pytest.mark.parametrize("resource", [True, False], ids=["resource", "ref"])
def test_a_pick_a_variable_update_reads_keeps_its_assertion(resource):
    """Padding is for picks only logging reads: a pick stored in a variable is state the
    step writes (an ``Assign`` of a ref variable is not marked stateful: review 46 took it
    for logging), and an empty tower still stops with replicate's message."""
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, 6], name="x")
        w = v1.get_variable("w", [6, 1], initializer=v1.glorot_uniform_initializer(seed=1))
        first = v1.get_variable("first", [6], initializer=tf.zeros_initializer(), trainable=False,
                                use_resource=resource)
        with tf.control_dependencies([v1.assign(first, x[0])]):
            loss = tf.identity(tf.reduce_mean(tf.square(tf.matmul(x, w))), name="loss")
        v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
    _kept(replicate.transform(g, DEVICES))


@pytest.mark.parametrize("route", ["assert_data", "v1_print_data"])
def test_a_bool_pick_only_logged_is_padded_with_false(route):
    """Review 46: the zero padded in was an int, and a bool pick (``wrong[0]``) failed the
    transform."""
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, 4], name="x")
        y = v1.placeholder(tf.int64, [None], name="y")
        w = v1.get_variable("w", [4, 3], initializer=v1.glorot_uniform_initializer(seed=1))
        logits = tf.matmul(x, w)
        ce = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
        wrong = tf.not_equal(tf.argmax(logits, 1), y)
        if route == "assert_data":
            with tf.control_dependencies([tf.debugging.Assert(tf.reduce_all(tf.math.is_finite(ce)),
                                                              [wrong[0]])]):
                loss = tf.identity(tf.reduce_mean(ce), name="loss")
        else:
            loss = tf.identity(tf.reduce_mean(v1.Print(ce, [wrong[0]], "wrong ")), name="loss")
        v1.train.GradientDescentOptimizer(0.4).minimize(loss, name="train")
    res = replicate.transform(g, DEVICES)
    assert res.report.exact, res.report.reasons
    assert compare(g, res.graph, "train", _feeds([7, 2, 5]), fetch=("loss:0",)).max_rel < 1e-5
