"""A small pix2pix-style conditional GAN, written in the idiom of the well-known 2017 TF1 port:
a U-Net generator (strided convolutions down, transposed convolutions up, skip connections,
dropout in the first decoder layers), a PatchGAN discriminator on the input concatenated with
the real or generated target, ``tf.compat.v1.layers.batch_normalization(training=True)``,
losses with an ``EPS`` inside the logs, an L1 term, and the generator's train op built under
``tf.control_dependencies([discrim_train])``: one ``sess.run`` of ``train`` updates the
discriminator, then computes the generator's gradients against the updated discriminator and
applies them. An ``ExponentialMovingAverage`` of the three losses and an increment of the
global step run in the same step."""

import numpy as np
import tensorflow as tf

v1 = tf.compat.v1

FAMILY = "pix2pix (conditional GAN)"
DESCRIPTION = ("pix2pix style: `inputs`/`targets` [None, 8, 8, 2] dynamic, U-Net generator "
               "(2 x conv stride 2 -> lrelu -> BN down, 2 x `conv2d_transpose` -> BN -> relu "
               "up, skip concats, dropout 0.5 in the first decoder layer), PatchGAN "
               "discriminator on concat(input, target), `layers.batch_normalization("
               "training=True)`, `-log(p + EPS)` losses plus 100 x L1, Adam for D, then G's "
               "`compute_gradients` under `control_dependencies([discrim_train])`, EMA of the "
               "losses, `train = group(update_losses, incr_global_step, gen_train)`")
DRIVER = ("per step `sess.run({'train', 'global_step', 'discrim_loss', 'gen_loss_GAN', "
          "'gen_loss_L1'}, {inputs, targets})` fetching the losses' moving averages, as the "
          "original's progress display; finally the generator's outputs on the first batch")
BATCHES = [6, 7]
#: Ill-conditioned, so not judged: the PatchGAN's last bias gets the gradient
#: mean(p_fake) - mean(1 - p_real), two terms near 0.5 that cancel, and Adam scales the
#: rounding left over. Its first-moment slot differs from one device by 1.7e-5 and 2.4e-5 at
#: 2 and 3 towers on the batch of 6 (every other variable and fetch by at most 6.1e-6, a
#: one-tower rewrite, which only reorders sums, already by 6.1e-6); with plain SGD
#: (``sync_sgd``) every variable, this bias included, stays within 1.2e-6.
NONDETERMINISTIC = {"variables": ["discriminator/layer_3/bias"], "fetches": []}
SIZE, CHANNELS, NGF, NDF = 8, 2, 4, 4
EPS = 1e-12
LR, BETA1, L1_WEIGHT, GAN_WEIGHT = 0.002, 0.5, 100.0, 1.0

VARIANTS = {
    "sync": {"build": {"seed": 7}, "options": {"batch_norm": "sync"},
             "expect": {"exact": True, "why": "the phases (D's update, then G's gradients against "
                        "the updated D) are kept; batch statistics over the global batch; the "
                        "dropout is seeded and drawn for the global batch"}},
    "sync_sgd": {"build": {"seed": 7, "optimizer": "sgd"}, "options": {"batch_norm": "sync"},
                 "expect": {"exact": True, "why": "the same with plain SGD"}},
    "tower0": {"build": {"seed": 7},
               "expect": {"exact": False, "reasons_only": ["batch norm", "batchnorm", "moments",
                                                           "batch reduction"],
                          "why": "each tower normalizes by its own slice (batch_norm='tower0')"}},
    "reference_variables": {"build": {"seed": 7, "resource": False}, "options": {"batch_norm": "sync"},
                            "expect": {"exact": True, "why": "G's gradients read D's reference "
                                       "variables as updated in place, as on one device: each "
                                       "tower reads them again after D's update"}},
}


def _conv(x, channels, name, bias=True):
    init = v1.random_normal_initializer(0, 0.02, seed=1)
    return v1.layers.conv2d(x, channels, kernel_size=4, strides=(2, 2), padding="same",
                            kernel_initializer=init, use_bias=bias, name=name)


def _deconv(x, channels, name, bias=True):
    init = v1.random_normal_initializer(0, 0.02, seed=2)
    return v1.layers.conv2d_transpose(x, channels, kernel_size=4, strides=(2, 2), padding="same",
                                      kernel_initializer=init, use_bias=bias, name=name)


def _lrelu(x, a=0.2):
    return tf.maximum(a * x, x)


def _batchnorm(x, name):
    return v1.layers.batch_normalization(x, axis=3, epsilon=1e-5, momentum=0.1, training=True,
                                         gamma_initializer=v1.random_normal_initializer(1.0, 0.02, seed=3),
                                         name=name)


def generator(inputs, seed):
    # bias-free convolutions before batch norm (a bias there gets a gradient that is zero up
    # to rounding, which Adam would scale into noise)
    e1 = _lrelu(_conv(inputs, NGF, "encoder_1"))
    e2 = _lrelu(_batchnorm(_conv(e1, NGF * 2, "encoder_2", bias=False), "encoder_2_bn"))
    d2 = _batchnorm(_deconv(tf.nn.relu(e2), NGF, "decoder_2", bias=False), "decoder_2_bn")
    d2 = tf.nn.dropout(d2, rate=0.5, seed=seed)
    d1 = _deconv(tf.nn.relu(tf.concat([d2, e1], axis=3)), CHANNELS, "decoder_1")
    return tf.tanh(d1)


