"""A character-level RNN in the style of the popular char-rnn TensorFlow port: static batch
and sequence length, a MultiRNNCell (optionally wrapped for dropout) run by ``static_rnn``
over split inputs, a loss normalised by ``batch_size`` and ``seq_length``, clipped gradients
for Adam on a non-trainable ``lr`` variable that the driver assigns with ``tf.assign`` each
epoch, and merged summaries fetched every step."""

import os

import numpy as np
import tensorflow as tf

v1 = tf.compat.v1
rnn = v1.nn.rnn_cell

FAMILY = "character-level RNN"
DESCRIPTION = ("char-rnn style: placeholders [batch_size, seq_length] (static), 2-layer LSTM "
               "(or GRU) `MultiRNNCell`, `static_rnn` over `tf.split` inputs from "
               "`cell.zero_state(batch_size)`, `cost = reduce_sum(loss)/batch_size/seq_length`, "
               "Adam on a non-trainable `lr` variable with clipped gradients, histogram and "
               "scalar summaries")
DRIVER = ("per epoch `sess.run(tf.assign(lr, ...))` (built in the driver), `state = "
          "sess.run(initial_state)`, per batch feed x, y and the state, fetch "
          "[summaries, cost, final_state, train_op]; `tf.train.Saver(global_variables())` "
          "built after import saves a checkpoint at the end")
BATCHES = [6, 7]

VOCAB, RNN_SIZE, LAYERS, SEQ_LENGTH = 10, 16, 2, 5
GRAD_CLIP, LEARNING_RATE, DECAY_RATE = 5.0, 0.01, 0.97

VARIANTS = {
    "lstm": {"expect": {"exact": True, "why": "zero state and fed state split per tower; the "
                        "loss is a mean over the static batch"}},
    "gru": {"build": {"model": "gru"}, "drive": {"model": "gru"},
            "expect": {"exact": True, "why": "as lstm; the state is one tensor per layer"}},
    "dropout": {"build": {"output_keep_prob": 0.8, "input_keep_prob": 0.9},
                "expect": {"exact": "either", "reasons_only": ["random"],
                           "why": "a mask of a static shape (the static batch) is drawn once for "
                           "the whole batch by the single-device op and seed, each tower taking "
                           "its rows: exact; a mask shaped by a tower's slice is drawn per tower "
                           "and must be reported"}},
}


class Model:
    def __init__(self, batch_size, model="lstm", training=True, input_keep_prob=1.0,
                 output_keep_prob=1.0):
        if model == "rnn":
            cell_fn = rnn.BasicRNNCell
        elif model == "gru":
            cell_fn = rnn.GRUCell
        elif model == "lstm":
            cell_fn = rnn.BasicLSTMCell
        else:
            raise Exception("model type not supported: {}".format(model))
        cells = []
        for _ in range(LAYERS):
            cell = cell_fn(RNN_SIZE)
            if training and (output_keep_prob < 1.0 or input_keep_prob < 1.0):
                cell = rnn.DropoutWrapper(cell, input_keep_prob=input_keep_prob,
                                          output_keep_prob=output_keep_prob)
            cells.append(cell)
        self.cell = cell = rnn.MultiRNNCell(cells, state_is_tuple=True)

        self.input_data = v1.placeholder(tf.int32, [batch_size, SEQ_LENGTH])
        self.targets = v1.placeholder(tf.int32, [batch_size, SEQ_LENGTH])
        self.initial_state = cell.zero_state(batch_size, tf.float32)

        with v1.variable_scope("rnnlm"):
            softmax_w = v1.get_variable("softmax_w", [RNN_SIZE, VOCAB])
            softmax_b = v1.get_variable("softmax_b", [VOCAB])
        embedding = v1.get_variable("embedding", [VOCAB, RNN_SIZE])
        inputs = tf.nn.embedding_lookup(embedding, self.input_data)
        if training and output_keep_prob < 1.0:
            inputs = v1.nn.dropout(inputs, output_keep_prob)
        inputs = tf.split(inputs, SEQ_LENGTH, 1)
        inputs = [tf.squeeze(input_, [1]) for input_ in inputs]
        outputs, last_state = v1.nn.static_rnn(cell, inputs, initial_state=self.initial_state,
                                               scope="rnnlm")
        output = tf.reshape(tf.concat(outputs, 1), [-1, RNN_SIZE])
        self.logits = tf.matmul(output, softmax_w) + softmax_b
        self.probs = tf.nn.softmax(self.logits)
        crossent = tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=tf.reshape(self.targets, [-1]), logits=self.logits)
        weights = tf.ones([batch_size * SEQ_LENGTH])
        loss = crossent * weights / (weights + 1e-12)      # sequence_loss_by_example, one step
        with tf.name_scope("cost"):
            self.cost = tf.reduce_sum(loss) / batch_size / SEQ_LENGTH
        self.final_state = last_state
        self.lr = tf.Variable(0.0, trainable=False, name="lr")
        tvars = v1.trainable_variables()
        grads, _ = tf.clip_by_global_norm(v1.gradients(self.cost, tvars), GRAD_CLIP)
        with tf.name_scope("optimizer"):
            optimizer = v1.train.AdamOptimizer(self.lr)
        self.train_op = optimizer.apply_gradients(zip(grads, tvars))
        v1.summary.histogram("logits", self.logits)
        v1.summary.histogram("loss", loss)
        v1.summary.scalar("train_loss", self.cost)


