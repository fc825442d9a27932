"""Noise (#25.5): the command line drops TensorFlow's and Graphviz's start-up chatter and keeps
every other line on stderr."""

import os
import subprocess
import sys

import models
import tensorflow as tf

from replicate import cli
from replicate.cli import quiet

v1 = tf.compat.v1

CHATTER = [
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
    "I0000 00:00:1795608253.895967   15657 cudart_stub.cc:31] Could not find cuda drivers on "
    "your machine, GPU will not be used.",
    "E0000 00:00:1795608263.462405   15657 cuda_platform.cc:52] failed call to cuInit: INTERNAL: "
    "CUDA error: Failed call to cuInit: UNKNOWN ERROR (303)",
    "I0000 00:00:1795608958.993361    7021 cpu_feature_guard.cc:227] This TensorFlow binary is "
    "optimized to use available CPU instructions in performance-critical operations.",
    "To enable the following instructions: AVX2 FMA, in other operations, rebuild TensorFlow "
    "with the appropriate compiler flags.",
    'Fontconfig warning: "/usr/share/fontconfig/conf.avail/05-reset-dirs-sample.conf", line 6: '
    'unknown element "reset-dirs"',
]

NEWS = [
    "W0000 00:00:1795608263.462405   15657 graph_execution_state.cc:12] a real warning",
    "E0000 00:00:1795608263.462405   15657 direct_session.cc:40] a real error",
    "replicate convert: error: model.meta: no such file or directory",
    "/x/y.py:3: UserWarning: something the user should see",
]


def test_chatter_is_recognized_and_news_is_not():
    assert all(quiet.is_noise(line) for line in CHATTER)
    assert not any(quiet.is_noise(line) for line in NEWS)


def test_filtered_stderr_drops_chatter_and_keeps_the_rest_in_order(capfd):
    with quiet.filtered_stderr():
        for line in CHATTER[:3] + NEWS[:2] + CHATTER[3:] + NEWS[2:]:
            os.write(2, (line + "\n").encode())
    assert capfd.readouterr().err.splitlines() == NEWS


def test_filter_can_be_turned_off(capfd):
    with quiet.filtered_stderr(enabled=False):
        os.write(2, (CHATTER[2] + "\n").encode())
    assert CHATTER[2] in capfd.readouterr().err


def test_the_users_log_level_is_kept():
    chosen = {"TF_CPP_MIN_LOG_LEVEL": "0"}
    cli.quiet_tensorflow(chosen)
    assert chosen == {"TF_CPP_MIN_LOG_LEVEL": "0"}
    unset = {}
    cli.quiet_tensorflow(unset)
    assert unset == {"TF_CPP_MIN_LOG_LEVEL": "2"}


def test_verify_in_a_subprocess_prints_nothing_on_stderr(tmp_path):
    """A real run that creates sessions (where cuInit is called): stderr stays empty."""
    path = str(tmp_path / "m.meta")
    with models.mlp().graph.as_default():
        v1.train.export_meta_graph(path)
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(cli.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    proc = subprocess.run([sys.executable, "-m", "replicate", "verify", path, "--devices",
                           "/cpu:0,/cpu:1", "--steps", "1"], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "verdict: agrees" in proc.stdout
    assert proc.stderr == "", proc.stderr