def discriminator(inputs, targets):
    h = tf.concat([inputs, targets], axis=3)
    h = _lrelu(_conv(h, NDF, "layer_1"))
    h = _lrelu(_batchnorm(_conv(h, NDF * 2, "layer_2", bias=False), "layer_2_bn"))
    return tf.sigmoid(v1.layers.conv2d(h, 1, kernel_size=2, padding="same", name="layer_3",
                                       kernel_initializer=v1.random_normal_initializer(0, 0.02, seed=4)))


def build(batch_size, seed=None, optimizer="adam", resource=True):
    v1.set_random_seed(11)
    inputs = v1.placeholder(tf.float32, [None, SIZE, SIZE, CHANNELS], name="inputs")
    targets = v1.placeholder(tf.float32, [None, SIZE, SIZE, CHANNELS], name="targets")
    with v1.variable_scope("model", use_resource=resource):
        with v1.variable_scope("generator"):
            outputs = generator(inputs, seed)
        with v1.name_scope("real_discriminator"):
            with v1.variable_scope("discriminator"):
                predict_real = discriminator(inputs, targets)
        with v1.name_scope("fake_discriminator"):
            with v1.variable_scope("discriminator", reuse=True):
                predict_fake = discriminator(inputs, outputs)
    with tf.name_scope("discriminator_loss"):
        discrim_loss = tf.reduce_mean(-(tf.math.log(predict_real + EPS) + tf.math.log(1 - predict_fake + EPS)))
    with tf.name_scope("generator_loss"):
        gen_loss_GAN = tf.reduce_mean(-tf.math.log(predict_fake + EPS))
        gen_loss_L1 = tf.reduce_mean(tf.abs(targets - outputs))
        gen_loss = gen_loss_GAN * GAN_WEIGHT + gen_loss_L1 * L1_WEIGHT

    def make():
        if optimizer == "sgd":
            return v1.train.GradientDescentOptimizer(LR * 0.1)
        return v1.train.AdamOptimizer(LR, BETA1)

    with tf.name_scope("discriminator_train"):
        discrim_tvars = [var for var in v1.trainable_variables() if var.name.startswith("model/discriminator")]
        discrim_optim = make()
        discrim_grads_and_vars = discrim_optim.compute_gradients(discrim_loss, var_list=discrim_tvars)
        discrim_train = discrim_optim.apply_gradients(discrim_grads_and_vars)
    with tf.name_scope("generator_train"):
        with tf.control_dependencies([discrim_train]):
            gen_tvars = [var for var in v1.trainable_variables() if var.name.startswith("model/generator")]
            gen_optim = make()
            gen_grads_and_vars = gen_optim.compute_gradients(gen_loss, var_list=gen_tvars)
            gen_train = gen_optim.apply_gradients(gen_grads_and_vars)
    ema = v1.train.ExponentialMovingAverage(decay=0.99)
    update_losses = ema.apply([discrim_loss, gen_loss_GAN, gen_loss_L1])
    global_step = v1.train.get_or_create_global_step()
    incr_global_step = v1.assign(global_step, global_step + 1)
    train = tf.group(update_losses, incr_global_step, gen_train, name="train")
    saver = v1.train.Saver(max_to_keep=1)
    init = v1.global_variables_initializer()
    return {"inputs": inputs.name, "targets": targets.name, "train": train.name,
            "global_step": global_step.name, "outputs": outputs.name,
            "discrim_loss": ema.average(discrim_loss).name,
            "gen_loss_GAN": ema.average(gen_loss_GAN).name,
            "gen_loss_L1": ema.average(gen_loss_L1).name,
            "init": [init.name], "saver": saver}


def make_data(rng, batch_size, steps=3):
    grid = np.linspace(-1, 1, SIZE, dtype=np.float32)
    pairs = []
    for _ in range(steps):
        a = grid[None, :, None, None] * rng.uniform(0.3, 1.0, (batch_size, 1, 1, CHANNELS))
        a = (a + 0.1 * rng.randn(batch_size, SIZE, SIZE, CHANNELS)).astype(np.float32)
        b = np.tanh(np.flip(a, axis=2) * 1.5 + 0.05 * rng.randn(*a.shape)).astype(np.float32)
        pairs.append((a, b))
    return {"pairs": pairs}


def drive(sess, graph, names, data, workdir):
    t = graph.get_tensor_by_name
    fetches = {"train": graph.get_operation_by_name(names["train"]),
               "global_step": t(names["global_step"]),
               "discrim_loss": t(names["discrim_loss"]), "gen_loss_GAN": t(names["gen_loss_GAN"]),
               "gen_loss_L1": t(names["gen_loss_L1"])}
    log = []
    for a, b in data["pairs"]:
        results = sess.run(fetches, {t(names["inputs"]): a, t(names["targets"]): b})
        log += [(key, results[key]) for key in ("global_step", "discrim_loss", "gen_loss_GAN", "gen_loss_L1")]
    a, b = data["pairs"][0]
    log.append(("outputs", sess.run(t(names["outputs"]), {t(names["inputs"]): a})))
    return log
