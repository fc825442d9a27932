"""The empty-batch guard: TensorFlow's oneDNN MaxPoolGrad aborts the process on an empty batch
(``Check failed: dtype() == expected_dtype``), the collective abort the fuzzer saw; towers with
no examples must train through max pooling exactly and without aborting."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

HERE = os.path.dirname(__file__)

# A pooling model run in a child process (an abort must not take pytest down).
_CHILD = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {here!r})
    import conftest, models, numpy as np, tensorflow as tf
    import replicate
    from replicate.check.equivalence import compare
    v1 = tf.compat.v1
    mode = sys.argv[1]
    x = None
    if mode == "raw":          # TensorFlow alone, one device: MaxPoolGrad on an empty batch
        x = v1.placeholder(tf.float32, [None, 8, 8, 2])
        g = tf.gradients(tf.reduce_sum(tf.nn.max_pool2d(x, 2, 2, "SAME")), x)[0]
        with v1.Session() as s:
            s.run(g, {{x: np.zeros((0, 8, 8, 2), np.float32)}})
        print("RESULT raw ok"); sys.exit(0)
    def run(agg, towers, batch):
        graph = tf.Graph()
        with graph.as_default():
            v1.set_random_seed(1)
            x = v1.placeholder(tf.float32, [None, 8, 8, 2], name="x")
            y = v1.placeholder(tf.int64, [None], name="y")
            w0 = v1.get_variable("w0", [1, 1, 2, 2], use_resource=True)
            h = tf.reshape(tf.nn.max_pool2d(x * tf.reduce_sum(w0), 2, 2, "SAME"), [-1, 32])
            w = v1.get_variable("w", [32, 3], use_resource=True)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=y, logits=tf.matmul(h, w)), name="loss")
            v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
        def feed(rng, b):
            return {{"x:0": rng.randn(b, 8, 8, 2).astype(np.float32),
                    "y:0": rng.randint(0, 3, b).astype(np.int64)}}
        model = models.Model(graph, "train", feed)
        res = replicate.transform(graph, [f"/cpu:{{k}}" for k in range(towers)], aggregation=agg)
        guards = sum(1 for n in res.graph_def.node if "/replicate/guard/" in n.name and n.op == "Slice"
                     and n.name.endswith("/sliced"))
        ops = {{n.name: n.op for n in res.graph_def.node}}
        paired = sum(1 for n in res.graph_def.node if n.op == "MaxPoolGrad"
                     and ops[n.input[1].split(":")[0]] == "MaxPool")
        r = compare(graph, res.meta_graph_def, "train", model.feeds(batch, 2), cpus=towers)
        print("RESULT", guards, paired, r.max_rel)
    for agg, towers, batch in zip(sys.argv[2].split(","), map(int, sys.argv[3].split(",")),
                                  map(int, sys.argv[4].split(","))):
        run(agg, towers, batch)
""").format(here=HERE)


def _child(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_USE_LEGACY_KERAS="1")
    return subprocess.run([sys.executable, "-c", _CHILD, *args], capture_output=True, text=True,
                          env=env, timeout=240)


@pytest.mark.skipif(os.environ.get("TF_ENABLE_ONEDNN_OPTS") == "0", reason="oneDNN is off")
def test_tensorflow_alone_aborts_on_an_empty_max_pool_gradient():
    """The cause, without replicate: if TensorFlow fixes its kernel this test says so."""
    done = _child("raw", "-", "1", "0")
    if done.returncode == 0:
        pytest.skip("this TensorFlow build no longer aborts (oneDNN MaxPoolGrad fixed or off)")
    assert done.returncode < 0 or done.returncode == 134, done.stderr[-500:]
    assert "dtype() == expected_dtype" in done.stderr


def test_towers_without_examples_train_through_max_pooling():
    """4 towers with 2 examples (add_n) and 3 with 1 (packed all-reduce), in one child process
    (an abort must not take pytest down; one TensorFlow import for both)."""
    done = _child("replicate", "add_n,packed_allreduce", "4,3", "2,1")
    assert done.returncode == 0, done.stderr[-1500:]
    lines = [l.split() for l in done.stdout.splitlines() if l.startswith("RESULT")]
    assert len(lines) == 2, done.stdout
    for towers, (_, guards, paired, rel) in zip((4, 3), lines):
        assert int(guards) == towers
        # the gradient still reads the forward pooling output directly (oneDNN pairs them)
        assert int(paired) == towers
        assert float(rel) <= 1e-5


