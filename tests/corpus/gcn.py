"""Graph convolutional networks in the style of the widely read Kipf & Welling TF1 code: a
``placeholders`` dict (``support`` as a list of sparse placeholders, sparse ``features``,
``labels``, ``labels_mask``, ``dropout``, ``num_features_nonzero``), a ``GraphConvolution``
layer that drops out its (sparse) input, multiplies by its weights with ``dot(...,
sparse=True)`` and then by the normalized adjacency, weight decay on the first layer, the
masked softmax cross-entropy (the mask divided by its mean), Adam, and a driver that builds
feed dicts with ``construct_feed_dict`` and evaluates on the validation mask.

The full-batch program convolves twice over every node: the second convolution adds each
node's neighbours' hidden rows, so no split of the nodes can run it and replicate refuses,
naming the graph convolution. The node-minibatch variant feeds, per step, the adjacency rows of
a batch of target nodes (a SparseTensor over all the nodes) with every node's features: one
convolution and a dense layer, exact."""

import numpy as np
import tensorflow as tf

v1 = tf.compat.v1

FAMILY = "graph convolutional network"
DESCRIPTION = ("Kipf-style GCN: `placeholders` dict with `support` (sparse adjacency), sparse "
               "`features`, `labels`, `labels_mask`, `dropout`, `num_features_nonzero`; "
               "`GraphConvolution` layers (sparse dropout of the features, `dot(x, W, "
               "sparse=True)`, `dot(support, pre_sup, sparse=True)`), weight decay on the first "
               "layer, masked softmax cross-entropy with the mask divided by its mean, Adam; "
               "full-batch (two convolutions over all nodes) or node minibatches (one "
               "convolution over the batch's adjacency rows, then a dense layer)")
DRIVER = ("per epoch: `construct_feed_dict(features, support, y_train, train_mask)`, feed "
          "`dropout`, fetch [opt_op, loss, accuracy]; after the last one an evaluation with the "
          "validation mask and dropout 0, fetch [loss, accuracy]")
BATCHES = [6, 7]

NODES, FEATURES, HIDDEN, CLASSES, WEIGHT_DECAY = 14, 5, 8, 3, 5e-4

VARIANTS = {
    "minibatch": {"build": {"minibatch": True}, "data": {"minibatch": True},
                  "expect": {"exact": True, "why": "the batch's adjacency rows (a SparseTensor "
                             "split by example) times every node's features (shared): each "
                             "tower computes its nodes' rows; the hidden dropout is drawn at "
                             "the global batch's shape"}},
    "minibatch_sgd": {"build": {"minibatch": True, "optimizer": "sgd"}, "data": {"minibatch": True},
                      "expect": {"exact": True, "why": "the same with plain SGD"}},
    "full_batch": {"expect": {"exact": "refused", "refusal": ["graph convolution"],
                              "why": "the second convolution adds every node's neighbours' "
                              "hidden rows: no split of the nodes can run it"}},
}

_LAYER_UIDS = {}


def get_layer_uid(layer_name=""):
    if layer_name not in _LAYER_UIDS:
        _LAYER_UIDS[layer_name] = 1
        return 1
    _LAYER_UIDS[layer_name] += 1
    return _LAYER_UIDS[layer_name]


def glorot(shape, name=None, seed=None):
    init_range = np.sqrt(6.0 / (shape[0] + shape[1]))
    initial = v1.random_uniform(shape, minval=-init_range, maxval=init_range, dtype=tf.float32,
                                seed=seed)
    return tf.Variable(initial, name=name)


def zeros(shape, name=None):
    return tf.Variable(tf.zeros(shape, dtype=tf.float32), name=name)


def sparse_dropout(x, keep_prob, noise_shape):
    random_tensor = keep_prob
    random_tensor += v1.random_uniform(noise_shape, seed=11)
    dropout_mask = tf.cast(tf.floor(random_tensor), dtype=tf.bool)
    pre_out = v1.sparse_retain(x, dropout_mask)
    return pre_out * (1.0 / keep_prob)


def dot(x, y, sparse=False):
    if sparse:
        return v1.sparse_tensor_dense_matmul(x, y)
    return tf.matmul(x, y)


