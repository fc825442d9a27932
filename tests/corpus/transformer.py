"""A Transformer in the style of the widely read TF1 ports of "Attention Is All You Need":
token and sinusoid position embeddings scaled by sqrt(d_model), multi-head attention with the
heads split by reshape and transpose (tensor2tensor's ``split_heads``), an additive attention
bias of -1e9 at padded keys and, in the decoder, future positions, a hand-written layer norm,
position-wise feed-forward layers, residual connections, dropout fed through a keep
probability, label smoothing, the token-weighted loss ``sum(ce * nonpadding) /
(sum(nonpadding) + 1e-7)``, the Noam learning-rate schedule on the global step and Adam with
``beta2=0.98``; the driver fetches the loss, accuracy over non-padding tokens and the
learning rate, then greedy-decodes the last batch one position at a time."""

import numpy as np
import tensorflow as tf

v1 = tf.compat.v1

FAMILY = "Transformer"
DESCRIPTION = ("Transformer-port style: `x` [None, 6] and `y` [None, 6] ids (0 pads), "
               "embeddings scaled by sqrt(d), sinusoid positions, multi-head attention (heads "
               "split by reshape/transpose) with key padding and causal biases, hand-written layer norm, feed-forward, residuals, "
               "dropout via `keep_prob`, label smoothing, `sum(ce * nonpadding) / "
               "(sum(nonpadding) + 1e-7)`, Noam warmup on the global step, Adam(beta2=0.98)")
DRIVER = ("train step: feed x, y, keep_prob 0.9, fetch [train_op, global_step, loss, acc, lr]; "
          "then greedy decoding of the last batch: 6 runs of `preds` with keep_prob 1.0, each "
          "feeding the decoded prefix")
BATCHES = [6, 7]

VOCAB, MAXLEN, D_MODEL, HEADS, D_FF, SMOOTHING, WARMUP = 16, 6, 16, 2, 32, 0.1, 4

VARIANTS = {
    "adam_noam": {"expect": {"exact": True, "why": "a token-weighted mean whose denominator "
                             "(the non-padding count plus 1e-7) is computed once over the batch; "
                             "dropout masks drawn at the global batch's shape"}},
    "sgd": {"build": {"optimizer": "sgd"},
            "expect": {"exact": True, "why": "the same with plain SGD, so a weighting error "
                       "cannot hide behind Adam's normalization"}},
}


def positional_encoding(maxlen, d_model):
    pos = np.arange(maxlen)[:, None]
    i = np.arange(d_model)[None, :]
    angle = pos / np.power(10000, (i - i % 2) / d_model)
    angle[:, 0::2] = np.sin(angle[:, 0::2])
    angle[:, 1::2] = np.cos(angle[:, 1::2])
    return tf.constant(angle, dtype=tf.float32)


def ln(inputs, epsilon=1e-8, scope="ln"):
    with v1.variable_scope(scope, reuse=v1.AUTO_REUSE):
        params_shape = inputs.get_shape()[-1:]
        mean, variance = tf.nn.moments(inputs, [-1], keepdims=True)
        beta = v1.get_variable("beta", params_shape, initializer=tf.zeros_initializer())
        gamma = v1.get_variable("gamma", params_shape, initializer=tf.ones_initializer())
        normalized = (inputs - mean) / ((variance + epsilon) ** .5)
        return gamma * normalized + beta


