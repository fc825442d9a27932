"""Model families beyond MLPs, built the way legacy TF1 code builds them (issue 4)."""

from __future__ import annotations

import contextlib

import numpy as np
import tensorflow as tf

from models import OPTIMIZERS, Model

v1 = tf.compat.v1
L = v1.losses


def _feed_images(shape=(6, 6, 2), classes=3):
    def make(rng, batch):
        return {"x:0": rng.randn(batch, *shape).astype(np.float32),
                "y:0": rng.randint(0, classes, batch).astype(np.int64)}
    return make


def _xent(y, logits):
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits),
                          name="loss")


def embedding(optimizer: str = "adam", resource: bool = True) -> Model:
    """Bag-of-embeddings classifier: the table's gradient is IndexedSlices."""
    graph = tf.Graph()
    with graph.as_default():
        v1.set_random_seed(2)
        ids = v1.placeholder(tf.int64, [None, 3], name="ids")
        y = v1.placeholder(tf.int64, [None], name="y")
        with v1.variable_scope("m", use_resource=resource):
            table = v1.get_variable("embedding", [50, 4])
            w = v1.get_variable("w", [4, 3])
        logits = tf.matmul(tf.reduce_mean(tf.nn.embedding_lookup(table, ids), axis=1), w, name="logits")
        OPTIMIZERS[optimizer]().minimize(_xent(y, logits), name="train")

    def make(rng, batch):
        return {"ids:0": rng.randint(0, 50, (batch, 3)), "y:0": rng.randint(0, 3, batch)}
    return Model(graph, "train", make, ("loss:0", "logits:0"))


def sampled(loss: str = "nce", optimizer: str = "adam", resource: bool = True,
            batch: int | None = None, num_true: int = 1) -> Model:
    """Skip-gram-like model with a sampled loss (``nce_loss`` or ``sampled_softmax_loss``):
    the candidate sampler draws once per step, and the loss gathers the batch's labels and the
    sampled classes in one lookup of the output weights."""
    graph = tf.Graph()
    with graph.as_default():
        v1.set_random_seed(5)
        ids = v1.placeholder(tf.int64, [batch], name="ids")
        labels = v1.placeholder(tf.int64, [batch, num_true], name="labels")
        with v1.variable_scope("m", use_resource=resource):
            table = v1.get_variable("embedding", [30, 6],
                                    initializer=v1.random_uniform_initializer(-1.0, 1.0, seed=1))
            weights = v1.get_variable("out_w", [30, 6],
                                      initializer=v1.truncated_normal_initializer(stddev=0.4, seed=2))
            biases = v1.get_variable("out_b", [30], initializer=v1.zeros_initializer())
        embed = tf.nn.embedding_lookup(table, ids)
        fn = v1.nn.nce_loss if loss == "nce" else v1.nn.sampled_softmax_loss
        per_example = fn(weights=weights, biases=biases, labels=labels, inputs=embed,
                         num_sampled=5, num_classes=30, num_true=num_true)
        total = tf.reduce_mean(per_example, name="loss")
        OPTIMIZERS[optimizer]().minimize(total, name="train")

    def make(rng, b):
        return {"ids:0": rng.randint(0, 30, b), "labels:0": rng.randint(0, 30, (b, num_true))}
    return Model(graph, "train", make, ("loss:0",))


def batch_norm_cnn(fused: bool = True, optimizer: str = "momentum") -> Model:
    """conv (no bias) -> batch norm -> relu -> dense -> batch norm -> logits, with the legacy
    UPDATE_OPS + control_dependencies wiring."""
    graph = tf.Graph()
    with graph.as_default():
        v1.set_random_seed(1)
        x = v1.placeholder(tf.float32, [None, 6, 6, 2], name="x")
        y = v1.placeholder(tf.int64, [None], name="y")
        h = v1.layers.conv2d(x, 4, 3, padding="same", use_bias=False, name="conv")
        h = v1.layers.batch_normalization(h, training=True, fused=fused, name="bn1")
        h = tf.reshape(tf.nn.relu(h), [-1, 6 * 6 * 4])
        h = v1.layers.dense(h, 8, use_bias=False, name="fc")
        h = v1.layers.batch_normalization(h, training=True, name="bn2")
        logits = v1.layers.dense(tf.nn.relu(h), 3, name="logits")
        loss = _xent(y, logits)
        with tf.control_dependencies(v1.get_collection(v1.GraphKeys.UPDATE_OPS)):
            OPTIMIZERS[optimizer]().minimize(loss, name="train")
    return Model(graph, "train", _feed_images(), ("loss:0",))


