"""A word-level LSTM language model in the style of the PTB tutorial: static batch and steps,
a Python-unrolled 2-layer LSTM from ``cell.zero_state(batch_size)``, per-example sequence
loss with ``tf.ones([batch_size * num_steps])`` weights, ``cost = reduce_sum(loss) /
batch_size``, clipped gradients, a non-trainable learning rate assigned between epochs, and
validation/test models sharing the variables (the test one with batch 1 and 1 step)."""

import numpy as np
import tensorflow as tf

v1 = tf.compat.v1
rnn = v1.nn.rnn_cell

FAMILY = "word-level LSTM LM"
DESCRIPTION = ("PTB-tutorial style: placeholders [batch_size, num_steps] (static), 2-layer "
               "BasicLSTMCell unrolled in Python from `cell.zero_state(batch_size)`, "
               "`sequence_loss_by_example` with `tf.ones([batch_size*num_steps])` weights, "
               "`cost = reduce_sum(loss)/batch_size` (variant: the later `sequence_loss` with "
               "`tf.ones([batch_size, num_steps])`, `cost = reduce_sum(loss)`), `clip_by_global_norm(v1.gradients(cost, "
               "tvars))`, SGD on a non-trainable `lr` variable, Valid (same batch) and Test "
               "(batch 1, 1 step) models reusing the variables")
DRIVER = ("per epoch: `sess.run(lr_update, {new_lr: ...})`, `state = sess.run(initial_state)`, "
          "then per step feed x, y and every (c, h) of the previous final state, fetch "
          "{cost, final_state, train_op}; a validation pass the same way without the train op")
BATCHES = [6, 7]

VOCAB, HIDDEN, LAYERS, NUM_STEPS = 16, 12, 2, 4
INIT_SCALE, MAX_GRAD_NORM, LEARNING_RATE, LR_DECAY, MAX_EPOCH = 0.1, 5.0, 1.0, 0.5, 1

VARIANTS = {
    "keep1": {"build": {"keep_prob": 1.0},
              "expect": {"exact": True, "why": "the zero state, the fed state and the static "
                         "batch constants are all batch-shaped and can be split per tower; "
                         "`reduce_sum/batch_size` is a mean"}},
    "seq2seq_loss": {"build": {"keep_prob": 1.0, "loss": "sequence_loss"},
                     "expect": {"exact": True, "why": "the later tutorial's loss: "
                                "`sequence_loss(logits, targets, tf.ones([batch_size, num_steps]), "
                                "average_across_timesteps=False, average_across_batch=True)` "
                                "summed over time is a mean over the batch per step"}},
    "dropout": {"build": {"keep_prob": 0.5},
                "expect": {"exact": "either", "reasons_only": ["random"],
                           "why": "a mask of a static shape (the static batch) is drawn once for "
                           "the whole batch by the single-device op and seed, each tower taking "
                           "its rows: exact; a mask shaped by a tower's slice is drawn per tower "
                           "and must be reported"}},
}


def sequence_loss(logits, targets, weights, average_across_timesteps=True,
                  average_across_batch=True):
    """contrib.seq2seq.sequence_loss, written out (contrib is gone)."""
    num_classes = tf.shape(logits)[2]
    logits_flat = tf.reshape(logits, [-1, num_classes])
    crossent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=tf.reshape(targets, [-1]),
                                                              logits=logits_flat)
    crossent *= tf.reshape(weights, [-1])
    if average_across_timesteps and average_across_batch:
        return tf.reduce_sum(crossent) / (tf.reduce_sum(weights) + 1e-12)
    batch_size, sequence_length = tf.shape(logits)[0], tf.shape(logits)[1]
    crossent = tf.reshape(crossent, [batch_size, sequence_length])
    if average_across_timesteps and not average_across_batch:
        return tf.reduce_sum(crossent, axis=[1]) / (tf.reduce_sum(weights, axis=[1]) + 1e-12)
    if not average_across_timesteps and average_across_batch:
        return tf.reduce_sum(crossent, axis=[0]) / (tf.reduce_sum(weights, axis=[0]) + 1e-12)
    return crossent


