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


#: Tests that run for 10 s or more (subprocesses importing TensorFlow, servers, the corpus):
#: run first, so that the suite's last minutes hold short tests both workers share; placed
#: last, one worker ran a 40 s test while the other had nothing left.
SLOW = ("test_corpus.py", "test_recovery_drills.py", "test_between_graph.py", "test_fuzz.py",
        "test_distributed_docs.py", "test_soundness_programs.py", "test_cluster.py",
        "test_verify.py::test_verify_command_line_in_eager_mode", "test_guard.py::test_an_empty_tower_s",
        "test_guard.py::test_towers_without_examples", "test_docs.py", "test_trimmed_steps.py")


def pytest_collection_modifyitems(session, config, items):
    items.sort(key=lambda item: not any(s in item.nodeid for s in SLOW))
