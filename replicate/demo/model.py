"""The seeds' MNIST CNN, built as an ordinary single-device TF1 training graph.

conv 5x5 (32) -> max-pool 2 -> conv 5x5 (64) -> max-pool 2 -> dense (1024, ReLU) -> dense (10),
mean sparse softmax cross-entropy, Adam, a global step: the model of the tutorial seed,
written with ``tf.nn`` and ``tf.compat.v1.get_variable`` so it needs no legacy Keras. Nothing
here knows about replicate; the graph is what a user would have saved. Dropout is left out on
purpose: its random streams differ per tower, so a model with it cannot train exactly.
"""

from __future__ import annotations

import dataclasses
import logging

import tensorflow as tf

from replicate.demo.data import CLASSES, IMAGE_SIZE

__all__ = ["CNN", "build_cnn", "FULL_SIZE", "SMALL_SIZE"]

log = logging.getLogger(__name__)
v1 = tf.compat.v1

#: The seeds' sizes: (conv1 filters, conv2 filters, dense units).
FULL_SIZE = (32, 64, 1024)
#: A quarter of the work, for quick runs on small CPUs.
SMALL_SIZE = (16, 32, 256)


@dataclasses.dataclass
class CNN:
    """A built training graph and the names a driver feeds and fetches.

    Attributes:
        graph: the single-device training graph.
        train_op: name of the op that takes one training step.
        images: placeholder name for [batch, 784] float32 images.
        labels: placeholder name for [batch] int64 labels.
        loss: name of the mean cross-entropy tensor.
        accuracy: name of the batch accuracy tensor.
        logits: name of the [batch, 10] logits tensor.
        sizes: (conv1 filters, conv2 filters, dense units).
    """

    graph: tf.Graph
    train_op: str = "train"
    images: str = "x:0"
    labels: str = "y:0"
    loss: str = "loss:0"
    accuracy: str = "accuracy:0"
    logits: str = "logits:0"
    sizes: tuple[int, int, int] = FULL_SIZE

    def parameters(self) -> int:
        """Number of trainable parameters."""
        return sum(int(v.shape.num_elements())
                   for v in self.graph.get_collection(v1.GraphKeys.TRAINABLE_VARIABLES))


def _conv(net: tf.Tensor, name: str, filters: int) -> tf.Tensor:
    with v1.variable_scope(name):
        w = v1.get_variable("weights", [5, 5, int(net.shape[-1]), filters],
                            initializer=v1.glorot_uniform_initializer())
        b = v1.get_variable("biases", [filters], initializer=v1.zeros_initializer())
        net = tf.nn.relu(tf.nn.bias_add(tf.nn.conv2d(net, w, [1, 1, 1, 1], "SAME"), b))
    return tf.nn.max_pool2d(net, 2, 2, "SAME")


def _dense(net: tf.Tensor, name: str, units: int, relu: bool) -> tf.Tensor:
    with v1.variable_scope(name):
        w = v1.get_variable("weights", [int(net.shape[-1]), units],
                            initializer=v1.glorot_uniform_initializer())
        b = v1.get_variable("biases", [units], initializer=v1.zeros_initializer())
        net = tf.nn.bias_add(tf.matmul(net, w), b)
    return tf.nn.relu(net) if relu else net


def build_cnn(sizes: tuple[int, int, int] = FULL_SIZE, learning_rate: float = 1e-3,
              seed: int = 0, resource: bool = True) -> CNN:
    """Build the CNN and its Adam training step in a new graph.

    Args:
        sizes: (conv1 filters, conv2 filters, dense units); ``FULL_SIZE`` is the seeds'.
        learning_rate: Adam's learning rate.
        seed: the graph-level random seed (initial values).
        resource: resource variables (True) or legacy ref variables.

    Returns:
        A :class:`CNN` naming the placeholders, loss and train op.
    """
    conv1, conv2, units = sizes
    graph = tf.Graph()
    with graph.as_default():
        v1.set_random_seed(seed)
        x = v1.placeholder(tf.float32, [None, IMAGE_SIZE * IMAGE_SIZE], name="x")
        y = v1.placeholder(tf.int64, [None], name="y")
        with v1.variable_scope("cnn", use_resource=resource):
            net = tf.reshape(x, [-1, IMAGE_SIZE, IMAGE_SIZE, 1])
            net = _conv(net, "conv1", conv1)
            net = _conv(net, "conv2", conv2)
            net = tf.reshape(net, [-1, int(net.shape[1] * net.shape[2] * net.shape[3])])
            net = _dense(net, "dense_1", units, relu=True)
            logits = _dense(net, "dense_2", CLASSES, relu=False)
        logits = tf.identity(logits, name="logits")
        xent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
        loss = tf.reduce_mean(xent, name="loss")
        correct = tf.equal(tf.argmax(logits, 1), y)
        tf.reduce_mean(tf.cast(correct, tf.float32), name="accuracy")
        step = v1.train.get_or_create_global_step()
        v1.train.AdamOptimizer(learning_rate).minimize(loss, global_step=step, name="train")
    log.debug("built the CNN %s", sizes)
    return CNN(graph, sizes=tuple(sizes))
