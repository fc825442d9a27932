"""An attention seq2seq model in the style of the TensorFlow NMT tutorial, ported by hand where
``tf.contrib.seq2seq`` is gone: a bidirectional LSTM encoder with source lengths, a 2-layer
decoder starting from the encoder's (fw, bw) states, Luong attention with input feeding
written as a ``tf.compat.v1.while_loop`` that runs, like ``TrainingHelper`` under
``dynamic_decode``, to the longest target of the batch, a masked cross-entropy summed and
divided by the batch size, learning-rate warm-up then staircase decay on the global step,
clipped gradients and summaries."""

import numpy as np
import tensorflow as tf

v1 = tf.compat.v1
rnn = v1.nn.rnn_cell

FAMILY = "attention seq2seq"
DESCRIPTION = ("nmt-tutorial style: dynamic batch and lengths, `bidirectional_dynamic_rnn` "
               "encoder with `sequence_length`, a hand-written Luong-attention decoder "
               "(`while_loop` to `reduce_max(target_sequence_length)`, memory masked by "
               "`sequence_mask`, input feeding), `reduce_sum(crossent * target_weights) / "
               "batch_size` with `batch_size = tf.size(source_sequence_length)`, warm-up "
               "(`tf.cond` on the global step) then staircase `exponential_decay`, "
               "`clip_by_global_norm`, SGD")
DRIVER = ("per step feed source, target_input, target_output and both length vectors (batch "
          "padded to its longest sentence), fetch [update, train_loss, predict_count, "
          "train_summary, global_step, word_count, batch_size, grad_norm, learning_rate]")
BATCHES = [6, 7]

SRC_VOCAB, TGT_VOCAB, EMBED, UNITS = 12, 11, 8, 8
SOS, EOS = 1, 2
LEARNING_RATE, WARMUP_STEPS, START_DECAY_STEP, DECAY_STEPS, DECAY_FACTOR = 0.5, 2, 2, 1, 0.5
MAX_GRADIENT_NORM = 5.0

VARIANTS = {
    "nodropout": {"expect": {"exact": True, "why": "the loss is a batch mean (sum / batch "
                             "size); each tower's decoder may stop at its own longest target "
                             "if the padded targets are cut to match, masked steps add nothing"}},
    "dropout": {"build": {"dropout": 0.2},
                "expect": {"exact": False, "reasons_only": ["iterations at once"],
                           "why": "the loops run iterations in parallel (dynamic_rnn's 32, "
                                  "while_loop's 10), so which time step gets which draw of a "
                                  "DropoutWrapper is up to the scheduler, on one device too"}},
    "dropout_serial": {"build": {"dropout": 0.2, "parallel_iterations": 1},
                       "expect": {"exact": True, "why": "with one iteration at a time every "
                                  "tower's loop draws the global mask at each step and keeps its "
                                  "rows"}},
}


def _single_cell(dropout):
    cell = rnn.BasicLSTMCell(UNITS)
    if dropout > 0.0:
        cell = rnn.DropoutWrapper(cell=cell, input_keep_prob=(1.0 - dropout))
    return cell