def _state_names(state):
    out = []
    for s in state:
        out.append([t.name for t in s] if isinstance(s, tuple) else [s.name])
    return out


def build(batch_size, model="lstm", input_keep_prob=1.0, output_keep_prob=1.0):
    m = Model(batch_size, model, True, input_keep_prob, output_keep_prob)
    summaries = v1.summary.merge_all()
    init = v1.global_variables_initializer()
    saver = v1.train.Saver(v1.global_variables())
    return {"input_data": m.input_data.name, "targets": m.targets.name, "cost": m.cost.name,
            "train_op": m.train_op.name, "summaries": summaries.name,
            "initial_state": _state_names(m.initial_state),
            "final_state": _state_names(m.final_state), "lr": m.lr.op.name,
            "init": [init.name], "saver": saver}


def make_data(rng, batch_size, epochs=2, batches=2):
    """Batches of a character stream (a noisy repeated phrase), cut as the text loader does."""
    phrase = np.array([1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 3, 5], np.int32)
    n = batch_size * SEQ_LENGTH * batches
    stream = np.resize(phrase, n + 1)
    noise = rng.rand(n + 1) < 0.2
    stream[noise] = rng.randint(0, VOCAB, noise.sum())
    xdata, ydata = stream[:-1], np.copy(stream[1:])
    x_batches = np.split(xdata.reshape(batch_size, -1), batches, 1)
    y_batches = np.split(ydata.reshape(batch_size, -1), batches, 1)
    # Two epochs over two batches would be four steps; the last epoch has one batch.
    return {"epochs": epochs, "x": x_batches, "y": y_batches, "last_epoch_batches": 1}


def drive(sess, graph, names, data, workdir, model="lstm"):
    t = graph.get_tensor_by_name
    lr = next(v for v in v1.global_variables() if v.op.name == names["lr"])
    initial_state = [[t(n) for n in layer] for layer in names["initial_state"]]
    final_state = [[t(n) for n in layer] for layer in names["final_state"]]
    fetches = [t(names["summaries"]), t(names["cost"]), final_state,
               graph.get_operation_by_name(names["train_op"])]
    saver = v1.train.Saver(v1.global_variables())
    save_dir = os.path.join(workdir, "save")
    os.makedirs(save_dir, exist_ok=True)
    log = []
    for e in range(data["epochs"]):
        sess.run(v1.assign(lr, LEARNING_RATE * (DECAY_RATE ** e)))
        state = sess.run(initial_state)
        batches = len(data["x"]) if e + 1 < data["epochs"] else data["last_epoch_batches"]
        for b in range(batches):
            feed = {t(names["input_data"]): data["x"][b], t(names["targets"]): data["y"][b]}
            if model == "lstm":
                for i, (c, h) in enumerate(initial_state):
                    feed[c] = state[i][0]
                    feed[h] = state[i][1]
            else:
                for i, (s,) in enumerate(initial_state):
                    feed[s] = state[i][0]
            summ, train_loss, state, _ = sess.run(fetches, feed)
            log.append(("summaries", summ))
            log.append(("train_loss", train_loss))
            for i, layer in enumerate(state):
                for j, value in enumerate(layer):
                    log.append((f"state/{i}/{j}", value))
    saver.save(sess, os.path.join(save_dir, "model.ckpt"), global_step=e * 2 + b)
    return log
