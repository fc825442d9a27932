"""A "stateful" LSTM regressor that keeps its recurrent state between steps in non-trainable
variables, a pattern common in 2017 blog posts on truncated back-propagation through time:
the state variables hold one row per sequence of the (static) batch, ``dynamic_rnn`` starts
from them, the train op first assigns the final state back, and a ``reset_state`` op zeroes
them at the start of each epoch."""

import numpy as np
import tensorflow as tf

v1 = tf.compat.v1
rnn = v1.nn.rnn_cell

FAMILY = "stateful LSTM (state in variables)"
DESCRIPTION = ("state kept in non-trainable variables `state/c`, `state/h` of shape "
               "[batch_size, 12]; `dynamic_rnn(LSTMCell)` from `LSTMStateTuple(c, h)`; "
               "`train_op` runs under `control_dependencies([assign final state])`; a "
               "`reset_state` op; `x` [batch_size, 4, 3], `y` [batch_size, 4, 1] static; "
               "`reduce_mean(squared_difference)`, RMSProp")
DRIVER = ("per epoch `sess.run(reset_state)`, then per window of 4 steps `sess.run([train_op, "
          "loss, predictions], {x, y})`; the next window continues from the stored state")
BATCHES = [6, 7]

FEATURES, HIDDEN, STEPS = 3, 12, 4

VARIANTS = {
    "stateful": {"expect": {"exact": "refused", "refusal": ["share the variable's buffer"],
                            "why": "reference variables: on one device the assignment of the final "
                            "state rewrites, in place, the buffer the gradient code kept from the "
                            "read of the initial state (measured: storing zeros instead of the "
                            "final state moves the weights by 0.3 after one step), so the "
                            "single-device gradient itself depends on TensorFlow's buffer "
                            "sharing; towers reading their rows cannot reproduce it"}},
    "resource": {"build": {"resource": True},
                 "expect": {"exact": True,
                            "why": "resource state variables: each tower reads its own rows of one "
                            "read (split); the assignment of the final state runs once and writes "
                            "the towers' rows concatenated in order, so the next window starts "
                            "from the single-device state"}},
}


def build(batch_size, resource=False):
    x = v1.placeholder(tf.float32, [batch_size, STEPS, FEATURES], name="x")
    y = v1.placeholder(tf.float32, [batch_size, STEPS, 1], name="y")
    cell = rnn.LSTMCell(HIDDEN)
    with v1.variable_scope("state", use_resource=resource):
        c = v1.get_variable("c", [batch_size, HIDDEN], trainable=False,
                            initializer=v1.zeros_initializer())
        h = v1.get_variable("h", [batch_size, HIDDEN], trainable=False,
                            initializer=v1.zeros_initializer())
    initial_state = rnn.LSTMStateTuple(c.value(), h.value())
    outputs, final_state = v1.nn.dynamic_rnn(cell, x, initial_state=initial_state)
    predictions = tf.identity(v1.layers.dense(outputs, 1, name="out"), name="predictions")
    loss = tf.reduce_mean(tf.math.squared_difference(predictions, y), name="loss")
    store_state = tf.group(v1.assign(c, final_state.c), v1.assign(h, final_state.h),
                           name="store_state")
    reset_state = tf.group(v1.assign(c, tf.zeros_like(c)), v1.assign(h, tf.zeros_like(h)),
                           name="reset_state")
    with tf.control_dependencies([store_state]):
        train_op = v1.train.RMSPropOptimizer(0.01).minimize(loss, name="train_op")
    saver = v1.train.Saver()
    init = v1.global_variables_initializer()
    return {"x": x.name, "y": y.name, "train_op": train_op.name, "loss": loss.name,
            "predictions": predictions.name, "reset_state": reset_state.name,
            "init": [init.name], "saver": saver}


def make_data(rng, batch_size, epochs=2, windows=2):
    """Noisy sine waves, one phase per sequence, cut into windows of STEPS."""
    n = STEPS * windows + 1
    t = np.arange(n)[None, :] * 0.4 + rng.uniform(0, 6, (batch_size, 1))
    series = np.sin(t) + 0.05 * rng.randn(batch_size, n)
    feats = np.stack([series, np.cos(t), np.ones_like(t)], -1).astype(np.float32)
    out = []
    for w in range(windows):
        sl = slice(w * STEPS, (w + 1) * STEPS)
        out.append((feats[:, sl], series[:, w * STEPS + 1:(w + 1) * STEPS + 1, None].astype(np.float32)))
    return {"epochs": epochs, "windows": out}


def drive(sess, graph, names, data, workdir):
    t = graph.get_tensor_by_name
    op = graph.get_operation_by_name
    log = []
    windows = data["windows"]
    for epoch in range(data["epochs"]):
        sess.run(op(names["reset_state"]))
        for x, y in (windows if epoch == 0 else windows[:1]):
            _, loss, pred = sess.run([op(names["train_op"]), t(names["loss"]), t(names["predictions"])],
                                     {t(names["x"]): x, t(names["y"]): y})
            log += [("loss", loss), ("predictions", pred)]
    return log
