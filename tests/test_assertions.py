"""Assertions on a value of the whole batch: ``assert_positive(tf.shape(x)[0])``,
``tf.Assert(B > 1, ...)``, ``assert_positive(reduce_sum(...))``, ``tf.Assert(reduce_any(...))``.

Each tower's copy checked its own value, so a tower with fewer examples, or none, failed where
one device passes: reported exact, the rewrite failed at step 1. Now each copy checks the
batch's value (merged, or computed once on the controller), in TF1 conds and in TensorFlow
2's assert guards (an ``If`` whose branch asserts) alike; an assertion on per-example values
(``All``) stays in its tower. One that fails on one device fails in the rewrite too."""

from models import control_flow_v1
import numpy as np
import pytest
import tensorflow as tf

import replicate
from replicate.check.equivalence import compare, session_config

v1 = tf.compat.v1
DEVICES = ["/cpu:1", "/cpu:2", "/cpu:3"]


def _graph(kind: str, v1_control_flow: bool) -> tf.Graph:
    g = tf.Graph()
    with control_flow_v1(v1_control_flow), g.as_default():
        x = v1.placeholder(tf.float32, [None, 6], name="x")
        y = v1.placeholder(tf.int64, [None], name="y")
        w = v1.get_variable("w", [6, 6], initializer=v1.glorot_uniform_initializer(seed=1))
        out = v1.get_variable("out", [6, 3], initializer=v1.glorot_uniform_initializer(seed=2))
        h = tf.tanh(tf.matmul(x, w))
        size = tf.shape(x)[0]
        check = {
            "positive_size": lambda: v1.assert_positive(size),
            "size_above_one": lambda: tf.Assert(size > 1, [size]),
            "size_at_most_5": lambda: v1.assert_less_equal(size, 5),
            "positive_sum": lambda: v1.assert_positive(tf.reduce_sum(tf.exp(h))),
            "some_small": lambda: tf.Assert(tf.reduce_any(h < 0.5), [h]),
            "labels": lambda: v1.assert_less(y, tf.constant(3, tf.int64)),
        }[kind]
        with tf.control_dependencies([check()]):
            h = tf.identity(h)
        logits = tf.matmul(h, out)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits),
                              name="loss")
        v1.train.GradientDescentOptimizer(0.4).minimize(loss, name="train")
    return g


def _feeds(batches):
    rng = np.random.default_rng(0)
    return [{"x:0": rng.normal(size=(b, 6)).astype(np.float32), "y:0": rng.integers(0, 3, b)}
            for b in batches]


def _per_example_losses(squash: bool = False):
    """In the default graph: the fed ``x`` and ``y``, a seeded weight ``w`` and the examples'
    cross-entropies of a linear classifier (of ``tanh`` of it, with ``squash``)."""
    x = v1.placeholder(tf.float32, [None, 6], name="x")
    y = v1.placeholder(tf.int64, [None], name="y")
    w = v1.get_variable("w", [6, 3], initializer=v1.glorot_uniform_initializer(seed=1))
    logits = tf.tanh(tf.matmul(x, w)) if squash else tf.matmul(x, w)
    return x, y, w, tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)


WHOLE_BATCH = ["positive_size", "size_above_one", "positive_sum", "some_small"]


@pytest.mark.parametrize("kind", WHOLE_BATCH + ["labels"])
@pytest.mark.parametrize("v1_control_flow", [False, True])
def test_an_assertion_checks_the_batch_s_value_in_every_tower(kind, v1_control_flow):
    graph = _graph(kind, v1_control_flow)
    res = replicate.transform(graph, DEVICES)
    assert res.report.exact, res.report.reasons
    # 2 examples on 3 towers: the last tower has none (its size is 0, its sum 0, its Any False)
    cmp = compare(graph, res.graph, "train", _feeds([2, 7, 2]), fetch=("loss:0",))
    assert cmp.max_rel < 1e-5, cmp


@pytest.mark.parametrize("kind", WHOLE_BATCH)
def test_the_towers_copies_read_the_merged_condition(kind):
    res = replicate.transform(_graph(kind, False), DEVICES)
    gd = res.graph.as_graph_def()
    nodes = {n.name: n for n in gd.node}
    checks = [n for n in gd.node if n.name.startswith("tower_") and n.op in ("Assert", "If")
              and "Assert" in n.name]
    assert len(checks) == 3
    for node in checks:
        source = nodes[node.input[0].split(":")[0]]
        assert not source.name.startswith("tower_"), (node.name, source.name)


