"""Everyday idioms that once converted and then failed at run time (or were refused), each
checked against one device with plain SGD at 3 towers on an uneven batch."""

import contextlib

import numpy as np
import pytest
import tensorflow as tf

import replicate
from replicate.check.equivalence import compare

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
        elif kind == "ones_matmul":
            # a mean written as a product with a row of ones over a static batch, reading
            # pred[:, None]: the slice's gradient was made tower-sized by its shape and cut to
            # the towers' rows again (InternalError: the rewrite did not import)
            loss = tf.squeeze(tf.matmul(tf.ones([1, batch]) / batch, tf.square(pred - y)[:, None]))
        elif kind == "assert_dep":
            # tf.debugging.assert_non_negative over the batch as a control dependency: its
            # reduce_all was merged across towers with a Minimum on bool (InternalError)
            err = tf.square(pred - y)
            with tf.control_dependencies([tf.debugging.assert_non_negative(err)]):
                loss = tf.reduce_mean(err)
        elif kind == "baked_reshape":
            # a Python batch size of 8 in a reshape of a dynamic batch ([B, 4] -> [8, 2, 2]):
            # "splits or scatters the examples", and the rewrite did not run
            folded = tf.reshape(x * w, [8, 2, 2])
            loss = tf.reduce_mean(tf.square(tf.reduce_sum(tf.reshape(folded, [8, 4]), 1) - y))
        elif kind == "last_example":
            # a term on the batch's last example: inexact, and its gradient, put at each
            # tower's last row, was cut as a global tensor ("the rewrite fails at step 1")
            loss = tf.reduce_mean(tf.square(pred - y)) + 0.1 * tf.square(pred - y)[-1]
        elif kind in ("gather_one", "slice_one", "gather_nd_one"):
            # the same through a gather, a slice and a gather_nd: their gradients (a segment
            # sum into the tower's count of rows, a Pad by it, a ScatterNd) were cut as
            # global tensors, and the slice's paddings, a concat of a shared zero and the
            # tower's count, were taken for a shared value
            err = tf.square(pred - y)
            pick = {"gather_one": lambda: tf.gather(err, [1]), "slice_one": lambda: tf.slice(err, [1], [1]),
                    "gather_nd_one": lambda: tf.gather_nd(err, [[1]])}[kind]()
            loss = tf.reduce_mean(err) + 0.1 * tf.reduce_sum(pick)
        elif kind in ("dqn_pick", "dqn_pick_reversed"):
            # DQN's action pick, row numbers from another input's size (review 26: reported
            # "picks examples of the batch by position"); reversed, it does pick by position
            q = x * w
            action = tf.cast(y, tf.int32)
            numbers = tf.range(tf.shape(action)[0])
            if kind == "dqn_pick_reversed":
                numbers = tf.reverse(numbers, [0])
            q_sa = tf.gather_nd(q, tf.stack([numbers, action], axis=1))
            loss = tf.reduce_mean(tf.square(q_sa - y))
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
                                               ("grad_scope", 7, False),
                                               ("dqn_pick", 7, False), ("dqn_pick", 2, False),
                                               ("ones_matmul", 8, True),
                                               ("baked_reshape", 8, False),
                                               ("assert_dep", 7, False), ("assert_dep", 2, False)])
def test_idiom_trains_exactly(kind, batch, static):
    graph = _graph(kind, batch if static else None)
    res = replicate.transform(graph, ["/cpu:1", "/cpu:2", "/cpu:3"])
    assert res.report.exact, res.report.reasons
    if kind == "baked_reshape":     # the assumption is stated
        assert any("taken to be 8 from 'Reshape'" in w for w in res.report.warnings), res.report.warnings
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


@pytest.mark.parametrize("kind,batch,static", [("last_example", 7, False), ("last_example", 8, True),
                                               ("gather_one", 7, False), ("slice_one", 7, False),
                                               ("gather_nd_one", 7, False), ("slice_one", 8, True),
                                               ("dqn_pick_reversed", 7, False)])
def test_an_inexact_pick_by_position_still_runs(kind, batch, static):
    """``loss[-1]``, ``tf.gather(loss, [1])``...: each tower picks its own example (a
    reason), and the rewrite runs with the original feeds at an uneven split."""
    graph = _graph(kind, batch if static else None)
    res = replicate.transform(graph, ["/cpu:1", "/cpu:2", "/cpu:3"])
    assert not res.report.exact
    assert any("pick" in r.what or "keeps only some" in r.what or "reverses the order" in r.what
               for r in res.report.reasons), \
        res.report.reasons
    rng = np.random.RandomState(0)
    feeds = [{"x:0": rng.randn(batch, 4).astype(np.float32),
              "y:0": rng.randint(0, 3, batch).astype(np.float32)} for _ in range(2)]
    compare(graph, res.graph, "train", feeds, fetch=("loss:0",))