def _regression(loss_of):
    """A linear regression whose loss ``loss_of(predictions, y)`` builds, trained by SGD."""
    import tensorflow as tf
    v1 = tf.compat.v1
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, 4], name="x")
        y = v1.placeholder(tf.float32, [None], name="y")
        w = v1.get_variable("w", [4], initializer=v1.glorot_uniform_initializer(seed=1))
        loss = tf.identity(loss_of(tf.reduce_sum(x * w, 1), y), name="loss")
        v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
    return g


def _picking(kind: str):
    """A graph whose loss picks an example of the batch by position (so it is inexact)."""
    import tensorflow as tf

    def loss(p, y):
        p = {"first": lambda: p - p[0], "second": lambda: p - tf.gather(p, [1]),
             "scan": lambda: tf.scan(lambda a, e: a + e, p), "input": lambda: p - y[0],
             "argmax": lambda: p * tf.cast(tf.argmax(y), tf.float32)}[kind]()
        return tf.reduce_mean(tf.square(p - y))
    return _regression(loss)


@pytest.mark.parametrize("kind,need", [("first", 1), ("second", 2), ("scan", 1), ("input", 1), ("argmax", 1)])
def test_a_tower_too_small_for_a_positional_pick_stops_with_a_message(kind, need):
    """The last short batch of an epoch: with fewer examples than the towers need, the step
    stops with the rewrite's own assertion, which names the op and the batch size to feed
    (TensorFlow's own error was 'slice index 0 of dimension 0 out of bounds' in a tower);
    with enough examples it runs; the certificate notes it instead of refusing the graph.
    Review 31: a pick straight from a batch input (``y[0]``, the tower reads its slice) and
    an ``argmax`` over the batch ("Reduction axis 0 is empty") stopped with TensorFlow's
    errors."""
    import numpy as np

    import replicate
    from replicate.check.equivalence import compare
    from replicate.errors import RewriteError

    towers = 3
    res = replicate.transform(_picking(kind), [f"/cpu:{k}" for k in range(towers)], check=True)
    assert not res.report.exact
    assert any(f"at least {need * towers} examples per step" in w for w in res.report.warnings)
    assert any("rewrite stops with its assertion" in n for n in res.report.check["notes"])
    rng = np.random.default_rng(0)

    def feeds(b):
        return [{"x:0": rng.normal(size=(b, 4)).astype(np.float32),
                 "y:0": rng.normal(size=(b,)).astype(np.float32)}]

    compare(_picking(kind), res.graph, "train", feeds(need * towers), cpus=towers)
    with pytest.raises(RewriteError, match="a tower has too few examples.*picks example") as err:
        compare(_picking(kind), res.graph, "train", feeds(need * towers - 1), cpus=towers)
    assert f"feed at least {need * towers} examples per step" in str(err.value)


def test_the_check_states_an_empty_tower_failure_instead_of_refusing():
    """oneDNN's fused convolution + bias + relu gives an empty batch a wrongly shaped output,
    so a conv net's rewrite fails when a tower gets no example (on CPU builds). It runs at the
    uneven split, so the check no longer refuses it (``replicate convert`` refused every such
    CNN): the report warns of short batches instead."""
    import tensorflow as tf

    import replicate
    v1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 4, 4, 1], name="x")
        y = v1.placeholder(tf.int64, [None], name="y")
        h = v1.layers.conv2d(x, 4, 2, padding="same", activation=tf.nn.relu,
                             kernel_initializer=v1.glorot_uniform_initializer(seed=4))
        logits = v1.layers.dense(tf.reshape(h, [-1, 64]), 3,
                                 kernel_initializer=v1.glorot_uniform_initializer(seed=3))
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits),
                              name="loss")
        v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
    res = replicate.transform(graph, ["/cpu:1", "/cpu:2", "/cpu:3"], check=True)
    assert res.report.exact and res.report.check["ran"] and res.report.check["ok"]
    failed = res.report.check.get("empty_tower")
    if failed:      # oneDNN on (the default CPU build): stated, not refused
        assert any("without examples" in w and failed[:40] in w for w in res.report.warnings)
    else:           # TF_ENABLE_ONEDNN_OPTS=0: the empty tower ran
        assert len(res.report.check["runs"]) == 2