def test_an_assertion_on_per_example_values_stays_in_its_tower():
    gd = replicate.transform(_graph("labels", False), DEVICES).graph.as_graph_def()
    guards = [n for n in gd.node if n.name.startswith("tower_") and n.op == "If"]
    assert len(guards) == 3
    assert all(n.input[0].startswith(n.name.split("/")[0] + "/") for n in guards)


@pytest.mark.parametrize("v1_control_flow", [False, True])
def test_an_assertion_one_device_fails_fails_in_the_rewrite(v1_control_flow):
    graph = _graph("size_at_most_5", v1_control_flow)
    res = replicate.transform(graph, DEVICES)
    assert res.report.exact, res.report.reasons
    with res.graph.as_default():
        init = v1.global_variables_initializer()
    with v1.Session(graph=res.graph, config=session_config()) as sess:
        sess.run(init)
        sess.run("train", feed_dict=_feeds([5])[0])          # 5 <= 5 on one device: 2 + 2 + 1 here
        with pytest.raises(tf.errors.InvalidArgumentError):
            sess.run("train", feed_dict=_feeds([7])[0])      # 7 > 5: each tower holds <= 3


def _branch_graph(kind: str) -> tf.Graph:
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, 6], name="x")
        y = v1.placeholder(tf.int64, [None], name="y")
        flag = v1.placeholder_with_default(True, [], name="flag")
        w = v1.get_variable("w", [6, 3], initializer=v1.glorot_uniform_initializer(seed=1))
        h = tf.matmul(x, w)
        size = tf.shape(x)[0]

        def checked():
            if kind == "size":      # a value passed into the branch, read only by the assertion
                check = v1.assert_positive(size)
            elif kind == "inner_size":      # the size of the rows passed in, taken in the branch
                check = v1.assert_positive(tf.shape(h)[0])
            else:                   # computed in the branch from the tower's rows
                check = tf.Assert(tf.reduce_any(h < 0.5), [h])
            with tf.control_dependencies([check]):
                return tf.identity(h)

        logits = tf.cond(flag, checked, lambda: h * 1.0)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits),
                              name="loss")
        v1.train.GradientDescentOptimizer(0.4).minimize(loss, name="train")
    return g


def test_a_cond_branch_asserting_on_a_value_passed_in_reads_the_batch_s():
    graph = _branch_graph("size")
    res = replicate.transform(graph, DEVICES)
    assert res.report.exact, res.report.reasons
    cmp = compare(graph, res.graph, "train", _feeds([2, 7]), fetch=("loss:0",))
    assert cmp.max_rel < 1e-5, cmp


@pytest.mark.parametrize("kind", ["rows", "inner_size"])
def test_a_cond_branch_asserting_on_its_own_batch_value_is_a_reason_and_runs(kind):
    """The branch computes the value from the tower's rows: no merged value can stand in.
    A reason says the towers do not check it, and they do not (an empty tower failed)."""
    graph = _branch_graph(kind)
    res = replicate.transform(graph, DEVICES)
    assert not res.report.exact
    assert any("assertion inside function" in r.what and "do not check" in r.what
               for r in res.report.reasons), res.report.reasons
    compare(graph, res.graph, "train", _feeds([7, 2]), fetch=("loss:0",))     # runs


def _stat_graph(kind: str, v1_control_flow: bool = False) -> tf.Graph:
    """Review 43's cases: checks of a whole-batch value placed in the towers."""
    g = tf.Graph()
    with control_flow_v1(v1_control_flow), g.as_default():
        x, y, w, ce = _per_example_losses()
        c = x[:, 0]
        deps, updates = [], []
        stat = tf.identity(tf.math.reduce_variance(c), name="stat")
        if kind == "logged_variance":        # printed in the towers, averaged beside the step
            deps = [tf.print("variance", stat, output_stream="file:///dev/null")]
            running = v1.get_variable("running", [], initializer=tf.zeros_initializer(), trainable=False)
            updates = [running.assign(0.9 * running + 0.1 * stat)]
        elif kind == "versus_mean":          # each example against the batch's mean
            deps = [v1.assert_greater_equal(c, tf.reduce_mean(c) - 2.0)]
        elif kind == "sum_bound":            # a TF1 guard: every tower under it, the batch not
            deps = [v1.assert_less(tf.reduce_sum(c), 3.0)]
        with tf.control_dependencies(deps):
            ce = tf.identity(ce)
        loss = tf.reduce_mean(ce)
        if kind == "check_numerics":
            loss = tf.debugging.check_numerics(loss, "loss is NaN")
        loss = tf.identity(loss, name="loss")
        train = v1.train.GradientDescentOptimizer(0.4).minimize(loss)
        tf.group(train, *updates, name="train")
    return g