class GraphConvolution(object):
    def __init__(self, input_dim, output_dim, placeholders, dropout=0.0, sparse_inputs=False,
                 act=tf.nn.relu, bias=False, seed=None):
        self.name = "graphconvolution_%d" % get_layer_uid("graphconvolution")
        self.dropout = placeholders["dropout"] if dropout else 0.0
        self.act, self.support = act, placeholders["support"]
        self.sparse_inputs, self.bias = sparse_inputs, bias
        self.num_features_nonzero = placeholders["num_features_nonzero"]
        self.vars = {}
        with v1.variable_scope(self.name + "_vars"):
            self.vars["weights_0"] = glorot([input_dim, output_dim], name="weights_0", seed=seed)
            if self.bias:
                self.vars["bias"] = zeros([output_dim], name="bias")

    def __call__(self, x):
        with tf.name_scope(self.name):
            if self.sparse_inputs:
                x = sparse_dropout(x, 1 - self.dropout, self.num_features_nonzero)
            else:
                x = v1.nn.dropout(x, rate=self.dropout, seed=12)
            pre_sup = dot(x, self.vars["weights_0"], sparse=self.sparse_inputs)
            output = tf.add_n([dot(s, pre_sup, sparse=True) for s in self.support])
            if self.bias:
                output += self.vars["bias"]
            return self.act(output)


class Dense(object):
    def __init__(self, input_dim, output_dim, placeholders, dropout=0.0, act=lambda x: x, seed=None):
        self.dropout = placeholders["dropout"] if dropout else 0.0
        self.act = act
        with v1.variable_scope("dense_vars"):
            self.vars = {"weights": glorot([input_dim, output_dim], name="weights", seed=seed),
                         "bias": zeros([output_dim], name="bias")}

    def __call__(self, x):
        x = v1.nn.dropout(x, rate=self.dropout, seed=13)
        return self.act(tf.matmul(x, self.vars["weights"]) + self.vars["bias"])


def masked_softmax_cross_entropy(preds, labels, mask):
    loss = tf.nn.softmax_cross_entropy_with_logits(logits=preds, labels=labels)
    mask = tf.cast(mask, dtype=tf.float32)
    mask /= tf.reduce_mean(mask)
    loss *= mask
    return tf.reduce_mean(loss)


def masked_accuracy(preds, labels, mask):
    correct_prediction = tf.equal(tf.argmax(preds, 1), tf.argmax(labels, 1))
    accuracy_all = tf.cast(correct_prediction, tf.float32)
    mask = tf.cast(mask, dtype=tf.float32)
    mask /= tf.reduce_mean(mask)
    accuracy_all *= mask
    return tf.reduce_mean(accuracy_all)


class GCN(object):
    def __init__(self, placeholders, input_dim, minibatch, optimizer):
        self.inputs, self.placeholders = placeholders["features"], placeholders
        self.output_dim = placeholders["labels"].get_shape().as_list()[1]
        if minibatch:
            self.layers = [GraphConvolution(input_dim, HIDDEN, placeholders, dropout=True,
                                            sparse_inputs=True, seed=1),
                           Dense(HIDDEN, self.output_dim, placeholders, dropout=True, seed=2)]
        else:
            self.layers = [GraphConvolution(input_dim, HIDDEN, placeholders, dropout=True,
                                            sparse_inputs=True, seed=1),
                           GraphConvolution(HIDDEN, self.output_dim, placeholders, dropout=True,
                                            act=lambda x: x, seed=2)]
        self.optimizer = (v1.train.AdamOptimizer(learning_rate=0.01) if optimizer == "adam"
                          else v1.train.GradientDescentOptimizer(learning_rate=0.5))
        hidden = self.inputs
        for layer in self.layers:
            hidden = layer(hidden)
        self.outputs = hidden
        self.loss = 0
        for var in self.layers[0].vars.values():
            self.loss += WEIGHT_DECAY * tf.nn.l2_loss(var)
        self.loss += masked_softmax_cross_entropy(self.outputs, placeholders["labels"],
                                                  placeholders["labels_mask"])
        self.accuracy = masked_accuracy(self.outputs, placeholders["labels"],
                                        placeholders["labels_mask"])
        self.opt_op = self.optimizer.minimize(self.loss)


