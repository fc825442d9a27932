"""Generated training graphs for the soundness fuzzer, with the patterns that fooled guesses.

Each case is drawn from a seeded ``random.Random``: an input layout (dynamic, static or mixed
static/dynamic batch; a shared class-weights input whose length may equal the batch), a small
network, and a loss from families that are exact (means, sums, normalized sums, ratios,
reductions nested along other axes, several losses in one ``tf.gradients`` call, regularizers)
and families that are not (examples selected or mixed across the batch, products and roots of
batch statistics, extremes over the batch), with integers that merely *equal* the batch size
placed where a value-based guess would rewrite them. ``describe`` gives a one-line account of a
case, so a failure names what to rebuild.
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import tensorflow as tf

import models

v1 = tf.compat.v1

FEATURES = 4
CLASSES = 3

#: Loss families: name -> whether exactness is mathematically possible.
LOSSES = {
    "mean": True, "sum": True, "sum_over_int_batch": True, "sum_over_fed_batch": True,
    "sum_of_axis0_mean": True, "mean_of_axis0_sum": True, "weighted_ratio": True,
    "two_seeds": True, "mean_plus_sum": True, "sum_plus_l2": True, "mean_plus_l2": True,
    "ones_weights": True, "reshape_static": True, "time_mean": True,
    "floormod_const": True, "onehot_depth": True, "class_weights": True,
    "topk": False, "first_k": False, "cumsum": False, "sort": False, "gather_positions": False,
    # nonlinear in batch means: exact by synchronizing the means
    "mean_squared": True, "sqrt_mean": True, "max_over_batch": False, "center_batch": False,
    "softmax_over_batch": False, "argmax_over_batch": False,
    # sampled losses: the batch's labels and shared sampled classes in one lookup
    "nce": True, "sampled_softmax": True,
    "concat_rows_mean": False, "concat_rows_gather_sum": False, "concat_head_k": False,
    # positions in the batch: each tower numbers its rows from 0
    "batch_position": False,
    # the examples' order changed, then paired with per-example values in the old order
    "reversed_batch": False, "shuffled_batch": False,
}


@dataclasses.dataclass(frozen=True)
class Case:
    """One generated case."""

    seed: int
    loss: str
    towers: int
    batch: int
    static: bool
    mixed_static: bool
    hidden: int
    activation: str
    optimizer: str
    resource: bool

    def describe(self) -> str:
        return (f"case {self.seed}: loss={self.loss} towers={self.towers} batch={self.batch} "
                f"static={self.static} mixed={self.mixed_static} hidden={self.hidden} "
                f"act={self.activation} opt={self.optimizer} resource={self.resource}")


def draw(seed: int) -> Case:
    """The case of ``seed`` (adversarial families drawn as often as exact ones)."""
    rng = random.Random(seed)
    towers = rng.randint(2, 4)
    loss = rng.choice(sorted(LOSSES))
    static = rng.random() < 0.5
    # a static batch that coincides with a model dimension half the time
    batch = rng.choice([CLASSES, FEATURES, rng.randint(towers, 11)])
    batch = max(batch, towers)
    return Case(seed, loss, towers, batch, static, static and rng.random() < 0.3,
                rng.choice([CLASSES, FEATURES, 5]), rng.choice(["relu", "tanh", "none"]),
                rng.choice(["sgd", "adam", "momentum"]), rng.random() < 0.5)


def build(case: Case) -> models.Model:
    """The single-device training graph of ``case`` and its feed maker."""
    graph = tf.Graph()
    batch = case.batch if case.static else None
    with graph.as_default():
        v1.set_random_seed(case.seed % 1000)
        x = v1.placeholder(tf.float32, [batch, FEATURES], name="x")
        y = v1.placeholder(tf.float32, [None if case.mixed_static else batch, CLASSES], name="y")
        with v1.variable_scope("net", use_resource=case.resource):
            w1 = v1.get_variable("w1", [FEATURES, case.hidden])
            w2 = v1.get_variable("w2", [case.hidden, CLASSES])
            b2 = v1.get_variable("b2", [CLASSES], initializer=v1.constant_initializer(0.1))
            h = tf.matmul(x, w1)
            h = {"relu": tf.nn.relu, "tanh": tf.nn.tanh, "none": tf.identity}[case.activation](h)
            logits = tf.identity(tf.matmul(h, w2) + b2, name="logits")
            sq = tf.square(logits - y)
            per = tf.reduce_sum(sq, axis=1, name="per_example")
            loss, extra = _loss(case, x, y, logits, sq, per, [w1, w2, b2])
        loss = tf.identity(loss, name="loss")
        opt = models.OPTIMIZERS[case.optimizer]()
        if extra is not None:
            variables = [w1, w2, b2]
            # gated like compute_gradients: with reference variables an ungated gradient races
            # with the update in the single-device graph itself
            grads = tf.gradients([loss, extra], variables, gate_gradients=True)
            opt.apply_gradients(zip(grads, variables), name="train")
        else:
            opt.minimize(loss, name="train")

    def feed(rng: np.random.RandomState, b: int) -> dict:
        out = {"x:0": rng.randn(b, FEATURES).astype(np.float32),
               "y:0": rng.randn(b, CLASSES).astype(np.float32)}
        names = {op.name for op in graph.get_operations()}
        if "net/w" in names:
            out["net/w:0"] = rng.uniform(0.5, 2.0, b).astype(np.float32)
        if "net/ids" in names:
            out["net/ids:0"] = rng.randint(0, 50, b).astype(np.int64)
        if "net/batch_size" in names:
            out["net/batch_size:0"] = np.float32(b)
        if "net/cw" in names:
            out["net/cw:0"] = np.array([0.5, 1.0, 2.0], np.float32)
        return out

    return models.Model(graph, "train", feed, ("loss:0", "logits:0"))


def _loss(case: Case, x, y, logits, sq, per, variables):
    """(loss, second differentiated output or None) of ``case``'s loss family."""
    batch = case.batch if case.static else None
    k = max(1, min(2, case.batch // case.towers))
    kind = case.loss
    l2 = tf.add_n([tf.nn.l2_loss(v) for v in variables])
    if kind == "mean":
        return tf.reduce_mean(per), None
    if kind == "sum":
        return tf.reduce_sum(per), None
    if kind == "sum_over_int_batch":
        return tf.reduce_sum(per) / float(case.batch), None
    if kind == "sum_over_fed_batch":
        return tf.reduce_sum(per) / v1.placeholder(tf.float32, [], name="batch_size"), None
    if kind == "sum_of_axis0_mean":
        return tf.reduce_sum(tf.reduce_mean(sq, axis=0)), None
    if kind == "mean_of_axis0_sum":
        return tf.reduce_mean(tf.reduce_sum(sq, axis=0)), None
    if kind == "weighted_ratio":
        w = v1.placeholder(tf.float32, [batch], name="w")
        return tf.reduce_sum(per * w) / tf.reduce_sum(w), None
    if kind == "two_seeds":
        return tf.reduce_mean(per), 1e-2 * tf.reduce_sum(tf.square(logits))
    if kind == "mean_plus_sum":
        return tf.reduce_mean(per) + 0.1 * tf.reduce_sum(tf.abs(logits)), None
    if kind == "sum_plus_l2":
        return tf.reduce_sum(per) + 1e-2 * l2, None
    if kind == "mean_plus_l2":
        return tf.reduce_mean(per) + 1e-2 * l2, None
    if kind == "ones_weights":
        ones = tf.ones([case.batch]) if case.static else tf.ones_like(per)
        return tf.reduce_sum(per * ones) / float(case.batch), None
    if kind == "reshape_static":
        shape = [case.batch, 1] if case.static else [-1, 1]
        return tf.reduce_mean(tf.reshape(per, shape) * tf.constant([[2.0]])), None
    if kind == "time_mean":
        seq = tf.stack([per, 2.0 * per, tf.sqrt(per + 1.0)], axis=1)   # bounded growth: no divergence
        return tf.reduce_mean(tf.reduce_mean(seq, axis=1)), None
    if kind == "floormod_const":
        ids = v1.placeholder(tf.int64, [batch], name="ids")
        table = v1.get_variable("table", [case.batch, CLASSES])
        picked = tf.gather(table, tf.math.floormod(ids, case.batch))
        return tf.reduce_mean(tf.reduce_sum(tf.square(logits + picked - y), 1)), None
    if kind == "onehot_depth":
        labels = tf.argmax(y, axis=1)
        depth = case.batch
        proj = v1.get_variable("proj", [CLASSES, depth])
        target = tf.one_hot(labels, depth)
        return tf.reduce_mean(tf.reduce_sum(tf.square(tf.matmul(logits, proj) - target), 1)), None
    if kind == "class_weights":
        cw = v1.placeholder(tf.float32, [CLASSES], name="cw")
        return tf.reduce_mean(tf.reduce_sum(sq * cw, 1)), None
    if kind in ("nce", "sampled_softmax"):
        labels = tf.reshape(tf.argmax(y, axis=1), [-1, 1])
        out_w = v1.get_variable("out_w", [2 * CLASSES, case.hidden])
        out_b = v1.get_variable("out_b", [2 * CLASSES], initializer=v1.zeros_initializer())
        fn = v1.nn.nce_loss if kind == "nce" else v1.nn.sampled_softmax_loss
        hidden = tf.matmul(x, variables[0])
        return tf.reduce_mean(fn(out_w, out_b, labels, hidden, num_sampled=2,
                                 num_classes=2 * CLASSES)) + tf.reduce_mean(per), None
    if kind == "concat_rows_mean":
        return tf.reduce_mean(tf.concat([per, tf.constant([1.0, 2.0])], axis=0)), None
    if kind == "concat_rows_gather_sum":
        table = v1.get_variable("rows", [CLASSES, CLASSES])
        ids = tf.concat([tf.argmax(y, axis=1), tf.constant([0, 1], tf.int64)], axis=0)
        return tf.reduce_mean(per) + tf.reduce_sum(tf.square(tf.gather(table, ids))), None
    if kind == "concat_head_k":
        return tf.reduce_mean(tf.concat([per, tf.constant([1.0, 2.0])], axis=0)[:k + 1]), None
    if kind == "batch_position":
        return tf.reduce_mean(per * (1.0 + tf.cast(tf.range(tf.shape(per)[0]), tf.float32))), None
    if kind in ("reversed_batch", "shuffled_batch"):
        moved = tf.reverse(per, [0]) if kind == "reversed_batch" else \
            tf.gather(per, tf.random.shuffle(tf.range(tf.shape(per)[0]), seed=9))
        return tf.reduce_mean(moved * tf.cast(tf.argmax(y, axis=1) + 1, tf.float32)), None
    if kind == "topk":
        return tf.reduce_mean(tf.nn.top_k(per, k).values), None
    if kind == "first_k":
        return tf.reduce_mean(per[:k]), None
    if kind == "cumsum":
        return tf.reduce_mean(tf.cumsum(per)), None
    if kind == "sort":
        return tf.reduce_mean(tf.sort(per)[:k]), None
    if kind == "gather_positions":
        return tf.reduce_mean(tf.gather(per, [0])), None
    if kind == "mean_squared":
        return 0.05 * tf.square(tf.reduce_mean(per)), None
    if kind == "sqrt_mean":
        return tf.sqrt(tf.reduce_mean(per) + 1.0), None
    if kind == "max_over_batch":
        return tf.reduce_max(per), None
    if kind == "center_batch":
        centered = logits - tf.reduce_mean(logits, axis=0, keepdims=True)
        return tf.reduce_mean(tf.reduce_sum(tf.square(centered - y), 1)), None
    if kind == "softmax_over_batch":
        return tf.reduce_sum(tf.nn.softmax(per) * per), None
    if kind == "argmax_over_batch":
        best = tf.argmax(per, axis=0)
        return tf.reduce_mean(per) + tf.gather(per, best), None
    raise ValueError(kind)