def batch_norm_inputs(momentum: float = 0.9) -> Model:
    """Batch norm applied to the raw input, so its moving mean can be checked by hand."""
    graph = tf.Graph()
    with graph.as_default():
        v1.set_random_seed(1)
        x = v1.placeholder(tf.float32, [None, 4], name="x")
        y = v1.placeholder(tf.int64, [None], name="y")
        h = v1.layers.batch_normalization(x, training=True, momentum=momentum, name="bn")
        logits = v1.layers.dense(h, 3, name="logits")
        with tf.control_dependencies(v1.get_collection(v1.GraphKeys.UPDATE_OPS)):
            v1.train.GradientDescentOptimizer(0.1).minimize(_xent(y, logits), name="train")

    def make(rng, batch):
        return {"x:0": (rng.randn(batch, 4) * 2 + 3).astype(np.float32), "y:0": rng.randint(0, 3, batch)}
    return Model(graph, "train", make)


@contextlib.contextmanager
def control_flow_v1():
    """Build with TF1 while loops (Enter/Exit frames, stacks, TensorArrays)."""
    v1.disable_control_flow_v2()
    try:
        yield
    finally:
        v1.enable_control_flow_v2()


def time_loop(noise: str = "", frames: bool = False, read: str = "index",
              parallel: int = 1, width: int = 6) -> tf.Graph:
    """A hand-written RNN over a time-major batch: ``tf.while_loop`` reading ``xs[t]`` (a
    strided slice whose bounds the loop counter gives at run time; with ``read="slice"``,
    ``tf.slice`` from ``tf.stack([t, 0, 0])``, ``"concat"``: from ``tf.concat([[t], [0, 0]], 0)``,
    ``"scaled"``: from ``[1, 0, 0] * t``). ``noise`` drops out each step's input:
    ``dropout`` (``tf.nn.dropout``), ``flag`` (``dropout(training=flag)``, an ``If`` inside the
    ``While``), ``flag_loop`` (that ``If`` inside a second loop, of ``parallel`` iterations
    at once, in the body) or ``parity`` (``tf.nn.dropout`` under a cond on the step's parity:
    drawn in every other iteration). ``width``: the units."""
    graph = tf.Graph()
    with graph.as_default(), (control_flow_v1() if frames else contextlib.nullcontext()):
        v1.set_random_seed(3)
        x = v1.placeholder(tf.float32, [None, 5, width], name="x")
        y = v1.placeholder(tf.int64, [None], name="y")
        flag = v1.placeholder_with_default(True, [], name="training")
        w = v1.get_variable("w", [width, width], initializer=v1.glorot_uniform_initializer(seed=1))
        out = v1.get_variable("out", [width, 3], initializer=v1.glorot_uniform_initializer(seed=2))
        xs = tf.transpose(x, [1, 0, 2])

        def drop(h):
            if noise in ("dropout", "parity"):
                return tf.nn.dropout(h, rate=0.3, seed=7)
            return v1.layers.dropout(h, 0.3, training=flag, seed=7) if noise else h

        def step(t, h):
            begin = {"slice": lambda: tf.stack([t, 0, 0]), "concat": lambda: tf.concat([[t], [0, 0]], 0),
                     "scaled": lambda: tf.constant([1, 0, 0]) * t}.get(read)
            now = xs[t] if read == "index" else tf.reshape(tf.slice(xs, begin(), [1, -1, -1]), [-1, width])
            if noise == "parity":
                now = tf.cond(tf.equal(t % 2, 0), lambda: drop(now), lambda: now * 0.5)
            elif noise == "flag_loop":
                _, now = tf.while_loop(lambda i, v: i < 2, lambda i, v: (i + 1, drop(v)),
                                       [tf.constant(0), now], parallel_iterations=parallel)
            else:
                now = drop(now)
            return t + 1, tf.tanh(tf.matmul(now + h, w))

        _, h = tf.while_loop(lambda t, h: t < 5, step, [tf.constant(0), tf.zeros_like(xs[0])],
                             parallel_iterations=1)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=y, logits=tf.matmul(h, out)), name="loss")
        v1.train.GradientDescentOptimizer(0.5).minimize(loss, name="train")
    return graph


