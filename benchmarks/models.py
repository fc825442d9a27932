"""The benchmarked models, each built three ways from one definition.

A :class:`Spec` names a model's variables and its forward pass in plain ``tf.nn`` ops, so
the same computation can be built as

* an ordinary single-device TF1 training graph (``Adam.minimize``): replicate's input and
  the single-device baseline (:func:`single_graph`);
* hand-written in-graph towers in the style of the multi-GPU tutorial seed: a device function
  that puts variables on the controller, per-tower slices of the batch, ``compute_gradients``
  per tower, ``average_gradients`` (stack and mean), one ``apply_gradients`` on the controller
  (:func:`towers_graph`);
* TF2 ``tf.distribute.MirroredStrategy`` with a ``tf.function`` step (:func:`mirrored_step`).

All three use ``tf.compat.v1.train.AdamOptimizer`` with the same hyper-parameters and a mean
sparse softmax cross-entropy over the global batch.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf

__all__ = ["Spec", "SPECS", "single_graph", "towers_graph", "mirrored_step", "Built", "feeds"]

log = logging.getLogger(__name__)
v1 = tf.compat.v1
LEARNING_RATE = 1e-3


@dataclasses.dataclass(frozen=True)
class Spec:
    """A model: its variables (name -> shape) and a forward pass over them.

    Attributes:
        name: short name used in tables.
        features: input features per example (flattened).
        variables: (name, shape) in creation order; names ending in ``biases`` start at zero.
        forward: (params by name, [batch, features] images) -> [batch, 10] logits.
    """

    name: str
    features: int
    variables: tuple[tuple[str, tuple[int, ...]], ...]
    forward: Callable[[dict, tf.Tensor], tf.Tensor]

    def parameters(self) -> int:
        """Number of trainable parameters."""
        return sum(int(np.prod(shape)) for _, shape in self.variables)


def _cnn_forward(p: dict, x: tf.Tensor) -> tf.Tensor:
    net = tf.reshape(x, [-1, 28, 28, 1])
    for layer in ("conv1", "conv2"):
        net = tf.nn.conv2d(net, p[f"{layer}/weights"], [1, 1, 1, 1], "SAME")
        net = tf.nn.relu(tf.nn.bias_add(net, p[f"{layer}/biases"]))
        net = tf.nn.max_pool2d(net, 2, 2, "SAME")
    net = tf.reshape(net, [-1, 7 * 7 * 64])
    net = tf.nn.relu(tf.nn.bias_add(tf.matmul(net, p["dense_1/weights"]), p["dense_1/biases"]))
    return tf.nn.bias_add(tf.matmul(net, p["dense_2/weights"]), p["dense_2/biases"])


def _mlp_forward(p: dict, x: tf.Tensor) -> tf.Tensor:
    net = x
    hidden = sorted({name.split("/")[0] for name in p if name.startswith("fc")}, key=lambda s: int(s[2:]))
    for layer in hidden:
        net = tf.nn.relu(tf.nn.bias_add(tf.matmul(net, p[f"{layer}/weights"]), p[f"{layer}/biases"]))
    return tf.nn.bias_add(tf.matmul(net, p["out/weights"]), p["out/biases"])


SPECS: dict[str, Spec] = {
    # The seeds' MNIST CNN: 3.3M parameters, conv-heavy.
    "mnist_cnn": Spec("mnist_cnn", 784, (
        ("conv1/weights", (5, 5, 1, 32)), ("conv1/biases", (32,)),
        ("conv2/weights", (5, 5, 32, 64)), ("conv2/biases", (64,)),
        ("dense_1/weights", (3136, 1024)), ("dense_1/biases", (1024,)),
        ("dense_2/weights", (1024, 10)), ("dense_2/biases", (10,))), _cnn_forward),
    # A larger model: 20M parameters in two 4096-wide layers, so gradient traffic dominates.
    "mlp_20m": Spec("mlp_20m", 784, (
        ("fc1/weights", (784, 4096)), ("fc1/biases", (4096,)),
        ("fc2/weights", (4096, 4096)), ("fc2/biases", (4096,)),
        ("out/weights", (4096, 10)), ("out/biases", (10,))), _mlp_forward),
    # Many layers of one size (12 x 1024 wide, 13M parameters): no layer dominates the
    # gradients, as in most deep models, so how long each layer's gradient stays live shows.
    "mlp_deep": Spec("mlp_deep", 784, (
        ("fc1/weights", (784, 1024)), ("fc1/biases", (1024,)),
        *((f"fc{i}/{kind}", (1024, 1024) if kind == "weights" else (1024,))
          for i in range(2, 13) for kind in ("weights", "biases")),
        ("out/weights", (1024, 10)), ("out/biases", (10,))), _mlp_forward),
}


def _initializer(name: str):
    return v1.zeros_initializer() if name.endswith("biases") else v1.glorot_uniform_initializer(seed=1)


def _loss(spec: Spec, params: dict, x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
    logits = spec.forward(params, x)
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))


@dataclasses.dataclass
class Built:
    """A TF1 training graph and the names to run it with."""

    graph: tf.Graph
    train_op: str
    loss: str
    x: str = "x:0"
    y: str = "y:0"


def _get_params(spec: Spec) -> dict:
    return {name: v1.get_variable(name, shape, initializer=_initializer(name), use_resource=True)
            for name, shape in spec.variables}


def _inputs_and_params(spec: Spec) -> tuple:
    """The placeholders ``x``, ``y`` and the model's variables (under ``model/``), in the
    default graph: what every single-device variant starts from."""
    x = v1.placeholder(tf.float32, [None, spec.features], name="x")
    y = v1.placeholder(tf.int64, [None], name="y")
    with v1.variable_scope("model"):
        params = _get_params(spec)
    return x, y, params


def single_graph(spec: Spec) -> Built:
    """The ordinary single-device graph (no devices set)."""
    graph = tf.Graph()
    with graph.as_default():
        x, y, params = _inputs_and_params(spec)
        loss = tf.identity(_loss(spec, params, x, y), name="loss")
        step = v1.train.get_or_create_global_step()
        v1.train.AdamOptimizer(LEARNING_RATE).minimize(loss, global_step=step, name="train")
    return Built(graph, "train", "loss:0")


_PS_OPS = ("Variable", "VariableV2", "VarHandleOp", "AutoReloadVariable", "MutableHashTable",
           "MutableHashTableOfTensors", "MutableDenseHashTable")


def _assign_to_device(device: str, ps_device: str):
    """The tutorial's device function: variables on ``ps_device``, everything else on ``device``."""
    def assign(op):
        node_def = op if isinstance(op, tf.compat.v1.NodeDef) else op.node_def
        return ps_device if node_def.op in _PS_OPS else device
    return assign