class AttentionModel:
    def __init__(self, dropout=0.0, parallel_iterations=None):
        self.parallel = parallel_iterations
        self.source = v1.placeholder(tf.int32, [None, None], name="source")
        self.target_input = v1.placeholder(tf.int32, [None, None], name="target_input")
        self.target_output = v1.placeholder(tf.int32, [None, None], name="target_output")
        self.source_sequence_length = v1.placeholder(tf.int32, [None], name="source_sequence_length")
        self.target_sequence_length = v1.placeholder(tf.int32, [None], name="target_sequence_length")
        self.batch_size = tf.size(self.source_sequence_length)
        initializer = v1.random_uniform_initializer(-0.1, 0.1)
        v1.get_variable_scope().set_initializer(initializer)

        with v1.variable_scope("embeddings"):
            self.embedding_encoder = v1.get_variable("embedding_encoder", [SRC_VOCAB, EMBED])
            self.embedding_decoder = v1.get_variable("embedding_decoder", [TGT_VOCAB, EMBED])
        with v1.variable_scope("build_network"):
            with v1.variable_scope("decoder/output_projection"):
                self.output_w = v1.get_variable("kernel", [UNITS, TGT_VOCAB])
            encoder_outputs, encoder_state = self._build_encoder(dropout)
            logits, self.final_context_state = self._build_decoder(encoder_outputs, encoder_state,
                                                                   dropout)
        self.train_loss = tf.identity(self._compute_loss(logits), name="train_loss")
        self.word_count = tf.reduce_sum(self.source_sequence_length) + tf.reduce_sum(
            self.target_sequence_length)
        self.predict_count = tf.reduce_sum(self.target_sequence_length)
        self.global_step = tf.Variable(0, trainable=False, name="global_step")
        params = v1.trainable_variables()
        self.learning_rate = tf.constant(LEARNING_RATE)
        self.learning_rate = self._get_learning_rate_warmup()
        self.learning_rate = self._get_learning_rate_decay()
        opt = v1.train.GradientDescentOptimizer(self.learning_rate)
        gradients = v1.gradients(self.train_loss, params, colocate_gradients_with_ops=True)
        clipped_grads, grad_norm_summary, self.grad_norm = self._gradient_clip(gradients)
        self.update = opt.apply_gradients(zip(clipped_grads, params), global_step=self.global_step)
        self.train_summary = v1.summary.merge(
            [v1.summary.scalar("lr", self.learning_rate),
             v1.summary.scalar("train_loss", self.train_loss)] + grad_norm_summary)

    def _build_encoder(self, dropout):
        with v1.variable_scope("encoder") as scope:
            encoder_emb_inp = tf.nn.embedding_lookup(self.embedding_encoder, self.source)
            fw_cell = _single_cell(dropout)
            bw_cell = _single_cell(dropout)
            bi_outputs, bi_state = v1.nn.bidirectional_dynamic_rnn(
                fw_cell, bw_cell, encoder_emb_inp, dtype=scope.dtype,
                sequence_length=self.source_sequence_length, time_major=False,
                parallel_iterations=self.parallel)
            encoder_outputs = tf.concat(bi_outputs, -1)
            encoder_state = bi_state          # (fw, bw): one state per decoder layer
        return encoder_outputs, encoder_state

    def _build_decoder(self, memory, encoder_state, dropout):
        with v1.variable_scope("decoder"):
            cell = rnn.MultiRNNCell([_single_cell(dropout) for _ in range(2)])
            with v1.variable_scope("attention"):
                memory_w = v1.get_variable("memory_layer/kernel", [2 * UNITS, UNITS])
                attention_w = v1.get_variable("attention_layer/kernel", [UNITS + 2 * UNITS, UNITS])
            keys = tf.tensordot(memory, memory_w, [[2], [0]])
            memory_mask = tf.sequence_mask(self.source_sequence_length, tf.shape(memory)[1])
            decoder_emb_inp = tf.nn.embedding_lookup(self.embedding_decoder, self.target_input)
            # TrainingHelper: the decoder runs until every sequence of the batch has finished.
            max_time = tf.reduce_max(self.target_sequence_length)
            inputs_ta = tf.TensorArray(tf.float32, size=tf.shape(decoder_emb_inp)[1])
            inputs_ta = inputs_ta.unstack(tf.transpose(decoder_emb_inp, [1, 0, 2]))
            initial_attention = tf.zeros([self.batch_size, UNITS])
            outputs_ta = tf.TensorArray(tf.float32, size=max_time)

            def body(time, cell_state, attention, outputs_ta):
                cell_input = tf.concat([inputs_ta.read(time), attention], -1)
                cell_output, next_state = cell(cell_input, cell_state)
                score = tf.squeeze(tf.matmul(tf.expand_dims(cell_output, 1), keys, transpose_b=True), [1])
                score = tf.where(memory_mask, score, tf.ones_like(score) * -1e9)
                alignments = tf.nn.softmax(score)
                context = tf.squeeze(tf.matmul(tf.expand_dims(alignments, 1), memory), [1])
                attention = tf.matmul(tf.concat([cell_output, context], 1), attention_w)
                return time + 1, next_state, attention, outputs_ta.write(time, attention)

            _, final_state, _, outputs_ta = v1.while_loop(
                lambda time, *_: time < max_time, body,
                [tf.constant(0), encoder_state, initial_attention, outputs_ta],
                parallel_iterations=self.parallel or 10)
            outputs = tf.transpose(outputs_ta.stack(), [1, 0, 2])
            logits = tf.tensordot(outputs, self.output_w, [[2], [0]])
        return logits, final_state

    def _compute_loss(self, logits):
        max_time = tf.shape(self.target_output)[1]
        crossent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=self.target_output,
                                                                  logits=logits)
        target_weights = tf.sequence_mask(self.target_sequence_length, max_time, dtype=logits.dtype)
        return tf.reduce_sum(crossent * target_weights) / tf.cast(self.batch_size, tf.float32)

    def _get_learning_rate_warmup(self):
        warmup_factor = tf.exp(tf.math.log(0.01) / WARMUP_STEPS)
        inv_decay = warmup_factor ** (tf.cast(WARMUP_STEPS - self.global_step, tf.float32))
        return tf.cond(self.global_step < WARMUP_STEPS, lambda: inv_decay * self.learning_rate,
                       lambda: self.learning_rate, name="learning_rate_warump_cond")

    def _get_learning_rate_decay(self):
        return tf.cond(self.global_step < START_DECAY_STEP, lambda: self.learning_rate,
                       lambda: v1.train.exponential_decay(
                           self.learning_rate, (self.global_step - START_DECAY_STEP),
                           DECAY_STEPS, DECAY_FACTOR, staircase=True),
                       name="learning_rate_decay_cond")

    def _gradient_clip(self, gradients):
        clipped_gradients, gradient_norm = tf.clip_by_global_norm(gradients, MAX_GRADIENT_NORM)
        summary = [v1.summary.scalar("grad_norm", gradient_norm),
                   v1.summary.scalar("clipped_gradient", tf.linalg.global_norm(clipped_gradients))]
        return clipped_gradients, summary, gradient_norm


