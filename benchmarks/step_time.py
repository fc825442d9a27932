"""Step time of replicate's output against the single-device graph, hand-written towers and
MirroredStrategy, on the same logical CPU devices and the same global batch.

    python benchmarks/step_time.py                       # both models, 2 and 4 devices
    python benchmarks/step_time.py --models mnist_cnn --devices 2 --rounds 3 --trace

Every variant of a (model, device count) runs in one process (a fresh one per pair); rounds
are interleaved (each variant takes
``--per-round`` steps in turn, the starting variant rotating) and the median per-step time
over rounds is reported, so machine load hits all variants alike. Ratios below 1.0 mean
replicate is faster. Results go to ``benchmarks/results/step_time.json``.

replicate's variants are ``REPLICATE_VARIANTS``: a list of transform() option dicts. An
option this version of transform() does not accept is skipped with a note, so aggregation
strategies can be listed before they exist.
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import os
import subprocess
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import models  # noqa: E402
import tracing  # noqa: E402

import replicate  # noqa: E402
from replicate.check.equivalence import session_config  # noqa: E402

__all__ = ["REPLICATE_VARIANTS", "main"]

log = logging.getLogger(__name__)
v1 = tf.compat.v1

#: replicate's variants: a label and transform() options. "$towers" means the tower devices.
REPLICATE_VARIANTS: list[dict] = [
    {"label": "replicate (defaults)", "options": {}},
    {"label": "replicate param_devices=towers", "options": {"param_devices": "$towers"}},
    {"label": "replicate aggregation=packed", "options": {"aggregation": "packed"}},
    {"label": "replicate aggregation=allreduce", "options": {"aggregation": "allreduce"}},
    {"label": "replicate aggregation=packed_allreduce",
     "options": {"aggregation": "packed_allreduce"}},
    {"label": "replicate param_devices=mirrored", "options": {"param_devices": "mirrored"}},
]


def _session_step(graph: tf.Graph, train_op: str, loss: str, cpus: int, feeds: list):
    """A session on ``graph`` with its variables initialized, and its step function."""
    with graph.as_default():
        init = v1.global_variables_initializer()
    sess = v1.Session(graph=graph, config=session_config(cpus))
    sess.run(init)
    fetches = [graph.get_operation_by_name(train_op), graph.get_tensor_by_name(loss)]
    x, y = graph.get_tensor_by_name("x:0"), graph.get_tensor_by_name("y:0")

    def step(i: int) -> None:
        bx, by = feeds[i % len(feeds)]
        sess.run(fetches, {x: bx, y: by})
    step.session, step.fetches, step.feed = sess, fetches, {x: feeds[0][0], y: feeds[0][1]}
    return step


def _replicate_options(options: dict, devices: list[str]) -> dict | None:
    accepted = inspect.signature(replicate.transform).parameters
    out = {}
    for key, value in options.items():
        if key not in accepted:
            return None
        out[key] = devices if value == "$towers" else value
    return out


def build_variants(spec: models.Spec, n: int, feeds: list, mirrored: bool) -> tuple[dict, dict]:
    """label -> step function for every variant on ``n`` devices; and notes per label."""
    devices = [f"/cpu:{k}" for k in range(n)]
    steps, notes = {}, {}
    single = models.single_graph(spec)
    steps["single device"] = _session_step(single.graph, single.train_op, single.loss, n, feeds)
    towers = models.towers_graph(spec, devices)
    steps["hand-written towers"] = _session_step(towers.graph, towers.train_op, towers.loss, n, feeds)
    if mirrored:
        run = models.mirrored_step(spec, devices)
        steps["MirroredStrategy"] = lambda i: run(*feeds[i % len(feeds)])
    for variant in REPLICATE_VARIANTS:
        options = _replicate_options(variant["options"], devices)
        if options is None:
            notes[variant["label"]] = "skipped: transform() has no such option yet"
            continue
        # Under eager execution (MirroredStrategy needs it) transform() must be called inside
        # the graph's context: io.load exports the meta graph without entering it (reported).
        try:
            with single.graph.as_default():
                res = replicate.transform(single.graph, devices, **options)
        except replicate.ReplicateError as exc:
            notes[variant["label"]] = f"skipped: {exc}"
            continue
        notes[variant["label"]] = f"transform {res.transform_seconds * 1e3:.0f} ms"
        steps[variant["label"]] = _session_step(res.graph, single.train_op, single.loss, n, feeds)
    return steps, notes


def _print_table(model: str, n: int, batch: int, timed: dict, notes: dict) -> None:
    base = timed["single device"]["median"]
    towers = timed["hand-written towers"]["median"]
    mirrored = timed.get("MirroredStrategy", {}).get("median")
    print(f"\n{model}, {n} logical CPU devices, global batch {batch}")
    print(f"  {'variant':40s} {'ms/step':>8s} {'ex/s':>7s} {'/single':>8s} {'/towers':>8s} "
          f"{'/mirrored':>9s}  spread")
    for label, t in timed.items():
        med = t["median"]
        spread = f"{t['min'] * 1e3:.0f}-{t['max'] * 1e3:.0f} ms"
        print(f"  {label:40s} {med * 1e3:8.1f} {batch / med:7.0f} {common.fmt_ratio(med, base):>8s} "
              f"{common.fmt_ratio(med, towers):>8s} {common.fmt_ratio(med, mirrored):>9s}  {spread}")
    for label, note in notes.items():
        if label not in timed:
            print(f"  {label:40s} {note}")


def _measure(name: str, n: int, args: argparse.Namespace) -> dict:
    """Build and time every variant of one model on ``n`` devices (in this process)."""
    spec = models.SPECS[name]
    feeds = models.feeds(spec, args.batch, 8)
    steps, notes = build_variants(spec, n, feeds, not args.no_mirrored)
    timed = common.interleaved(steps, args.rounds, args.per_round, args.warmup)
    _print_table(f"{name} ({spec.parameters() / 1e6:.1f}M parameters)", n, args.batch, timed, notes)
    entry = {"model": name, "devices": n, "batch": args.batch, "timed": timed, "notes": notes}
    if args.trace:
        entry["trace"] = {label: tracing.trace_step(step) for label, step in steps.items()
                          if hasattr(step, "session")}
        tracing.print_traces(entry["trace"])
    for step in steps.values():
        if hasattr(step, "session"):
            step.session.close()
    return entry


def _child(name: str, n: int, args: argparse.Namespace, argv: list[str]) -> dict | None:
    """Measure (model, n) in a fresh process: MirroredStrategies of different sizes cannot
    share one process (their collective group keys collide)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "entry.json")
        cmd = [sys.executable, os.path.abspath(__file__), *argv, "--models", name,
               "--devices", str(n), "--child", out]
        proc = subprocess.run(cmd)
        if proc.returncode != 0 or not os.path.exists(out):
            print(f"  {name} on {n} devices failed (exit {proc.returncode})")
            return None
        with open(out) as f:
            return json.load(f)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print tables; write the JSON results."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="mnist_cnn,mlp_20m")
    parser.add_argument("--devices", default="2,4", help="device counts, comma-separated")
    parser.add_argument("--batch", type=int, default=128, help="global batch")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--per-round", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-mirrored", action="store_true")
    parser.add_argument("--trace", action="store_true",
                        help="also trace one step of each session variant: busy time per device "
                             "and the costliest op types")
    parser.add_argument("--output", default="step_time.json")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("common").setLevel(logging.INFO)
    tf.get_logger().setLevel("ERROR")
    counts = [int(c) for c in args.devices.split(",")]
    names = args.models.split(",")
    if args.child:
        common.logical_cpus(counts[0])
        entry = _measure(names[0], counts[0], args)
        with open(args.child, "w") as f:
            json.dump(entry, f, default=str)
        return 0
    info = {"machine": common.machine(), "args": vars(args), "results": []}
    print(f"machine: {info['machine']['cpu']}, {info['machine']['cores']} cores; "
          f"TF {info['machine']['tensorflow']}; replicate {info['machine']['replicate_commit']}; "
          f"load {info['machine']['load_average']}", flush=True)
    for name in names:
        for n in counts:
            entry = _child(name, n, args, argv)
            if entry is not None:
                info["results"].append(entry)
    info["machine_after"] = {"load_average": os.getloadavg(),
                             "busy_processes": common.busy_processes()}
    print("\nwrote", common.write_json(args.output, info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
