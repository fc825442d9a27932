"""The CIFAR-10 tutorial CNN, ported to placeholders: conv/LRN/pool twice, two weight-decayed
fully connected layers, a 'losses' collection summed into total_loss, staircase-decayed
learning rate, an ExponentialMovingAverage of the losses that the gradients wait for, and
moving averages of the trainable variables applied after the update."""

import numpy as np
import tensorflow as tf

v1 = tf.compat.v1

FAMILY = "tutorial CNN"
DESCRIPTION = ("cifar10-tutorial style: static batch, conv+LRN+pool x2, `reshape(pool2, "
               "[batch_size, -1])`, weight decay added to a `losses` collection, staircase "
               "`exponential_decay`, an EMA of the losses the gradients wait for, an EMA of the "
               "variables after `apply_gradients`, activation summaries")
DRIVER = ("`sess.run([train_op, loss])` per step with images/labels fed, the merged summary op "
          "every other step, `in_top_k` precision fetched at the end")
BATCHES = [6, 7]

IMAGE, CHANNELS, CLASSES = 8, 3, 5
MOVING_AVERAGE_DECAY = 0.9999
NUM_EXAMPLES_PER_EPOCH = 24
NUM_EPOCHS_PER_DECAY = 0.5
LEARNING_RATE_DECAY_FACTOR = 0.5
INITIAL_LEARNING_RATE = 0.1

VARIANTS = {
    "tutorial": {"expect": {"exact": True, "why": "every batch reduction is a mean; the loss "
                            "EMA can read the global mean loss"}},
}


def _activation_summary(x):
    name = x.op.name
    v1.summary.histogram(name + "/activations", x)
    v1.summary.scalar(name + "/sparsity", tf.nn.zero_fraction(x))


def _variable_on_cpu(name, shape, initializer):
    with tf.device("/cpu:0"):
        return v1.get_variable(name, shape, initializer=initializer, dtype=tf.float32)


def _variable_with_weight_decay(name, shape, stddev, wd):
    var = _variable_on_cpu(name, shape, v1.truncated_normal_initializer(stddev=stddev))
    if wd is not None:
        weight_decay = tf.multiply(tf.nn.l2_loss(var), wd, name="weight_loss")
        v1.add_to_collection("losses", weight_decay)
    return var


def inference(images, batch_size):
    with v1.variable_scope("conv1") as scope:
        kernel = _variable_with_weight_decay("weights", [3, 3, CHANNELS, 8], 5e-2, None)
        conv = tf.nn.conv2d(images, kernel, [1, 1, 1, 1], padding="SAME")
        biases = _variable_on_cpu("biases", [8], v1.constant_initializer(0.0))
        conv1 = tf.nn.relu(tf.nn.bias_add(conv, biases), name=scope.name)
        _activation_summary(conv1)
    pool1 = tf.nn.max_pool(conv1, ksize=[1, 3, 3, 1], strides=[1, 2, 2, 1], padding="SAME", name="pool1")
    norm1 = tf.nn.lrn(pool1, 4, bias=1.0, alpha=0.001 / 9.0, beta=0.75, name="norm1")
    with v1.variable_scope("conv2") as scope:
        kernel = _variable_with_weight_decay("weights", [3, 3, 8, 8], 5e-2, None)
        conv = tf.nn.conv2d(norm1, kernel, [1, 1, 1, 1], padding="SAME")
        biases = _variable_on_cpu("biases", [8], v1.constant_initializer(0.1))
        conv2 = tf.nn.relu(tf.nn.bias_add(conv, biases), name=scope.name)
        _activation_summary(conv2)
    norm2 = tf.nn.lrn(conv2, 4, bias=1.0, alpha=0.001 / 9.0, beta=0.75, name="norm2")
    pool2 = tf.nn.max_pool(norm2, ksize=[1, 3, 3, 1], strides=[1, 2, 2, 1], padding="SAME", name="pool2")
    with v1.variable_scope("local3") as scope:
        reshape = tf.reshape(pool2, [batch_size, -1])
        dim = reshape.get_shape()[1]
        weights = _variable_with_weight_decay("weights", [dim, 16], 0.04, 0.004)
        biases = _variable_on_cpu("biases", [16], v1.constant_initializer(0.1))
        local3 = tf.nn.relu(tf.matmul(reshape, weights) + biases, name=scope.name)
        _activation_summary(local3)
    with v1.variable_scope("local4") as scope:
        weights = _variable_with_weight_decay("weights", [16, 12], 0.04, 0.004)
        biases = _variable_on_cpu("biases", [12], v1.constant_initializer(0.1))
        local4 = tf.nn.relu(tf.matmul(local3, weights) + biases, name=scope.name)
        _activation_summary(local4)
    with v1.variable_scope("softmax_linear") as scope:
        weights = _variable_with_weight_decay("weights", [12, CLASSES], 1 / 12.0, None)
        biases = _variable_on_cpu("biases", [CLASSES], v1.constant_initializer(0.0))
        softmax_linear = tf.add(tf.matmul(local4, weights), biases, name=scope.name)
        _activation_summary(softmax_linear)
    return softmax_linear


