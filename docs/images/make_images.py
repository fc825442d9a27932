"""Render the example pictures of docs/show.md and the README (needs the test extras and Graphviz).

    python docs/images/make_images.py            # all pictures, ~1 min on 2 cores
    python docs/images/make_images.py mlp cnn    # some of them

Each picture is what ``replicate show`` draws for a graph saved by its model builder:
a small MLP on 2 towers, the seeds' MNIST CNN on 2 towers, a tf-slim ResNet-50 on 4.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import time

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests"))

import tensorflow as tf  # noqa: E402

from replicate.viz import show  # noqa: E402

__all__ = ["PICTURES", "main"]

log = logging.getLogger(__name__)
tf.compat.v1.disable_eager_execution()


def _mlp():
    import models

    return models.mlp("adam").graph


def _cnn():
    from replicate.demo.model import build_cnn

    return build_cnn().graph


def _resnet50():
    import breadth_models

    return breadth_models.slim_resnet(full=True).graph


#: name -> (graph builder, towers, formats).
PICTURES = {
    "mlp": (_mlp, 2, ("png", "svg")),
    "cnn": (_cnn, 2, ("png", "svg")),
    "resnet50": (_resnet50, 4, ("png", "svg")),
}


def main(names: list[str]) -> int:
    """Render the pictures called ``names`` (all when empty) into this directory."""
    for name in names or list(PICTURES):
        build, towers, formats = PICTURES[name]
        with tempfile.TemporaryDirectory() as tmp:
            meta = os.path.join(tmp, f"{name}.meta")
            tf.compat.v1.train.export_meta_graph(meta, graph=build())
            for fmt in formats:
                out = os.path.join(HERE, f"{name}_x{towers}.{fmt}")
                start = time.perf_counter()
                shown = show.show(meta, [f"/gpu:{k}" for k in range(towers)], out, force=True)
                print(f"{out}: {shown.boxes.number_of_nodes()} boxes, "
                      f"{time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
