"""Autoencoders in the style of the TensorFlow models' autoencoder examples: a class that
builds its graph in ``__init__`` with a dynamic-batch input, a softplus hidden layer, a
linear reconstruction, the cost ``0.5 * reduce_sum(pow(reconstruction - x, 2))`` (a sum
over the batch), Adam, and helpers ``partial_fit``, ``calc_total_cost``, ``transform`` and
``reconstruct`` that the driver calls; the additive-Gaussian-noise variant corrupts its
input with ``scale * tf.random_normal((n_input,))`` fed a ``scale``."""

import numpy as np
import tensorflow as tf

v1 = tf.compat.v1

FAMILY = "autoencoder"
DESCRIPTION = ("models/autoencoder style: `x` [None, 10], hidden softplus(8), linear "
               "reconstruction, `cost = 0.5 * reduce_sum(pow(reconstruction - x, 2))` (a sum "
               "over the batch), Adam; the noisy variant adds `scale * random_normal((n_input,))`")
DRIVER = ("per batch `partial_fit`: `sess.run((cost, optimizer), {x[, scale]})`, averaging "
          "`cost / n_samples * batch_size`; then `calc_total_cost(X)`, `transform(X)` (hidden) "
          "and `reconstruct(X)` on the last batch")
BATCHES = [6, 7]

N_INPUT, N_HIDDEN = 10, 8

VARIANTS = {
    "plain": {"expect": {"exact": True, "why": "a sum loss: tower gradients add up"}},
    "gaussian_noise": {"build": {"noise": True}, "drive": {"scale": 0.1},
                       "expect": {"exact": True,
                                  "why": "the noise vector does not depend on the batch: drawn "
                                  "once and shared by every tower; `scale` is a placeholder "
                                  "without a shape, taken to be the scalar the driver feeds "
                                  "(the report says so, and the rewrite checks it each step)"}},
    "accumulate": {"options": {"accumulate": 2},
                   "expect": {"exact": True,
                              "why": "two micro-batches per device, summed: both layers' weight "
                              "gradients are computed once from the kept slices at these batches"}},
}


def xavier_init(fan_in, fan_out, constant=1):
    low = -constant * np.sqrt(6.0 / (fan_in + fan_out))
    high = constant * np.sqrt(6.0 / (fan_in + fan_out))
    return v1.random_uniform((fan_in, fan_out), minval=low, maxval=high, dtype=tf.float32)


class Autoencoder(object):
    def __init__(self, n_input, n_hidden, transfer_function=tf.nn.softplus,
                 optimizer=v1.train.AdamOptimizer(learning_rate=0.01), noise=False):
        self.n_input = n_input
        self.n_hidden = n_hidden
        self.transfer = transfer_function
        network_weights = self._initialize_weights()
        self.weights = network_weights
        self.x = v1.placeholder(tf.float32, [None, self.n_input], name="x")
        inputs = self.x
        if noise:
            self.scale = v1.placeholder(tf.float32, name="scale")
            inputs = self.x + self.scale * v1.random_normal((n_input,))
        self.hidden = self.transfer(tf.add(tf.matmul(inputs, self.weights["w1"]), self.weights["b1"]),
                                    name="hidden")
        self.reconstruction = tf.add(tf.matmul(self.hidden, self.weights["w2"]), self.weights["b2"],
                                     name="reconstruction")
        self.cost = tf.multiply(0.5, tf.reduce_sum(tf.pow(tf.subtract(self.reconstruction, self.x), 2.0)),
                                name="cost")
        self.optimizer = optimizer.minimize(self.cost, name="optimizer")

    def _initialize_weights(self):
        all_weights = dict()
        all_weights["w1"] = tf.Variable(xavier_init(self.n_input, self.n_hidden), name="w1")
        all_weights["b1"] = tf.Variable(tf.zeros([self.n_hidden], dtype=tf.float32), name="b1")
        all_weights["w2"] = tf.Variable(tf.zeros([self.n_hidden, self.n_input], dtype=tf.float32), name="w2")
        all_weights["b2"] = tf.Variable(tf.zeros([self.n_input], dtype=tf.float32), name="b2")
        return all_weights


def build(batch_size, noise=False):
    ae = Autoencoder(N_INPUT, N_HIDDEN, optimizer=v1.train.AdamOptimizer(learning_rate=0.01), noise=noise)
    init = v1.global_variables_initializer()
    saver = v1.train.Saver()
    names = {"x": ae.x.name, "cost": ae.cost.name, "optimizer": ae.optimizer.name,
             "hidden": ae.hidden.name, "reconstruction": ae.reconstruction.name,
             "init": [init.name], "saver": saver}
    if noise:
        names["scale"] = ae.scale.name
    return names


def make_data(rng, batch_size, steps=3):
    basis = rng.randn(3, N_INPUT)
    X = (rng.randn(batch_size * steps, 3) @ basis).astype(np.float32)
    X = (X - X.min(0)) / (X.max(0) - X.min(0))             # min-max scaled, as the examples do
    return {"X": X, "batch_size": batch_size}


def drive(sess, graph, names, data, workdir, scale=None):
    t = graph.get_tensor_by_name
    x = t(names["x"])

    def feed(X):
        out = {x: X}
        if scale is not None:
            out[t(names["scale"])] = scale
        return out

    def partial_fit(X):
        cost, opt = sess.run((t(names["cost"]), graph.get_operation_by_name(names["optimizer"])), feed(X))
        return cost

    X, batch_size = data["X"], data["batch_size"]
    n_samples = len(X)
    log = []
    avg_cost = 0.0
    for i in range(n_samples // batch_size):
        batch_xs = X[i * batch_size:(i + 1) * batch_size]
        cost = partial_fit(batch_xs)
        avg_cost += cost / n_samples * batch_size
        log.append(("cost", cost))
    log.append(("avg_cost", avg_cost))
    log.append(("total_cost", sess.run(t(names["cost"]), feed_dict=feed(batch_xs))))
    log.append(("transform", sess.run(t(names["hidden"]), feed_dict=feed(batch_xs))))
    log.append(("reconstruct", sess.run(t(names["reconstruction"]), feed_dict=feed(batch_xs))))
    return log
