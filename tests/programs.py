"""Generated TF1-style training programs for the soundness fuzzer, over a wide vocabulary.

A program is a dense trunk, two or three *blocks* and a *head* (the loss), trained with plain
SGD (a misweighted gradient shows in the update) or momentum, at 2 or 3 towers, optionally
with accumulation and synchronized batch statistics. Blocks put ops where legacy programs put
them: inside ``tf.cond`` / ``tf.while_loop`` (v2 ``If``/``While`` bodies), ``tf.function``
defuns and ``map_fn``; seeded dropout and noise at the top level and inside bodies;
``tf.compat.v1.layers`` batch norm and dropout and Keras ``Dropout`` under a ``training``
placeholder; custom gradients (per-example clipping and clipping by norm over the batch);
integer arithmetic on ``tf.shape``; ``unique`` / segment sums / ``dynamic_partition`` on the
labels. Heads cover every ``tf.compat.v1.losses`` reduction, masked means whose mask can leave
a tower empty, per-class (vector) denominators, a root mean square error and an L2
regularizer. Every random op is seeded, so one device reproduces itself.

Nothing here says which programs are exact: the fuzzer checks what the report claims.
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import tensorflow as tf

v1 = tf.compat.v1

FEATURES = 4
CLASSES = 3
HIDDEN = 5

BLOCKS = ("dense", "cond", "while", "defun", "map_fn", "map_fn_weight", "scan_over_batch",
          "dropout_in_map_fn", "dropout", "dropout_in_cond",
          "noise_in_while", "layers_bn", "layers_dropout", "keras_dropout", "clip_grad",
          "clip_grad_by_norm", "shape_arith", "drop_last_row", "reshape_fold",
          "segment_mean_by_label", "partition_by_label", "class_frequency", "assert_batch",
          "assert_in_cond")
HEADS = ("mean_ce", "sum_ce", "masked_mean", "masked_mean_plus_l2", "shifted_masked_mean",
         "vector_denominator",
         "rmse", "losses_none", "losses_sum", "losses_mean", "losses_sum_over_batch_size",
         "losses_sum_by_nonzero_weights", "losses_sum_over_nonzero_weights")
#: The categories docs/testing.md lists, by the blocks and heads that exercise them.
CATEGORIES = {
    "cond_v2 / while_v2 / defun / map_fn bodies": ("cond", "while", "defun", "map_fn",
                                                   "map_fn_weight", "scan_over_batch",
                                                   "dropout_in_map_fn", "dropout_in_cond",
                                                   "noise_in_while"),
    "random ops": ("dropout", "dropout_in_cond", "noise_in_while", "dropout_in_map_fn",
                   "layers_dropout", "keras_dropout"),
    "layers with a training placeholder": ("layers_bn", "layers_dropout", "keras_dropout"),
    "custom gradients": ("clip_grad", "clip_grad_by_norm"),
    "integer arithmetic on tf.shape": ("shape_arith", "drop_last_row", "reshape_fold"),
    "unique / segment / dynamic_partition on labels": ("segment_mean_by_label",
                                                      "partition_by_label", "class_frequency"),
    "vector denominators": ("vector_denominator",),
    "masked means with empty towers": ("masked_mean", "masked_mean_plus_l2", "shifted_masked_mean"),
    "tf.compat.v1.losses reductions": tuple(h for h in HEADS if h.startswith("losses_")),
    "regularization": ("masked_mean_plus_l2", "l2"),
    "assertions on whole-batch values": ("assert_batch", "assert_in_cond"),
}


@dataclasses.dataclass(frozen=True)
class Program:
    """One generated program."""

    seed: int
    blocks: tuple[str, ...]
    head: str
    towers: int
    batch: int
    optimizer: str
    accumulate: int
    batch_norm: str
    l2: bool

    def describe(self) -> str:
        return (f"program {self.seed}: blocks={'+'.join(self.blocks)} head={self.head} "
                f"towers={self.towers} batch={self.batch} opt={self.optimizer} "
                f"accumulate={self.accumulate} batch_norm={self.batch_norm} l2={self.l2}")

    def options(self) -> dict:
        out = {}
        if self.accumulate > 1:
            out["accumulate"] = self.accumulate
        if self.batch_norm != "tower0":
            out["batch_norm"] = self.batch_norm
        return out

    def categories(self) -> list[str]:
        parts = set(self.blocks) | {self.head} | ({"l2"} if self.l2 else set())
        return [c for c, members in CATEGORIES.items() if parts & set(members)]


def draw(seed: int) -> Program:
    """Program ``seed``. The first block and the head go round the vocabulary with the seed,
    so any 24 consecutive seeds use every block and any 13 every head."""
    rng = random.Random(seed)
    towers = rng.choice([2, 3])
    blocks = (BLOCKS[seed % len(BLOCKS)],) + tuple(rng.choice(BLOCKS) for _ in range(rng.choice([1, 2])))
    # uneven batches, and batches smaller than the towers (an empty tower)
    batch = rng.choice([towers - 1, towers + 1, 2 * towers + 1, 7])
    return Program(seed, blocks, HEADS[seed % len(HEADS)], towers, max(batch, 1),
                   rng.choice(["sgd", "sgd", "momentum"]), rng.choice([1, 1, 2]),
                   rng.choice(["tower0", "sync"]), rng.random() < 0.3)


def _dense(h, name: str, seed: int):
    w = v1.get_variable(name, [HIDDEN, HIDDEN], initializer=v1.glorot_uniform_initializer(seed=seed))
    return tf.matmul(h, w)


def _block(kind: str, h, i: int, ctx: dict):
    """Block ``kind`` applied to ``h`` ([B, HIDDEN]); the ``i``-th block."""
    s = ctx["seed"] * 10 + i
    name = f"b{i}"
    training, y = ctx["training"], ctx["y"]
    if kind == "dense":
        return tf.nn.tanh(_dense(h, name, s))
    if kind == "cond":
        w = v1.get_variable(name, [HIDDEN, HIDDEN], initializer=v1.glorot_uniform_initializer(seed=s))
        return tf.cond(training, lambda: tf.nn.relu(tf.matmul(h, w)), lambda: tf.matmul(h, w))
    if kind == "while":
        w = v1.get_variable(name, [HIDDEN, HIDDEN], initializer=v1.glorot_uniform_initializer(seed=s))
        _, out = tf.while_loop(lambda t, a: t < 2, lambda t, a: (t + 1, tf.nn.tanh(tf.matmul(a, w))),
                               [tf.constant(0), h])
        return out
    if kind == "defun":
        w = v1.get_variable(name, [HIDDEN, HIDDEN], initializer=v1.glorot_uniform_initializer(seed=s))

        @tf.function
        def body(a, m):
            return tf.nn.softplus(tf.matmul(a, m))
        return body(h, tf.identity(w))
    if kind == "map_fn":
        return tf.map_fn(lambda row: tf.nn.tanh(row * 1.5 + 0.1), h)
    if kind == "map_fn_weight":
        w = v1.get_variable(name, [HIDDEN, HIDDEN], initializer=v1.glorot_uniform_initializer(seed=s))
        return tf.map_fn(lambda row: tf.nn.tanh(tf.linalg.matvec(w, row, transpose_a=True)), h)
    if kind == "scan_over_batch":
        # a running state over the examples: not per example
        return tf.scan(lambda a, row: 0.5 * a + row, h, initializer=tf.zeros([HIDDEN]))
    if kind == "dropout_in_map_fn":
        return tf.map_fn(lambda row: tf.nn.dropout(row, rate=0.3, seed=s), h, parallel_iterations=1)
    if kind == "dropout":
        return tf.nn.dropout(h, rate=0.3, seed=s)
    if kind == "dropout_in_cond":
        return tf.cond(training, lambda: tf.nn.dropout(h, rate=0.4, seed=s), lambda: h)
    if kind == "noise_in_while":
        _, out = tf.while_loop(
            lambda t, a: t < 2,
            lambda t, a: (t + 1, a + 0.1 * tf.random.normal(tf.shape(a), seed=s)),
            [tf.constant(0), h], parallel_iterations=1)
        return out
    if kind == "layers_bn":
        # a nonlinearity after it: batch norm right after batch norm leaves the first beta
        # without gradient (its updates are rounding noise, no test of anything)
        return tf.nn.tanh(v1.layers.batch_normalization(h, training=training, name=name))
    if kind == "layers_dropout":
        return v1.layers.dropout(h, rate=0.3, training=training, seed=s)
    if kind == "keras_dropout":
        return tf.keras.layers.Dropout(0.3, seed=s)(h, training=training)
    if kind in ("clip_grad", "clip_grad_by_norm"):
        @tf.custom_gradient
        def clipped(a):
            if kind == "clip_grad":
                return a, lambda dy: tf.clip_by_value(dy, -0.05, 0.05)
            return a, lambda dy: tf.clip_by_norm(dy, 0.05)
        return clipped(h)
    if kind == "shape_arith":
        n = tf.shape(h)[0]
        return h * tf.cast(n + 1, tf.float32) / tf.cast(2 * n + 2, tf.float32)
    if kind == "drop_last_row":
        keep = tf.range(tf.shape(h)[0] - 1)
        return tf.concat([tf.gather(h, keep), h[-1:] * 0.5], axis=0)
    if kind == "reshape_fold":
        flat = tf.reshape(h, [tf.shape(h)[0] * HIDDEN])
        return tf.reshape(tf.nn.tanh(flat), [-1, HIDDEN])
    if kind == "segment_mean_by_label":
        means = tf.math.unsorted_segment_mean(h, y, CLASSES)
        return h - 0.5 * tf.gather(means, y)
    if kind == "partition_by_label":
        idx = tf.range(tf.shape(h)[0])
        parts = tf.dynamic_partition(h, tf.cast(y % 2, tf.int32), 2)
        where = tf.dynamic_partition(idx, tf.cast(y % 2, tf.int32), 2)
        return tf.dynamic_stitch(where, [parts[0] * 2.0, tf.nn.relu(parts[1])])
    if kind == "class_frequency":
        uniq, pos = tf.unique(y)
        counts = tf.math.unsorted_segment_sum(tf.ones_like(y, tf.float32), pos, tf.size(uniq))
        return h / tf.expand_dims(tf.gather(counts, pos), 1)
    if kind == "assert_batch":      # checks of the batch's size and sum, as control inputs
        checks = [v1.assert_positive(tf.shape(h)[0]),
                  tf.Assert(tf.reduce_sum(tf.exp(h)) > 0.0, [tf.shape(h)[0]])]
        with tf.control_dependencies(checks):
            return tf.identity(h)
    if kind == "assert_in_cond":    # a branch checking the batch size it is passed
        size = tf.shape(h)[0]

        def checked():
            with tf.control_dependencies([v1.assert_positive(size)]):
                return tf.nn.tanh(h)
        return tf.cond(training, checked, lambda: h)
    raise ValueError(kind)


def _head(kind: str, logits, ctx: dict):
    y, m = ctx["y"], ctx["m"]
    ce = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
    onehot = tf.one_hot(y, CLASSES)
    if kind == "mean_ce":
        return tf.reduce_mean(ce)
    if kind == "sum_ce":
        return 0.1 * tf.reduce_sum(ce)
    if kind == "masked_mean":
        return tf.reduce_sum(ce * m) / tf.reduce_sum(m)
    if kind == "masked_mean_plus_l2":
        return tf.reduce_sum(ce * m) / tf.reduce_sum(m) + 0.5 * tf.reduce_mean(ce)
    if kind == "shifted_masked_mean":
        return tf.reduce_sum(ce * m) / tf.maximum(tf.reduce_sum(m), 1.0)
    if kind == "vector_denominator":
        per_class = tf.reduce_sum(onehot * tf.expand_dims(ce, 1), axis=0)
        counts = tf.reduce_sum(onehot, axis=0)
        return tf.reduce_sum(per_class / (counts + 1.0))
    if kind == "rmse":
        return tf.sqrt(tf.reduce_mean(tf.reduce_sum(tf.square(logits - onehot), 1)) + 1e-6)
    reduction = {
        "losses_none": v1.losses.Reduction.NONE, "losses_sum": v1.losses.Reduction.SUM,
        "losses_mean": v1.losses.Reduction.MEAN,
        "losses_sum_over_batch_size": v1.losses.Reduction.SUM_OVER_BATCH_SIZE,
        "losses_sum_by_nonzero_weights": v1.losses.Reduction.SUM_BY_NONZERO_WEIGHTS,
        "losses_sum_over_nonzero_weights": v1.losses.Reduction.SUM_OVER_NONZERO_WEIGHTS,
    }[kind]
    out = v1.losses.sparse_softmax_cross_entropy(y, logits, weights=m, reduction=reduction)
    return tf.reduce_mean(out) if kind == "losses_none" else out


def build(p: Program) -> tf.Graph:
    graph = tf.Graph()
    with graph.as_default():
        v1.set_random_seed(p.seed % 997 + 1)
        x = v1.placeholder(tf.float32, [None, FEATURES], name="x")
        y = v1.placeholder(tf.int32, [None], name="y")
        m = v1.placeholder(tf.float32, [None], name="m")
        training = v1.placeholder_with_default(True, [], name="training")
        ctx = {"seed": p.seed, "training": training, "y": y, "m": m}
        w0 = v1.get_variable("w0", [FEATURES, HIDDEN], initializer=v1.glorot_uniform_initializer(seed=p.seed))
        h = tf.nn.tanh(tf.matmul(x, w0))
        for i, kind in enumerate(p.blocks):
            h = _block(kind, h, i, ctx)
        w_out = v1.get_variable("w_out", [HIDDEN, CLASSES],
                                initializer=v1.glorot_uniform_initializer(seed=p.seed + 1))
        logits = tf.matmul(h, w_out)
        loss = _head(p.head, logits, ctx)
        if p.l2:
            loss += 0.01 * tf.add_n([tf.nn.l2_loss(v) for v in v1.trainable_variables()])
        loss = tf.identity(loss, name="loss")
        opt = (v1.train.GradientDescentOptimizer(0.2) if p.optimizer == "sgd"
               else v1.train.MomentumOptimizer(0.1, 0.9))
        with tf.control_dependencies(v1.get_collection(v1.GraphKeys.UPDATE_OPS)):
            opt.minimize(loss, name="train")
    return graph


def feeds(p: Program, steps: int = 3) -> list[dict]:
    """Uneven batches; masks that leave a tower's examples all masked out."""
    rng = np.random.RandomState(p.seed)
    out = []
    for step in range(steps):
        b = p.batch if step != 1 else max(1, p.batch - 1)
        mask = (rng.rand(b) > 0.4).astype(np.float32)
        mask[: max(1, b // p.towers)] = 0.0
        mask[-1] = 1.0
        out.append({"x:0": rng.randn(b, FEATURES).astype(np.float32),
                    "y:0": rng.randint(0, CLASSES, b).astype(np.int32), "m:0": mask})
    return out