def _fused_batch_norm_under_a_flag(version: int) -> tf.Graph:
    """The 2017 idiom: ``batch_normalization(training=is_training, fused=True)`` with a
    placeholder, its moving averages in UPDATE_OPS, a momentum of 0.9 so they move."""
    from breadth_models import control_flow_v1

    graph = tf.Graph()
    with (control_flow_v1() if version == 1 else contextlib.nullcontext()), graph.as_default():
        x = v1.placeholder(tf.float32, [None, 4, 4, 2], name="x")
        y = v1.placeholder(tf.int32, [None], name="y")
        training = v1.placeholder_with_default(True, [], name="is_training")
        # a 1x1 projection, not a convolution: oneDNN's Conv2D (CPU, AVX-512) returns an
        # empty batch with its input's channels (README, Known limits), and the batch of 2
        # over 3 towers below leaves one tower empty
        kernel = v1.get_variable("kernel", [2, 5], initializer=v1.glorot_uniform_initializer(seed=1))
        h = tf.tensordot(x, kernel, 1)
        h = v1.layers.batch_normalization(h, training=training, fused=True, momentum=0.9)
        logits = v1.layers.dense(tf.reduce_mean(tf.nn.relu(h), [1, 2]), 3,
                                 kernel_initializer=v1.glorot_uniform_initializer(seed=2))
        loss = tf.identity(v1.losses.sparse_softmax_cross_entropy(y, logits), name="loss")
        with tf.control_dependencies(v1.get_collection(v1.GraphKeys.UPDATE_OPS)):
            v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
    return graph


@pytest.mark.parametrize("version", [1, 2])
def test_fused_batch_norm_under_a_training_placeholder(version):
    """TF1 conds (legacy programs, ``disable_v2_behavior``): refused with "input 3 of
    FusedBatchNormV3 depends on the examples" (the inference branch's gradient asked for the
    moving mean per example), and once running, the moving variance was called unmergeable.
    Now exact with ``batch_norm='sync'``. In a v2 ``If`` body the fused op cannot be
    synchronized: a reason naming the fix."""
    graph = _fused_batch_norm_under_a_flag(version)
    res = replicate.transform(graph, ["/cpu:1", "/cpu:2", "/cpu:3"], batch_norm="sync")
    if version == 2:
        assert not res.report.exact
        assert any("disable_control_flow_v2" in r.fix for r in res.report.reasons), res.report.reasons
        return
    assert res.report.exact, res.report.reasons
    rng = np.random.RandomState(0)
    feeds = [{"x:0": rng.randn(b, 4, 4, 2).astype(np.float32), "y:0": rng.randint(0, 3, b)}
             for b in (7, 5, 2)]
    cmp = compare(graph, res.graph, "train", feeds, fetch=("loss:0",))
    assert cmp.max_rel <= 1e-5, (cmp.worst, cmp.max_rel)


def test_a_switch_read_on_the_controller_keeps_its_live_output():
    """The corpus ResNet's batch norm under a training flag (TF1 conds), ``batch_norm='sync'``:
    the controller's recomputed batch norm reads the cond's ``Switch`` merged from the towers.
    Merged as one ``IdentityN`` of both outputs, one of them dead, it was dead whole: the
    moving averages never moved (claimed exact, 1.0 off), which only Grappler's rewrite of
    the IdentityN had hidden; ``compare`` runs without Grappler."""
    from breadth_models import control_flow_v1
    from corpus import resnet_layers

    graph = tf.Graph()
    with control_flow_v1(), graph.as_default():
        v1.set_random_seed(0)
        names = resnet_layers.build(7, flag=True)
    res = replicate.transform(graph, ["/cpu:1", "/cpu:2"], batch_norm="sync")
    assert res.report.exact, res.report.reasons
    switches = [n for n in res.graph.as_graph_def().node if n.name.endswith("cond/FusedBatchNormV3/Switch")]
    assert switches and all(n.op == "Switch" for n in switches), [n.op for n in switches]
    data = resnet_layers.make_data(np.random.RandomState(0), 7, 2)
    feeds = [{names["features"]: x, names["labels"]: y} for x, y in data]
    cmp = compare(graph, res.graph, names["train_op"], feeds)
    assert cmp.max_rel <= 1e-5, (cmp.worst, cmp.max_rel)


def test_a_named_split_that_cannot_run_is_refused_by_the_check():
    """``batch_inputs=`` naming a [3] class-weights table splits it: the analysis reports the
    lookup by labels (inexact), and the rewrite fails at run time. With the check the
    transform refuses, naming the failing node; without it the report says inexact."""
    graph = _graph("class_weights", None)
    named = ["x:0", "y:0", "class_weights:0"]
    res = replicate.transform(graph, ["/cpu:1", "/cpu:2", "/cpu:3"], batch_inputs=named)
    assert not res.report.exact
    with pytest.raises(replicate.errors.RewriteError, match=r"fails at step 1 .*GatherV2.*(indices|too few examples)"):
        replicate.transform(graph, ["/cpu:1", "/cpu:2", "/cpu:3"], batch_inputs=named, check=True)
    # an inexact rewrite that runs says so in its check
    worst = tf.Graph()
    with worst.as_default():
        x = v1.placeholder(tf.float32, [None, 4], name="x")
        w = v1.get_variable("w", [4], initializer=v1.glorot_uniform_initializer(seed=2))
        loss = tf.reduce_max(tf.square(tf.reduce_sum(x * w, axis=1)), name="loss")
        v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
    res = replicate.transform(worst, ["/cpu:1", "/cpu:2"], check=True)
    assert not res.report.exact
    assert res.report.check["ran"] and "checked that the rewrite runs" in res.report.check["notes"][0]


def test_shared_inputs_are_never_split():
    """A fed per-class table whose length equals the batch (3): the evidence (a lookup by the
    labels) keeps it shared; ``shared_inputs=`` says so outright, and a name given both as a
    batch and a shared input is refused."""
    graph = _graph("class_weights", None)
    res = replicate.transform(graph, ["/cpu:1", "/cpu:2", "/cpu:3"], shared_inputs=["class_weights:0"])
    assert res.report.exact, res.report.reasons
    assert "class_weights:0" in res.report.shared_inputs
    assert "class_weights:0" not in [b.tensor for b in res.analysis.batch_inputs]
    with pytest.raises(replicate.ReplicateError, match="both a batch input and a shared input"):
        replicate.transform(graph, ["/cpu:1", "/cpu:2"], batch_inputs=["x:0", "class_weights:0"],
                            shared_inputs=["class_weights:0"])
    with pytest.raises(replicate.ReplicateError, match="not a tensor of the graph"):
        replicate.transform(graph, ["/cpu:1", "/cpu:2"], shared_inputs=["nope:0"])


