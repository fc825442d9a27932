"""A legacy single-device TF1 training script: trains a small CNN, saves .meta + checkpoint.

This stands for the code you inherited. It knows nothing about replicate: placeholders
``x`` and ``y``, a ``loss``, ``accuracy`` and ``predictions``, ``Adam.minimize`` named
``train``, a ``tf.train.Saver``. It writes into ``--out``:

    model.meta          the MetaGraphDef (what `replicate convert` reads)
    ckpt/model-<step>   the checkpoint
    data.npz            the (synthetic) training set the driver keeps reading

    python legacy_train.py --out /tmp/retrofit_legacy --steps 20
"""

from __future__ import annotations

import argparse
import logging
import os
import warnings

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # tf.compat.v1.layers need tf-keras
# This script is the legacy code on purpose: tf.compat.v1.layers is what it used. Their
# "is deprecated" notices (one per layer) say nothing a reader of this example needs.
warnings.filterwarnings("ignore", message=r"`tf\.layers\.\w+` is deprecated", category=UserWarning)

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

__all__ = ["build", "make_data", "main"]

log = logging.getLogger(__name__)
v1 = tf.compat.v1


def make_data(examples: int = 960, size: int = 14, classes: int = 10, seed: int = 0):
    """Images with a class-dependent blob and noise (learnable, deterministic)."""
    rng = np.random.RandomState(seed)
    labels = rng.randint(0, classes, examples)
    images = rng.rand(examples, size, size).astype(np.float32) * 0.5
    for i, label in enumerate(labels):
        row, col = divmod(label, 4)
        images[i, 3 * row:3 * row + 4, 3 * col:3 * col + 4] += 1.0
    return images.reshape(examples, size * size), labels.astype(np.int64)


def build(size: int = 14, classes: int = 10) -> tf.Graph:
    """The model, written the way TF1 code was: one device, names for the driver."""
    graph = tf.Graph()
    with graph.as_default():
        v1.set_random_seed(42)
        x = v1.placeholder(tf.float32, [None, size * size], name="x")
        y = v1.placeholder(tf.int64, [None], name="y")
        net = tf.reshape(x, [-1, size, size, 1])
        net = v1.layers.conv2d(net, 8, 3, padding="same", activation=tf.nn.relu, name="conv1")
        net = v1.layers.max_pooling2d(net, 2, 2, name="pool1")
        net = v1.layers.conv2d(net, 16, 3, padding="same", activation=tf.nn.relu, name="conv2")
        net = v1.layers.max_pooling2d(net, 2, 2, name="pool2")
        net = v1.layers.flatten(net)
        net = v1.layers.dense(net, 64, activation=tf.nn.relu, name="fc")
        logits = tf.identity(v1.layers.dense(net, classes, name="out"), name="logits")
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits),
                              name="loss")
        predictions = tf.argmax(logits, 1, name="predictions")
        tf.reduce_mean(tf.cast(tf.equal(predictions, y), tf.float32), name="accuracy")
        step = v1.train.get_or_create_global_step()
        v1.train.AdamOptimizer(1e-3).minimize(loss, global_step=step, name="train")
    return graph


def main(argv: list[str] | None = None) -> str:
    """Train ``--steps`` on one device, save; return the checkpoint path."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="/tmp/retrofit_legacy")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args(argv)
    v1.disable_eager_execution()
    os.makedirs(args.out, exist_ok=True)
    xs, ys = make_data()
    np.savez(os.path.join(args.out, "data.npz"), x=xs, y=ys)
    graph = build()
    with graph.as_default(), v1.Session() as sess:
        saver = v1.train.Saver(v1.global_variables())
        sess.run(v1.global_variables_initializer())
        for step in range(args.steps):
            lo = step * args.batch % len(xs)
            feed = {"x:0": xs[lo:lo + args.batch], "y:0": ys[lo:lo + args.batch]}
            _, loss = sess.run(["train", "loss:0"], feed)
        print(f"single device, {args.steps} steps: loss {loss:.4f}")
        path = saver.save(sess, os.path.join(args.out, "ckpt", "model"), global_step=args.steps)
        saver.export_meta_graph(os.path.join(args.out, "model.meta"))
    print(f"saved {args.out}/model.meta and {path}")
    return path


if __name__ == "__main__":
    main()
