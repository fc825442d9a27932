"""Where replicate.transform spends its time: cProfile of one transform of a cached graph.

    python benchmarks/profile_transform.py deep_600 --towers 2
    python benchmarks/profile_transform.py inception_v3 --towers 4 --top 30

The graph is built (and cached) by ``compile_time.py``'s worker if it is not cached yet. Prints
the passes' times and the functions with the most own time and the most cumulative time, and
writes the same text to ``benchmarks/results/profile_<graph>_<towers>.txt``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import logging
import os
import pstats
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import compile_time  # noqa: E402

__all__ = ["main", "profile"]

log = logging.getLogger(__name__)


def _load(name: str, cache: str):
    import tensorflow as tf

    path = os.path.join(cache, f"{name}.meta")
    if not os.path.exists(path):
        os.makedirs(cache, exist_ok=True)
        subprocess.run([sys.executable, compile_time.__file__, "--worker", "build", name, path],
                       check=True, capture_output=True)
    meta = tf.compat.v1.MetaGraphDef()
    with open(path, "rb") as f:
        meta.ParseFromString(f.read())
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.train.import_meta_graph(meta, clear_devices=False)
    return graph


def profile(graph, towers: int, top: int) -> tuple[str, float]:
    """Profile one transform; return the report text and the transform's seconds."""
    import graphs
    import replicate

    replicate.transform(graphs.build("deep_2"), ["/cpu:0", "/cpu:1"])   # warm-up: imports, caches
    profiler = cProfile.Profile()
    profiler.enable()
    res = replicate.transform(graph, [f"/cpu:{i}" for i in range(towers)])
    profiler.disable()
    out = io.StringIO()
    out.write(f"transform {res.transform_seconds:.2f} s (under cProfile), "
              f"{len(graph.as_graph_def().node):,} -> {len(res.graph_def.node):,} nodes\n")
    out.write("passes: " + ", ".join(f"{r.name} {r.millis / 1e3:.2f} s" for r in res.records) + "\n")
    for key, title in (("tottime", "own time"), ("cumulative", "cumulative time")):
        out.write(f"\n--- top {top} by {title} ---\n")
        stats = pstats.Stats(profiler, stream=out)
        stats.strip_dirs().sort_stats(key).print_stats(top)
    return out.getvalue(), res.transform_seconds


def main(argv: list[str] | None = None) -> int:
    """Profile and print."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("graph")
    parser.add_argument("--towers", type=int, default=2)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--cache", default=compile_time._CACHE)
    args = parser.parse_args(argv)
    import tensorflow as tf

    tf.compat.v1.disable_eager_execution()
    graph = _load(args.graph, args.cache)
    text, _ = profile(graph, args.towers, args.top)
    print(text)
    os.makedirs(common.RESULTS_DIR, exist_ok=True)
    path = os.path.join(common.RESULTS_DIR, f"profile_{args.graph}_{args.towers}.txt")
    with open(path, "w") as f:
        f.write(text)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
