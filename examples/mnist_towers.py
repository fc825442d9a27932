"""Train the seeds' MNIST CNN on N towers with an unchanged TF1 driver.

The graph is built the ordinary single-device way (``replicate.demo.build_cnn`` is plain
``tf.compat.v1`` code: placeholders ``x``/``y``, a ``loss``, ``Adam.minimize`` named
``train``). ``replicate.transform`` rewrites it into one tower per device; the driver below
feeds the same names and runs the same op, and the checkpoint it writes loads back into the
single-device graph.

    python examples/mnist_towers.py --towers 2 --steps 100
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile

import tensorflow as tf

import replicate
from replicate.check.equivalence import session_config
from replicate.demo import FULL_SIZE, SMALL_SIZE, batches, build_cnn, load

__all__ = ["main"]

log = logging.getLogger(__name__)
v1 = tf.compat.v1


def main() -> None:
    """Build, replicate, train, save, and restore into the single-device graph."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--towers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--data-dir")
    parser.add_argument("--small", action="store_true", help="16/32 filters, 256 dense")
    args = parser.parse_args()
    v1.disable_eager_execution()

    data = load(args.data_dir)
    print("data:", data.source)
    model = build_cnn(SMALL_SIZE if args.small else FULL_SIZE)       # one device, as written

    gpus = len(tf.config.list_physical_devices("GPU"))
    kind = "gpu" if gpus >= args.towers else "cpu"                    # logical CPUs otherwise
    res = replicate.transform(model.graph, [f"/{kind}:{k}" for k in range(args.towers)])
    print(res.report)

    config = session_config(cpus=args.towers if kind == "cpu" else 1)
    checkpoint = os.path.join(tempfile.mkdtemp(), "cnn")
    with res.graph.as_default(), v1.Session(config=config) as sess:
        sess.run(v1.global_variables_initializer())
        for step, (x, y) in enumerate(batches(data, args.batch, args.steps)):
            # The legacy driver: same feed names, same train op, same loss name.
            _, loss = sess.run(["train", "loss:0"], {"x:0": x, "y:0": y})
            if step % 20 == 0:
                print(f"step {step:4d}  loss {loss:.4f}")
        v1.train.Saver().save(sess, checkpoint)

    # Variables kept their names, so the single-device graph reads the checkpoint as is.
    with model.graph.as_default(), v1.Session() as sess:
        v1.train.Saver().restore(sess, checkpoint)
        x, y = next(batches(data, 512, 1, seed=1))
        acc = sess.run(model.accuracy, {model.images: x, model.labels: y})
        print(f"single-device graph restored from the {args.towers}-tower checkpoint: "
              f"accuracy {acc:.3f} on 512 examples")


if __name__ == "__main__":
    main()
