"""The legacy training driver: continue training a saved model. Not edited for replicate.

It imports a MetaGraphDef, restores a checkpoint, feeds ``x:0``/``y:0`` by name, runs
``train`` by name and fetches ``loss:0`` and ``accuracy:0``, then saves a checkpoint.
Pointed at ``model.meta`` it trains on one device; pointed at the output of
``replicate convert`` it trains on every device, with the same numbers.

    python driver.py GRAPH CHECKPOINT --data data.npz --steps 10 --save OUT_PREFIX
"""

from __future__ import annotations

import argparse
import logging

import numpy as np
import tensorflow as tf

__all__ = ["main"]

log = logging.getLogger(__name__)
v1 = tf.compat.v1


def main(argv: list[str] | None = None) -> list[float]:
    """Train ``--steps`` steps from CHECKPOINT; return the losses."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("graph", help="a .meta file")
    parser.add_argument("checkpoint", help="checkpoint prefix to start from")
    parser.add_argument("--data", required=True, help="data.npz written by legacy_train.py")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--save", required=True, help="checkpoint prefix to write")
    args = parser.parse_args(argv)
    v1.disable_eager_execution()
    data = np.load(args.data)
    xs, ys = data["x"], data["y"]
    # Four logical CPU devices so that a graph converted for /cpu:0../cpu:3 runs on a
    # machine without GPUs; a graph converted for /gpu:k needs nothing here.
    config = v1.ConfigProto(device_count={"CPU": 4})
    losses = []
    with tf.Graph().as_default():
        saver = v1.train.import_meta_graph(args.graph)
        with v1.Session(config=config) as sess:
            saver.restore(sess, args.checkpoint)
            for step in range(args.steps):
                lo = step * args.batch % len(xs)
                feed = {"x:0": xs[lo:lo + args.batch], "y:0": ys[lo:lo + args.batch]}
                _, loss, accuracy = sess.run(["train", "loss:0", "accuracy:0"], feed)
                losses.append(float(loss))
                print(f"step {step:3d}  loss {loss:.6f}  accuracy {accuracy:.3f}")
            print("saved", saver.save(sess, args.save))
    return losses


if __name__ == "__main__":
    main()