def test_batch_inputs_that_cannot_be_made_consistent_are_refused():
    """A full-batch graph convolution: every node's output depends on every node, so labels
    and a mask named as batch inputs pair row by row with a value that has no batch axis.
    The rewrite could not run (its gradient needs every row); the override is refused at
    transform time, naming the value."""
    n, f, c = 6, 3, 2
    graph = tf.Graph()
    with graph.as_default():
        adj = v1.placeholder(tf.float32, [n, n], name="adj")
        feats = v1.placeholder(tf.float32, [n, f], name="features")
        labels = v1.placeholder(tf.float32, [None, c], name="labels")
        mask = v1.placeholder(tf.float32, [None], name="mask")
        w1 = v1.get_variable("w1", [f, 4], initializer=v1.glorot_uniform_initializer(seed=1))
        w2 = v1.get_variable("w2", [4, c], initializer=v1.glorot_uniform_initializer(seed=2))
        logits = adj @ tf.nn.relu(adj @ feats @ w1) @ w2
        ce = tf.nn.softmax_cross_entropy_with_logits(labels=labels, logits=logits)
        loss = tf.identity(tf.reduce_sum(ce * mask) / tf.reduce_sum(mask), name="loss")
        v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
    with pytest.raises(replicate.ReplicateError, match="no batch axis"):
        replicate.transform(graph, ["/cpu:1", "/cpu:2"], batch_inputs=["labels:0", "mask:0"])


@pytest.mark.parametrize("batch_norm", ["sync", "tower0"])
def test_a_batch_mean_in_a_cond_branch_named_like_a_top_level_node_is_a_reason(batch_norm):
    """``tf.cond(flag, lambda: h - reduce_mean(h, 0), lambda: h)`` (TF2 control flow) beside a
    loss whose own mean is the top-level node ``Mean``: the branch's ``Mean`` was taken for
    that node, synchronized there under ``batch_norm='sync'``, and the graph claimed exact
    (1.6 off one device in an independent review). A coupling inside a body is named with its
    caller, and cannot be synchronized there: a reason in every mode."""
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 4], name="x")
        y = v1.placeholder(tf.int64, [None], name="y")
        flag = v1.placeholder_with_default(True, [], name="flag")
        h = v1.layers.dense(x, 5, use_bias=False, kernel_initializer=v1.glorot_uniform_initializer(seed=3))
        h = tf.cond(flag, lambda: h - tf.reduce_mean(h, 0), lambda: h)
        logits = v1.layers.dense(tf.nn.relu(h), 3, kernel_initializer=v1.glorot_uniform_initializer(seed=4))
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
        assert loss.op.name == "Mean"
        v1.train.GradientDescentOptimizer(0.5).minimize(tf.identity(loss, name="loss"), name="train")
    res = replicate.transform(graph, ["/cpu:1", "/cpu:2", "/cpu:3"], batch_norm=batch_norm)
    assert not res.report.exact
    assert any("inside a function body" in r.what for r in res.report.reasons), res.report.reasons


@pytest.mark.parametrize("expand", ["tile", "repeat", "stack", "concat"])
def test_a_parameter_expanded_to_a_static_batch(expand):
    """A learned row added to every example of a static batch of 6 (``tf.tile(p, [6, 1])``,
    ``tf.repeat``): the tile's gradient reshapes by a target computed from the multiples
    (transposed, so their values were not followed) and kept the global 6 in each tower
    (InternalError at import). The target is resized per tower now: exact. A stack of six
    copies (``Unpack`` of num=6 in its gradient) is refused naming the node, not an internal
    error."""
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [6, 4], name="x")
        y = v1.placeholder(tf.float32, [6], name="y")
        p = v1.get_variable("p", [1, 4], initializer=v1.random_normal_initializer(seed=1))
        w = v1.get_variable("w", [4], initializer=v1.glorot_uniform_initializer(seed=2))
        rows = {"tile": lambda: tf.tile(p, [6, 1]), "repeat": lambda: tf.repeat(p, 6, axis=0),
                "stack": lambda: tf.stack([p[0]] * 6), "concat": lambda: tf.concat([p] * 6, 0)}[expand]()
        loss = tf.reduce_mean(tf.square(tf.reduce_sum((x + rows) * w, 1) - y), name="loss")
        v1.train.GradientDescentOptimizer(0.2).minimize(loss, name="train")
    devices = ["/cpu:1", "/cpu:2", "/cpu:3"]
    if expand in ("stack", "concat"):     # the concat was claimed exact and failed at step 1
        with pytest.raises(replicate.errors.AnalysisError, match="joins copies of a trained value"):
            replicate.transform(graph, devices)
        return
    res = replicate.transform(graph, devices)
    assert res.report.exact, res.report.reasons
    rng = np.random.RandomState(0)
    feeds = [{"x:0": rng.randn(6, 4).astype(np.float32), "y:0": rng.randn(6).astype(np.float32)}
             for _ in range(3)]
    cmp = compare(graph, res.graph, "train", feeds, fetch=("loss:0",))
    assert cmp.max_rel <= 1e-5, (cmp.worst, cmp.max_rel)


