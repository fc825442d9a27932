"""Single-device training graphs built the ordinary TF1 way, for the tests.

Each builder returns a :class:`Model`: the graph, the train op's name and a function that
makes feed dicts. None of them knows about replicate.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable

import numpy as np
import tensorflow as tf

v1 = tf.compat.v1

OPTIMIZERS: dict[str, Callable[[], object]] = {
    "sgd": lambda: v1.train.GradientDescentOptimizer(0.1),
    "momentum": lambda: v1.train.MomentumOptimizer(0.05, 0.9),
    "nesterov": lambda: v1.train.MomentumOptimizer(0.05, 0.9, use_nesterov=True),
    "adam": lambda: v1.train.AdamOptimizer(0.01),
    "rmsprop": lambda: v1.train.RMSPropOptimizer(0.01),
    "rmsprop_momentum": lambda: v1.train.RMSPropOptimizer(0.01, momentum=0.5),
    "rmsprop_centered": lambda: v1.train.RMSPropOptimizer(0.01, momentum=0.5, centered=True),
    "adagrad": lambda: v1.train.AdagradOptimizer(0.1),
    "adadelta": lambda: v1.train.AdadeltaOptimizer(1.0),
    "ftrl": lambda: v1.train.FtrlOptimizer(0.1),
    "proximal_sgd": lambda: v1.train.ProximalGradientDescentOptimizer(0.1, l1_regularization_strength=0.01),
    "proximal_adagrad": lambda: v1.train.ProximalAdagradOptimizer(0.1, l2_regularization_strength=0.01),
}


@contextlib.contextmanager
def control_flow_v1(on: bool = True):
    """Build with TF1 control flow (Switch/Merge conds, loop frames) when ``on``."""
    if on:
        v1.disable_control_flow_v2()
    try:
        yield
    finally:
        if on:
            v1.enable_control_flow_v2()


@dataclasses.dataclass
class Model:
    """A built training graph and how to feed it."""

    graph: tf.Graph
    train_op: str
    make_feed: Callable[[np.random.RandomState, int], dict]
    fetch: tuple[str, ...] = ("loss:0",)

    def feeds(self, batch: int, steps: int = 3, seed: int = 0) -> list[dict]:
        """``steps`` feed dicts of ``batch`` examples each."""
        rng = np.random.RandomState(seed)
        return [self.make_feed(rng, batch) for _ in range(steps)]


def _classification_feed(features: tuple[int, ...], classes: int, onehot: bool = False):
    def make(rng: np.random.RandomState, batch: int) -> dict:
        labels = rng.randint(0, classes, size=batch)
        feed = {"x:0": rng.randn(batch, *features).astype(np.float32)}
        feed["y:0"] = np.eye(classes, dtype=np.float32)[labels] if onehot else labels.astype(np.int64)
        return feed
    return make


def masked_regression():
    """Inside a graph: placeholders ``x`` [B, 4], ``y`` [B] and a mask ``m`` [B], and the
    prediction ``p = x . w`` of a seeded resource variable ``w``; returns ``(p, y, m, w)``.
    The prelude of the loss-shape tests (denominators, nonlinear losses, custom gradients)."""
    v1 = tf.compat.v1
    x = v1.placeholder(tf.float32, [None, 4], name="x")
    y = v1.placeholder(tf.float32, [None], name="y")
    m = v1.placeholder(tf.float32, [None], name="m")
    w = v1.get_variable("w", [4], initializer=v1.glorot_uniform_initializer(seed=1),
                        use_resource=True)
    return tf.reduce_sum(x * w, axis=1), y, m, w


def mlp(optimizer: str = "adam", resource: bool = True, batch: int | None = None,
        hidden: int = 16, global_step: bool = True) -> Model:
    """Two dense layers, softmax cross-entropy mean loss, optional global step."""
    graph = tf.Graph()
    with graph.as_default():
        v1.set_random_seed(7)
        x = v1.placeholder(tf.float32, [batch, 8], name="x")
        y = v1.placeholder(tf.int64, [batch], name="y")
        with v1.variable_scope("model", use_resource=resource):
            w1 = v1.get_variable("w1", [8, hidden])
            b1 = v1.get_variable("b1", [hidden], initializer=v1.constant_initializer(0.1))
            w2 = v1.get_variable("w2", [hidden, 3])
            b2 = v1.get_variable("b2", [3], initializer=v1.zeros_initializer())
        h = tf.nn.relu(tf.matmul(x, w1) + b1)
        logits = tf.identity(tf.matmul(h, w2) + b2, name="logits")
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits),
                              name="loss")
        tf.identity(tf.argmax(logits, 1), name="predictions")
        tf.reduce_mean(tf.cast(tf.equal(tf.argmax(logits, 1), y), tf.float32), name="accuracy")
        step = v1.train.get_or_create_global_step() if global_step else None
        OPTIMIZERS[optimizer]().minimize(loss, global_step=step, name="train")
    return Model(graph, "train", _classification_feed((8,), 3),
                 ("loss:0", "logits:0", "predictions:0", "accuracy:0"))


def cnn(filters: tuple[int, int] = (4, 8), dense: int = 32, batch: int | None = None,
        optimizer: str = "adam", resource: bool = True, size: int = 28) -> Model:
    """The seeds' MNIST CNN (conv 5x5, pool, conv 5x5, pool, dense, logits), scaled down.

    ``filters=(32, 64), dense=1024`` is the seeds' full size. ``batch`` fixes the
    placeholders' batch dimension, as the first seed does.
    """
    graph = tf.Graph()
    with graph.as_default():
        v1.set_random_seed(3)
        x = v1.placeholder(tf.float32, [batch, size * size], name="x")
        y = v1.placeholder(tf.float32, [batch, 10], name="y")
        net = tf.reshape(x, [batch if batch is not None else -1, size, size, 1])
        with v1.variable_scope("cnn", use_resource=resource):
            for i, f in enumerate(filters):
                w = v1.get_variable(f"conv{i + 1}/weights", [5, 5, net.shape[-1], f],
                                    initializer=v1.truncated_normal_initializer(stddev=0.1))
                b = v1.get_variable(f"conv{i + 1}/biases", [f], initializer=v1.constant_initializer(0.1))
                net = tf.nn.relu(tf.nn.bias_add(tf.nn.conv2d(net, w, [1, 1, 1, 1], "SAME"), b))
                net = tf.nn.max_pool2d(net, 2, 2, "SAME")
            flat = int(np.prod(net.shape[1:]))
            net = tf.reshape(net, [batch if batch is not None else -1, flat])
            w = v1.get_variable("fc/weights", [flat, dense], initializer=v1.truncated_normal_initializer(stddev=0.1))
            b = v1.get_variable("fc/biases", [dense], initializer=v1.constant_initializer(0.1))
            net = tf.nn.relu(tf.matmul(net, w) + b)
            w = v1.get_variable("out/weights", [dense, 10], initializer=v1.truncated_normal_initializer(stddev=0.1))
            b = v1.get_variable("out/biases", [10], initializer=v1.zeros_initializer())
            logits = tf.matmul(net, w) + b
        logits = tf.identity(logits, name="logits")
        loss = tf.reduce_mean(tf.nn.softmax_cross_entropy_with_logits(labels=y, logits=logits), name="loss")
        correct = tf.equal(tf.argmax(logits, 1), tf.argmax(y, 1))
        tf.reduce_mean(tf.cast(correct, tf.float32), name="accuracy")
        step = v1.train.get_or_create_global_step()
        OPTIMIZERS[optimizer]().minimize(loss, global_step=step, name="train")
    return Model(graph, "train", _classification_feed((size * size,), 10, onehot=True),
                 ("loss:0", "logits:0", "accuracy:0"))


def clipped(resource: bool = True, norm: float = 0.5) -> Model:
    """compute_gradients -> clip_by_global_norm -> apply_gradients (Momentum)."""
    graph = tf.Graph()
    with graph.as_default():
        v1.set_random_seed(11)
        x = v1.placeholder(tf.float32, [None, 8], name="x")
        y = v1.placeholder(tf.int64, [None], name="y")
        with v1.variable_scope("model", use_resource=resource):
            w1 = v1.get_variable("w1", [8, 16])
            w2 = v1.get_variable("w2", [16, 3])
        logits = tf.matmul(tf.nn.tanh(tf.matmul(x, w1)), w2, name="logits")
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits),
                              name="loss")
        opt = v1.train.MomentumOptimizer(0.5, 0.9)
        grads_and_vars = opt.compute_gradients(loss)
        grads, variables = zip(*grads_and_vars)
        clipped_grads, _ = tf.clip_by_global_norm(grads, norm)
        step = v1.train.get_or_create_global_step()
        opt.apply_gradients(zip(clipped_grads, variables), global_step=step, name="train")
    return Model(graph, "train", _classification_feed((8,), 3))


def two_optimizers(resource: bool = True) -> Model:
    """A body trained by Adam and a head trained by SGD, grouped into one train op."""
    graph = tf.Graph()
    with graph.as_default():
        v1.set_random_seed(5)
        x = v1.placeholder(tf.float32, [None, 8], name="x")
        y = v1.placeholder(tf.int64, [None], name="y")
        with v1.variable_scope("body", use_resource=resource):
            w1 = v1.get_variable("w", [8, 16])
        with v1.variable_scope("head", use_resource=resource):
            w2 = v1.get_variable("w", [16, 3])
        logits = tf.matmul(tf.nn.relu(tf.matmul(x, w1)), w2, name="logits")
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits),
                              name="loss")
        step = v1.train.get_or_create_global_step()
        body = v1.train.AdamOptimizer(0.01).minimize(loss, var_list=[w1], global_step=step)
        head = v1.train.GradientDescentOptimizer(0.1).minimize(loss, var_list=[w2])
        tf.group(body, head, name="train")
    return Model(graph, "train", _classification_feed((8,), 3))


def dataset_mlp(examples: int = 40, batch: int = 12, resource: bool = True) -> Model:
    """An MLP reading a tf.data one-shot iterator (last batch smaller); no feeds."""
    rng = np.random.RandomState(1)
    xs = rng.randn(examples, 8).astype(np.float32)
    ys = rng.randint(0, 3, examples).astype(np.int64)
    graph = tf.Graph()
    with graph.as_default():
        v1.set_random_seed(9)
        data = tf.data.Dataset.from_tensor_slices((xs, ys)).batch(batch)
        x, y = v1.data.make_one_shot_iterator(data).get_next()
        with v1.variable_scope("model", use_resource=resource):
            w1 = v1.get_variable("w1", [8, 16])
            w2 = v1.get_variable("w2", [16, 3])
        logits = tf.matmul(tf.nn.relu(tf.matmul(x, w1)), w2, name="logits")
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits),
                              name="loss")
        v1.train.AdamOptimizer(0.01).minimize(loss, global_step=v1.train.get_or_create_global_step(),
                                              name="train")
    return Model(graph, "train", lambda rng, b: {})