@pytest.mark.parametrize("kind", ["logged_variance", "check_numerics"])
def test_a_whole_batch_statistic_checked_in_the_towers_is_the_batch_s(kind):
    """A variance printed in the towers was merged by its last mean (each tower's squares
    around its own mean: 0.43 for 4.0) and its running average trained 0.2-0.95 off; a
    ``check_numerics`` of the mean loss failed in an empty tower (0/0)."""
    graph = _stat_graph(kind)
    for options in ({}, {"accumulate": 2}):
        res = replicate.transform(graph, DEVICES, **options)
        assert res.report.exact, res.report.reasons
        cmp = compare(graph, res.graph, "train", _feeds([7, 2, 5]), fetch=("loss:0", "stat:0"))
        assert cmp.max_rel < 1e-5, (options, cmp)
        for one, rewrite in cmp.fetched:
            np.testing.assert_allclose(rewrite[1], one[1], rtol=1e-5)


@pytest.mark.parametrize("kind,v1_control_flow", [("versus_mean", False), ("versus_mean", True),
                                                  ("sum_bound", True)])
def test_an_assertion_fails_in_the_rewrite_exactly_where_one_device_fails(kind, v1_control_flow):
    """Column 0 of the first feed passes on one device but not in the tower holding 6 (mean
    3 there); the second passes in every tower but not in the batch (sum 4)."""
    graph = _stat_graph(kind, v1_control_flow)
    res = replicate.transform(graph, DEVICES)
    feeds = _feeds([7, 7])
    feeds[0]["x:0"][:, 0] = [0, 0, 0, 0, 6, 0, 0]
    feeds[1]["x:0"][:, 0] = [1, 0.5, 0.5, 1, 0.5, 0.25, 0.25]
    outcomes = []
    for g in (graph, res.graph):
        with g.as_default():
            init = v1.global_variables_initializer()
        ran = []
        with v1.Session(graph=g, config=session_config()) as sess:
            sess.run(init)
            for feed in feeds:
                try:
                    sess.run("train", feed_dict=feed)
                    ran.append(True)
                except tf.errors.InvalidArgumentError:
                    ran.append(False)
        outcomes.append(ran)
    expected = [True, True] if kind == "versus_mean" else [False, False]
    assert outcomes == [expected, expected], outcomes


def test_an_assertion_in_a_tf1_loop_on_a_whole_batch_value_is_a_reason_and_runs():
    g = tf.Graph()
    with control_flow_v1(True), g.as_default():
        x = v1.placeholder(tf.float32, [None, 6], name="x")
        y = v1.placeholder(tf.int64, [None], name="y")
        w = v1.get_variable("w", [6, 3], initializer=v1.glorot_uniform_initializer(seed=1))
        size = tf.shape(x)[0]

        def body(i, h):
            with tf.control_dependencies([v1.assert_less(i, size + 1)]):
                return i + 1, h * 0.9
        _, h = tf.while_loop(lambda i, h: i < 2, body, [tf.constant(0), x])
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=tf.matmul(h, w)),
                              name="loss")
        v1.train.GradientDescentOptimizer(0.4).minimize(loss, name="train")
    res = replicate.transform(g, DEVICES)
    assert not res.report.exact and any("assertion" in r.what for r in res.report.reasons)
    compare(g, res.graph, "train", _feeds([7, 2]), fetch=("loss:0",))     # runs


@pytest.mark.parametrize("kind", ["print_argmax", "print_first", "assert_sorted_min", "check_sorted_max",
                                  "all_finite_first", "summary_top_1", "histogram_first_3"])