def sequence_loss_by_example(logits, targets, weights):
    """legacy_seq2seq.sequence_loss_by_example, written out (contrib is gone)."""
    log_perp_list = []
    for logit, target, weight in zip(logits, targets, weights):
        crossent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=target, logits=logit)
        log_perp_list.append(crossent * weight)
    log_perps = tf.add_n(log_perp_list)
    total_size = tf.add_n(weights) + 1e-12
    return log_perps / total_size


class PTBModel:
    def __init__(self, is_training, batch_size, num_steps, keep_prob, loss_fn="by_example"):
        self.batch_size, self.num_steps = batch_size, num_steps
        self._input_data = v1.placeholder(tf.int32, [batch_size, num_steps], name="input_data")
        self._targets = v1.placeholder(tf.int32, [batch_size, num_steps], name="targets")

        def lstm_cell():
            return rnn.BasicLSTMCell(HIDDEN, forget_bias=0.0, state_is_tuple=True,
                                     reuse=v1.get_variable_scope().reuse)
        attn_cell = lstm_cell
        if is_training and keep_prob < 1:
            def attn_cell():
                return rnn.DropoutWrapper(lstm_cell(), output_keep_prob=keep_prob)
        cell = rnn.MultiRNNCell([attn_cell() for _ in range(LAYERS)], state_is_tuple=True)
        self._initial_state = cell.zero_state(batch_size, tf.float32)

        with tf.device("/cpu:0"):
            embedding = v1.get_variable("embedding", [VOCAB, HIDDEN], dtype=tf.float32)
            inputs = tf.nn.embedding_lookup(embedding, self._input_data)
        if is_training and keep_prob < 1:
            inputs = v1.nn.dropout(inputs, keep_prob)

        outputs = []
        state = self._initial_state
        with v1.variable_scope("RNN"):
            for time_step in range(num_steps):
                if time_step > 0:
                    v1.get_variable_scope().reuse_variables()
                (cell_output, state) = cell(inputs[:, time_step, :], state)
                outputs.append(cell_output)
        output = tf.reshape(tf.concat(outputs, 1), [-1, HIDDEN])
        softmax_w = v1.get_variable("softmax_w", [HIDDEN, VOCAB], dtype=tf.float32)
        softmax_b = v1.get_variable("softmax_b", [VOCAB], dtype=tf.float32)
        logits = tf.matmul(output, softmax_w) + softmax_b
        if loss_fn == "by_example":
            loss = sequence_loss_by_example([logits], [tf.reshape(self._targets, [-1])],
                                            [tf.ones([batch_size * num_steps], dtype=tf.float32)])
            self._cost = cost = tf.reduce_sum(loss) / batch_size
        else:
            logits = tf.reshape(logits, [batch_size, num_steps, VOCAB])
            loss = sequence_loss(logits, self._targets, tf.ones([batch_size, num_steps], dtype=tf.float32),
                                 average_across_timesteps=False, average_across_batch=True)
            self._cost = cost = tf.reduce_sum(loss)
        self._final_state = state
        if not is_training:
            return
        self._lr = tf.Variable(0.0, trainable=False)
        tvars = v1.trainable_variables()
        grads, _ = tf.clip_by_global_norm(v1.gradients(cost, tvars), MAX_GRAD_NORM)
        optimizer = v1.train.GradientDescentOptimizer(self._lr)
        self._train_op = optimizer.apply_gradients(
            zip(grads, tvars), global_step=v1.train.get_or_create_global_step())
        self._new_lr = v1.placeholder(tf.float32, shape=[], name="new_learning_rate")
        self._lr_update = v1.assign(self._lr, self._new_lr)

    def names(self):
        out = {"input_data": self._input_data.name, "targets": self._targets.name,
               "cost": self._cost.name,
               "initial_state": [(s.c.name, s.h.name) for s in self._initial_state],
               "final_state": [(s.c.name, s.h.name) for s in self._final_state]}
        if hasattr(self, "_train_op"):
            out.update(train_op=self._train_op.name, lr=self._lr.name, new_lr=self._new_lr.name,
                       lr_update=self._lr_update.name)
        return out


