"""Sync batch norm's statistics under their original names: from the sync pass, or a batch
norm recomputed over the merged activations on the controller (what the rewrite did before).

    python benchmarks/sync_statistics.py

The corpus's official-style ResNet (tests/corpus/resnet_layers.py, 7 fused batch norms,
Momentum) with ``batch_norm="sync"`` on 2 logical CPU towers, batch 64. One process builds
both rewrites (the old one by switching off the analysis step that hands the statistics to
the sync pass) and times them in alternation: best of 3 runs of 15 steps each, twice.
"""

import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "corpus"))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import replicate  # noqa: E402
import resnet_layers as R  # noqa: E402
from replicate.passes import analyze as A  # noqa: E402

v1 = tf.compat.v1
v1.disable_v2_behavior()

def graph():
    g = tf.Graph()
    with g.as_default():
        v1.set_random_seed(1)
        names = R.build(64)
    return g, names

def steptime(res, names, steps=15, reps=3):
    g = tf.Graph()
    with g.as_default():
        v1.train.import_meta_graph(res.meta_graph_def)
        init = [g.get_operation_by_name(n) for n in names["init"]]
    cfg = v1.ConfigProto(device_count={"CPU": 3})
    rng = np.random.RandomState(0)
    x = rng.randn(64, 8, 8, 3).astype(np.float32)
    y = rng.randint(0, 4, 64).astype(np.int32)
    with v1.Session(graph=g, config=cfg) as s:
        s.run(init)
        op = g.get_operation_by_name(names["train_op"])
        feed = {names["features"]: x, names["labels"]: y}
        for _ in range(3):
            s.run(op, feed)
        best = []
        for _ in range(reps):
            t = time.perf_counter()
            for _ in range(steps):
                s.run(op, feed)
            best.append((time.perf_counter() - t) / steps)
    return min(best)


def main() -> None:
    orig = A._synchronized_statistics
    out: dict = {}
    for label, fn in [("recomputed", lambda ir, outputs, couplings: outputs), ("synchronized", orig),
                      ("recomputed", lambda ir, outputs, couplings: outputs), ("synchronized", orig)]:
        A._synchronized_statistics = fn
        g, names = graph()
        res = replicate.transform(g, ["/cpu:1", "/cpu:2"], batch_norm="sync")
        nodes = sum(1 for n in res.graph_def.node if n.op == "FusedBatchNormV3" and not n.name.startswith("tower_"))
        t = steptime(res, names)
        out.setdefault(label, []).append(t)
        print(label, f"{t*1000:.1f} ms/step", "controller FusedBatchNormV3 nodes:", nodes, flush=True)
    r, s = min(out["recomputed"]), min(out["synchronized"])
    print(f"recomputed {r*1000:.1f} ms, synchronized {s*1000:.1f} ms, ratio {s/r:.3f}")


if __name__ == "__main__":
    main()
