"""Named dimensions (replicate/batchflow/dims.py): two unknown dimensions get one name only when
they are proved equal at run time.

The name lets the reshape rules see that ``tf.reshape(y, [-1, tf.shape(words)[1], C])`` undoes
the fold of ``y``'s batch and time axes. A padded tagger fed ``[None, None]`` token ids was only
honest-inexact (review 26): its time axis was lost through the embedding lookup, dropout and
``dynamic_rnn``'s TensorList. Each step back must be a proof, so the negative cases matter as
much as the positive ones: a name given to two different dimensions would make a false exact.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import tensorflow as tf

import replicate
from replicate.batchflow.lattice import Classes
from replicate.batchflow.solver import solve
from replicate.check.equivalence import compare
from replicate.graph.ir import IR
from breadth_models import control_flow_v1

v1 = tf.compat.v1
DEVICES = ["/cpu:0", "/cpu:1", "/cpu:2"]


def _solved(build, inputs=("words",)):
    """The analysis context of the graph ``build()`` makes, ``inputs`` one batch class."""
    graph = tf.Graph()
    with graph.as_default():
        build()
    ir = IR.from_graph_def(graph.as_graph_def())
    ir.load_static_shapes(graph)
    classes = Classes()
    cls = classes.new(None)
    region = [n for n in ir.nodes if n not in inputs]
    return solve(ir, region, {f"{n}:0": (0, cls) for n in inputs}, set(), classes)


def _ids():
    return v1.placeholder(tf.int32, [None, None], name="words")


def test_a_lookup_dropout_and_dynamic_rnn_keep_the_time_axis_of_the_ids():
    def build():
        x = tf.nn.embedding_lookup(v1.get_variable("emb", [20, 5]), _ids())
        x = tf.identity(tf.nn.dropout(x, rate=0.2, seed=3), name="dropped")
        out, _ = v1.nn.dynamic_rnn(v1.nn.rnn_cell.BasicRNNCell(4), x, dtype=tf.float32)
        tf.concat([out, out], -1, name="both")
        tf.matmul(tf.reshape(out, [-1, 4]), v1.get_variable("w", [4, 3]), name="proj")

    ctx = _solved(build)
    assert ctx.dim_token("dropped:0", 1) == "words:0#1"
    assert ctx.dim_token("both:0", 1) == "words:0#1"     # through the loop's TensorList


def test_two_unknown_dimensions_that_broadcast_stay_apart():
    """``a + b`` with both dimensions unknown: either may be 1 at run time, so the sum's is
    neither operand's, and a broadcast against a static 1 keeps the other operand's."""
    def build():
        a = v1.placeholder(tf.float32, [None, None], name="words")
        b = v1.placeholder(tf.float32, [None, None], name="other")
        tf.add(a, b, name="sum")
        tf.add(a, tf.ones([1, 1]), name="plus_one")
        tf.add(a, tf.reverse(a, [0]), name="twice")

    ctx = _solved(build, inputs=("words", "other"))
    assert ctx.dim_token("sum:0", 1) not in ("words:0#1", "other:0#1")
    assert ctx.dim_token("plus_one:0", 1) == "words:0#1"
    assert ctx.dim_token("twice:0", 1) == "words:0#1"


@pytest.mark.parametrize("version", [1, 2])
def test_a_list_written_past_its_size_is_not_its_reserved_length(version):
    """A ``dynamic_size`` TensorArray grows beyond the size it was made with (its writes may
    resize the list), so the stacked length is not the reserved one (TF2: a TensorList set
    with resizing; TF1: a TensorArray whose size is read after the loop)."""
    def build():
        words = _ids()
        steps = tf.shape(words)[1]
        ta = tf.TensorArray(tf.int32, size=steps, dynamic_size=True, element_shape=[None])

        def body(i, ta):
            return i + 1, ta.write(i, words[:, 0])

        _, ta = tf.while_loop(lambda i, _: i < steps + 2, body, [0, ta])
        tf.identity(ta.stack(), name="grown")
        fixed = tf.TensorArray(tf.int32, size=steps, element_shape=[None])
        _, fixed = tf.while_loop(lambda i, _: i < steps, lambda i, t: (i + 1, t.write(i, words[:, 0])),
                                 [0, fixed])
        tf.identity(fixed.stack(), name="kept")

    with control_flow_v1() if version == 1 else contextlib.nullcontext():
        ctx = _solved(build)
    assert ctx.dim_token("grown:0", 0) != "words:0#1"
    assert ctx.dim_token("kept:0", 0) == "words:0#1"


def test_the_concat_axis_is_not_copied_and_a_stack_shifts_the_dimensions_after_its_axis():
    def build():
        words = v1.placeholder(tf.float32, [None, None], name="words")
        tf.concat([words, words], 1, name="wide")
        tf.concat([words, words], 0, name="tall")
        tf.stack([words, words], axis=1, name="pairs")
        tf.stack([words, words], axis=-1, name="last")

    ctx = _solved(build)
    assert ctx.dim_token("wide:0", 1) != "words:0#1"
    assert ctx.dim_token("tall:0", 1) == "words:0#1"
    assert ctx.dim_token("pairs:0", 2) == "words:0#1"
    assert ctx.dim_token("last:0", 1) == "words:0#1"


def _tagger(time_of, version=2):
    """A padded tagger whose logits are unfolded by ``tf.shape(time_of)[1]``; ``version`` 1
    builds its loop with TF1 frames and a TensorArray."""
    graph = tf.Graph()
    with graph.as_default(), (control_flow_v1() if version == 1 else contextlib.nullcontext()):
        v1.set_random_seed(31)
        words = v1.placeholder(tf.int32, [None, None], name="words")
        chars = v1.placeholder(tf.int32, [None, None], name="chars")
        lengths = v1.placeholder(tf.int32, [None], name="lengths")
        x = tf.nn.embedding_lookup(v1.get_variable("emb", [20, 5]), words)
        x = x + tf.reduce_mean(tf.nn.embedding_lookup(v1.get_variable("cemb", [20, 5]), chars), 1,
                               keepdims=True)
        x = tf.nn.dropout(x, rate=0.25, seed=5)
        out, _ = v1.nn.dynamic_rnn(v1.nn.rnn_cell.BasicRNNCell(4), x, sequence_length=lengths,
                                   dtype=tf.float32, parallel_iterations=1)
        steps = tf.shape(words if time_of == "words" else chars)[1]
        logits = tf.reshape(tf.matmul(tf.reshape(out, [-1, 4]), v1.get_variable("w", [4, 3])),
                            [-1, steps, 3])
        probs = tf.nn.softmax(tf.reduce_sum(logits, 2), axis=1)     # over each row's steps
        loss = tf.reduce_mean(tf.square(probs - 0.5))
        v1.train.GradientDescentOptimizer(0.5).minimize(loss, name="train")
    return graph


@pytest.mark.parametrize("version", [1, 2])
def test_a_tagger_unfolded_by_its_own_time_axis_is_exact_and_by_another_is_not(version):
    rng = np.random.RandomState(0)
    feeds = [{"words:0": rng.randint(0, 20, (7, 4)), "chars:0": rng.randint(0, 20, (7, 2)),
              "lengths:0": rng.randint(1, 5, 7)} for _ in range(2)]
    graph = _tagger("words", version)
    res = replicate.transform(graph, DEVICES)
    assert res.report.exact, res.report.reasons
    assert compare(graph, res.graph, "train", feeds).max_rel <= 1e-5
    other = replicate.transform(_tagger("chars", version), DEVICES)
    assert not other.report.exact
    assert "Reshape" in " ".join(str(r) for r in other.report.reasons)


def test_an_empty_tower_reshapes_back_by_its_dynamic_time_axis():
    """Review 28: ``tf.reshape(flat, [tf.shape(x)[0], -1, C])`` over a dynamic time axis. A
    tower without examples has no elements to infer the ``-1`` from; TensorFlow made it 1, and
    the step failed at the loss's shape check. The guard now pins it to the tower's
    ``tf.shape(x)[1]``, a named dimension of the input, when the input is empty."""
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, None, 4], name="x")
        y = v1.placeholder(tf.int32, [None, None], name="y")
        w = v1.get_variable("w", [4, 3], initializer=v1.glorot_uniform_initializer(seed=1))
        logits = tf.reshape(tf.matmul(tf.reshape(x, [-1, 4]), w), [tf.shape(x)[0], -1, 3])
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
        tf.argmax(logits, -1, name="pred")
        v1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
    res = replicate.transform(graph, DEVICES)
    assert res.report.exact, res.report.reasons
    rng = np.random.RandomState(0)
    feeds = [{"x:0": rng.randn(2, 5, 4).astype(np.float32), "y:0": rng.randint(0, 3, (2, 5))}
             for _ in range(2)]
    result = compare(graph, res.graph, "train", feeds, fetch=("pred:0",))
    assert result.max_rel <= 1e-5