def split_heads(x):
    """[batch, length, d_model] -> [batch, heads, length, d_model / heads]."""
    length = tf.shape(x)[1]
    x = tf.reshape(x, [-1, length, HEADS, D_MODEL // HEADS])
    return tf.transpose(x, [0, 2, 1, 3])


def combine_heads(x):
    x = tf.transpose(x, [0, 2, 1, 3])
    return tf.reshape(x, [-1, tf.shape(x)[1], D_MODEL])


def attention_bias(key_padding, causality, length):
    """-1e9 where a key is padding (and, in the decoder, in the future): [batch or 1, 1, q, k]."""
    bias = tf.expand_dims(tf.expand_dims(v1.to_float(key_padding) * -1e9, 1), 1)
    if causality:
        tril = tf.linalg.LinearOperatorLowerTriangular(tf.ones([length, length])).to_dense()
        bias += tf.reshape((1.0 - tril) * -1e9, [1, 1, length, length])
    return bias


def scaled_dot_product_attention(Q, K, V, bias, keep_prob, scope):
    with v1.variable_scope(scope, reuse=v1.AUTO_REUSE):
        d_k = Q.get_shape().as_list()[-1]
        outputs = tf.matmul(Q, K, transpose_b=True) / d_k ** 0.5
        outputs = tf.nn.softmax(outputs + bias)
        outputs = v1.nn.dropout(outputs, keep_prob=keep_prob, seed=21)
        return tf.matmul(outputs, V)


def multihead_attention(queries, keys, values, key_padding, keep_prob, causality=False,
                        scope="multihead_attention"):
    with v1.variable_scope(scope, reuse=v1.AUTO_REUSE):
        Q = split_heads(v1.layers.dense(queries, D_MODEL, use_bias=False, name="q"))
        K = split_heads(v1.layers.dense(keys, D_MODEL, use_bias=False, name="k"))
        V = split_heads(v1.layers.dense(values, D_MODEL, use_bias=False, name="v"))
        bias = attention_bias(key_padding, causality, tf.shape(queries)[1])
        outputs = combine_heads(scaled_dot_product_attention(Q, K, V, bias, keep_prob, "sdpa"))
        outputs += queries
        return ln(outputs)


def ff(inputs, scope="positionwise_feedforward"):
    with v1.variable_scope(scope, reuse=v1.AUTO_REUSE):
        outputs = v1.layers.dense(inputs, D_FF, activation=tf.nn.relu, name="inner")
        outputs = v1.layers.dense(outputs, D_MODEL, name="outer")
        outputs += inputs
        return ln(outputs)


def label_smoothing(inputs, epsilon=SMOOTHING):
    V = inputs.get_shape().as_list()[-1]
    return ((1 - epsilon) * inputs) + (epsilon / V)


def noam_scheme(init_lr, global_step, warmup_steps=4000.):
    step = tf.cast(global_step + 1, dtype=tf.float32)
    return init_lr * warmup_steps ** 0.5 * tf.minimum(step * warmup_steps ** -1.5, step ** -0.5)


class Transformer(object):
    def __init__(self):
        with v1.variable_scope("shared_weight_matrix"):
            self.embeddings = v1.get_variable(
                "weight_mat", [VOCAB, D_MODEL], initializer=v1.glorot_uniform_initializer(seed=3))
        self.pos = positional_encoding(MAXLEN, D_MODEL)

    def encode(self, xs, keep_prob):
        with v1.variable_scope("encoder", reuse=v1.AUTO_REUSE):
            src_masks = tf.math.equal(xs, 0)
            enc = tf.nn.embedding_lookup(self.embeddings, xs) * D_MODEL ** 0.5
            enc += self.pos[:tf.shape(xs)[1]]
            enc = v1.nn.dropout(enc, keep_prob=keep_prob, seed=22)
            with v1.variable_scope("num_blocks_0", reuse=v1.AUTO_REUSE):
                enc = multihead_attention(enc, enc, enc, src_masks, keep_prob)
                enc = ff(enc)
        return enc, src_masks

    def decode(self, decoder_inputs, memory, src_masks, keep_prob):
        with v1.variable_scope("decoder", reuse=v1.AUTO_REUSE):
            tgt_masks = tf.math.equal(decoder_inputs, 0)
            dec = tf.nn.embedding_lookup(self.embeddings, decoder_inputs) * D_MODEL ** 0.5
            dec += self.pos[:tf.shape(decoder_inputs)[1]]
            dec = v1.nn.dropout(dec, keep_prob=keep_prob, seed=23)
            with v1.variable_scope("num_blocks_0", reuse=v1.AUTO_REUSE):
                dec = multihead_attention(dec, dec, dec, tgt_masks, keep_prob, causality=True,
                                          scope="self_attention")
                dec = multihead_attention(dec, memory, memory, src_masks, keep_prob,
                                          scope="vanilla_attention")
                dec = ff(dec)
        weights = tf.transpose(self.embeddings)
        logits = tf.einsum("ntd,dk->ntk", dec, weights)
        return logits, tf.cast(tf.argmax(logits, axis=-1), tf.int32)


def build(batch_size, optimizer="adam"):
    v1.set_random_seed(5)
    xs = v1.placeholder(tf.int32, [None, MAXLEN], name="x")
    ys = v1.placeholder(tf.int32, [None, MAXLEN], name="y")
    decoder_inputs = v1.placeholder_with_default(
        tf.concat([tf.ones_like(ys[:, :1]), ys[:, :-1]], 1), [None, MAXLEN], name="decoder_inputs")
    keep_prob = v1.placeholder_with_default(1.0, [], name="keep_prob")
    model = Transformer()
    memory, src_masks = model.encode(xs, keep_prob)
    logits, preds = model.decode(decoder_inputs, memory, src_masks, keep_prob)
    y_ = label_smoothing(tf.one_hot(ys, depth=VOCAB))
    ce = tf.nn.softmax_cross_entropy_with_logits(logits=logits, labels=y_)
    nonpadding = v1.to_float(tf.not_equal(ys, 0))
    loss = tf.identity(tf.reduce_sum(ce * nonpadding) / (tf.reduce_sum(nonpadding) + 1e-7), name="loss")
    acc = tf.identity(tf.reduce_sum(v1.to_float(tf.equal(preds, ys)) * nonpadding)
                      / (tf.reduce_sum(nonpadding) + 1e-7), name="acc")
    global_step = v1.train.get_or_create_global_step()
    if optimizer == "adam":
        lr = noam_scheme(0.05, global_step, WARMUP)
        opt = v1.train.AdamOptimizer(lr, beta1=0.9, beta2=0.98, epsilon=1e-9)
    else:
        lr = tf.constant(0.5)
        opt = v1.train.GradientDescentOptimizer(lr)
    train_op = opt.minimize(loss, global_step=global_step)
    v1.summary.scalar("lr", lr)
    v1.summary.scalar("loss", loss)
    summaries = v1.summary.merge_all()
    saver = v1.train.Saver()
    return {"x": xs.name, "y": ys.name, "decoder_inputs": decoder_inputs.name,
            "keep_prob": keep_prob.name, "train_op": train_op.name, "global_step": global_step.name,
            "loss": loss.name, "acc": acc.name, "lr": lr.name, "preds": preds.name,
            "summaries": summaries.name, "init": [v1.global_variables_initializer().name],
            "saver": saver}


def make_data(rng, batch_size, steps=3):
    out = []
    for _ in range(steps + 1):
        lengths = rng.randint(2, MAXLEN + 1, batch_size)
        x = np.zeros((batch_size, MAXLEN), np.int32)
        y = np.zeros((batch_size, MAXLEN), np.int32)
        for b, n in enumerate(lengths):
            x[b, :n] = rng.randint(2, VOCAB, n)
            y[b, :n] = x[b, :n][::-1]                    # learn to reverse
        out.append((x, y))
    return out


def drive(sess, graph, names, data, workdir):
    t = graph.get_tensor_by_name
    train_op = graph.get_operation_by_name(names["train_op"])
    log = []
    for x, y in data[:-1]:
        _, step, loss, acc, lr, _ = sess.run(
            [train_op, t(names["global_step"]), t(names["loss"]), t(names["acc"]), t(names["lr"]),
             t(names["summaries"])], {t(names["x"]): x, t(names["y"]): y, t(names["keep_prob"]): 0.9})
        log.extend([("step", step), ("loss", loss), ("acc", acc), ("lr", lr)])
    x, y = data[-1]
    decoder_inputs = np.ones((len(x), 1), np.int32)
    for _ in range(MAXLEN):
        padded = np.concatenate([decoder_inputs, np.zeros((len(x), MAXLEN - decoder_inputs.shape[1]), np.int32)], 1)
        preds = sess.run(t(names["preds"]), {t(names["x"]): x, t(names["y"]): y,
                                             t(names["decoder_inputs"]): padded})
        decoder_inputs = np.concatenate([np.ones((len(x), 1), np.int32), preds[:, :decoder_inputs.shape[1]]], 1)
        if decoder_inputs.shape[1] > MAXLEN:
            break
    log.append(("decoded", decoder_inputs[:, 1:]))
    return log
