"""Unit tests of the batch dataflow (replicate/batchflow), one group per op family.

Each test builds a small forward graph, runs the solver with ``x:0`` as the batch input
(class 0) and checks the fact of named tensors: ``shared``, ``part axis A class C``,
``reduced (MERGE) over class C`` or ``mixed at OP: WHY``. These are the facts that weighting,
constant rewriting and batch-input detection read, so a wrong one here is a wrong claim of
exactness later (tests/test_soundness.py checks the end-to-end consequence).
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from replicate.batchflow.analysis import analyze
from replicate.batchflow.lattice import MIXED, PART, RED, SHARED, Classes, Sym
from replicate.batchflow.solver import solve
from replicate.graph.ir import IR

v1 = tf.compat.v1


def flow(build, batch=None, inputs=("x",)):
    """Build a graph with ``x`` [batch, 6] (and whatever ``build`` adds), solve it with the
    named placeholders as batch inputs on axis 0 (one class) and return fact(name)."""
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [batch, 6], name="x")
        build(x)
    ir = IR.from_graph_def(graph.as_graph_def())
    ir.load_static_shapes(graph)
    classes = Classes()
    cls = classes.new(batch)
    region = [n for n in ir.nodes if n not in inputs]          # the inputs feed the region
    ctx = solve(ir, region, {f"{n}:0": (0, cls) for n in inputs}, set(), classes)

    def fact(name):
        return ctx.facts[name if ":" in name else name + ":0"]
    fact.classes = classes
    fact.ctx = ctx
    return fact


# ---------------------------------------------------------------- elementwise / broadcasting
def test_elementwise_keeps_the_batch_axis_and_broadcasts_shared_operands():
    def build(x):
        w = tf.constant(np.ones([6], np.float32))
        tf.identity(tf.nn.relu(x * w + 1.0), name="y")
        tf.identity(w * 2.0, name="s")
    fact = flow(build)
    assert fact("y").kind == PART and fact("y").axis == 0
    assert fact("s").kind == SHARED


def test_broadcasting_a_batch_vector_against_a_column_moves_no_axis():
    def build(x):
        col = tf.reduce_sum(x, axis=1, keepdims=True)          # [B, 1]
        tf.identity(x - col, name="centred")
    fact = flow(build)
    assert fact("centred").kind == PART and fact("centred").axis == 0


# ---------------------------------------------------------------- reductions by axis
def test_reduction_over_features_keeps_the_batch():
    fact = flow(lambda x: tf.reduce_sum(x, axis=1, name="r"))
    assert fact("r").kind == PART and fact("r").axis == 0


@pytest.mark.parametrize("op,merge", [(tf.reduce_sum, "sum"), (tf.reduce_mean, "mean"),
                                      (tf.reduce_max, "max"), (tf.reduce_min, "min")])
def test_reduction_over_the_batch_is_reduced_with_its_merge(op, merge):
    fact = flow(lambda x: op(x, axis=0, name="r"))
    assert fact("r").kind == RED and fact("r").merge == merge


def test_nested_reductions_mean_of_sums_over_the_batch():
    """The first table row of issue 12: the batch is reduced by the inner reduction over axis 0,
    the outer one reduces features only."""
    def build(x):
        tf.reduce_mean(tf.reduce_sum(tf.square(x), axis=0), name="loss")
        tf.reduce_sum(tf.reduce_mean(tf.square(x), axis=0), name="loss2")
    fact = flow(build)
    assert fact("loss").kind == RED and fact("loss").merge == "sum"
    assert fact("loss2").kind == RED and fact("loss2").merge == "mean"


def test_full_reduction_of_all_axes():
    fact = flow(lambda x: tf.reduce_mean(x, name="r"))
    assert fact("r").kind == RED and fact("r").merge == "mean"


# ---------------------------------------------------------------- reshape / transpose / concat
def test_reshape_with_a_dynamic_batch_keeps_the_axis():
    fact = flow(lambda x: tf.reshape(x, [-1, 2, 3], name="r"))
    assert fact("r").kind == PART and fact("r").axis == 0


def test_reshape_that_folds_examples_into_features_mixes():
    fact = flow(lambda x: tf.reshape(x, [3, -1], name="r"), batch=6)
    assert fact("r").kind == MIXED


def test_transpose_moves_the_batch_axis():
    def build(x):
        tf.transpose(tf.reshape(x, [-1, 2, 3]), [2, 0, 1], name="t")
    fact = flow(build)
    assert fact("t").kind == PART and fact("t").axis == 1


def test_concat_along_features_and_along_the_batch():
    def build(x):
        tf.concat([x, x * 2.0], axis=1, name="wide")
        tf.concat([x, tf.zeros([2, 6])], axis=0, name="extra_rows")
        tf.concat([tf.zeros([2, 6]), x], axis=0, name="rows_first")
        tf.concat([x, x], axis=0, name="twice")
    fact = flow(build)
    assert fact("wide").kind == PART and fact("wide").axis == 0
    # batch rows followed by shared rows: a fact of its own, only tail-aware ops accept it
    assert fact("extra_rows").kind == PART and fact("extra_rows").tail == (2, "shared")
    assert fact("rows_first").kind == MIXED and "shared rows" in fact("rows_first").why
    assert fact("twice").tail is None


def test_rows_part_batch_part_shared_mix_under_any_other_op():
    """The shared rows after the batch rows must never be treated as examples: reducing,
    scaling by a per-row tensor, slicing across the boundary or merging them makes the
    result mixed; only the head and the tail cut as the sampled losses cut are clean."""
    def build(x):
        rows = tf.concat([x, tf.ones([3, 6])], axis=0, name="rows")
        n = tf.shape(x)[0]
        tf.reduce_sum(rows, axis=0, name="total")
        tf.reduce_mean(rows, name="mean")
        tf.reduce_sum(rows, axis=1, name="per_row")
        tf.nn.softmax(rows, name="softmax")
        tf.slice(rows, [0, 0], tf.stack([n, -1]), name="head")
        tf.slice(rows, tf.stack([n, 0]), [-1, -1], name="tail")
        tf.slice(rows, [0, 0], [2, -1], name="first_two")
        tf.slice(rows, tf.stack([n - 1, 0]), [-1, -1], name="straddle")
        tf.identity(tf.gather(tf.ones([10, 4]), tf.cast(rows[:, 0], tf.int32)), name="gathered_by_slice")
        ids = tf.concat([tf.cast(x[:, 0], tf.int64), tf.constant([1, 2], tf.int64)], 0)
        looked = tf.gather(tf.ones([10, 4]), ids, name="looked")
        tf.identity(looked + tf.ones([4]), name="plus_bias")
        tf.add_n([looked, looked], name="sum_of_two")
    fact = flow(build)
    for name in ("total", "mean", "per_row", "softmax", "first_two", "straddle", "gathered_by_slice"):
        assert fact(name).kind == MIXED, (name, fact(name).describe())
    assert fact("head").kind == PART and fact("head").tail is None and fact("head").ordered
    assert fact("tail").kind == SHARED
    assert fact("looked").tail == (2, "shared")
    assert fact("sum_of_two").tail == (2, "shared")
    assert fact("plus_bias").tail == (2, "shared")     # a shared bias along the columns


# ---------------------------------------------------------------- matmul / conv / pool
def test_matmul_contracting_features_keeps_the_batch_and_contracting_the_batch_reduces():
    def build(x):
        w = tf.constant(np.ones([6, 3], np.float32))
        tf.matmul(x, w, name="h")
        tf.matmul(x, x, transpose_a=True, name="gram")       # [6, 6]: sum over examples
        tf.matmul(x, x, transpose_b=True, name="pairs")      # [B, B]: example x example
    fact = flow(build)
    assert fact("h").kind == PART and fact("h").axis == 0
    assert fact("gram").kind == RED and fact("gram").merge == "sum"
    assert fact("pairs").kind == MIXED


def test_conv_and_pool_keep_the_batch():
    def build(x):
        img = tf.reshape(x, [-1, 2, 3, 1])
        k = tf.constant(np.ones([2, 2, 1, 4], np.float32))
        c = tf.nn.conv2d(img, k, 1, "SAME", name="conv")
        tf.nn.max_pool2d(c, 2, 1, "SAME", name="pool")
    fact = flow(build)
    assert fact("conv").kind == PART and fact("conv").axis == 0
    assert fact("pool").kind == PART and fact("pool").axis == 0


# ---------------------------------------------------------------- selecting and mixing examples
def test_top_k_over_the_batch_mixes_and_over_features_does_not():
    def build(x):
        per_example = tf.reduce_sum(x, axis=1)
        tf.identity(tf.nn.top_k(per_example, 2).values, name="hard")
        tf.identity(tf.nn.top_k(x, 2).values, name="per_row")
    fact = flow(build, batch=6)
    assert fact("hard").kind == MIXED
    assert fact("per_row").kind == PART and fact("per_row").axis == 0


def test_slicing_the_first_examples_mixes():
    fact = flow(lambda x: tf.identity(x[:4], name="first4"), batch=8)
    assert fact("first4").kind == MIXED


def test_slicing_features_keeps_the_batch():
    fact = flow(lambda x: tf.identity(x[:, 1:3], name="cols"))
    assert fact("cols").kind == PART and fact("cols").axis == 0


def test_sort_along_the_batch_mixes():
    fact = flow(lambda x: tf.identity(tf.sort(tf.reduce_sum(x, 1)), name="s"))
    assert fact("s").kind == MIXED


# ---------------------------------------------------------------- gather / scatter
def test_gather_of_shared_params_by_per_example_ids_is_per_example():
    def build(x):
        emb = tf.constant(np.ones([10, 4], np.float32))
        ids = tf.cast(x[:, 0], tf.int32)
        tf.gather(emb, ids, name="rows")
    fact = flow(build)
    assert fact("rows").kind == PART and fact("rows").axis == 0


def test_gather_of_batch_rows_by_shared_ids_mixes():
    fact = flow(lambda x: tf.gather(x, [0, 2], name="picked"))
    assert fact("picked").kind == MIXED


def test_unsorted_segment_sum_into_shared_segments_reduces():
    def build(x):
        seg = tf.cast(tf.abs(x[:, 0]), tf.int32) % 3
        tf.math.unsorted_segment_sum(x, seg, 3, name="per_class")
    fact = flow(build)
    assert fact("per_class").kind == RED and fact("per_class").merge == "sum"


# ---------------------------------------------------------------- shapes and batch-size constants
def test_the_dynamic_batch_size_is_a_symbol_of_the_class():
    fact = flow(lambda x: tf.identity(tf.shape(x)[0], name="n"))
    value = fact("n").value
    assert value is not None and isinstance(value[0], Sym) and value[0].coef == 1
    assert fact("n").kind == RED and fact("n").merge == "size"


def test_a_constant_equal_to_the_batch_size_is_not_a_batch_size():
    """Issue 12: ``floormod(ids, 8)`` and ``one_hot(ids, 8)`` with a static batch of 8 keep
    their 8; only the reshape target, which provably holds the batch, is a position."""
    def build(x):
        ids = tf.cast(x[:, 0], tf.int32)
        tf.math.floormod(ids, 8, name="bucket")
        tf.one_hot(ids, 8, name="onehot")
        tf.reshape(x, [8, 2, 3], name="r")
    fact = flow(build, batch=8)
    assert fact("bucket").kind == PART
    assert fact("onehot").kind == PART and fact("onehot").axis == 0
    positions = {(p.tensor, p.element) for p in fact.ctx.positions.values()}
    assert positions == {("r/shape:0", 0)}


def test_a_static_batch_fill_shape_is_a_position():
    """``tf.zeros([8, 6])`` added to an [8, 6] batch: its 8 must become the tower's size."""
    def build(x):
        tf.add(x, tf.zeros([8, 6]), name="y")
        tf.add(tf.reduce_sum(x), tf.zeros([8]), name="not_batch")   # an 8 that is no batch
    fact = flow(build, batch=8)
    assert fact("y").kind == PART
    assert fact("not_batch").kind == RED
    found = {p.tensor for p in fact.ctx.positions.values()} | {d.tensor for d in fact.ctx.demands.values()}
    assert any(t.startswith("zeros") for t in found), found
    assert not any(t.startswith("zeros_1") for t in found), found