def test_an_empty_tower_reshapes_a_flat_batch_as_the_others_do():
    """``tf.reshape(flat, [tf.shape(logits)[0], -1])`` of per-token losses, summed over the
    batch only (a sequence loss averaged per time step): in a tower with no examples
    TensorFlow infers the ``-1`` as 1, not T, and the summed statistics had shapes [T] and
    [1] ("AddN must have the same size and shape" at a batch of 2 on 3 towers)."""
    import numpy as np
    import tensorflow as tf

    import replicate
    from replicate.check.equivalence import compare
    v1 = tf.compat.v1
    T, C = 3, 4

    def build():
        g = tf.Graph()
        with g.as_default():
            x = v1.placeholder(tf.float32, [None, T, 2], name="x")
            y = v1.placeholder(tf.int64, [None, T], name="y")
            m = v1.placeholder(tf.float32, [None, T], name="m")
            w = v1.get_variable("w", [2, C], initializer=v1.glorot_uniform_initializer(seed=2))
            logits = tf.einsum("btd,dc->btc", x, w)
            flat = tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=tf.reshape(y, [-1]), logits=tf.reshape(logits, [-1, C])) * tf.reshape(m, [-1])
            per_step = tf.reshape(flat, [tf.shape(logits)[0], -1])
            loss = tf.reduce_sum(tf.reduce_sum(per_step, 0) / (tf.reduce_sum(m, 0) + 1e-12), name="loss")
            v1.train.GradientDescentOptimizer(0.5).minimize(loss, name="train")
        return g

    rng = np.random.default_rng(3)
    feeds = [{"x:0": rng.normal(size=(b, T, 2)).astype(np.float32),
              "y:0": rng.integers(0, C, (b, T)).astype(np.int64),
              "m:0": (rng.random((b, T)) < 0.7).astype(np.float32)} for b in (7, 2, 5)]
    res = replicate.transform(build(), ["/cpu:1", "/cpu:2", "/cpu:3"])
    assert res.report.exact
    pinned = [n for n in res.graph_def.node if n.name.endswith("replicate/reshape/target")]
    assert len(pinned) == 3
    assert compare(build(), res.graph, "train", feeds, fetch=("loss:0",), cpus=4).max_rel < 1e-5