def build(batch_size, minibatch=False, optimizer="adam"):
    _LAYER_UIDS.clear()
    v1.set_random_seed(7)
    placeholders = {
        "support": [v1.sparse_placeholder(tf.float32)],
        "features": v1.sparse_placeholder(tf.float32, shape=tf.constant([NODES, FEATURES], dtype=tf.int64)),
        "labels": v1.placeholder(tf.float32, shape=(None, CLASSES)),
        # the original leaves this placeholder unshaped; then nothing proves it per node
        # (replicate shares it and reports its unknown rank), so this port gives it a shape
        "labels_mask": v1.placeholder(tf.int32, shape=(None,)),
        "dropout": v1.placeholder_with_default(0.0, shape=()),
        "num_features_nonzero": v1.placeholder(tf.int32),
    }
    model = GCN(placeholders, FEATURES, minibatch, optimizer)
    saver = v1.train.Saver()
    init = v1.global_variables_initializer()
    names = {"support": [(s.indices.name, s.values.name, s.dense_shape.name) for s in placeholders["support"]],
             "features": (placeholders["features"].indices.name, placeholders["features"].values.name,
                          placeholders["features"].dense_shape.name),
             "labels": placeholders["labels"].name, "labels_mask": placeholders["labels_mask"].name,
             "dropout": placeholders["dropout"].name,
             "num_features_nonzero": placeholders["num_features_nonzero"].name,
             "opt_op": model.opt_op.name, "loss": model.loss.name, "accuracy": model.accuracy.name,
             "init": [init.name], "saver": saver}
    return names


def sparse_to_tuple(matrix):
    coords = np.argwhere(matrix != 0).astype(np.int64)
    return coords, matrix[matrix != 0].astype(np.float32), np.array(matrix.shape, np.int64)


def preprocess_adj(adj):
    adj = adj + np.eye(adj.shape[0], dtype=np.float32)
    d_inv_sqrt = np.power(adj.sum(1), -0.5)
    return (adj * d_inv_sqrt[:, None]) * d_inv_sqrt[None, :]


def make_data(rng, batch_size, steps=3, minibatch=False):
    """A random graph, row-normalized sparse features, one-hot labels, train/val masks. Full
    batch: ``batch_size`` nodes, every step all of them. Minibatch: ``NODES`` nodes, every
    step the adjacency rows of ``batch_size`` target nodes."""
    nodes = NODES if minibatch else batch_size
    adj = (rng.rand(nodes, nodes) < 0.25).astype(np.float32)
    adj = np.maximum(adj, adj.T)
    np.fill_diagonal(adj, 0)
    support = preprocess_adj(adj)
    feats = (rng.rand(nodes, FEATURES) < 0.5).astype(np.float32) * rng.rand(nodes, FEATURES)
    feats[:, 0] += 0.1
    feats = (feats / feats.sum(1, keepdims=True)).astype(np.float32)
    labels = np.eye(CLASSES, dtype=np.float32)[rng.randint(0, CLASSES, nodes)]
    out = []
    for _ in range(steps + 1):
        rows = np.sort(rng.choice(nodes, batch_size, replace=False)) if minibatch else np.arange(nodes)
        mask = (rng.rand(len(rows)) < 0.7).astype(np.int32)
        mask[0] = 1
        out.append({"support": [sparse_to_tuple(support[rows])], "features": sparse_to_tuple(feats),
                    "labels": labels[rows], "mask": mask})
    return out


def construct_feed_dict(graph, names, features, support, labels, labels_mask):
    t = graph.get_tensor_by_name
    feed_dict = {t(names["labels"]): labels, t(names["labels_mask"]): labels_mask}
    for part, value in zip(names["features"], features):
        feed_dict[t(part)] = value
    for parts, value in zip(names["support"], support):
        for part, v in zip(parts, value):
            feed_dict[t(part)] = v
    feed_dict[t(names["num_features_nonzero"])] = features[1].shape
    return feed_dict


def drive(sess, graph, names, data, workdir, dropout=0.5):
    t = graph.get_tensor_by_name
    opt_op = graph.get_operation_by_name(names["opt_op"])
    log = []
    for step in data[:-1]:
        feed_dict = construct_feed_dict(graph, names, step["features"], step["support"],
                                        step["labels"], step["mask"])
        feed_dict.update({t(names["dropout"]): dropout})
        _, loss, acc = sess.run([opt_op, t(names["loss"]), t(names["accuracy"])], feed_dict=feed_dict)
        log.extend([("train_loss", loss), ("train_acc", acc)])
    last = data[-1]
    feed_dict_val = construct_feed_dict(graph, names, last["features"], last["support"],
                                        last["labels"], 1 - last["mask"] + (last["mask"].sum() == len(last["mask"])))
    loss, acc = sess.run([t(names["loss"]), t(names["accuracy"])], feed_dict=feed_dict_val)
    log.extend([("val_loss", loss), ("val_acc", acc)])
    return log