# ---------------------------------------------------------------- control flow
def test_a_tf1_while_loop_over_time_keeps_the_batch_of_its_state():
    def build(x):
        def body(i, h):
            return i + 1, tf.tanh(h + x)
        _, h = v1.while_loop(lambda i, h: i < 3, body, [tf.constant(0), tf.zeros_like(x)])
        tf.identity(h, name="h")
    fact = flow(build)
    assert fact("h").kind == PART and fact("h").axis == 0


def test_cond_on_a_shared_predicate_keeps_the_batch():
    def build(x):
        flag = v1.placeholder_with_default(True, [], name="training")
        tf.identity(v1.cond(flag, lambda: x * 2.0, lambda: x), name="y")
    fact = flow(build)
    assert fact("y").kind == PART and fact("y").axis == 0


# ---------------------------------------------------------------- batch-input evidence
def test_a_class_weights_placeholder_is_not_a_batch_input():
    """Issue 12: a [3] placeholder read alongside the batch is demoted by the conflict it
    causes, not split as "the batch"."""
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 3], name="x")
        w = v1.placeholder(tf.float32, [3], name="class_weights")
        tf.reduce_mean(tf.reduce_sum(x * w, axis=1), name="loss")
    ir = IR.from_graph_def(graph.as_graph_def())
    ir.load_static_shapes(graph)
    region = [n for n in ir.nodes if n not in ("x", "class_weights")]
    settled = analyze(ir, region, ["x:0", "class_weights:0"], set(), [], ["loss:0"])
    assert set(settled.inputs) == {"x:0"}
    assert "class_weights:0" in settled.demoted


# ---------------------------------------------------------------- einsum
def test_einsum_follows_the_batch_letter():
    """Kept in the output: partitioned where it lands; summed away: a sum over the examples;
    a shared operand with the batch letter pairs examples with a shared axis: mixed."""
    def build(x):
        w = tf.constant(np.ones([6, 3], np.float32))
        tf.identity(tf.einsum("nd,dk->kn", x, w), name="kept")
        tf.identity(tf.einsum("nd,nd->d", x, x), name="summed")
        tf.identity(tf.einsum("nd,nk->dk", x, tf.constant(np.ones([5, 3], np.float32))), name="paired")
    fact = flow(build)
    assert fact("kept").kind == PART and fact("kept").axis == 1
    assert fact("summed").kind == RED and fact("summed").merge == "sum"
    assert fact("paired").kind == MIXED
