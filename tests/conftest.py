"""Test set-up: legacy Keras for tf.compat.v1.layers, graph mode, quiet TensorFlow."""

import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import sys  # noqa: E402

import tensorflow as tf  # noqa: E402

tf.compat.v1.disable_eager_execution()
tf.get_logger().setLevel("ERROR")
sys.path.insert(0, os.path.dirname(__file__))