def _classifier(features, y) -> None:
    """A 3-class softmax head on ``features``, its mean loss ``loss`` and SGD ``train``."""
    logits = v1.layers.dense(features, 3, kernel_initializer=v1.glorot_uniform_initializer(seed=4))
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits),
                          name="loss")
    v1.train.GradientDescentOptimizer(0.5).minimize(loss, name="train")


def _runs_inexact(graph: tf.Graph) -> None:
    """The rewrite of ``graph`` (x [B, 4], y [B] labels) at 3 towers is inexact and runs at
    uneven splits."""
    res = replicate.transform(graph, ["/cpu:1", "/cpu:2", "/cpu:3"])
    assert not res.report.exact
    rng = np.random.RandomState(0)
    feeds = [{"x:0": rng.randn(b, 4).astype(np.float32), "y:0": rng.randint(0, 3, b)} for b in (7, 5)]
    compare(graph, res.graph, "train", feeds, fetch=("loss:0",))


def test_a_hand_written_batch_norm_in_a_tf2_cond_runs():
    """The 2016 blog idiom, ``mean, var = tf.cond(is_training, moments + ema.apply, fixed)``
    with TF2 control flow: the cond updates state, so it was moved out of the towers to run
    once on the whole batch, while each tower's gradient ``If`` read its intermediates (the
    whole batch's rows against the tower's: the rewrite failed at step 1). A call whose
    outputs gradient code reads stays in the towers; the moments in the branch are a reason."""
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 4], name="x")
        y = v1.placeholder(tf.int64, [None], name="y")
        training = v1.placeholder_with_default(True, [], name="training")
        h = v1.layers.dense(x, 5, use_bias=False, kernel_initializer=v1.glorot_uniform_initializer(seed=3))
        ema = v1.train.ExponentialMovingAverage(0.5)

        def batch_stats():
            m, v = tf.nn.moments(h, [0])
            with tf.control_dependencies([ema.apply([m, v])]):
                return tf.identity(m), tf.identity(v)

        mean, var = tf.cond(training, batch_stats, lambda: (tf.zeros([5]), tf.ones([5])))
        hn = tf.nn.batch_normalization(h, mean, var, None, None, 1e-3)
        _classifier(tf.nn.relu(hn), y)
    _runs_inexact(graph)


def test_labels_fed_flattened_with_their_time_steps_are_refused_with_the_fix():
    """Char-RNN labels fed as ``[B*T]`` against logits reshaped to ``[-1, C]``: the labels'
    rows pair with the logits' rows, T per example, and were taken for a batch of B examples:
    split by the examples' counts, the rewrite failed at step 1 while the report said exact.
    Fed tensors are split by examples, so this is refused, saying how to feed them."""
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 3, 4], name="x")
        labels = v1.placeholder(tf.int64, [None], name="labels")
        w = v1.get_variable("w", [4, 5], initializer=v1.glorot_uniform_initializer(seed=1))
        logits = tf.reshape(tf.tensordot(x, w, axes=1), [-1, 5])
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits),
                              name="loss")
        v1.train.GradientDescentOptimizer(0.5).minimize(loss, name="train")
    with pytest.raises(replicate.errors.AnalysisError, match=r"several rows per example.*tf.reshape"):
        replicate.transform(graph, ["/cpu:1", "/cpu:2", "/cpu:3"])


@pytest.mark.parametrize("batch_norm", ["sync", "tower0"])
def test_batch_statistics_in_a_tf1_rnn_cell_are_a_reason(batch_norm):
    """Recurrent batch norm (moments over the batch inside a ``dynamic_rnn`` cell, TF1 control
    flow): the sync pass cannot reach into the loop's frame; under ``batch_norm='sync'`` it
    read the statistics from outside the frame, claimed exact, and the rewrite failed at step 1
    ("inputs from different frames"). A reason in every mode, and the rewrite runs."""
    from breadth_models import control_flow_v1

    class NormalizedCell(v1.nn.rnn_cell.RNNCell):
        state_size = output_size = 5

        def build(self, _):
            self.w = self.add_weight("w", [9, 5], initializer=v1.glorot_uniform_initializer(seed=2))
            self.built = True

        def call(self, inputs, state):
            a = tf.matmul(tf.concat([inputs, state], 1), self.w)
            mean, var = tf.nn.moments(a, [0])
            h = tf.tanh((a - mean) * tf.math.rsqrt(var + 1e-3))
            return h, h

    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 3, 4], name="x")
        y = v1.placeholder(tf.float32, [None], name="y")
        with control_flow_v1():
            _, state = v1.nn.dynamic_rnn(NormalizedCell(), x, dtype=tf.float32)
        loss = tf.reduce_mean(tf.square(tf.reduce_sum(state, 1) - y), name="loss")
        v1.train.GradientDescentOptimizer(0.5).minimize(loss, name="train")
    res = replicate.transform(graph, ["/cpu:1", "/cpu:2", "/cpu:3"], batch_norm=batch_norm)
    assert not res.report.exact
    assert any("TF1 while loop" in r.what for r in res.report.reasons), res.report.reasons
    rng = np.random.RandomState(0)
    feeds = [{"x:0": rng.randn(b, 3, 4).astype(np.float32), "y:0": rng.randn(b).astype(np.float32)}
             for b in (7, 5)]
    compare(graph, res.graph, "train", feeds, fetch=("loss:0",))


