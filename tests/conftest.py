"""Test set-up: legacy Keras for tf.compat.v1.layers, graph mode, quiet TensorFlow, and a
garbage collector that does not rescan TensorFlow's modules over and over."""

import gc
import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import sys  # noqa: E402

import tensorflow as tf  # noqa: E402

tf.compat.v1.disable_eager_execution()
tf.get_logger().setLevel("ERROR")
sys.path.insert(0, os.path.dirname(__file__))


def pytest_collection_finish(session):
    """Freeze what importing TensorFlow and the test modules made (the collector's full passes
    rescanned it all, 5-8% of a test file's time) and collect less often. Garbage still goes:
    the graphs the tests drop are collected, in larger batches."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(20000, 20, 20)