def test_a_logged_or_checked_pick_of_the_batch_runs_with_an_empty_tower(kind):
    """Review 44: printing or checking the batch's worst or first example (``tf.print(argmax(
    ce))``, ``tf.print(x[0])``, an assertion on ``sort(c)[0]``) as a control dependency was
    claimed exact, and each tower's own pick stopped an empty tower at replicate's "too few
    examples" assertion. The print or check runs once, on the batch's value."""
    g = tf.Graph()
    with g.as_default():
        x, y, w, ce = _per_example_losses()
        c = tf.stop_gradient(ce)
        check = {
            "print_argmax": lambda: tf.print("worst", tf.argmax(c), output_stream="file:///dev/null"),
            "print_first": lambda: tf.print("first", x[0], output_stream="file:///dev/null"),
            "assert_sorted_min": lambda: v1.assert_non_negative(tf.sort(c)[0]),
            "check_sorted_max": lambda: tf.debugging.check_numerics(tf.sort(c)[-1], "nan"),
            # an identity of the first example that waits for the check
            "all_finite_first": lambda: tf.debugging.assert_all_finite(c[0], "nan"),
            "summary_top_1": lambda: v1.summary.scalar("worst", tf.math.top_k(c, 1).values[0]),
            "histogram_first_3": lambda: v1.summary.histogram("first", c[:3]),
        }[kind]()
        with tf.control_dependencies([check]):
            loss = tf.identity(tf.reduce_mean(ce), name="loss")
        v1.train.GradientDescentOptimizer(0.4).minimize(loss, name="train")
    res = replicate.transform(g, DEVICES)
    assert res.report.exact, res.report.reasons
    cmp = compare(g, res.graph, "train", _feeds([7, 2, 5]), fetch=("loss:0",))
    assert cmp.max_rel < 1e-5, cmp
    if kind.startswith("print"):        # printed once per step, not once per tower
        prints = [n for n in res.graph_def.node if n.op == "PrintV2"]
        assert len(prints) == 1, [n.name for n in prints]
    # no tower picks its own examples any more: no step needs a minimum batch
    assert not any("examples per step" in w for w in res.report.warnings), res.report.warnings
    if kind in ("check_sorted_max", "all_finite_first"):    # fetched by name: the batch's value
        assert not any("tower 0's value" in w for w in res.report.warnings), res.report.warnings


def _checked_sum_graph(kind: str) -> tf.Graph:
    """A NaN check of a batch sum, divided by the batch size after it (review 44 B5): the
    check's gradient checks the gradient entering it too, which in a tower without examples
    is 1 / 0 (its mean of no examples)."""
    g = tf.Graph()
    with control_flow_v1(kind in ("cond_branch", "tf1_loop")), g.as_default():
        x, y, w, ce = _per_example_losses(squash=True)
        size = tf.cast(tf.shape(x)[0], tf.float32)
        if kind == "sum_over_size":
            loss = tf.debugging.check_numerics(tf.reduce_sum(ce), "nan") / size
        elif kind == "in_a_function":
            @tf.function
            def checked(c):
                return tf.debugging.check_numerics(tf.reduce_sum(c), "nan")
            loss = checked(ce) / size
        elif kind == "tf1_loop":   # a weight norm checked in a TF1 loop's body: its frame
            # cannot read the tower's count outside it ("inputs from different frames", review 45)
            _, norm = tf.while_loop(lambda i, a: i < 2, lambda i, a: (i + 1, a + tf.debugging.check_numerics(
                tf.reduce_sum(tf.square(w)), "nan")), [0, 0.0])
            loss = tf.reduce_mean(ce) + 0.01 * norm
        else:   # the mean checked in a TF1 cond's branch: the towers' gradients entering it add up
            flag = v1.placeholder_with_default(True, [], name="flag")
            loss = tf.cond(flag, lambda: tf.debugging.check_numerics(tf.reduce_mean(ce), "nan"),
                           lambda: tf.reduce_mean(ce))
        loss = tf.identity(loss, name="loss")
        v1.train.GradientDescentOptimizer(0.4).minimize(loss, name="train")
    return g


@pytest.mark.parametrize("kind", ["sum_over_size", "in_a_function", "cond_branch", "tf1_loop"])
def test_a_nan_check_s_gradient_runs_in_a_tower_without_examples(kind):
    graph = _checked_sum_graph(kind)
    res = replicate.transform(graph, DEVICES)
    # a check inside a function body cannot read the batch's value: a reason, and it runs
    assert res.report.exact == (kind != "in_a_function"), res.report.reasons
    cmp = compare(graph, res.graph, "train", _feeds([7, 2, 5]), fetch=("loss:0",))
    assert cmp.max_rel < 1e-5, cmp