def build(batch_size, keep_prob=1.0, loss="by_example"):
    initializer = v1.random_uniform_initializer(-INIT_SCALE, INIT_SCALE)
    with tf.name_scope("Train"):
        with v1.variable_scope("Model", reuse=None, initializer=initializer):
            m = PTBModel(True, batch_size, NUM_STEPS, keep_prob, loss)
        v1.summary.scalar("Training Loss", m._cost)
        v1.summary.scalar("Learning Rate", m._lr)
    with tf.name_scope("Valid"):
        with v1.variable_scope("Model", reuse=True, initializer=initializer):
            mvalid = PTBModel(False, batch_size, NUM_STEPS, keep_prob, loss)
        v1.summary.scalar("Validation Loss", mvalid._cost)
    with tf.name_scope("Test"):
        with v1.variable_scope("Model", reuse=True, initializer=initializer):
            mtest = PTBModel(False, 1, 1, keep_prob, loss)
    saver = v1.train.Saver()
    init = v1.global_variables_initializer()
    return {"train": m.names(), "valid": mvalid.names(), "test": mtest.names(),
            "init": [init.name], "saver": saver}


def make_data(rng, batch_size, epochs=(2, 1)):
    """A token stream cut into [batch_size, -1] rows, as the PTB reader does; a Markov chain
    so that there is something to learn."""
    steps = sum(epochs)
    length = NUM_STEPS * max(epochs) + 1
    trans = rng.dirichlet(np.ones(VOCAB) * 0.3, VOCAB)
    rows = np.zeros((batch_size, length), np.int32)
    for b in range(batch_size):
        w = rng.randint(VOCAB)
        for i in range(length):
            rows[b, i] = w
            w = rng.choice(VOCAB, p=trans[w])
    valid = rng.randint(0, VOCAB, (batch_size, NUM_STEPS + 1)).astype(np.int32)
    return {"epochs": epochs, "train": rows, "valid": valid, "steps": steps}


def run_epoch(sess, graph, model, rows, epoch_size, eval_op=None):
    t = graph.get_tensor_by_name
    costs, iters = 0.0, 0
    state = sess.run([(t(c), t(h)) for c, h in model["initial_state"]])
    fetches = {"cost": t(model["cost"]),
               "final_state": [(t(c), t(h)) for c, h in model["final_state"]]}
    if eval_op is not None:
        fetches["eval_op"] = graph.get_operation_by_name(eval_op)
    log = []
    for step in range(epoch_size):
        x = rows[:, step * NUM_STEPS:(step + 1) * NUM_STEPS]
        y = rows[:, step * NUM_STEPS + 1:(step + 1) * NUM_STEPS + 1]
        feed_dict = {t(model["input_data"]): x, t(model["targets"]): y}
        for i, (c, h) in enumerate(model["initial_state"]):
            feed_dict[t(c)] = state[i][0]
            feed_dict[t(h)] = state[i][1]
        vals = sess.run(fetches, feed_dict)
        cost = vals["cost"]
        state = vals["final_state"]
        costs += cost
        iters += NUM_STEPS
        log.append(("cost", cost))
        for i, (c, h) in enumerate(state):
            log.append((f"final_state/{i}/c", c))
            log.append((f"final_state/{i}/h", h))
    log.append(("perplexity", np.exp(costs / iters)))
    return log


def drive(sess, graph, names, data, workdir):
    m, mvalid = names["train"], names["valid"]
    log = []
    for i, epoch_size in enumerate(data["epochs"]):
        lr_decay = LR_DECAY ** max(i + 1 - MAX_EPOCH, 0.0)
        sess.run(graph.get_operation_by_name(m["lr_update"].split(":")[0]),
                 feed_dict={graph.get_tensor_by_name(m["new_lr"]): LEARNING_RATE * lr_decay})
        log += run_epoch(sess, graph, m, data["train"], epoch_size, eval_op=m["train_op"])
        log += run_epoch(sess, graph, mvalid, data["valid"], 1)
    return log