def lstm(version: int = 2, static_batch: int | None = None) -> Model:
    """dynamic_rnn over an LSTM cell; version 1 uses TF1 while-loop frames. With
    ``static_batch`` the input has that static batch and the initial state is the cell's
    ``zero_state(static_batch)``, as legacy language models build it."""
    graph = tf.Graph()
    with contextlib.ExitStack() as stack:
        if version == 1:
            stack.enter_context(control_flow_v1())
        with graph.as_default():
            v1.set_random_seed(1)
            x = v1.placeholder(tf.float32, [static_batch, 5, 4], name="x")
            y = v1.placeholder(tf.int64, [static_batch], name="y")
            # Fixed initializer seeds: Keras-backed defaults draw a new instance per build,
            # and on some instances 3 Adam steps amplify float32 rounding past 1e-5 (measured:
            # 2 of 15 random instances at 3 towers reached 1.1e-5 and 2.4e-5, one device
            # against itself 0 on every one).
            cell = v1.nn.rnn_cell.LSTMCell(6, initializer=v1.glorot_uniform_initializer(seed=3))
            state = cell.zero_state(static_batch, tf.float32) if static_batch else None
            out, _ = v1.nn.dynamic_rnn(cell, x, initial_state=state, dtype=tf.float32)
            logits = v1.layers.dense(out[:, -1], 3, name="logits",
                                     kernel_initializer=v1.glorot_uniform_initializer(seed=4))
            v1.train.AdamOptimizer(0.01).minimize(_xent(y, logits), name="train")
    return Model(graph, "train", _feed_images((5, 4)))


def stateful_lstm(resource: bool = True, batch: int = 7, trainable: bool = False) -> Model:
    """Truncated back-propagation through time with the state kept in variables of one row per
    sequence (a static batch): ``dynamic_rnn`` starts from them and the train op first stores
    the final state back, so every step continues the previous one."""
    graph = tf.Graph()
    with control_flow_v1(), graph.as_default():
        v1.set_random_seed(1)
        x = v1.placeholder(tf.float32, [batch, 3, 2], name="x")
        y = v1.placeholder(tf.float32, [batch, 3, 1], name="y")
        cell = v1.nn.rnn_cell.LSTMCell(5, initializer=v1.glorot_uniform_initializer(seed=3))
        with v1.variable_scope("state", use_resource=resource):
            c = v1.get_variable("c", [batch, 5], trainable=trainable,
                                initializer=v1.random_uniform_initializer(-0.5, 0.5, seed=5))
            h = v1.get_variable("h", [batch, 5], trainable=False,
                                initializer=v1.random_uniform_initializer(-0.5, 0.5, seed=6))
        out, final = v1.nn.dynamic_rnn(cell, x, initial_state=v1.nn.rnn_cell.LSTMStateTuple(
            c.value(), h.value()))
        pred = v1.layers.dense(out, 1, kernel_initializer=v1.glorot_uniform_initializer(seed=4))
        loss = tf.reduce_mean(tf.square(pred - y), name="loss")
        store = tf.group(v1.assign(c, final.c), v1.assign(h, final.h), name="store_state")
        with tf.control_dependencies([store]):
            v1.train.RMSPropOptimizer(0.01).minimize(loss, name="train")

    def make(rng, b):
        return {"x:0": rng.randn(b, 3, 2).astype(np.float32), "y:0": rng.randn(b, 3, 1).astype(np.float32)}
    return Model(graph, "train", make, ("loss:0",))


def conditional(on_batch: bool = False) -> Model:
    """tf.cond on a fed flag (exact), or on a sum over the batch (couples the towers)."""
    graph = tf.Graph()
    with graph.as_default():
        v1.set_random_seed(1)
        x = v1.placeholder(tf.float32, [None, 5, 4], name="x")
        y = v1.placeholder(tf.int64, [None], name="y")
        flag = v1.placeholder_with_default(True, [], name="flag")
        h = v1.layers.dense(tf.reshape(x, [-1, 20]), 6, name="h")
        pred = tf.reduce_sum(x, name="batch_sum") > 0 if on_batch else flag
        h = tf.cond(pred, lambda: tf.nn.relu(h), lambda: tf.nn.tanh(h))
        logits = v1.layers.dense(h, 3, name="logits")
        v1.train.GradientDescentOptimizer(0.1).minimize(_xent(y, logits), name="train")
    return Model(graph, "train", _feed_images((5, 4)))


def dropout(seed: int | None = 4) -> Model:
    """A dense layer with dropout (random: each tower draws its own mask)."""
    graph = tf.Graph()
    with graph.as_default():
        v1.set_random_seed(1)
        x = v1.placeholder(tf.float32, [None, 8], name="x")
        y = v1.placeholder(tf.int64, [None], name="y")
        h = tf.nn.dropout(v1.layers.dense(x, 16, name="h"), rate=0.3, seed=seed)
        logits = v1.layers.dense(h, 3, name="logits")
        v1.train.GradientDescentOptimizer(0.1).minimize(_xent(y, logits), name="train")
    return Model(graph, "train", _feed_images((8,)))