@pytest.mark.parametrize("lengths", [True, False])
def test_a_time_major_placeholder_is_split_along_its_batch_axis(lengths):
    """``xt`` fed ``[T, B, D]`` to ``dynamic_rnn(time_major=True)`` (the seq2seq tutorials'
    placeholders): taken for a batch on axis 0, the loop carried its state from one "example"
    to the next and the rewrite split along time (inexact, and it failed at step 1). Axis 1
    is tried when axis 0 leaves the loss unproven: exact, as with batch_inputs={'xt:0': 1}."""
    graph = tf.Graph()
    with graph.as_default():
        xt = v1.placeholder(tf.float32, [None, None, 4], name="xt")
        y = v1.placeholder(tf.int64, [None], name="y")
        sl = v1.placeholder(tf.int32, [None], name="sl") if lengths else None
        _, state = v1.nn.dynamic_rnn(v1.nn.rnn_cell.GRUCell(5), xt, sequence_length=sl,
                                     time_major=True, dtype=tf.float32)
        logits = v1.layers.dense(state, 3, kernel_initializer=v1.glorot_uniform_initializer(seed=2))
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits),
                              name="loss")
        v1.train.GradientDescentOptimizer(0.5).minimize(loss, name="train")
    res = replicate.transform(graph, ["/cpu:1", "/cpu:2", "/cpu:3"])
    assert res.report.exact, res.report.reasons
    assert {i["tensor"]: i["axis"] for i in res.report.inputs}["xt:0"] == 1
    rng = np.random.RandomState(5)
    feeds = []
    for b in (7, 5, 2):
        f = {"xt:0": rng.randn(3, b, 4).astype(np.float32), "y:0": rng.randint(0, 3, b)}
        if lengths:
            f["sl:0"] = rng.randint(1, 4, b).astype(np.int32)
        feeds.append(f)
    cmp = compare(graph, res.graph, "train", feeds, fetch=("loss:0",))
    assert cmp.max_rel <= 1e-5, (cmp.worst, cmp.max_rel)


def test_a_defun_recomputed_for_the_fetched_loss_keeps_all_its_outputs():
    """``h - h[0:1]`` inside a ``tf.function`` (inexact): the fetched loss is recomputed once
    from merged values, which runs the function's call on the batch; one of the call's other
    outputs was also merged from the towers, which replaced the call by tower 0's copy, and
    the recomputed loss met the batch's labels with tower 0's rows (failed at step 1)."""
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 4], name="x")
        y = v1.placeholder(tf.int64, [None], name="y")

        @tf.function
        def centered(h):
            return h - h[0:1]

        h = v1.layers.dense(x, 5, kernel_initializer=v1.glorot_uniform_initializer(seed=3))
        _classifier(centered(h), y)
    _runs_inexact(graph)



@pytest.mark.parametrize("towers,batches,accumulate", [(3, (7, 5), 1), (3, (2,), 1), (2, (7,), 2)])
def test_keras_layer_normalization_is_exact(towers, batches, accumulate):
    """Keras ``LayerNormalization`` lowers to a batch norm whose channels are the examples
    (``[B, H]`` reshaped to ``[1, B, H, 1]``, NCHW, a scale of ones per example): its
    statistics are per example. It was reported inexact ("input 1 of FusedBatchNormV3
    depends on the examples"), though it trains exactly."""
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 4], name="x")
        y = v1.placeholder(tf.int64, [None], name="y")
        h = v1.layers.dense(x, 5, kernel_initializer=v1.glorot_uniform_initializer(seed=3))
        _classifier(tf.keras.layers.LayerNormalization()(h), y)
    res = replicate.transform(graph, [f"/cpu:{k + 1}" for k in range(towers)], accumulate=accumulate)
    assert res.report.exact, res.report.reasons
    rng = np.random.RandomState(0)
    feeds = [{"x:0": rng.randn(b, 4).astype(np.float32), "y:0": rng.randint(0, 3, b)} for b in batches]
    cmp = compare(graph, res.graph, "train", feeds, fetch=("loss:0",))
    assert cmp.max_rel <= 1e-5, (cmp.worst, cmp.max_rel)


def test_labels_tiled_whole_against_rows_of_each_example_are_a_reason():
    """``tf.tile(y, [T])`` (T copies of the batch's labels one after the other) against logits
    ``[B, T, C]`` reshaped to ``[-1, C]`` (each example's T rows together): the same number of
    rows per example, laid out differently, so row i meets another example's label in each
    tower than on one device (claimed exact, 1.08 off in an independent review)."""
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 3, 4], name="x")
        y = v1.placeholder(tf.int64, [None], name="y")
        w = v1.get_variable("w", [4, 3], initializer=v1.glorot_uniform_initializer(seed=1))
        logits = tf.reshape(tf.tensordot(x, w, axes=1), [-1, 3])
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=tf.tile(y, [3]), logits=logits), name="loss")
        v1.train.GradientDescentOptimizer(0.5).minimize(loss, name="train")
    res = replicate.transform(graph, ["/cpu:1", "/cpu:2", "/cpu:3"])
    assert not res.report.exact


def test_a_softmax_over_a_tiled_parameter_s_rows_is_a_reason():
    """A parameter tiled over a static batch of 6 and normalized across those rows
    (``softmax(tile(p, [6, 1]), axis=0)``): computed once and cut into the towers' rows, the
    softmax's gradient ran per tower on its rows (claimed exact, p 0.32 off)."""
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [6, 4], name="x")
        y = v1.placeholder(tf.float32, [6], name="y")
        p = v1.get_variable("p", [1, 1], initializer=v1.random_normal_initializer(seed=1))
        weights = tf.nn.softmax(tf.tile(p, [6, 1]), axis=0) * 6.0
        loss = tf.reduce_mean(tf.square(tf.reduce_sum(x * weights, 1) - y), name="loss")
        v1.train.GradientDescentOptimizer(0.5).minimize(loss, name="train")
    res = replicate.transform(graph, ["/cpu:1", "/cpu:2", "/cpu:3"])
    assert not res.report.exact
    assert any("from each other" in r.what for r in res.report.reasons), res.report.reasons


