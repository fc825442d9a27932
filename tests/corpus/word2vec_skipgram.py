"""Skip-gram word embeddings in the style of the basic word2vec tutorial: a static batch of
centre words and context labels generated from a token stream with a sliding window, an
embedding table and NCE weights pinned to the CPU, ``nce_loss`` (negative classes drawn by a
log-uniform candidate sampler) averaged over the batch, plain SGD, cosine similarity of a few
validation words against the normalized embeddings, and a loss summary."""

import collections

import numpy as np
import tensorflow as tf

v1 = tf.compat.v1

FAMILY = "skip-gram (sampled loss)"
DESCRIPTION = ("word2vec-basic style: `train_inputs` [batch_size], `train_labels` "
               "[batch_size, 1] (static), `embeddings` and NCE weights/biases under `/cpu:0`, "
               "`reduce_mean(nce_loss(..., num_sampled=4))` (or `sampled_softmax_loss`), "
               "SGD(1.0).minimize, normalized embeddings and a `similarity` matrix for "
               "constant validation ids, a merged loss summary")
DRIVER = ("`generate_batch` with a sliding window (num_skips=2, skip_window=1) over a token "
          "stream; per step `session.run([optimizer, merged, loss], feed_dict)`; "
          "`similarity.eval()` and `normalized_embeddings.eval()` at the end")
BATCHES = [12, 10]          # num_skips=2 needs even batches; 10 is uneven on 3 towers

VOCAB, EMBED, NUM_SAMPLED, NUM_SKIPS, SKIP_WINDOW = 40, 8, 4, 2, 1
VALID_EXAMPLES = np.array([1, 3, 5, 7], np.int32)

VARIANTS = {
    "nce": {"expect": {"exact": True,
                       "why": "the candidate sampler runs once for the whole batch (one draw, as on "
                       "one device); nce_loss's concat of labels and sampled ids has per-example "
                       "rows and shared rows, which the towers slice apart again, and each tower's "
                       "sparse gradient for the shared rows is its share of the batch's"}},
    "sampled_softmax": {"build": {"loss": "sampled_softmax"},
                        "expect": {"exact": True, "why": "as nce, with accidental hits removed "
                                   "per example and log-q subtracted"}},
}


def build(batch_size, loss="nce"):
    with tf.name_scope("inputs"):
        train_inputs = v1.placeholder(tf.int32, shape=[batch_size])
        train_labels = v1.placeholder(tf.int32, shape=[batch_size, 1])
        valid_dataset = tf.constant(VALID_EXAMPLES, dtype=tf.int32)
    with tf.device("/cpu:0"):
        with tf.name_scope("embeddings"):
            embeddings = tf.Variable(v1.random_uniform([VOCAB, EMBED], -1.0, 1.0))
            embed = tf.nn.embedding_lookup(embeddings, train_inputs)
        with tf.name_scope("weights"):
            nce_weights = tf.Variable(v1.truncated_normal([VOCAB, EMBED], stddev=1.0 / np.sqrt(EMBED)))
        with tf.name_scope("biases"):
            nce_biases = tf.Variable(tf.zeros([VOCAB]))
    with tf.name_scope("loss"):
        if loss == "nce":
            per_example = v1.nn.nce_loss(weights=nce_weights, biases=nce_biases, labels=train_labels,
                                         inputs=embed, num_sampled=NUM_SAMPLED, num_classes=VOCAB)
        else:
            per_example = v1.nn.sampled_softmax_loss(weights=nce_weights, biases=nce_biases,
                                                     labels=train_labels, inputs=embed,
                                                     num_sampled=NUM_SAMPLED, num_classes=VOCAB)
        loss_t = tf.reduce_mean(per_example)
    v1.summary.scalar("loss", loss_t)
    with tf.name_scope("optimizer"):
        optimizer = v1.train.GradientDescentOptimizer(1.0).minimize(loss_t)
    norm = tf.sqrt(tf.reduce_sum(tf.square(embeddings), 1, keepdims=True))
    normalized_embeddings = embeddings / norm
    valid_embeddings = tf.nn.embedding_lookup(normalized_embeddings, valid_dataset)
    similarity = tf.matmul(valid_embeddings, normalized_embeddings, transpose_b=True)
    merged = v1.summary.merge_all()
    init = v1.global_variables_initializer()
    saver = v1.train.Saver()
    return {"train_inputs": train_inputs.name, "train_labels": train_labels.name,
            "optimizer": optimizer.name, "merged": merged.name, "loss": loss_t.name,
            "similarity": similarity.name, "normalized_embeddings": normalized_embeddings.name,
            "init": [init.name], "saver": saver}


def make_data(rng, batch_size, steps=3):
    """A Zipf-like token stream; the driver cuts skip-gram batches from it."""
    ranks = np.arange(1, VOCAB + 1)
    p = (1.0 / ranks) / np.sum(1.0 / ranks)
    stream = rng.choice(VOCAB, size=batch_size * steps + 8, p=p).astype(np.int32)
    return {"data": stream, "steps": steps}


def drive(sess, graph, names, data, workdir):
    t = graph.get_tensor_by_name
    stream = data["data"]
    state = {"data_index": 0}

    def generate_batch(batch_size, num_skips, skip_window):
        assert batch_size % num_skips == 0
        assert num_skips <= 2 * skip_window
        batch = np.ndarray(shape=(batch_size), dtype=np.int32)
        labels = np.ndarray(shape=(batch_size, 1), dtype=np.int32)
        span = 2 * skip_window + 1
        buffer = collections.deque(maxlen=span)
        if state["data_index"] + span > len(stream):
            state["data_index"] = 0
        buffer.extend(stream[state["data_index"]:state["data_index"] + span])
        state["data_index"] += span
        for i in range(batch_size // num_skips):
            context_words = [w for w in range(span) if w != skip_window]
            words_to_use = context_words[:num_skips]       # the tutorial samples; fixed here
            for j, context_word in enumerate(words_to_use):
                batch[i * num_skips + j] = buffer[skip_window]
                labels[i * num_skips + j, 0] = buffer[context_word]
            if state["data_index"] == len(stream):
                buffer.extend(stream[0:span])
                state["data_index"] = span
            else:
                buffer.append(stream[state["data_index"]])
                state["data_index"] += 1
        state["data_index"] = (state["data_index"] + len(stream) - span) % len(stream)
        return batch, labels

    batch_size = t(names["train_inputs"]).shape[0]
    optimizer = graph.get_operation_by_name(names["optimizer"])
    log = []
    average_loss = 0
    for step in range(data["steps"]):
        batch_inputs, batch_labels = generate_batch(batch_size, NUM_SKIPS, SKIP_WINDOW)
        feed_dict = {t(names["train_inputs"]): batch_inputs, t(names["train_labels"]): batch_labels}
        _, summary, loss_val = sess.run([optimizer, t(names["merged"]), t(names["loss"])],
                                        feed_dict=feed_dict)
        average_loss += loss_val
        log += [("summary", summary), ("loss", loss_val)]
    log.append(("similarity", t(names["similarity"]).eval()))
    log.append(("final_embeddings", t(names["normalized_embeddings"]).eval()))
    return log
