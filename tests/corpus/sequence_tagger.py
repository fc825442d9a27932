"""A bi-LSTM sequence tagger in the style of 2017 NER/POS tutorials: word ids padded to the
batch's longest sentence, sequence lengths, a ``batch_size`` placeholder for the cells' zero
states, a learning-rate placeholder decayed by the driver, and a token-level loss: the mean
over ``tf.boolean_mask(losses, mask)`` (or ``tf.compat.v1.losses`` with mask weights)."""

import numpy as np
import tensorflow as tf

v1 = tf.compat.v1
rnn = v1.nn.rnn_cell

FAMILY = "sequence tagger (batch_size placeholder, v1.losses weights)"
DESCRIPTION = ("sequence-tagging style: `word_ids` [None, None], `sequence_lengths` [None], "
               "`labels` [None, None], scalar placeholders `batch_size` (fed len(batch), used in "
               "`cell.zero_state(batch_size)`) and `lr`; embedding, `bidirectional_dynamic_rnn` "
               "with lengths, dense projection; loss `reduce_mean(boolean_mask(xent, "
               "sequence_mask(lengths)))`, or `v1.losses.sparse_softmax_cross_entropy(weights="
               "mask)`; Adam(lr); `labels_pred = argmax` fetched for evaluation")
DRIVER = ("per batch feed word_ids, lengths, labels, `batch_size=len(batch)` and `lr`, fetch "
          "[train_op, loss, merged]; `lr *= lr_decay` after each epoch; an evaluation pass "
          "fetches `labels_pred`")
BATCHES = [6, 7]

VOCAB, TAGS, EMBED, HIDDEN, LR, LR_DECAY = 20, 4, 8, 8, 0.01, 0.9

#: Adam divides each gradient by its running RMS: the LSTM's near-zero bias gradients turn
#: float32 rounding (1.3e-6 with SGD on the same batches) into 1e-5 to 3e-5 after the driver's
#: steps. The SGD variant is judged at the default 1e-5.
ADAM_ROUNDING = 5e-5

VARIANTS = {
    "boolean_mask": {"expect": {"exact": True, "rtol": ADAM_ROUNDING,
                                "why": "a mean over the unmasked tokens: each "
                                "tower weighs by its token count; `batch_size` must be the "
                                "tower's count"}},
    "losses_weights": {"build": {"loss": "v1_losses"},
                       "expect": {"exact": True, "rtol": ADAM_ROUNDING, "why": "SUM_BY_NONZERO_WEIGHTS with "
                                  "sequence-mask weights"}},
    "sgd": {"build": {"optimizer": "sgd"},
            "expect": {"exact": True, "why": "the boolean-mask mean with plain SGD: a weighting "
                       "error shows in every parameter"}},
}