def _mining(k: str):
    """Hard-example mining: the mean of the k largest per-example losses (inexact)."""
    import tensorflow as tf

    def loss(p, y):
        per = tf.square(p - y)
        n = tf.shape(per)[0]
        if k == "nth":          # the losses above the third smallest
            third = tf.stop_gradient(tf.raw_ops.NthElement(input=per, n=2))
            return tf.reduce_mean(per * tf.cast(per >= third, tf.float32))
        if k == "last":         # the last example's loss (review 32: "slice index -1")
            return tf.reduce_mean(per) + per[n - 1]
        if k == "quantile":     # the losses above the batch's 70% quantile (review 32): the pick
            at = tf.cast(0.7 * tf.cast(n - 1, tf.float32), tf.int32)    # reads a mixed tensor
            return tf.reduce_mean(per * tf.stop_gradient(tf.cast(per >= tf.sort(per)[at], tf.float32)))
        if k == "anchor":       # a random example's loss (the index drawn from the batch size)
            i = tf.compat.v1.random_uniform([1], 0, tf.maximum(n, 1), dtype=tf.int32, seed=9)
            return tf.reduce_mean(per) + tf.reduce_sum(tf.gather(per, i))
        if k == "mirror":       # reflection padding of the batch axis (review 34: "paddings must be
            return tf.reduce_mean(tf.pad(per[:, None], [[1, 1], [0, 0]], "REFLECT"))  # less than")
        if k == "second":       # the second smallest loss, its gradient flowing (review 34: the
            return tf.sort(per)[1]      # pick's gradient ran first and failed)
        if k == "in_batch":     # in-batch negatives: the classes are the examples (review 32:
            logits = p[:, None] * (p[None, :] + y[None, :])   # "Must have at least one class")
            return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=tf.range(n), logits=logits))
        count = {"static": 2, "half": tf.maximum(1, n // 2), "guarded": tf.minimum(n, 3)}[k]
        return tf.reduce_mean(tf.nn.top_k(per, count)[0])
    return _regression(loss)


@pytest.mark.parametrize("k,runs,stops", [("static", 6, 5), ("half", 3, 2), ("guarded", 2, None),
                                          ("nth", 9, 8), ("anchor", 3, 2), ("last", 3, 2),
                                          ("quantile", 3, 2), ("in_batch", 3, 2), ("second", 6, 5),
                                          ("mirror", 6, 5)])
def test_top_k_over_the_batch_runs_or_says_how_many_examples_it_needs(k, runs, stops):
    """``top_k`` over the towers' examples (inexact): a tower with fewer than k examples
    stopped in TensorFlow's "input must have at least k columns", and a tower without any in
    the gradient's "Requires delta != 0". The tower now asserts it has k examples, and the
    gradient's range of an empty tower steps by 1: a ``min(n, 3)`` that one device never sees
    exceed its batch runs even with an empty tower."""
    import numpy as np

    import replicate
    from replicate.check.equivalence import compare
    from replicate.errors import RewriteError

    rng = np.random.default_rng(0)

    def feeds(b):
        return [{"x:0": rng.normal(size=(b, 4)).astype(np.float32),
                 "y:0": rng.normal(size=(b,)).astype(np.float32)}]

    res = replicate.transform(_mining(k), ["/cpu:1", "/cpu:2", "/cpu:3"])
    assert not res.report.exact
    compare(_mining(k), res.graph, "train", feeds(runs), cpus=4)
    if stops is not None:
        what = {"nth": "NthElement.{1,3} takes the n-th",
                "anchor": "GatherV2.{1,3} picks example.s. of each tower.{1,3}s batch by a position computed",
                "last": "strided_slice.{1,6} picks example.s. of each tower.{1,3}s batch by a position computed",
                "mirror": "MirrorPad.{1,3} mirrors each tower.{1,3}s examples",
                "second": "strided_slice.{1,6} picks by position from .{1,3}sort/",
                "in_batch": "SparseSoftmaxCrossEntropyWithLogits.{1,60} takes a softmax over .{1,3}mul",
                "quantile": "strided_slice.{1,6} picks by a position computed at run time .{1,20} from .{1,3}sort/"}.get(
                    k, "TopKV2.{1,3} takes the k largest")
        with pytest.raises(RewriteError, match="a tower has too few examples: .{1,3}" + what):
            compare(_mining(k), res.graph, "train", feeds(stops), cpus=4)


def test_a_flattened_concatenation_of_two_copies_of_the_batch_keeps_its_width():
    """``tf.reshape(tf.concat([h, 2 * h], 0), [tf.shape(z)[0], -1])``: each example holds two
    rows of the concatenation; the pinned -1 had ignored the copies (2 instead of 4), and
    every tower failed at step 1, claimed exact."""
    import numpy as np
    import tensorflow as tf

    import replicate
    from replicate.check.equivalence import compare
    v1 = tf.compat.v1

    def build():
        g = tf.Graph()
        with g.as_default():
            x = v1.placeholder(tf.float32, [None, 3], name="x")
            w = v1.get_variable("w", [3, 4], initializer=v1.glorot_uniform_initializer(seed=2))
            h = tf.matmul(x, w)
            z = tf.concat([h, 2 * h], 0)
            flat = tf.reshape(z, [tf.shape(z)[0], -1])
            flat.set_shape([None, 4])
            loss = tf.reduce_mean(tf.reduce_sum(tf.square(flat), 1), name="loss")
            v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
        return g

    rng = np.random.default_rng(3)
    feeds = [{"x:0": rng.normal(size=(b, 3)).astype(np.float32)} for b in (7, 5, 2)]
    res = replicate.transform(build(), ["/cpu:1", "/cpu:2", "/cpu:3"])
    assert res.report.exact
    assert compare(build(), res.graph, "train", feeds, fetch=("loss:0",), cpus=4).max_rel < 1e-5


def test_an_empty_tower_flattens_a_time_major_batch_as_the_others_do():
    """``tf.reshape(tf.transpose(h, [1, 0, 2]), [T * tf.shape(x)[0], -1])``: the batch on axis
    1 of ``[T, B, H]``. An empty tower's reshape inferred ``-1 = T * H`` (TensorFlow's rule for
    no elements) instead of H, and its dense layer failed at the step with an empty tower; the
    pin had served only batches on axis 0."""
    import numpy as np
    import tensorflow as tf

    import replicate
    from replicate.check.equivalence import compare
    v1 = tf.compat.v1
    T, D, H = 3, 4, 5

    def build():
        g = tf.Graph()
        with g.as_default():
            x = v1.placeholder(tf.float32, [None, T, D], name="x")
            init = v1.glorot_uniform_initializer
            h = v1.layers.dense(x, H, kernel_initializer=init(seed=1), name="h")
            rows = tf.reshape(tf.transpose(h, [1, 0, 2]), [T * tf.shape(x)[0], -1])
            rows.set_shape([None, H])
            out = v1.layers.dense(rows, 2, kernel_initializer=init(seed=2), name="o")
            loss = tf.reduce_mean(tf.square(out), name="loss")
            v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
        return g

    rng = np.random.default_rng(4)
    feeds = [{"x:0": rng.normal(size=(b, T, D)).astype(np.float32)} for b in (7, 5, 2)]
    res = replicate.transform(build(), ["/cpu:1", "/cpu:2", "/cpu:3"])
    assert compare(build(), res.graph, "train", feeds, fetch=("loss:0",), cpus=4).max_rel < 1e-5


def _empty_tower_case(kind: str):
    """A graph whose rewrite is inexact, and whose empty tower's copy of an op TensorFlow
    rejects on no examples: the rewrite must still run where one device runs."""
    import tensorflow as tf
    v1 = tf.compat.v1
    T, C = 4, 3
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, T, 2], name="x")
        n = v1.placeholder(tf.int32, [None], name="n")
        w = v1.get_variable("w", [2, C], initializer=v1.glorot_uniform_initializer(seed=1))
        h = tf.reshape(tf.matmul(tf.reshape(x, [-1, 2]), w), [-1, T, C])
        b = tf.shape(x)[0]
        if kind == "gather_axis1":          # the gradient's reshape: ``-1`` for no indices
            flat = tf.reshape(h, [b, T * C])
            loss = tf.reduce_mean(tf.square(tf.gather(flat, tf.minimum(tf.range(b) * T + n - 1, T * C - 1), axis=1)))
        elif kind == "segments_by_max":     # max over no ids: the smallest integer, plus one
            ids = tf.repeat(tf.range(b), T)
            loss = tf.reduce_mean(tf.math.unsorted_segment_sum(
                tf.reshape(tf.reduce_sum(tf.square(h), 2), [-1]), ids, tf.reduce_max(ids) + 1))
        elif kind == "sparse_sum":          # its gradient divides by the batch: "by zero"
            mask = tf.sequence_mask(n, T)
            where = tf.where(mask)
            tokens = tf.SparseTensor(where, tf.gather_nd(tf.reduce_sum(tf.square(h), 2), where),
                                     tf.cast(tf.shape(mask), tf.int64))
            loss = tf.reduce_mean(tf.sparse.reduce_sum(tokens, 1))
        elif kind == "masked_scatter":      # ``sel[:, None]`` only adds an axis: no pick
            flat, mask = tf.reshape(h, [b, T * C]), n > 2
            sel = tf.boolean_mask(tf.range(b), mask)
            loss = tf.reduce_mean(tf.square(tf.tensor_scatter_nd_update(
                flat, sel[:, None], tf.boolean_mask(flat, mask) * 2.0)))
        else:                               # CTC: "batch_size must not be 0"
            mask = tf.sequence_mask(tf.minimum(n, 2), 2)
            where = tf.where(mask)
            labels = tf.SparseTensor(where, tf.cast(tf.gather_nd(tf.ones_like(mask, tf.int32), where), tf.int32),
                                     tf.cast(tf.shape(mask), tf.int64))
            loss = tf.reduce_mean(v1.nn.ctc_loss(labels, tf.transpose(h, [1, 0, 2]), tf.fill([b], T)))
        loss = tf.identity(loss, name="loss")
        v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
    return g


