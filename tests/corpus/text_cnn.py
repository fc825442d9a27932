"""A CNN for sentence classification in the style of the widely read TensorFlow text-CNN
post: an embedding on the CPU, parallel convolution + max-pool branches of several filter
widths, dropout fed through ``dropout_keep_prob``, an L2 penalty on the output layer added to
the mean loss, Adam with ``compute_gradients``/``apply_gradients`` and the global step,
gradient histograms and sparsity summaries, and a dev step fed ``keep_prob=1.0``."""

import numpy as np
import tensorflow as tf

v1 = tf.compat.v1

FAMILY = "text CNN"
DESCRIPTION = ("cnn-text-classification style: `input_x` [None, 7] ids, one-hot `input_y`, "
               "`dropout_keep_prob` placeholder, embedding `W` under `/cpu:0`, conv+relu+"
               "max-pool branches for widths 2 and 3, concat, `v1.nn.dropout`, "
               "`xw_plus_b`, `reduce_mean(softmax xent) + l2_reg_lambda * l2_loss`, accuracy, "
               "Adam via compute/apply_gradients with the global step, per-gradient histogram "
               "and `zero_fraction` summaries (the embedding's gradient is IndexedSlices)")
DRIVER = ("train step: feed x, y, `dropout_keep_prob`, fetch [train_op, global_step, "
          "train_summary_op, loss, accuracy]; a dev step after the last one: keep 1.0, fetch "
          "[global_step, dev_summary_op, loss, accuracy]")
BATCHES = [6, 7]

SEQ_LEN, CLASSES, VOCAB, EMBED, FILTER_SIZES, NUM_FILTERS, L2_REG_LAMBDA = 7, 2, 30, 8, (2, 3), 4, 0.1

VARIANTS = {
    "keep0.5": {"drive": {"keep_prob": 0.5},
                "expect": {"exact": True, "why": "the seeded dropout mask is drawn at the global "
                           "batch's shape in every tower, each keeping its rows"}},
    "keep1.0": {"drive": {"keep_prob": 1.0},
                "expect": {"exact": True, "why": "the same graph fed keep_prob 1.0"}},
    "no_dropout": {"build": {"dropout": False}, "drive": {"keep_prob": 1.0},
                   "expect": {"exact": True, "why": "mean loss plus a batch-independent L2 term"}},
    "accumulate": {"drive": {"keep_prob": 0.5}, "options": {"accumulate": 2},
                   "expect": {"exact": True, "why": "two micro-batches per device, each drawing its "
                              "rows of the global mask"}},
}


class TextCNN(object):
    def __init__(self, sequence_length, num_classes, vocab_size, embedding_size, filter_sizes,
                 num_filters, l2_reg_lambda=0.0, dropout=True):
        self.input_x = v1.placeholder(tf.int32, [None, sequence_length], name="input_x")
        self.input_y = v1.placeholder(tf.float32, [None, num_classes], name="input_y")
        self.dropout_keep_prob = v1.placeholder(tf.float32, name="dropout_keep_prob")
        l2_loss = tf.constant(0.0)

        with tf.device("/cpu:0"), tf.name_scope("embedding"):
            self.W = tf.Variable(v1.random_uniform([vocab_size, embedding_size], -1.0, 1.0), name="W")
            self.embedded_chars = tf.nn.embedding_lookup(self.W, self.input_x)
            self.embedded_chars_expanded = tf.expand_dims(self.embedded_chars, -1)

        pooled_outputs = []
        for i, filter_size in enumerate(filter_sizes):
            with tf.name_scope("conv-maxpool-%s" % filter_size):
                filter_shape = [filter_size, embedding_size, 1, num_filters]
                W = tf.Variable(v1.truncated_normal(filter_shape, stddev=0.1), name="W")
                b = tf.Variable(tf.constant(0.1, shape=[num_filters]), name="b")
                conv = tf.nn.conv2d(self.embedded_chars_expanded, W, strides=[1, 1, 1, 1],
                                    padding="VALID", name="conv")
                h = tf.nn.relu(tf.nn.bias_add(conv, b), name="relu")
                pooled = tf.nn.max_pool(h, ksize=[1, sequence_length - filter_size + 1, 1, 1],
                                        strides=[1, 1, 1, 1], padding="VALID", name="pool")
                pooled_outputs.append(pooled)

        num_filters_total = num_filters * len(filter_sizes)
        self.h_pool = tf.concat(pooled_outputs, 3)
        self.h_pool_flat = tf.reshape(self.h_pool, [-1, num_filters_total])
        with tf.name_scope("dropout"):
            if dropout:
                self.h_drop = v1.nn.dropout(self.h_pool_flat, self.dropout_keep_prob)
            else:
                self.h_drop = self.h_pool_flat
        with tf.name_scope("output"):
            W = v1.get_variable("W", shape=[num_filters_total, num_classes],
                                initializer=v1.glorot_uniform_initializer())
            b = tf.Variable(tf.constant(0.1, shape=[num_classes]), name="b")
            l2_loss += tf.nn.l2_loss(W)
            l2_loss += tf.nn.l2_loss(b)
            self.scores = v1.nn.xw_plus_b(self.h_drop, W, b, name="scores")
            self.predictions = tf.argmax(self.scores, 1, name="predictions")
        with tf.name_scope("loss"):
            losses = tf.nn.softmax_cross_entropy_with_logits(logits=self.scores, labels=self.input_y)
            self.loss = tf.reduce_mean(losses) + l2_reg_lambda * l2_loss
        with tf.name_scope("accuracy"):
            correct_predictions = tf.equal(self.predictions, tf.argmax(self.input_y, 1))
            self.accuracy = tf.reduce_mean(tf.cast(correct_predictions, "float"), name="accuracy")


