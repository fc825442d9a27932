"""A small ResNet v1 built with ``tf.compat.v1.layers`` in the style of the official TF1
ResNet: fixed padding for strided convolutions, fused batch norm (momentum 0.997), building
blocks with a projection shortcut, global average pooling by ``reduce_mean``, weight decay
over the non-batch-norm variables, a piecewise-constant learning rate on the global step,
momentum SGD, ``train_op = tf.group(minimize_op, update_ops)`` and a streaming accuracy
metric (local variables) fetched by the driver."""

import numpy as np
import tensorflow as tf

v1 = tf.compat.v1

FAMILY = "ResNet (v1 layers, BN)"
DESCRIPTION = ("official-resnet style: `x` [None, 8, 8, 3] dynamic, `conv2d_fixed_padding`, "
               "`v1.layers.batch_normalization(training=True, fused=True)`, two building "
               "blocks (one strided with a projection shortcut), `reduce_mean` pooling, "
               "`v1.losses.sparse_softmax_cross_entropy` + weight decay over non-BN variables, "
               "`piecewise_constant` lr, Momentum, `train_op = tf.group(minimize_op, "
               "UPDATE_OPS)`, `v1.metrics.accuracy` (local variables)")
DRIVER = ("per step `sess.run([train_op, cross_entropy, learning_rate, train_accuracy])` "
          "(the metric's update op, as a logging hook fetches it) with x, y fed; `init` runs "
          "global and local initializers")
BATCHES = [6, 7]

CLASSES, WEIGHT_DECAY, BN_MOMENTUM, BN_EPSILON = 4, 2e-4, 0.997, 1e-5

VARIANTS = {
    "tower0": {"expect": {"exact": False, "reasons_only": ["batch norm", "batchnorm", "state update",
                                                           "batch reduction"],
                          "why": "batch_norm='tower0': each tower normalizes by its slice, "
                          "moving averages from tower 0"}},
    "sync": {"options": {"batch_norm": "sync"},
             "expect": {"exact": True, "why": "global batch statistics make batch norm exact; "
                        "the streaming accuracy reads the merged predictions"}},
    # the 2017 idiom: `training=is_training`, a placeholder, so batch norm and its moving
    # averages live in tf.cond branches (v2 If bodies)
    "flag": {"build": {"flag": True, "dropout": 0.3}, "options": {"batch_norm": "sync"},
             "expect": {"exact": True, "why": "batch norm under a training placeholder: "
                        "synchronized statistics, moving averages updated once per step inside "
                        "the cond; `v1.layers.dropout(training=is_training)` before the dense "
                        "layer draws its mask in the cond branch at the global batch's shape"}},
}


def batch_norm(inputs, training):
    return v1.layers.batch_normalization(inputs=inputs, axis=3, momentum=BN_MOMENTUM,
                                         epsilon=BN_EPSILON, center=True, scale=True,
                                         training=training, fused=True)


def fixed_padding(inputs, kernel_size):
    pad_total = kernel_size - 1
    pad_beg = pad_total // 2
    pad_end = pad_total - pad_beg
    return tf.pad(inputs, [[0, 0], [pad_beg, pad_end], [pad_beg, pad_end], [0, 0]])


def conv2d_fixed_padding(inputs, filters, kernel_size, strides):
    if strides > 1:
        inputs = fixed_padding(inputs, kernel_size)
    return v1.layers.conv2d(inputs=inputs, filters=filters, kernel_size=kernel_size,
                            strides=strides, padding=("SAME" if strides == 1 else "VALID"),
                            use_bias=False, kernel_initializer=v1.variance_scaling_initializer())


def building_block_v1(inputs, filters, training, projection_shortcut, strides):
    shortcut = inputs
    if projection_shortcut is not None:
        shortcut = projection_shortcut(inputs)
        shortcut = batch_norm(shortcut, training)
    inputs = conv2d_fixed_padding(inputs, filters, 3, strides)
    inputs = batch_norm(inputs, training)
    inputs = tf.nn.relu(inputs)
    inputs = conv2d_fixed_padding(inputs, filters, 3, 1)
    inputs = batch_norm(inputs, training)
    inputs += shortcut
    return tf.nn.relu(inputs)


