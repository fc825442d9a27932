"""Weighing the loss inside the towers against weighing the aggregated gradients.

    python benchmarks/weigh_loss.py                # mlp_20m, 2 and 4 towers, 9 rounds

replicate weighed a mean loss's tower gradients by each tower's share of the batch where they
are aggregated: one multiply per parameter per tower (``MulNoNan``), then ``AddN``. The
alternative, replicate's default since 2026-11-26, multiplies the gradient's seed in each
tower by that share (a scalar), so the towers' gradients only add. One process builds both
rewrites of the benchmark's ``mlp_20m`` (20M parameters, Adam, batch 128; the first with the
analysis step that chooses in-tower weighing switched off) and times them in interleaved
rounds on logical CPU devices.
Results go to ``benchmarks/results/weigh_loss.json``.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import models  # noqa: E402


def _build(graph, devices: list[str], in_towers: bool):
    """The rewrite with replicate's default (the loss weighed in the towers), or with that
    step switched off (every scope keeps the aggregated gradients' weights)."""
    import replicate
    from replicate.passes import _weights

    original = _weights.prefer_in_towers
    if not in_towers:
        _weights.prefer_in_towers = lambda *args, **kwargs: 0
    try:
        return replicate.transform(graph, devices, controller="/cpu:0")
    finally:
        _weights.prefer_in_towers = original


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--towers", default="2,4")
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    counts = [int(t) for t in args.towers.split(",")]
    common.logical_cpus(max(counts) + 1)
    import tensorflow as tf

    from replicate.check.equivalence import session_config

    v1 = tf.compat.v1
    spec = models.SPECS["mlp_20m"]
    data = models.feeds(spec, 128, 4)
    out = {"machine": common.machine(), "model": spec.name, "batch": 128, "results": {}}
    for n in counts:
        built = models.single_graph(spec)
        devices = [f"/cpu:{k + 1}" for k in range(n)]
        sessions = {}
        for label, in_towers in (("gradients weighed", False), ("loss weighed in towers", True)):
            result = _build(built.graph, devices, in_towers)
            assert result.report.exact, result.report.reasons
            graph = tf.Graph()
            with graph.as_default():
                v1.train.import_meta_graph(result.meta_graph_def)
                init = v1.global_variables_initializer()
            sess = v1.Session(graph=graph, config=session_config(n + 1))
            sess.run(init)
            sessions[label] = (sess, sum(1 for node in result.graph_def.node if node.op == "MulNoNan"))

        def stepper(label):
            def step(i):
                x, y = data[i % len(data)]
                sessions[label][0].run("train", {"x:0": x, "y:0": y})
            return step

        timed = common.interleaved({label: stepper(label) for label in sessions}, args.rounds, 3, 2)
        for label, t in timed.items():
            out["results"][f"{n} towers, {label}"] = {**t, "mulnonan_ops": sessions[label][1]}
            print(f"{n} towers  {label:24s} {t['median'] * 1e3:7.1f} ms  "
                  f"(round medians {t['min'] * 1e3:.0f}-{t['max'] * 1e3:.0f}; "
                  f"{sessions[label][1]} MulNoNan ops)")
        for sess, _ in sessions.values():
            sess.close()
    print("wrote", common.write_json("weigh_loss.json", out))


if __name__ == "__main__":
    main()
