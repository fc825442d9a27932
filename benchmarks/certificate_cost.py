"""What the numeric check adds to a conversion: transform() with and without check=True.

    python benchmarks/certificate_cost.py                          # mlp, cnn, resnet_v1_50
    python benchmarks/certificate_cost.py --graphs resnet_v1_50 --towers 2
    python benchmarks/certificate_cost.py --grappler                # the check with Grappler on, too

For each graph, one process times ``transform(graph, devices)`` and ``transform(graph,
devices, check=True)`` alternately (``--rounds`` each) and prints the medians, the check's own
seconds as the report gives them, and its verdict. The check trains the original and the
rewrite on logical CPUs (3 steps at 4N-1 examples, one step with an empty tower), so its cost
is a few training steps of the model on the CPU, whatever device the rewrite targets.
The check's sessions run without Grappler; ``--grappler`` also times, alternately, the check
with Grappler on (as it ran before 35f18d9).
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
from replicate.check import equivalence  # noqa: E402

_plain_config = equivalence.session_config


def _with_grappler(*args, **kwargs):
    """session_config with Grappler on whatever the caller asks."""
    return _plain_config(*args[:3], optimize=True)


def _small(name: str) -> tf.Graph:
    import models as test_models

    return (test_models.mlp("sgd") if name == "mlp" else test_models.cnn()).graph


def measure(name: str, towers: int, rounds: int, options: dict, grappler: bool = False) -> dict:
    graph = _small(name) if name in ("mlp", "cnn") else graphs.build(name)
    devices = [f"/cpu:{k}" for k in range(towers)]
    runs = (False, True, "grappler") if grappler else (False, True)
    times = {run: [] for run in runs}
    last = None
    for _ in range(rounds):
        for run in runs:
            equivalence.session_config = _with_grappler if run == "grappler" else _plain_config
            start = time.perf_counter()
            res = replicate.transform(graph, devices, check=bool(run), **options)
            times[run].append(time.perf_counter() - start)
            if run is True:
                last = res.report
    equivalence.session_config = _plain_config
    plain, checked = statistics.median(times[False]), statistics.median(times[True])
    if grappler:
        on = statistics.median(times["grappler"])
        print(f"{name:14s} check with Grappler on: {on:6.2f} s (+{on - plain:.2f} s); without: "
              f"{checked:6.2f} s (+{checked - plain:.2f} s); without / with: {(checked - plain) / (on - plain):.2f}")
    out = {"graph": name, "towers": towers, "options": options, "exact": last.exact, "nodes": len(graph.as_graph_def().node),
           "transform_s": plain, "with_check_s": checked, "added_s": checked - plain,
           "check": {k: v for k, v in last.check.items() if k != "runs"}, "runs": last.check.get("runs")}
    if grappler:
        out["with_check_grappler_s"] = on
    print(f"{name:14s} {options or ''} exact={last.exact} {out['nodes']:6d} nodes, {towers} towers: transform {plain:6.2f} s, with check "
          f"{checked:6.2f} s (+{checked - plain:.2f} s, x{checked / plain:.1f}); {last.check.get('summary')}")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graphs", default="mlp,cnn,resnet_v1_50")
    parser.add_argument("--towers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-norm", default="tower0", choices=("tower0", "sync"))
    parser.add_argument("--grappler", action="store_true", help="also time the check with Grappler on")
    args = parser.parse_args(argv)
    common.logical_cpus(args.towers + 1)
    tf.compat.v1.disable_eager_execution()
    print(common.machine())
    options = {"batch_norm": args.batch_norm} if args.batch_norm != "tower0" else {}
    results = [measure(name, args.towers, args.rounds, options, args.grappler) for name in args.graphs.split(",")]
    path = common.write_json("certificate_cost.json", {"machine": common.machine(), "results": results})
    print(f"written {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