@pytest.mark.parametrize("steps", [None, 3])
def test_time_major_inputs_with_per_step_labels_move_together(steps):
    """A time-major ``xt`` ``[T, B, D]`` with per-step labels ``yt`` ``[T, B]`` that no loop
    unstacks: moving only ``xt`` to axis 1 left ``yt`` on axis 0, which the analysis demoted,
    and the rewrite was claimed exact and split ``xt`` by the time steps (failed at step 1).
    Inputs laid out alike move together, and a retry that demotes an input is not kept. The
    same with the steps declared (``[3, None, D]``, the TF1 seq2seq habit): the labels stayed
    on axis 0 as a "batch of 3", claimed exact, and the split failed at step 1 (review 9)."""
    graph = tf.Graph()
    with graph.as_default():
        xt = v1.placeholder(tf.float32, [steps, None, 4], name="xt")
        yt = v1.placeholder(tf.int64, [steps, None], name="yt")
        outputs, _ = v1.nn.dynamic_rnn(v1.nn.rnn_cell.GRUCell(5), xt, time_major=True, dtype=tf.float32)
        logits = v1.layers.dense(outputs, 3, kernel_initializer=v1.glorot_uniform_initializer(seed=2))
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=yt, logits=logits),
                              name="loss")
        v1.train.GradientDescentOptimizer(0.5).minimize(loss, name="train")
    res = replicate.transform(graph, ["/cpu:1", "/cpu:2", "/cpu:3"])
    rng = np.random.RandomState(5)
    feeds = [{"xt:0": rng.randn(3, b, 4).astype(np.float32), "yt:0": rng.randint(0, 3, (3, b))}
             for b in (7, 5)]
    cmp = compare(graph, res.graph, "train", feeds, fetch=("loss:0",))
    assert res.report.exact, res.report.reasons
    assert cmp.max_rel <= 1e-5, (cmp.worst, cmp.max_rel)


def test_a_mask_fed_flattened_with_its_time_steps_is_refused_with_the_fix():
    """A mask fed ``[B*T]`` times the per-token loss of logits reshaped to ``[-1, C]``: the
    classes were united elsewhere, so the rows conflict was dropped, and the mask was split
    by the examples' counts (claimed exact, failed at step 1). A rows conflict inside one
    class refuses, saying how to feed the tensor."""
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 3, 4], name="x")
        yt = v1.placeholder(tf.int64, [None, 3], name="yt")
        mask = v1.placeholder(tf.float32, [None], name="mask")
        w = v1.get_variable("w", [4, 3], initializer=v1.glorot_uniform_initializer(seed=1))
        ce = tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=tf.reshape(yt, [-1]), logits=tf.reshape(tf.tensordot(x, w, axes=1), [-1, 3]))
        loss = tf.identity(tf.reduce_sum(ce * mask) / tf.reduce_sum(mask), name="loss")
        v1.train.GradientDescentOptimizer(0.5).minimize(loss, name="train")
    with pytest.raises(replicate.errors.AnalysisError, match="rows per example.*one row per example"):
        replicate.transform(graph, ["/cpu:1", "/cpu:2", "/cpu:3"])


def test_a_vocabulary_table_and_hashed_features_are_exact():
    """String features as the feature-column era wrote them: words mapped to ids by a static
    vocabulary table (``StaticHashTable``), hashed into buckets
    (``tf.strings.to_hash_bucket_fast``), and a number bucketized. The table was copied into
    every tower and never initialized ("Table not initialized" at step 1), and the three ops
    had no batch rule (review 9). Now the table is shared like a variable, each op maps its
    elements one by one, and the rewrite is exact through an empty tower and accumulation."""
    def build():
        graph = tf.Graph()
        with graph.as_default():
            x = v1.placeholder(tf.float32, [None, 2], name="x")
            y = v1.placeholder(tf.int64, [None], name="y")
            word = v1.placeholder(tf.string, [None], name="word")
            table = v1.lookup.StaticHashTable(v1.lookup.KeyValueTensorInitializer(
                ["a", "b", "c"], [0, 1, 2], key_dtype=tf.string, value_dtype=tf.int64), 3)
            init = v1.random_normal_initializer
            words = tf.nn.embedding_lookup(v1.get_variable("words", [4, 3], initializer=init(seed=1)),
                                           table.lookup(word))
            hashed = tf.nn.embedding_lookup(v1.get_variable("hashed", [5, 3], initializer=init(seed=2)),
                                            tf.strings.to_hash_bucket_fast(word, 5))
            buckets = tf.raw_ops.Bucketize(input=x[:, 0], boundaries=[-0.5, 0.0, 0.5])
            ranges = tf.nn.embedding_lookup(v1.get_variable("ranges", [4, 3], initializer=init(seed=3)),
                                            buckets)
            h = tf.concat([x, words, hashed, ranges], 1)
            w = v1.get_variable("w", [11, 3], initializer=init(seed=4))
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=y, logits=tf.matmul(h, w)), name="loss")
            v1.train.GradientDescentOptimizer(0.5).minimize(loss, name="train")
        return graph

    rng = np.random.RandomState(0)
    vocab = np.array(["a", "b", "c", "zz", "q"], dtype=object)
    feeds = [{"x:0": rng.randn(b, 2).astype(np.float32), "y:0": rng.randint(0, 3, b),
              "word:0": vocab[rng.randint(0, 5, b)]} for b in (7, 5, 2)]
    for accumulate in (1, 2):
        res = replicate.transform(build(), ["/cpu:1", "/cpu:2", "/cpu:3"], accumulate=accumulate)
        assert res.report.exact, res.report.reasons
        assert [op.name for op in res.graph.get_operations() if op.type == "HashTableV2"] == ["hash_table"]
        cmp = compare(build(), res.graph, "train", feeds, fetch=("loss:0",))
        assert cmp.max_rel <= 1e-5, (cmp.worst, cmp.max_rel)