@pytest.mark.parametrize("kind", ["gather_axis1", "segments_by_max", "ctc", "sparse_sum", "masked_scatter"])
def test_an_inexact_rewrite_with_an_empty_tower_still_runs(kind):
    """Each failed at step 1 with a batch of 2 on 3 towers, where one device runs: an empty
    tower's gather gradient (``data.shape = [1,0]``), segment count (``num_segments ==
    -2147483647``), CTC loss (``batch_size must not be 0``) or sparse sum's gradient
    (``Integer division by zero``); or replicate's own check that a tower holds the example
    an op picks, misplaced on ``sel[:, None]``, which picks none (review 31)."""
    import numpy as np

    import replicate
    from replicate.check.equivalence import compare
    rng = np.random.default_rng(5)
    feeds = [{"x:0": rng.normal(size=(b, 4, 2)).astype(np.float32),
              "n:0": rng.integers(1, 5, size=b).astype(np.int32)} for b in (2, 1)]
    res = replicate.transform(_empty_tower_case(kind), ["/cpu:1", "/cpu:2", "/cpu:3"])
    # each picks, counts or scatters by tower-local row numbers; the sparse sum's tokens are
    # picked by tf.where(sequence_mask(n)) coordinates, which name n's examples: once those
    # were taken for a batch of their own, now for x's (exact, review 26's gather_nd rule);
    # the CTC loss is per example (exact since review 28)
    assert res.report.exact == (kind in ("sparse_sum", "ctc")), res.report.reasons
    result = compare(_empty_tower_case(kind), res.graph, "train", feeds, fetch=("loss:0",), cpus=4)
    assert np.isfinite(result.max_rel)
    if res.report.exact:
        assert result.max_rel <= 1e-5


