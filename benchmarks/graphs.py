"""Training graphs of many sizes for the compile-time benchmark.

* tf-slim nets (ResNet-v1 50/101/152, Inception-v3) with batch norm, a mean cross-entropy and
  Momentum, written the way the ``tf.layers`` documentation recommends: ``minimize`` under
  ``tf.control_dependencies(update_ops)``.
* ``deep_<L>``: a synthetic very deep model, L dense layers of width 8 trained with Adam,
  about 50 nodes per layer, for graphs of 10,000 to 200,000+ nodes.

Each builder returns a single-device ``tf.Graph`` with ``train`` and ``loss``.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from collections.abc import Callable

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import tensorflow as tf  # noqa: E402

__all__ = ["BUILDERS", "build"]

log = logging.getLogger(__name__)
v1 = tf.compat.v1


def _slim():
    """tf-slim, with the module alias its batch norm needs under tf-keras 2.21.

    ``tensorflow/python/layers/normalization.py`` imports ``tf_keras.legacy_tf_layers``,
    which tf-keras 2.21 ships only as ``tf_keras.src.legacy_tf_layers``; without the alias
    ``slim.batch_norm`` raises ModuleNotFoundError. (A tf-slim/tf-keras problem, not replicate's.)
    """
    for name in ("legacy_tf_layers", "legacy_tf_layers.normalization"):
        if f"tf_keras.{name}" not in sys.modules:
            try:
                sys.modules[f"tf_keras.{name}"] = importlib.import_module(f"tf_keras.src.{name}")
            except ImportError:
                pass
    import tf_slim

    return tf_slim


def _train(logits: tf.Tensor, y: tf.Tensor, optimizer) -> None:
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits),
                          name="loss")
    with tf.control_dependencies(v1.get_collection(v1.GraphKeys.UPDATE_OPS)):
        optimizer.minimize(loss, global_step=v1.train.get_or_create_global_step(), name="train")


def _slim_net(module: str, fn: str, scope: str, size: int) -> Callable[[], tf.Graph]:
    def build() -> tf.Graph:
        slim = _slim()
        nets = importlib.import_module(f"tf_slim.nets.{module}")
        graph = tf.Graph()
        with graph.as_default():
            x = v1.placeholder(tf.float32, [None, size, size, 3], name="x")
            y = v1.placeholder(tf.int64, [None], name="y")
            with slim.arg_scope(getattr(nets, scope)()):
                logits, _ = getattr(nets, fn)(x, num_classes=10, is_training=True)
            _train(tf.reshape(logits, [-1, 10]), y, v1.train.MomentumOptimizer(0.01, 0.9))
        return graph
    return build


def _deep(layers: int, width: int = 8) -> Callable[[], tf.Graph]:
    def build() -> tf.Graph:
        graph = tf.Graph()
        with graph.as_default():
            x = v1.placeholder(tf.float32, [None, width], name="x")
            y = v1.placeholder(tf.int64, [None], name="y")
            net = x
            for i in range(layers):
                with v1.variable_scope(f"layer{i}"):
                    w = v1.get_variable("w", [width, width], use_resource=True)
                    b = v1.get_variable("b", [width], initializer=v1.zeros_initializer(),
                                        use_resource=True)
                    net = tf.nn.tanh(tf.matmul(net, w) + b)
            with v1.variable_scope("out"):
                w = v1.get_variable("w", [width, 10], use_resource=True)
            _train(tf.matmul(net, w), y, v1.train.AdamOptimizer(1e-3))
        return graph
    return build


BUILDERS: dict[str, Callable[[], tf.Graph]] = {
    "resnet_v1_50": _slim_net("resnet_v1", "resnet_v1_50", "resnet_arg_scope", 64),
    "inception_v3": _slim_net("inception_v3", "inception_v3", "inception_v3_arg_scope", 299),
    "resnet_v1_101": _slim_net("resnet_v1", "resnet_v1_101", "resnet_arg_scope", 64),
    "resnet_v1_152": _slim_net("resnet_v1", "resnet_v1_152", "resnet_arg_scope", 64),
    **{f"deep_{n}": _deep(n) for n in (60, 200, 600, 2000, 4000)},
}


def build(name: str) -> tf.Graph:
    """Build the named training graph.

    Raises:
        KeyError: no such graph (``deep_<L>`` works for any L).
    """
    if name in BUILDERS:
        return BUILDERS[name]()
    if name.startswith("deep_") and name[5:].isdigit():
        return _deep(int(name[5:]))()
    raise KeyError(f"no graph called {name!r}; known: {', '.join(BUILDERS)}, deep_<layers>")