def _time_major_variant(kind: str) -> tf.Graph:
    """Time-major sequences ([T, B, ...], T dynamic) whose batch axis only shows past another
    op: labels fed ``[T, B]`` beside a batch-major ``x`` (compared with transposed logits),
    ``tf.reverse_sequence`` before a backward RNN, a variational dropout before the RNN."""
    graph = tf.Graph()
    with graph.as_default():
        v1.set_random_seed(1)
        x = v1.placeholder(tf.float32, [None, None, 3], name="x")
        y = v1.placeholder(tf.int64, [None, None], name="y")        # [T, B]
        lengths = v1.placeholder(tf.int32, [None], name="len")
        cell = v1.nn.rnn_cell.BasicRNNCell(5)
        w = v1.get_variable("w", [5, 3], initializer=v1.random_normal_initializer(seed=3))
        if kind == "labels":                                          # x is [B, T, D]
            outputs, _ = v1.nn.dynamic_rnn(cell, x, dtype=tf.float32)
            logits = tf.transpose(tf.tensordot(outputs, w, 1), [1, 0, 2])
        elif kind == "reversed":
            back = tf.reverse_sequence(x, tf.cast(lengths, tf.int64), seq_axis=0, batch_axis=1)
            outputs, _ = v1.nn.dynamic_rnn(cell, back, sequence_length=lengths, dtype=tf.float32,
                                           time_major=True)
            logits = tf.tensordot(tf.reverse_sequence(outputs, tf.cast(lengths, tf.int64), seq_axis=0,
                                                      batch_axis=1), w, 1)
        else:
            kept = tf.nn.dropout(x, rate=0.3, noise_shape=[1, tf.shape(x)[1], 3], seed=11)
            outputs, _ = v1.nn.dynamic_rnn(cell, kept, dtype=tf.float32, time_major=True)
            logits = tf.tensordot(outputs, w, 1)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits),
                              name="loss")
        v1.train.GradientDescentOptimizer(0.5).minimize(loss, name="train")
    return graph


@pytest.mark.parametrize("kind", ["labels", "reversed", "dropout"])
def test_time_major_inputs_found_past_the_op_before_the_loop(kind):
    """Each was split along its time steps, and step 1 failed (the labels case claimed exact):
    the loop's reader is looked for past ops that keep the layout, and a lone time-major input
    is tried on axis 1 too (review 9). Exact (the dropout case at `accumulate` 2)."""
    rng = np.random.RandomState(0)
    feeds = []
    for b in (7, 5, 2):
        batch = rng.randn(b, 4, 3).astype(np.float32)
        feeds.append({"x:0": batch if kind == "labels" else batch.transpose(1, 0, 2).copy(),
                      "y:0": rng.randint(0, 3, (4, b)), "len:0": rng.randint(1, 5, b).astype(np.int32)})
    graph = _time_major_variant(kind)
    names = {o.name for o in graph.get_operations()}
    feeds = [{k: v for k, v in f.items() if k.split(":")[0] in names} for f in feeds]
    for accumulate in (2,) if kind == "dropout" else (1,):     # (suite time)
        res = replicate.transform(_time_major_variant(kind), ["/cpu:1", "/cpu:2", "/cpu:3"],
                                  accumulate=accumulate)
        assert res.report.exact, res.report.reasons
        moved = {"labels": "y:0", "reversed": "x:0", "dropout": "x:0"}[kind]
        assert any(f"input '{moved}' is taken to be time-major" in w for w in res.report.warnings)
        cmp = compare(_time_major_variant(kind), res.graph, "train", feeds, fetch=("loss:0",))
        assert cmp.max_rel <= 1e-5, (cmp.worst, cmp.max_rel)


def _labels_first() -> tf.Graph:
    graph = tf.Graph()
    with graph.as_default():
        y = v1.placeholder(tf.int32, [None], name="y")          # declared before the features
        x = v1.placeholder(tf.float32, [None, 4], name="x")
        w = v1.get_variable("w", [4, 3], initializer=v1.glorot_uniform_initializer(seed=2))
        logits = tf.matmul(x, w, name="logits")
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
        v1.train.GradientDescentOptimizer(0.2).minimize(loss, name="train")
    return graph


