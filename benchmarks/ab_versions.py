"""Step time of the same transform built by two replicate versions, timed side by side.

Used to measure the max-pooling guard change (``replicate/passes/guard.py``) on the seeds' CNN
with accumulation. Build each version's graphs with that version on ``sys.path`` first, then
time all of them (and the single-device graph) in one process, interleaved::

    python benchmarks/ab_versions.py dump new                      # this checkout
    git archive da66658 | tar -x -C /tmp/old                        # the version before
    PYTHONPATH=/tmp/old python benchmarks/ab_versions.py dump old  # (its replicate first)
    python benchmarks/ab_versions.py time old new --rounds 15

``dump TAG`` writes ``results/ab_<TAG>_k<K>.meta`` (mnist_cnn, one device, accumulate=K for K in
``--ks``); ``time`` prints JSON: per graph the median step ms over the rounds, its ratio to the
single-device graph and the spread of the per-round medians.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def _path(tag: str, k: int) -> str:
    return os.path.join(HERE, "results", f"ab_{tag}_k{k}.meta")


def dump(tag: str, ks: list[int], model: str) -> None:
    """Write this replicate version's ``accumulate=k`` graphs as meta graphs."""
    import tensorflow as tf

    import replicate
    from models import SPECS, single_graph

    tf.compat.v1.disable_eager_execution()
    for k in ks:
        graph = replicate.transform(single_graph(SPECS[model]).graph, ["/cpu:0"], accumulate=k).graph
        tf.compat.v1.train.export_meta_graph(_path(tag, k), graph=graph)
    print(f"replicate from {os.path.dirname(replicate.__file__)}: wrote {[_path(tag, k) for k in ks]}")


def time_all(tags: list[str], ks: list[int], model: str, batch: int, rounds: int) -> dict:
    """Interleaved step times of the single-device graph and every dumped graph."""
    import tensorflow as tf

    from common import interleaved
    from models import SPECS, feeds, single_graph

    v1 = tf.compat.v1
    v1.disable_eager_execution()
    data = feeds(SPECS[model], batch, 4)

    def step_fn(graph):
        with graph.as_default():
            init = v1.global_variables_initializer()
        sess = v1.Session(graph=graph, config=v1.ConfigProto(device_count={"CPU": 1}))
        sess.run(init)
        fetch = [graph.get_operation_by_name("train"), graph.get_tensor_by_name("loss:0")]
        return lambda i: sess.run(fetch, {"x:0": data[i % 4][0], "y:0": data[i % 4][1]})

    steps = {"single": step_fn(single_graph(SPECS[model]).graph)}
    for tag in tags:
        for k in ks:
            graph = tf.Graph()
            with graph.as_default():
                v1.train.import_meta_graph(_path(tag, k))
            steps[f"{tag} k={k}"] = step_fn(graph)
    got = interleaved(steps, rounds=rounds, per_round=3, warmup=2)
    base = got["single"]["median"]
    return {label: {"ms": v["median"] * 1e3, "ratio": v["median"] / base,
                    "spread_ms": [v["min"] * 1e3, v["max"] * 1e3]} for label, v in got.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=["dump", "time"])
    parser.add_argument("tags", nargs="+")
    parser.add_argument("--ks", default="1,4")
    parser.add_argument("--model", default="mnist_cnn")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    ks = [int(k) for k in args.ks.split(",")]
    if args.mode == "dump":
        dump(args.tags[0], ks, args.model)
    else:
        print(json.dumps(time_all(args.tags, ks, args.model, args.batch, args.rounds)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