def build(batch_size, loss="boolean_mask", optimizer="adam"):
    word_ids = v1.placeholder(tf.int32, shape=[None, None], name="word_ids")
    sequence_lengths = v1.placeholder(tf.int32, shape=[None], name="sequence_lengths")
    labels = v1.placeholder(tf.int32, shape=[None, None], name="labels")
    batch_size_t = v1.placeholder(tf.int32, shape=[], name="batch_size")
    lr = v1.placeholder(dtype=tf.float32, shape=[], name="lr")
    with v1.variable_scope("words"):
        _word_embeddings = v1.get_variable(name="_word_embeddings", dtype=tf.float32,
                                           shape=[VOCAB, EMBED])
        word_embeddings = tf.nn.embedding_lookup(_word_embeddings, word_ids, name="word_embeddings")
    with v1.variable_scope("bi-lstm"):
        cell_fw = rnn.LSTMCell(HIDDEN)
        cell_bw = rnn.LSTMCell(HIDDEN)
        init_fw = cell_fw.zero_state(batch_size_t, tf.float32)
        init_bw = cell_bw.zero_state(batch_size_t, tf.float32)
        (output_fw, output_bw), _ = v1.nn.bidirectional_dynamic_rnn(
            cell_fw, cell_bw, word_embeddings, sequence_length=sequence_lengths,
            initial_state_fw=init_fw, initial_state_bw=init_bw, dtype=tf.float32)
        output = tf.concat([output_fw, output_bw], axis=-1)
    with v1.variable_scope("proj"):
        W = v1.get_variable("W", dtype=tf.float32, shape=[2 * HIDDEN, TAGS])
        b = v1.get_variable("b", shape=[TAGS], dtype=tf.float32, initializer=v1.zeros_initializer())
        nsteps = tf.shape(output)[1]
        output = tf.reshape(output, [-1, 2 * HIDDEN])
        pred = tf.matmul(output, W) + b
        logits = tf.reshape(pred, [-1, nsteps, TAGS])
    labels_pred = tf.cast(tf.argmax(logits, axis=-1), tf.int32, name="labels_pred")
    mask = tf.sequence_mask(sequence_lengths)
    if loss == "boolean_mask":
        losses = tf.nn.sparse_softmax_cross_entropy_with_logits(logits=logits, labels=labels)
        losses = tf.boolean_mask(losses, mask)
        loss_t = tf.reduce_mean(losses, name="loss")
    else:
        loss_t = v1.losses.sparse_softmax_cross_entropy(labels, logits,
                                                         weights=tf.cast(mask, tf.float32))
        loss_t = tf.identity(loss_t, name="loss")
    v1.summary.scalar("loss", loss_t)
    with v1.variable_scope("train_step"):
        opt = v1.train.AdamOptimizer(lr) if optimizer == "adam" else \
            v1.train.GradientDescentOptimizer(lr * 50)
        train_op = opt.minimize(loss_t)
    merged = v1.summary.merge_all()
    init = v1.global_variables_initializer()
    saver = v1.train.Saver()
    return {"word_ids": word_ids.name, "sequence_lengths": sequence_lengths.name,
            "labels": labels.name, "batch_size": batch_size_t.name, "lr": lr.name,
            "train_op": train_op.name, "loss": loss_t.name, "merged": merged.name,
            "labels_pred": labels_pred.name, "init": [init.name], "saver": saver}


def make_data(rng, batch_size, epochs=2, batches=2):
    def batch():
        lengths = rng.randint(2, 7, batch_size)
        width = lengths.max()
        words = np.zeros((batch_size, width), np.int32)
        tags = np.zeros((batch_size, width), np.int32)
        for i, n in enumerate(lengths):
            words[i, :n] = rng.randint(1, VOCAB, n)
            tags[i, :n] = words[i, :n] % TAGS
        return words, lengths.astype(np.int32), tags
    return {"epochs": epochs, "train": [batch() for _ in range(batches)], "dev": batch()}


def drive(sess, graph, names, data, workdir):
    t = graph.get_tensor_by_name

    def get_feed_dict(words, lengths, tags=None, lr=None):
        fd = {t(names["word_ids"]): words, t(names["sequence_lengths"]): lengths,
              t(names["batch_size"]): len(words)}
        if tags is not None:
            fd[t(names["labels"])] = tags
        if lr is not None:
            fd[t(names["lr"])] = lr
        return fd

    lr = LR
    log = []
    train_op = graph.get_operation_by_name(names["train_op"])
    for epoch in range(data["epochs"]):
        batches = data["train"] if epoch == 0 else data["train"][:1]
        for words, lengths, tags in batches:
            fd = get_feed_dict(words, lengths, tags, lr)
            _, train_loss, summary = sess.run([train_op, t(names["loss"]), t(names["merged"])],
                                              feed_dict=fd)
            log += [("train_loss", train_loss), ("summary", summary)]
        lr *= LR_DECAY
        words, lengths, tags = data["dev"]
        labels_pred = sess.run(t(names["labels_pred"]), feed_dict=get_feed_dict(words, lengths))
        accs = [a == b for lab, lab_pred, n in zip(tags, labels_pred, lengths)
                for a, b in zip(lab[:n], lab_pred[:n])]
        log += [("labels_pred", labels_pred), ("acc", np.mean(accs))]
    return log