def _batch_norm_per_tower():
    import tensorflow as tf
    v1 = tf.compat.v1
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, [None, 6], name="x")
        y = v1.placeholder(tf.int32, [None], name="y")
        w = v1.get_variable("w", [6, 8], initializer=v1.glorot_uniform_initializer(seed=1))
        h = tf.nn.relu(tf.matmul(x, w))
        mean, var = tf.nn.moments(h, [0])
        gamma = v1.get_variable("gamma", [8], initializer=v1.ones_initializer())
        beta = v1.get_variable("beta", [8], initializer=v1.zeros_initializer())
        h = tf.nn.batch_normalization(h, mean, var, beta, gamma, 1e-3)
        out = v1.get_variable("out", [8, 4], initializer=v1.glorot_uniform_initializer(seed=2))
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=y, logits=tf.matmul(h, out)), name="loss")
        v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
    return g


@pytest.mark.parametrize("options", [{}, {"aggregation": "packed"}, {"aggregation": "allreduce"},
                                     {"accumulate": 2}])
def test_an_empty_tower_s_own_batch_statistics_do_not_reach_the_variables(options):
    """Batch norm per tower (inexact): an empty tower's mean and variance are NaN, and its
    gradients for gamma and beta with them; weighed in the towers, they were summed as they
    were, and every variable was NaN after one step where one device trains (review 18)."""
    import numpy as np

    import replicate
    from replicate.check.equivalence import Trainer
    res = replicate.transform(_batch_norm_per_tower(), ["/cpu:1", "/cpu:2", "/cpu:3"], **options)
    assert not res.report.exact
    trainer = Trainer(res.meta_graph_def, "train", 4)
    rng = np.random.default_rng(6)
    try:
        for batch in (2, 1, 7):
            trainer.step({"x:0": rng.normal(size=(batch, 6)).astype(np.float32),
                          "y:0": rng.integers(0, 4, size=batch).astype(np.int32)})
        values = trainer.values()
        assert all(np.isfinite(v).all() for v in values.values()), \
            [n for n, v in values.items() if not np.isfinite(v).all()]
    finally:
        trainer.close()


_DEPTHWISE = textwrap.dedent("""
    import sys
    import numpy as np, tensorflow as tf
    import replicate
    from replicate.check.equivalence import compare
    v1 = tf.compat.v1

    def build():
        g = tf.Graph()
        with g.as_default():
            x = v1.placeholder(tf.float32, [None, 8, 8, 8], name="x")
            y = v1.placeholder(tf.int32, [None], name="y")
            dw = v1.get_variable("dw", [3, 3, 8, 1], initializer=v1.random_normal_initializer(stddev=0.3, seed=1))
            h = tf.nn.relu(tf.nn.depthwise_conv2d(x, dw, [1, 1, 1, 1], "SAME"))
            w = v1.get_variable("w", [8, 4], initializer=v1.random_normal_initializer(seed=2))
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=y, logits=tf.matmul(tf.reduce_mean(h, [1, 2]), w)))
            v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
        return g

    rng = np.random.RandomState(0)
    for accumulate in (1, 2):
        res = replicate.transform(build(), ["/cpu:0", "/cpu:1", "/cpu:2"], accumulate=accumulate)
        feeds = [{"x:0": rng.rand(b, 8, 8, 8).astype(np.float32) * 10,
                  "y:0": rng.randint(0, 4, b).astype(np.int32)} for b in (2, 2, 7)]
        print("RESULT", res.report.exact, compare(build(), res.graph, "train", feeds, cpus=3).max_rel)
""")