def test_a_print_of_a_batch_statistic_out_of_a_tf1_cond_is_said_to_print_per_tower():
    """Review 45: a variance computed in a TF1 cond's branch cannot be computed once from the
    towers' values, so each tower prints its own (three lines a step, ``nan`` for a tower
    without examples). Training is exact; the report now says which print logs per tower."""
    g = tf.Graph()
    with control_flow_v1(True), g.as_default():
        x, y, w, ce = _per_example_losses()
        flag = v1.placeholder_with_default(True, [], name="flag")
        stat = tf.cond(flag, lambda: tf.math.reduce_variance(tf.stop_gradient(ce)), lambda: 0.0)
        with tf.control_dependencies([tf.print("variance", stat, output_stream="file:///dev/null")]):
            loss = tf.identity(tf.reduce_mean(ce), name="loss")
        v1.train.GradientDescentOptimizer(0.4).minimize(loss, name="train")
    res = replicate.transform(g, DEVICES)
    assert res.report.exact, res.report.reasons
    assert any("each tower logs its own" in w for w in res.report.warnings), res.report.warnings
    cmp = compare(g, res.graph, "train", _feeds([7, 2, 5]), fetch=("loss:0",))
    assert cmp.max_rel < 1e-5, cmp


def test_a_nan_check_s_gradient_fails_on_a_batch_of_none_as_on_one_device():
    """Review 45: a step with no examples at all is one device's 0/0, and its NaN check's
    gradient stops the step; the empty-tower guard had zeroed the check's input in every tower,
    and the rewrite trained on. It keeps the check when the whole batch is empty."""
    graph = _checked_sum_graph("sum_over_size")
    res = replicate.transform(graph, DEVICES)
    for g in (graph, res.graph):
        with g.as_default():
            init = v1.global_variables_initializer()
        with v1.Session(graph=g, config=session_config()) as sess:
            sess.run(init)
            sess.run("train", _feeds([5])[0])                   # a batch with examples runs
            with pytest.raises(tf.errors.InvalidArgumentError, match="Inf|NaN"):
                sess.run("train", _feeds([0])[0])


@pytest.mark.parametrize("accumulate", [1, 2])
def test_merged_summaries_the_loss_waits_for_are_the_batch_s(accumulate):
    """Review 45: ``merge_all()`` as a control dependency of the loss (so that the summary is
    made every step): the towers' merge read their own summaries, a top-1 scalar stopped the
    tower without examples, and the fetched merge was tower 0's (a batch mean 1.33 for 1.42).
    Each tower's merge now reads the summaries made once from the batch's values."""
    g = tf.Graph()
    with g.as_default():
        x, y, w, ce = _per_example_losses()
        c = tf.stop_gradient(ce)
        v1.summary.scalar("worst", tf.math.top_k(c, 1).values[0])
        v1.summary.scalar("mean", tf.reduce_mean(c))
        v1.summary.histogram("first", c[:3])
        merged = v1.summary.merge_all(name="merged")
        with tf.control_dependencies([merged]):
            loss = tf.identity(tf.reduce_mean(ce), name="loss")
        v1.train.GradientDescentOptimizer(0.4).minimize(loss, name="train")
    res = replicate.transform(g, DEVICES, accumulate=accumulate)
    assert res.report.exact, res.report.reasons
    assert not any("tower 0's value" in w or "examples per step" in w for w in res.report.warnings), \
        res.report.warnings
    cmp = compare(g, res.graph, "train", _feeds([7, 2, 5]), fetch=(merged.name,))
    assert cmp.max_rel < 1e-5, cmp
    for (one,), (many,) in cmp.fetched:
        a, b = tf.compat.v1.Summary(), tf.compat.v1.Summary()
        a.ParseFromString(one)
        b.ParseFromString(many)
        one_scalars = {v.tag: v.simple_value for v in a.value if v.WhichOneof("value") == "simple_value"}
        many_scalars = {v.tag: v.simple_value for v in b.value if v.WhichOneof("value") == "simple_value"}
        assert set(one_scalars) == set(many_scalars) and len(one_scalars) == 2, (one_scalars, many_scalars)
        for tag, value in one_scalars.items():
            assert many_scalars[tag] == pytest.approx(value, rel=1e-5), tag