def block_layer(inputs, filters, blocks, strides, training, name):
    def projection_shortcut(inputs):
        return conv2d_fixed_padding(inputs, filters, 1, strides)
    inputs = building_block_v1(inputs, filters, training, projection_shortcut, strides)
    for _ in range(1, blocks):
        inputs = building_block_v1(inputs, filters, training, None, 1)
    return tf.identity(inputs, name)


def model(inputs, training, dropout=0.0):
    with v1.variable_scope("resnet_model"):
        inputs = conv2d_fixed_padding(inputs, 8, 3, 1)
        inputs = tf.identity(inputs, "initial_conv")
        inputs = batch_norm(inputs, training)
        inputs = tf.nn.relu(inputs)
        inputs = block_layer(inputs, 8, 1, 1, training, "block_layer1")
        inputs = block_layer(inputs, 12, 1, 2, training, "block_layer2")
        inputs = tf.reduce_mean(inputs, [1, 2], keepdims=True)
        inputs = tf.identity(inputs, "final_reduce_mean")
        inputs = tf.squeeze(inputs, [1, 2])
        if dropout:
            inputs = v1.layers.dropout(inputs, rate=dropout, training=training, seed=5)
        inputs = v1.layers.dense(inputs=inputs, units=CLASSES)
        return tf.identity(inputs, "final_dense")


def build(batch_size, flag=False, dropout=0.0):
    features = v1.placeholder(tf.float32, [None, 8, 8, 3], name="features")
    labels = v1.placeholder(tf.int32, [None], name="labels")
    training = v1.placeholder_with_default(True, [], name="is_training") if flag else True
    logits = model(features, training=training, dropout=dropout)
    predictions = {"classes": tf.argmax(logits, axis=1),
                   "probabilities": tf.nn.softmax(logits, name="softmax_tensor")}
    cross_entropy = v1.losses.sparse_softmax_cross_entropy(logits=logits, labels=labels)
    cross_entropy = tf.identity(cross_entropy, name="cross_entropy")
    v1.summary.scalar("cross_entropy", cross_entropy)

    def exclude_batch_norm(name):
        return "batch_normalization" not in name
    l2_loss = WEIGHT_DECAY * tf.add_n([tf.nn.l2_loss(tf.cast(v, tf.float32))
                                       for v in v1.trainable_variables() if exclude_batch_norm(v.name)])
    v1.summary.scalar("l2_loss", l2_loss)
    loss = cross_entropy + l2_loss
    global_step = v1.train.get_or_create_global_step()
    learning_rate = v1.train.piecewise_constant(tf.cast(global_step, tf.int32), [2], [0.1, 0.01])
    learning_rate = tf.identity(learning_rate, name="learning_rate")
    v1.summary.scalar("learning_rate", learning_rate)
    optimizer = v1.train.MomentumOptimizer(learning_rate=learning_rate, momentum=0.9)
    minimize_op = optimizer.minimize(loss, global_step)
    update_ops = v1.get_collection(v1.GraphKeys.UPDATE_OPS)
    train_op = tf.group(minimize_op, update_ops, name="train_op")
    accuracy = v1.metrics.accuracy(labels, predictions["classes"])
    tf.identity(accuracy[1], name="train_accuracy")
    v1.summary.scalar("train_accuracy", accuracy[1])
    init = [v1.global_variables_initializer(), v1.local_variables_initializer()]
    saver = v1.train.Saver()
    return {"features": features.name, "labels": labels.name, "train_op": train_op.name,
            "fetch": ["cross_entropy:0", "learning_rate:0", "train_accuracy:0"],
            "init": [op.name for op in init], "saver": saver}


def make_data(rng, batch_size, steps=3):
    out = []
    for _ in range(steps):
        y = rng.randint(0, CLASSES, batch_size).astype(np.int32)
        x = rng.randn(batch_size, 8, 8, 3).astype(np.float32)
        x[:, :, :, 0] += y[:, None, None] * 0.5
        out.append((x, y))
    return out


def drive(sess, graph, names, data, workdir):
    t = graph.get_tensor_by_name
    train_op = graph.get_operation_by_name(names["train_op"])
    fetch = [t(n) for n in names["fetch"]]
    log = []
    for x, y in data:
        _, ce, lr, acc = sess.run([train_op] + fetch, {t(names["features"]): x, t(names["labels"]): y})
        log += [("cross_entropy", ce), ("learning_rate", lr), ("train_accuracy", acc)]
    return log
