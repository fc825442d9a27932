"""What the numeric check adds to a conversion: transform() with and without check=True.

    python benchmarks/certificate_cost.py                          # mlp, cnn, resnet_v1_50
    python benchmarks/certificate_cost.py --graphs resnet_v1_50 --towers 2

For each graph, one process times ``transform(graph, devices)`` and ``transform(graph,
devices, check=True)`` alternately (``--rounds`` each) and prints the medians, the check's own
seconds as the report gives them, and its verdict. The check trains the original and the
rewrite on logical CPUs (3 steps at 4N-1 examples, one step with an empty tower), so its cost
is a few training steps of the model on the CPU, whatever device the rewrite targets.
Results go to ``benchmarks/results/certificate_cost.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import tensorflow as tf  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import common  # noqa: E402
import graphs  # noqa: E402

import replicate  # noqa: E402


def _small(name: str) -> tf.Graph:
    import models as test_models

    return (test_models.mlp("sgd") if name == "mlp" else test_models.cnn()).graph


def measure(name: str, towers: int, rounds: int, options: dict) -> dict:
    graph = _small(name) if name in ("mlp", "cnn") else graphs.build(name)
    devices = [f"/cpu:{k}" for k in range(towers)]
    times = {False: [], True: []}
    last = None
    for _ in range(rounds):
        for check in (False, True):
            start = time.perf_counter()
            res = replicate.transform(graph, devices, check=check, **options)
            times[check].append(time.perf_counter() - start)
            if check:
                last = res.report
    plain, checked = statistics.median(times[False]), statistics.median(times[True])
    out = {"graph": name, "towers": towers, "options": options, "exact": last.exact, "nodes": len(graph.as_graph_def().node),
           "transform_s": plain, "with_check_s": checked, "added_s": checked - plain,
           "check": {k: v for k, v in last.check.items() if k != "runs"}, "runs": last.check.get("runs")}
    print(f"{name:14s} {options or ''} exact={last.exact} {out['nodes']:6d} nodes, {towers} towers: transform {plain:6.2f} s, with check "
          f"{checked:6.2f} s (+{checked - plain:.2f} s, x{checked / plain:.1f}); {last.check.get('summary')}")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graphs", default="mlp,cnn,resnet_v1_50")
    parser.add_argument("--towers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-norm", default="tower0", choices=("tower0", "sync"))
    args = parser.parse_args(argv)
    common.logical_cpus(args.towers + 1)
    tf.compat.v1.disable_eager_execution()
    print(common.machine())
    options = {"batch_norm": args.batch_norm} if args.batch_norm != "tower0" else {}
    results = [measure(name, args.towers, args.rounds, options) for name in args.graphs.split(",")]
    path = common.write_json("certificate_cost.json", {"machine": common.machine(), "results": results})
    print(f"written {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
