"""CTC: ``tf.compat.v1.nn.ctc_loss`` over time-major logits, with sparse labels built in the
graph from dense labels and their lengths (``tf.where(sequence_mask(...))``). Each example's
loss reads its own time steps, labels and length, so the towers compute their examples'
losses exactly (review 28: "no batch rule for CTCLoss", inexact; with an empty tower the
fetched loss failed in the merge)."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import replicate
from replicate.check.equivalence import compare

v1 = tf.compat.v1
F, C = 6, 5


def _speech(api: str = "v1"):
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, None, F], name="inputs")
        seq_len = v1.placeholder(tf.int32, [None], name="seq_len")
        labels = v1.placeholder(tf.int32, [None, None], name="labels")
        label_len = v1.placeholder(tf.int32, [None], name="label_len")
        w = v1.get_variable("w", [F, C], initializer=v1.truncated_normal_initializer(stddev=0.1, seed=4))
        logits = tf.reshape(tf.matmul(tf.reshape(x, [-1, F]), w), [tf.shape(x)[0], -1, C])
        where = tf.where(tf.sequence_mask(label_len, tf.shape(labels)[1]))
        targets = tf.SparseTensor(where, tf.gather_nd(labels, where), tf.cast(tf.shape(labels), tf.int64))
        if api == "v1":
            losses = v1.nn.ctc_loss(targets, tf.transpose(logits, (1, 0, 2)), seq_len)
        else:       # TF2: CTCLoss inside a function with its own gradient; dense: a while loop
            labelled = targets if api == "v2" else labels
            losses = tf.nn.ctc_loss(labelled, logits, None if api == "v2" else label_len, seq_len,
                                    logits_time_major=False, blank_index=-1)
        cost = tf.reduce_mean(losses, name="cost")
        v1.train.GradientDescentOptimizer(0.05).minimize(cost, name="train")
    return graph


@pytest.mark.parametrize("api,devices,batch,accumulate", [
    ("v1", 3, 7, 1), ("v1", 3, 2, 1), ("v1", 2, 5, 2), ("v2", 3, 2, 1), ("dense", 3, 2, 1)])
def test_ctc_loss_is_exact(api, devices, batch, accumulate):
    """TF2's ``tf.nn.ctc_loss`` (review 29): with sparse labels exact, an empty tower's
    ``CTCLoss`` padded inside the function; with dense labels (``ctc_loss_dense``: offsets into
    flattened states inside its loop) inexact, and an empty tower's ``TensorScatter*`` in and
    out of the loop run (both failed: "batch_size must not be 0", "Indices and updates
    specified for empty output shape"). The dense labels' reason advises the sparse form."""
    graph = _speech(api)
    res = replicate.transform(graph, [f"/cpu:{i}" for i in range(devices)], accumulate=accumulate)
    assert res.report.exact == (api != "dense"), res.report.reasons
    if api == "dense":      # review 34: the advice was about row numbers the user never wrote
        assert any("as a tf.SparseTensor" in r.fix for r in res.report.reasons), res.report.reasons
    rng = np.random.RandomState(0)
    feeds = [{"inputs:0": rng.randn(batch, 10, F).astype(np.float32), "seq_len:0": rng.randint(6, 11, batch),
              "labels:0": rng.randint(0, C - 1, (batch, 3)), "label_len:0": rng.randint(1, 4, batch)}
             for _ in range(2)]
    result = compare(graph, res.graph, "train", feeds, fetch=("cost:0",))
    assert result.max_rel <= 1e-5, (result.worst, result.max_rel)