def test_an_empty_tower_s_depthwise_filter_gradient_is_zero():
    """TensorFlow's CPU filter gradient of a depthwise convolution leaves its output unwritten
    for an empty batch (with oneDNN off, as the README's limits advise for conv nets): an
    exact rewrite summed that memory into the variable, up to 1e34 off (review 19)."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_ENABLE_ONEDNN_OPTS="0")
    done = subprocess.run([sys.executable, "-c", _DEPTHWISE], capture_output=True, text=True,
                          env=env, timeout=240)
    rows = [line.split() for line in done.stdout.splitlines() if line.startswith("RESULT")]
    assert len(rows) == 2, done.stderr[-2000:]
    for _, exact, rel in rows:
        assert exact == "True" and float(rel) < 1e-5, rows


@pytest.mark.parametrize("crossed", [False, True, "bucketized"])
def test_an_empty_tower_sparse_reshapes_a_hashed_feature_column(crossed):
    """Review 28: ``feature_column.linear_model`` over a hashed string column reshapes its ids
    with ``sparse_reshape(ids, [tf.shape(ids)[0], -1])``; a tower with no examples could not
    infer the ``-1`` ("reshape cannot infer the missing input size for an empty tensor"), and
    the train step failed where one device runs. It is the product of the other dimensions.
    A ``crossed_column`` of two hashed columns (``SparseCross``, which had no rule) too, and
    (review 30) of a vocabulary column and a bucketized number, two batch inputs (mixed on the
    cross's shape operands, and an empty tower failed)."""
    import numpy as np
    import tensorflow as tf

    import replicate
    from replicate.check.equivalence import compare
    v1 = tf.compat.v1
    fc = v1.feature_column

    def build():
        g = tf.Graph()
        with g.as_default():
            feats = {"job": v1.placeholder(tf.string, [None, 1], name="job"),
                     "city": v1.placeholder(tf.string, [None, 1], name="city"),
                     "age": v1.placeholder(tf.float32, [None, 1], name="age")}
            y = v1.placeholder(tf.float32, [None, 1], name="y")
            columns = [fc.categorical_column_with_hash_bucket("job", 20)]
            if crossed == "bucketized":
                job = fc.categorical_column_with_vocabulary_list("job", ["eng", "doc", "law"])
                age = fc.bucketized_column(fc.numeric_column("age"), [25.0, 50.0])
                columns += [age, fc.crossed_column([job, age], 11)]
            elif crossed:
                columns.append(fc.crossed_column(["job", "city"], 30))
            logits = fc.linear_model(feats, columns)
            loss = tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=y, logits=logits))
            v1.train.GradientDescentOptimizer(0.5).minimize(loss, name="train")
        return g

    res = replicate.transform(build(), ["/cpu:0", "/cpu:1", "/cpu:2"])
    assert res.report.exact, res.report.reasons
    rng = np.random.RandomState(0)
    jobs = np.array([b"eng", b"doc", b"law"])
    feeds = [{"job:0": jobs[rng.randint(0, 3, (b, 1))], "city:0": jobs[rng.randint(0, 3, (b, 1))],
              "age:0": rng.uniform(18, 70, (b, 1)).astype(np.float32),
              "y:0": rng.randint(0, 2, (b, 1)).astype(np.float32)} for b in (2, 7)]
    assert compare(build(), res.graph, "train", feeds).max_rel <= 1e-5


@pytest.mark.parametrize("kind", ["argmax", "reflect", "reflect_batch_second"])
def test_an_empty_tower_pools_with_argmax(kind):
    """Review 28: ``tf.nn.max_pool_with_argmax`` (SegNet's pooling) and its gradient reject an
    empty batch ("tensor_in must not be empty"); a tower without examples now pools one zero
    example and slices it away. Review 33: so does reflection padding (``MirrorPad``: "paddings
    must be less than the dimension size: 0, 0 not less than 0"; CycleGAN's generators,
    ``tf.image.sobel_edges``), claimed exact."""
    import numpy as np
    import tensorflow as tf

    import replicate
    from replicate.check.equivalence import compare
    v1 = tf.compat.v1

    def build():
        g = tf.Graph()
        with g.as_default():
            x = v1.placeholder(tf.float32, [None, 4, 4, 2], name="x")
            y = v1.placeholder(tf.int32, [None], name="y")
            scale = v1.get_variable("scale", [2], initializer=tf.ones_initializer())
            if kind == "argmax":
                pooled, _ = tf.nn.max_pool_with_argmax(x * scale, [1, 2, 2, 1], [1, 2, 2, 1], "SAME")
            elif kind == "reflect":
                padded = tf.pad(x * scale, [[0, 0], [1, 1], [1, 1], [0, 0]], mode="REFLECT")
                pooled = tf.nn.avg_pool2d(padded, 3, 2, "VALID")
            else:       # the batch on axis 1 (review 34: only axis 0 was padded)
                rows = tf.pad(tf.transpose(x * scale, [1, 0, 2, 3]), [[1, 1], [0, 0], [1, 1], [0, 0]],
                              mode="REFLECT")
                pooled = tf.nn.avg_pool2d(tf.transpose(rows, [1, 0, 2, 3]), 3, 2, "VALID")
            w = v1.get_variable("w", [8, 3], initializer=v1.glorot_uniform_initializer(seed=2))
            logits = tf.matmul(tf.reshape(pooled, [-1, 8]), w)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
            v1.train.GradientDescentOptimizer(0.5).minimize(loss, name="train")
        return g

    res = replicate.transform(build(), ["/cpu:0", "/cpu:1", "/cpu:2"])
    assert res.report.exact, res.report.reasons
    rng = np.random.RandomState(0)
    feeds = [{"x:0": rng.rand(b, 4, 4, 2).astype(np.float32), "y:0": rng.randint(0, 3, b)} for b in (2, 7)]
    assert compare(build(), res.graph, "train", feeds).max_rel <= 1e-5