def loss(logits, labels):
    labels = tf.cast(labels, tf.int64)
    cross_entropy = tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=labels, logits=logits, name="cross_entropy_per_example")
    cross_entropy_mean = tf.reduce_mean(cross_entropy, name="cross_entropy")
    v1.add_to_collection("losses", cross_entropy_mean)
    return tf.add_n(v1.get_collection("losses"), name="total_loss")


def _add_loss_summaries(total_loss):
    loss_averages = v1.train.ExponentialMovingAverage(0.9, name="avg")
    losses = v1.get_collection("losses")
    loss_averages_op = loss_averages.apply(losses + [total_loss])
    for l in losses + [total_loss]:
        v1.summary.scalar(l.op.name + " (raw)", l)
        v1.summary.scalar(l.op.name, loss_averages.average(l))
    return loss_averages_op


def train(total_loss, global_step, batch_size):
    num_batches_per_epoch = NUM_EXAMPLES_PER_EPOCH / batch_size
    decay_steps = int(num_batches_per_epoch * NUM_EPOCHS_PER_DECAY)
    lr = v1.train.exponential_decay(INITIAL_LEARNING_RATE, global_step, decay_steps,
                                    LEARNING_RATE_DECAY_FACTOR, staircase=True)
    v1.summary.scalar("learning_rate", lr)
    loss_averages_op = _add_loss_summaries(total_loss)
    with tf.control_dependencies([loss_averages_op]):
        opt = v1.train.GradientDescentOptimizer(lr)
        grads = opt.compute_gradients(total_loss)
    apply_gradient_op = opt.apply_gradients(grads, global_step=global_step)
    for var in v1.trainable_variables():
        v1.summary.histogram(var.op.name, var)
    for grad, var in grads:
        if grad is not None:
            v1.summary.histogram(var.op.name + "/gradients", grad)
    variable_averages = v1.train.ExponentialMovingAverage(MOVING_AVERAGE_DECAY, global_step)
    with tf.control_dependencies([apply_gradient_op]):
        variables_averages_op = variable_averages.apply(v1.trainable_variables())
    with tf.control_dependencies([apply_gradient_op, variables_averages_op]):
        train_op = tf.no_op(name="train")
    return train_op


def build(batch_size):
    global_step = v1.train.get_or_create_global_step()
    images = v1.placeholder(tf.float32, [batch_size, IMAGE, IMAGE, CHANNELS], name="images")
    labels = v1.placeholder(tf.int32, [batch_size], name="labels")
    logits = inference(images, batch_size)
    total_loss = loss(logits, labels)
    train_op = train(total_loss, global_step, batch_size)
    top_k_op = v1.nn.in_top_k(logits, labels, 1, name="top_k")
    summary_op = v1.summary.merge_all()
    saver = v1.train.Saver(v1.global_variables())
    init = v1.global_variables_initializer()
    return {"images": images.name, "labels": labels.name, "loss": total_loss.name,
            "train_op": train_op.name, "summary_op": summary_op.name, "top_k": top_k_op.name,
            "init": [init.name], "saver": saver}


def make_data(rng, batch_size, steps=3):
    out = []
    for _ in range(steps + 1):
        labels = rng.randint(0, CLASSES, batch_size).astype(np.int32)
        images = rng.randn(batch_size, IMAGE, IMAGE, CHANNELS).astype(np.float32)
        images[:, :2, :2, 0] += labels[:, None, None]          # something to learn
        out.append((images, labels))
    return out


def drive(sess, graph, names, data, workdir):
    t = graph.get_tensor_by_name
    train_op = graph.get_operation_by_name(names["train_op"])
    images, labels, loss_t = t(names["images"]), t(names["labels"]), t(names["loss"])
    log = []
    for step, (x, y) in enumerate(data[:-1]):
        _, loss_value = sess.run([train_op, loss_t], feed_dict={images: x, labels: y})
        assert not np.isnan(loss_value), "Model diverged with loss = NaN"
        log.append(("loss", loss_value))
        if step % 2 == 0:
            log.append(("summary", sess.run(t(names["summary_op"]), feed_dict={images: x, labels: y})))
    x, y = data[-1]
    log.append(("precision", sess.run([t(names["top_k"])], feed_dict={images: x, labels: y})[0]))
    return log
