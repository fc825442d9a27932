"""A recurrent network written by hand, in the style of the 2016-2017 "RNN from scratch" blog
tutorials: the batch made time-major with ``tf.transpose``, the recurrence a ``tf.while_loop``
over time steps reading ``inputs[t]`` and writing each step's state into a ``TensorArray``
(or, in the shorter version of the same tutorials, ``tf.scan`` over the time-major inputs),
an initial state fed by the driver and its final state fetched and fed back at the next
batch (truncated back-propagation through time), per-step logits from the stacked states,
a mean cross-entropy over batch and time, and ``tf.layers.dropout(training=is_training)`` on
each step's input inside the loop."""

import numpy as np
import tensorflow as tf

v1 = tf.compat.v1

FAMILY = "RNN written by hand (while_loop / scan)"
DESCRIPTION = ("`x` [None, 6] token ids made time-major, embedding, a tanh RNN cell written "
               "by hand: `tf.while_loop` over `t` reading `inputs[t]`, writing a `TensorArray` "
               "of states (or `tf.scan` over the time-major inputs); `init_state` a placeholder "
               "[None, 16], the final state fetched; per-step logits, mean sparse cross-entropy "
               "over batch and time, Adagrad; optional `tf.layers.dropout(training=is_training)` "
               "on each step's input inside the loop")
DRIVER = ("per batch `sess.run([losses, total_loss, final_state, train_step], {x, y, "
          "init_state: training_state})`, feeding back the final state (zeros at the start); "
          "an evaluation pass with `is_training=False`")
BATCHES = [6, 7]

VOCAB, EMBED, STATE, STEPS = 8, 10, 16, 6

VARIANTS = {
    "while_loop": {"expect": {"exact": True,
                              "why": "the loop reads `inputs[t]`, a slice of the time axis: each "
                              "tower's loop sees its own rows of every step, and the state fed "
                              "back is split with the batch"}},
    "while_dropout": {"build": {"dropout": True, "parallel": 1},
                      "expect": {"exact": True,
                                 "why": "the dropout under the training flag is an `If` inside the "
                                 "loop body: every tower's loop draws the global mask at each "
                                 "step with the original seed and keeps its rows"}},
    "scan": {"build": {"loop": "scan"},
             "expect": {"exact": True, "why": "`tf.scan` over the time axis: each step's "
                        "element holds the tower's rows"}},
    "scan_dropout": {"build": {"loop": "scan", "dropout": True},
                     "expect": {"exact": False, "reasons_only": ["iterations at once"],
                                "why": "`tf.scan` runs 10 iterations at once by default, so the "
                                "order of the draws depends on scheduling and one device does "
                                "not reproduce its own: reported, not reproduced"}},
}


def build(batch_size, loop="while", dropout=False, parallel=10):
    v1.set_random_seed(11)
    x = v1.placeholder(tf.int32, [None, STEPS], name="input_placeholder")
    y = v1.placeholder(tf.int32, [None, STEPS], name="labels_placeholder")
    init_state = v1.placeholder(tf.float32, [None, STATE], name="init_state")
    is_training = v1.placeholder_with_default(True, [], name="is_training")
    embeddings = v1.get_variable("embedding_matrix", [VOCAB, EMBED])
    rnn_inputs = tf.transpose(tf.nn.embedding_lookup(embeddings, x), [1, 0, 2])   # time-major

    with v1.variable_scope("rnn_cell"):
        W = v1.get_variable("W", [EMBED + STATE, STATE])
        b = v1.get_variable("b", [STATE], initializer=v1.constant_initializer(0.0))

    def rnn_cell(rnn_input, state):
        if dropout:
            rnn_input = v1.layers.dropout(rnn_input, rate=0.2, training=is_training, seed=5)
        with v1.variable_scope("rnn_cell", reuse=True):
            W = v1.get_variable("W", [EMBED + STATE, STATE])
            b = v1.get_variable("b", [STATE])
        return tf.tanh(tf.matmul(tf.concat([rnn_input, state], 1), W) + b)

    if loop == "scan":
        states = tf.scan(lambda state, inp: rnn_cell(inp, state), rnn_inputs,
                         initializer=init_state, parallel_iterations=parallel)
        final_state = states[-1]
    else:
        outputs = tf.TensorArray(tf.float32, size=STEPS)

        def body(t, state, outputs):
            state = rnn_cell(rnn_inputs[t], state)
            return t + 1, state, outputs.write(t, state)

        _, final_state, outputs = tf.while_loop(lambda t, *_: t < STEPS, body,
                                                [tf.constant(0), init_state, outputs],
                                                parallel_iterations=parallel)
        states = outputs.stack()
    final_state = tf.identity(final_state, name="final_state")

    with v1.variable_scope("softmax"):
        W = v1.get_variable("W", [STATE, VOCAB])
        b = v1.get_variable("b", [VOCAB], initializer=v1.constant_initializer(0.0))
    logits = tf.reshape(tf.matmul(tf.reshape(states, [-1, STATE]), W) + b, [STEPS, -1, VOCAB])
    predictions = tf.nn.softmax(logits, name="predictions")
    losses = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=tf.transpose(y), logits=logits,
                                                            name="losses")
    total_loss = tf.reduce_mean(losses, name="total_loss")
    train_step = v1.train.AdagradOptimizer(0.3).minimize(total_loss, name="train_step")
    saver = v1.train.Saver()
    return {"x": x.name, "y": y.name, "init_state": init_state.name,
            "is_training": is_training.name, "losses": losses.name,
            "total_loss": total_loss.name, "final_state": final_state.name,
            "predictions": predictions.name, "train_step": train_step.name,
            "init": [v1.global_variables_initializer().name], "saver": saver}


def make_data(rng, batch_size, steps=3):
    raw_x = rng.randint(0, VOCAB, size=(steps + 1, batch_size, STEPS))
    raw_y = np.roll(raw_x, -1, axis=2) ^ (raw_x % 2)     # the next token, echoed or flipped
    return {"batches": [(raw_x[i], raw_y[i] % VOCAB) for i in range(steps + 1)],
            "batch_size": batch_size}


def drive(sess, graph, names, data, workdir):
    t = graph.get_tensor_by_name
    x, y, init_state = t(names["x"]), t(names["y"]), t(names["init_state"])
    fetch = [t(names["losses"]), t(names["total_loss"]), t(names["final_state"]),
             graph.get_operation_by_name(names["train_step"])]
    log = []
    *train, test = data["batches"]
    training_state = np.zeros((data["batch_size"], STATE), np.float32)
    for X, Y in train:
        losses, total, training_state, _ = sess.run(
            fetch, feed_dict={x: X, y: Y, init_state: training_state})
        log += [("losses", losses), ("total_loss", total), ("state", training_state)]
    X, Y = test
    probs = sess.run(t(names["predictions"]), feed_dict={
        x: X, init_state: training_state, t(names["is_training"]): False})
    log.append(("predictions", probs))
    return log