def build(batch_size, dropout=0.0, parallel_iterations=None):
    # The batch is dynamic: batch_size only matters to the data.
    model = AttentionModel(dropout, parallel_iterations)
    init = [v1.global_variables_initializer(), v1.tables_initializer()]
    saver = v1.train.Saver(v1.global_variables())
    return {"source": model.source.name, "target_input": model.target_input.name,
            "target_output": model.target_output.name,
            "source_sequence_length": model.source_sequence_length.name,
            "target_sequence_length": model.target_sequence_length.name,
            "fetches": [model.update.name, model.train_loss.name, model.predict_count.name,
                        model.train_summary.name, model.global_step.name, model.word_count.name,
                        model.batch_size.name, model.grad_norm.name, model.learning_rate.name],
            "init": [op.name for op in init], "saver": saver}


def make_data(rng, batch_size, steps=3):
    """Sentence pairs of lengths 2..6 (target: a noisy reversal of the source), padded with
    EOS to the longest of the batch, as the NMT iterator's padded_batch does."""
    batches = []
    for _ in range(steps):
        src_len = rng.randint(2, 7, batch_size)
        srcs = [rng.randint(3, SRC_VOCAB, n) for n in src_len]
        tgts = [np.minimum(s[::-1], TGT_VOCAB - 1) for s in srcs]
        tgts = [t[: max(1, len(t) - rng.randint(0, 2))] for t in tgts]
        tgt_in = [np.concatenate([[SOS], t]) for t in tgts]
        tgt_out = [np.concatenate([t, [EOS]]) for t in tgts]

        def pad(seqs):
            width = max(len(s) for s in seqs)
            return np.array([np.concatenate([s, [EOS] * (width - len(s))]) for s in seqs], np.int32)
        batches.append({"source": pad(srcs), "target_input": pad(tgt_in),
                        "target_output": pad(tgt_out),
                        "source_sequence_length": src_len.astype(np.int32),
                        "target_sequence_length": np.array([len(t) for t in tgt_in], np.int32)})
    return batches


def drive(sess, graph, names, data, workdir):
    t = graph.get_tensor_by_name
    fetches = [graph.get_operation_by_name(names["fetches"][0])] + [t(n) for n in names["fetches"][1:]]
    labels = ["train_loss", "predict_count", "train_summary", "global_step", "word_count",
              "batch_size", "grad_norm", "learning_rate"]
    log = []
    for batch in data:
        feed = {t(names[k]): v for k, v in batch.items()}
        values = sess.run(fetches, feed_dict=feed)[1:]
        log += list(zip(labels, values))
    return log