def test_an_empty_tower_keeps_its_share_of_weight_decay_in_an_inexact_rewrite():
    """Review 30: in an inexact rewrite an empty tower's gradients were zeroed whole against
    NaN batch statistics, so every variable under weight decay lost that tower's share of it
    (``w`` 7e-4 off, though the reason named only another variable). Only entries that are not
    finite are zeroed now. Here the reason is a max over the batch that trains ``u`` alone."""
    import numpy as np
    import tensorflow as tf

    import replicate
    from replicate.check.equivalence import compare
    v1 = tf.compat.v1

    def build():
        g = tf.Graph()
        with g.as_default():
            x = v1.placeholder(tf.float32, [None, 4], name="x")
            y = v1.placeholder(tf.float32, [None, 1], name="y")
            w = v1.get_variable("w", [4, 1], initializer=v1.glorot_uniform_initializer(seed=1))
            u = v1.get_variable("u", [4, 1], initializer=v1.glorot_uniform_initializer(seed=2))
            loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - y)) + 1e-2 * tf.nn.l2_loss(w) \
                + 0.1 * tf.reduce_max(tf.matmul(x, u))
            v1.train.MomentumOptimizer(0.1, 0.9).minimize(loss, name="train")
        return g

    res = replicate.transform(build(), ["/cpu:0", "/cpu:1", "/cpu:2"])
    assert not res.report.exact and all("Max" in str(r) for r in res.report.reasons), res.report.reasons
    rng = np.random.RandomState(0)
    feeds = [{"x:0": rng.randn(2, 4).astype(np.float32), "y:0": rng.randn(2, 1).astype(np.float32)}
             for _ in range(2)]
    result = compare(build(), res.graph, "train", feeds)
    assert result.per_variable["w"] <= 1e-5 and result.per_variable["w/Momentum"] <= 1e-5, result.per_variable


def test_an_empty_tower_writes_a_copy_of_the_batch_with_a_tensor_scatter():
    """Review 31: ``tensor_scatter_nd_update(zeros([2, n, D]), [[1]], h[None])`` (exact by the
    tensor scatter rule) failed with an empty tower in its gradient's ``GatherNd`` ("params is
    empty"); gradient gathers from empty params now read no tuples, shaped as the tuples say."""
    import numpy as np
    import tensorflow as tf

    import replicate
    from replicate.check.equivalence import compare
    v1 = tf.compat.v1

    def build():
        g = tf.Graph()
        with g.as_default():
            x = v1.placeholder(tf.float32, [None, 3], name="x")
            y = v1.placeholder(tf.float32, [None], name="y")
            h = tf.matmul(x, v1.get_variable("w", [3, 3], initializer=v1.random_normal_initializer(seed=1)))
            z = tf.tensor_scatter_nd_update(tf.zeros(tf.stack([2, tf.shape(x)[0], 3])), [[1]], h[None])
            out = tf.reduce_sum(z[1] * z[1] + z[0], 1)
            v1.train.GradientDescentOptimizer(0.1).minimize(tf.reduce_mean(tf.square(out - y)), name="train")
        return g

    res = replicate.transform(build(), ["/cpu:0", "/cpu:1", "/cpu:2"])
    assert res.report.exact, res.report.reasons
    rng = np.random.RandomState(0)
    feeds = [{"x:0": rng.randn(b, 3).astype(np.float32), "y:0": rng.randn(b).astype(np.float32)} for b in (2, 7)]
    assert compare(build(), res.graph, "train", feeds).max_rel <= 1e-5


def test_a_conv_net_on_cpus_warns_about_empty_towers(monkeypatch):
    """Review 40: an empty tower stops in TensorFlow's oneDNN convolution on CPU (the README
    said so, the report did not): the report now says how many examples a step needs."""
    import tensorflow as tf

    import replicate
    v1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 6, 6, 1], name="x")
        h = v1.layers.conv2d(x, 2, 3, kernel_initializer=v1.glorot_uniform_initializer(seed=1))
        loss = tf.reduce_mean(tf.square(h), name="loss")
        v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
    monkeypatch.delenv("TF_ENABLE_ONEDNN_OPTS", raising=False)
    res = replicate.transform(graph, ["/cpu:1", "/cpu:2", "/cpu:3"], accumulate=2)
    assert any("fewer than 6 examples" in w and "oneDNN" in w for w in res.report.warnings), res.report.warnings
    monkeypatch.setenv("TF_ENABLE_ONEDNN_OPTS", "0")
    res = replicate.transform(graph, ["/cpu:1", "/cpu:2", "/cpu:3"])
    assert not any("oneDNN" in w for w in res.report.warnings)