def layers_cnn() -> Model:
    """The tutorial seed's core model with tf.compat.v1.layers (scaled down)."""
    graph = tf.Graph()
    with graph.as_default():
        v1.set_random_seed(1)
        x = v1.placeholder(tf.float32, [None, 12, 12, 1], name="x")
        y = v1.placeholder(tf.int64, [None], name="y")
        net = v1.layers.conv2d(x, 4, 3, padding="same", activation=tf.nn.relu, name="conv1")
        net = v1.layers.max_pooling2d(net, 2, 2)
        net = v1.layers.conv2d(net, 8, 3, padding="same", activation=tf.nn.relu, name="conv2")
        net = v1.layers.max_pooling2d(net, 2, 2)
        net = tf.reshape(net, [-1, 3 * 3 * 8])
        net = v1.layers.dense(net, 16, activation=tf.nn.relu, name="dense_1")
        logits = v1.layers.dense(net, 10, name="dense_2")
        v1.train.AdamOptimizer(1e-3).minimize(_xent(y, logits), global_step=v1.train.get_or_create_global_step(),
                                              name="train")
    return Model(graph, "train", _feed_images((12, 12, 1), 10))


def keras_in_graph() -> Model:
    """A tf-keras Sequential model called on TF1 placeholders, trained by a v1 optimizer."""
    graph = tf.Graph()
    with graph.as_default():
        v1.set_random_seed(1)
        x = v1.placeholder(tf.float32, [None, 5, 4], name="x")
        y = v1.placeholder(tf.int64, [None], name="y")
        model = tf.keras.Sequential([tf.keras.layers.Flatten(), tf.keras.layers.Dense(6, activation="relu"),
                                     tf.keras.layers.Dense(3)])
        v1.train.RMSPropOptimizer(0.01).minimize(_xent(y, model(x)), name="train")
    return Model(graph, "train", _feed_images((5, 4)))


def slim_resnet(size: int = 32, full: bool = False) -> Model:
    """A tf-slim ResNet v1: ``resnet_v1_50`` when ``full``, else the same builder with two small
    blocks (no arg_scope: slim.batch_norm does not work with current tf-keras)."""
    from tf_slim.nets import resnet_v1

    graph = tf.Graph()
    with graph.as_default():
        v1.set_random_seed(1)
        x = v1.placeholder(tf.float32, [None, size, size, 3], name="x")
        y = v1.placeholder(tf.int64, [None], name="y")
        if full:
            logits, _ = resnet_v1.resnet_v1_50(x, num_classes=5, is_training=True, global_pool=True)
        else:
            blocks = [resnet_v1.resnet_v1_block("block1", base_depth=4, num_units=2, stride=2),
                      resnet_v1.resnet_v1_block("block2", base_depth=8, num_units=2, stride=1)]
            logits, _ = resnet_v1.resnet_v1(x, blocks, num_classes=5, is_training=True,
                                            global_pool=True, scope="resnet_small")
        logits = tf.reshape(logits, [-1, 5])
        v1.train.MomentumOptimizer(1e-3, 0.9).minimize(_xent(y, logits), name="train")
    return Model(graph, "train", _feed_images((size, size, 3), 5))


def loss_reduction(reduction: str, weighted: bool, regularized: bool = False) -> Model:
    """A dense classifier trained on a tf.compat.v1.losses loss with the given reduction."""
    graph = tf.Graph()
    with graph.as_default():
        v1.set_random_seed(1)
        x = v1.placeholder(tf.float32, [None, 8], name="x")
        y = v1.placeholder(tf.int64, [None], name="y")
        reg = (lambda w: 0.05 * tf.nn.l2_loss(w)) if regularized else None
        logits = v1.layers.dense(x, 3, kernel_regularizer=reg, name="logits")
        weights = tf.cast(tf.not_equal(y, 0), tf.float32) * 2.0 if weighted else 1.0
        L.sparse_softmax_cross_entropy(y, logits, weights=weights, reduction=getattr(L.Reduction, reduction))
        total = L.get_total_loss(name="total_loss")
        v1.train.GradientDescentOptimizer(0.1).minimize(total, name="train")
    return Model(graph, "train", _feed_images((8,)), ("total_loss:0",))


def sum_loss() -> Model:
    """A loss reduced with reduce_sum (gradients add across towers)."""
    graph = tf.Graph()
    with graph.as_default():
        v1.set_random_seed(1)
        x = v1.placeholder(tf.float32, [None, 8], name="x")
        y = v1.placeholder(tf.int64, [None], name="y")
        logits = v1.layers.dense(x, 3, name="logits")
        loss = tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits), name="loss")
        v1.train.GradientDescentOptimizer(0.01).minimize(loss, name="train")
    return Model(graph, "train", _feed_images((8,)))