def _average_gradients(tower_grads: list[list[tuple]]) -> list[tuple]:
    """The tutorial's averaging: stack each variable's tower gradients and take the mean."""
    average = []
    for grad_and_vars in zip(*tower_grads):
        grads = [g for g, _ in grad_and_vars]
        average.append((tf.reduce_mean(grads, 0), grad_and_vars[0][1]))
    return average


def towers_graph(spec: Spec, devices: Sequence[str], controller: str = "/cpu:0") -> Built:
    """Hand-written in-graph towers, as the tutorial seed writes them (even splits only)."""
    graph = tf.Graph()
    n = len(devices)
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, spec.features], name="x")
        y = v1.placeholder(tf.int64, [None], name="y")
        opt = v1.train.AdamOptimizer(LEARNING_RATE)
        per = tf.shape(x)[0] // n
        tower_grads, losses = [], []
        with v1.variable_scope(v1.get_variable_scope()) as outer:
            for i, dev in enumerate(devices):
                with graph.device(_assign_to_device(dev, controller)), v1.name_scope(f"tower_{i}"):
                    with v1.variable_scope("model"):
                        params = _get_params(spec)
                    loss = _loss(spec, params, x[i * per:(i + 1) * per], y[i * per:(i + 1) * per])
                    with v1.name_scope("compute_gradients"):
                        tower_grads.append(opt.compute_gradients(loss))
                    losses.append(loss)
                outer.reuse_variables()
        with v1.name_scope("apply_gradients"), graph.device(controller):
            grads = _average_gradients(tower_grads)
            step = v1.train.get_or_create_global_step()
            train = opt.apply_gradients(grads, global_step=step, name="train")
            loss = tf.reduce_mean(losses, name="loss")
    return Built(graph, train.name, loss.name)


def mirrored_step(spec: Spec, devices: Sequence[str]) -> Callable[[np.ndarray, np.ndarray], float]:
    """A TF2 MirroredStrategy training step over ``devices`` (eager logical devices).

    Variables are mirrored (one copy per device, kept in sync) rather than held on a
    controller; gradients are summed across replicas by the strategy's default cross-device
    ops (one-device reduction on CPUs), each replica's loss being its examples' sum divided
    by the global batch, which is the same mean over the global batch.
    """
    strategy = tf.distribute.MirroredStrategy(devices=list(devices))
    with strategy.scope():
        params = {name: tf.Variable(_initializer(name)(shape, tf.float32), name=name)
                  for name, shape in spec.variables}
        step_var = tf.Variable(0, dtype=tf.int64, trainable=False, name="global_step",
                               aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
        opt = v1.train.AdamOptimizer(LEARNING_RATE)
    names = [name for name, _ in spec.variables]

    def replica(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        ctx = tf.distribute.get_replica_context()
        i, n = ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync
        per = tf.shape(x)[0] // n
        xs, ys = x[i * per:(i + 1) * per], y[i * per:(i + 1) * per]
        with tf.GradientTape() as tape:
            logits = spec.forward(params, xs)
            xent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=ys, logits=logits)
            loss = tf.reduce_sum(xent) / tf.cast(tf.shape(x)[0], tf.float32)
        grads = tape.gradient(loss, [params[k] for k in names])
        opt.apply_gradients(zip(grads, [params[k] for k in names]), global_step=step_var)
        return loss

    @tf.function
    def step(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        losses = strategy.run(replica, args=(x, y))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

    return lambda x, y: float(step(tf.constant(x), tf.constant(y)))


def feeds(spec: Spec, batch: int, count: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """``count`` deterministic random batches of ``batch`` examples."""
    rng = np.random.RandomState(seed)
    return [(rng.rand(batch, spec.features).astype(np.float32),
             rng.randint(0, 10, batch).astype(np.int64)) for _ in range(count)]