def _gan_scoring_both() -> tf.Graph:
    """The discriminator scores ``concat([x, G(z)], 0)``; the generator's loss reads ``z``
    alone."""
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 4], name="x")
        z = v1.placeholder(tf.float32, [None, 2], name="z")
        gen = v1.get_variable("gen", [2, 4], initializer=v1.random_normal_initializer(seed=3))
        disc = v1.get_variable("disc", [4, 1], initializer=v1.random_normal_initializer(seed=4))
        fake = tf.tanh(tf.matmul(z, gen))
        b = tf.shape(x)[0]
        both = tf.matmul(tf.concat([x, fake], 0), disc)
        xent = tf.nn.sigmoid_cross_entropy_with_logits
        d_loss = tf.reduce_mean(xent(labels=tf.ones_like(both[:b]), logits=both[:b])) + \
            tf.reduce_mean(xent(labels=tf.zeros_like(both[b:]), logits=both[b:]))
        g_logits = tf.matmul(fake, disc)
        g_loss = tf.reduce_mean(xent(labels=tf.ones_like(g_logits), logits=g_logits))
        v1.train.GradientDescentOptimizer(0.1).minimize(d_loss, var_list=[disc], name="d_train")
        v1.train.GradientDescentOptimizer(0.1).minimize(g_loss, var_list=[gen], name="g_train")
    return graph


def test_a_run_feeds_only_what_its_fetches_read():
    """Every input of a batch was split by sizes computed from the shape of the first input
    in graph order: a prediction fed ``x`` asked for the labels ``y`` declared before it, and
    a GAN's generator step fed ``z`` asked for ``x`` (review 19). Each input is now split by
    its own size, and the counts that weigh the towers come from the input most train ops read."""
    from replicate.check.equivalence import Trainer
    rng = np.random.RandomState(0)
    res = replicate.transform(_labels_first(), ["/cpu:1", "/cpu:2", "/cpu:3"])
    assert res.report.exact, res.report.reasons
    one, many = Trainer(_labels_first(), "train", 4), Trainer(res.meta_graph_def, "train", 4)
    many.load(one.values())
    x = {"x:0": rng.randn(7, 4).astype(np.float32)}
    np.testing.assert_allclose(one.session.run("logits:0", x), many.session.run("logits:0", x),
                               rtol=1e-5, atol=1e-6)
    one.close()
    many.close()
    res = replicate.transform(_gan_scoring_both(), ["/cpu:1", "/cpu:2", "/cpu:3"])
    one, many = Trainer(_gan_scoring_both(), "d_train", 4), Trainer(res.meta_graph_def, "d_train", 4)
    many.load(one.values())
    z = {"z:0": rng.randn(7, 2).astype(np.float32)}
    one.session.run("g_train", z)
    many.session.run("g_train", z)         # asked for 'x' before
    expected, got = one.values(), many.values()
    np.testing.assert_allclose(expected["gen"], got["gen"], rtol=1e-5)
    one.close()
    many.close()


def _in_batch_negatives() -> tf.Graph:
    """Two-tower retrieval: every user is scored against every item of the batch."""
    graph = tf.Graph()
    with graph.as_default():
        u = v1.placeholder(tf.int32, [None], name="u")
        i = v1.placeholder(tf.int32, [None], name="i")
        users = v1.get_variable("users", [9, 3], initializer=v1.random_normal_initializer(stddev=0.3, seed=3))
        items = v1.get_variable("items", [12, 3], initializer=v1.random_normal_initializer(stddev=0.3, seed=4))
        logits = tf.matmul(tf.nn.embedding_lookup(users, u), tf.nn.embedding_lookup(items, i),
                           transpose_b=True)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=tf.range(tf.shape(u)[0]), logits=logits), name="loss")
        v1.train.GradientDescentOptimizer(0.5).minimize(loss, name="train")
    return graph


@pytest.mark.parametrize("towers,batch,accumulate", [(3, 7, 1), (3, 2, 2)])
def test_in_batch_negatives_run(towers, batch, accumulate):
    """Each tower scores its users against all the batch's items (a shared input): the item
    table's gradient took the ids once beside every tower's rows, and the update failed
    (review 19). The rows for ids the update reads whole are summed; inexact (the labels are
    tower-local row numbers), and it runs."""
    res = replicate.transform(_in_batch_negatives(), [f"/cpu:{k}" for k in range(1, towers + 1)],
                              accumulate=accumulate)
    assert not res.report.exact
    rng = np.random.RandomState(0)
    feeds = [{"u:0": rng.randint(0, 9, batch).astype(np.int32),
              "i:0": rng.randint(0, 12, batch).astype(np.int32)} for _ in range(2)]
    assert np.isfinite(compare(_in_batch_negatives(), res.graph, "train", feeds).max_rel)



def _offset_rows() -> tf.Graph:
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 4], name="x")
        m = v1.placeholder(tf.float32, [None, 4], name="m")
        w = v1.get_variable("w", [4, 4], initializer=v1.random_normal_initializer(seed=2))
        loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - m), name="loss")
        v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
    return graph


def test_inputs_split_by_their_own_sizes_check_them_where_they_meet():
    """``m`` fed one row broadcasts against ``x``'s batch on one device. Split by its own size,
    it went whole to tower 0 and the others paired their examples with no rows (claimed exact,
    0.1 off; review 20). Where ``x`` and ``m`` meet, a check now stops the step with a message;
    fed as many rows as ``x``, it is exact."""
    from replicate.errors import RewriteError
    res = replicate.transform(_offset_rows(), ["/cpu:1", "/cpu:2", "/cpu:3"])
    assert res.report.exact, res.report.reasons
    rng = np.random.RandomState(0)
    feeds = [{"x:0": rng.randn(7, 4).astype(np.float32), "m:0": rng.randn(7, 4).astype(np.float32)}
             for _ in range(2)]
    assert compare(_offset_rows(), res.graph, "train", feeds).max_rel < 1e-5
    one_row = [{"x:0": rng.randn(4, 4).astype(np.float32), "m:0": rng.randn(1, 4).astype(np.float32)}]
    with pytest.raises(RewriteError, match="holds another number of examples"):
        compare(_offset_rows(), res.graph, "train", one_row)