def build(batch_size, dropout=True):
    cnn = TextCNN(SEQ_LEN, CLASSES, VOCAB, EMBED, FILTER_SIZES, NUM_FILTERS, L2_REG_LAMBDA, dropout)
    global_step = tf.Variable(0, name="global_step", trainable=False)
    optimizer = v1.train.AdamOptimizer(1e-2)
    grads_and_vars = optimizer.compute_gradients(cnn.loss)
    train_op = optimizer.apply_gradients(grads_and_vars, global_step=global_step)
    grad_summaries = []
    for g, v in grads_and_vars:
        if g is not None:
            grad_hist_summary = v1.summary.histogram("{}/grad/hist".format(v.name.replace(":", "_")), g)
            sparsity_summary = v1.summary.scalar("{}/grad/sparsity".format(v.name.replace(":", "_")),
                                                 tf.nn.zero_fraction(g))
            grad_summaries.append(grad_hist_summary)
            grad_summaries.append(sparsity_summary)
    grad_summaries_merged = v1.summary.merge(grad_summaries)
    loss_summary = v1.summary.scalar("loss", cnn.loss)
    acc_summary = v1.summary.scalar("accuracy", cnn.accuracy)
    train_summary_op = v1.summary.merge([loss_summary, acc_summary, grad_summaries_merged])
    dev_summary_op = v1.summary.merge([loss_summary, acc_summary])
    saver = v1.train.Saver(v1.global_variables(), max_to_keep=5)
    init = v1.global_variables_initializer()
    return {"input_x": cnn.input_x.name, "input_y": cnn.input_y.name,
            "dropout_keep_prob": cnn.dropout_keep_prob.name, "train_op": train_op.name,
            "global_step": global_step.name, "train_summary_op": train_summary_op.name,
            "dev_summary_op": dev_summary_op.name, "loss": cnn.loss.name,
            "accuracy": cnn.accuracy.name, "init": [init.name], "saver": saver}


def make_data(rng, batch_size, steps=3):
    out = []
    for _ in range(steps + 1):
        labels = rng.randint(0, CLASSES, batch_size)
        x = rng.randint(1, VOCAB, (batch_size, SEQ_LEN))
        x[labels == 1, rng.randint(SEQ_LEN)] = 1          # a "positive" word
        out.append((x.astype(np.int32), np.eye(CLASSES, dtype=np.float32)[labels]))
    return out


def drive(sess, graph, names, data, workdir, keep_prob=0.5):
    t = graph.get_tensor_by_name
    train_op = graph.get_operation_by_name(names["train_op"])
    input_x, input_y, keep = t(names["input_x"]), t(names["input_y"]), t(names["dropout_keep_prob"])
    log = []

    def train_step(x_batch, y_batch):
        feed_dict = {input_x: x_batch, input_y: y_batch, keep: keep_prob}
        _, step, summaries, loss, accuracy = sess.run(
            [train_op, t(names["global_step"]), t(names["train_summary_op"]), t(names["loss"]),
             t(names["accuracy"])], feed_dict)
        log.extend([("step", step), ("train_summary", summaries), ("loss", loss), ("accuracy", accuracy)])

    def dev_step(x_batch, y_batch):
        feed_dict = {input_x: x_batch, input_y: y_batch, keep: 1.0}
        step, summaries, loss, accuracy = sess.run(
            [t(names["global_step"]), t(names["dev_summary_op"]), t(names["loss"]),
             t(names["accuracy"])], feed_dict)
        log.extend([("dev_step", step), ("dev_summary", summaries), ("dev_loss", loss),
                    ("dev_accuracy", accuracy)])

    for x_batch, y_batch in data[:-1]:
        train_step(x_batch, y_batch)
    dev_step(*data[-1])
    return log
