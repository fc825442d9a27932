"""Compile time: replicate.transform against TensorFlow's import_graph_def of the output.

    python benchmarks/compile_time.py                                # the default grid
    python benchmarks/compile_time.py --graphs deep_60,resnet_v1_50 --towers 2,4

For every training graph (``graphs.py``: tf-slim nets and a synthetic very deep model, 3,000
to 100,000+ nodes) and tower count, a fresh worker process loads the graph, warms up on a tiny
graph, runs ``replicate.transform`` (``Result.transform_seconds``), records the peak resident
memory the transform added (Linux ``VmHWM``, reset just before the transform, less the RSS
then), and times
``tf.graph_util.import_graph_def`` of the output into a fresh graph. Built graphs are cached
as MetaGraphDefs (``--cache``), so only the first run pays for building them; the worker
loads them with ``import_meta_graph``, which adds a Saver (``save/RestoreV2`` with one output
per variable), as any graph restored from a ``.meta`` file has.
Results go to ``benchmarks/results/compile_time.json``; ``plot.py`` draws them.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

__all__ = ["main", "DEFAULT_GRAPHS", "DEFAULT_TOWERS"]

log = logging.getLogger(__name__)

DEFAULT_GRAPHS = ("deep_60,resnet_v1_50,inception_v3,deep_200,resnet_v1_152,deep_600,"
                  "deep_2000:2")
DEFAULT_TOWERS = "2,4,8,16"
_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "replicate-benchmarks")


def _memory(field: str) -> int:
    """A ``/proc/self/status`` field in bytes (0 where there is no /proc)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")                                   # resets VmHWM to the current RSS
    except OSError:
        pass


def _worker_build(name: str, path: str) -> None:
    import tensorflow as tf

    import graphs

    tf.compat.v1.disable_eager_execution()
    start = time.perf_counter()
    graph = graphs.build(name)
    seconds = time.perf_counter() - start
    meta = tf.compat.v1.train.export_meta_graph(graph=graph, clear_devices=False)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(meta.SerializeToString())
    os.replace(tmp, path)
    print(json.dumps({"built": name, "seconds": seconds, "nodes": len(meta.graph_def.node)}))


def _worker_measure(path: str, towers: list[int], repeats: int) -> None:
    import tensorflow as tf

    import replicate

    tf.compat.v1.disable_eager_execution()
    meta = tf.compat.v1.MetaGraphDef()
    with open(path, "rb") as f:
        meta.ParseFromString(f.read())
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.train.import_meta_graph(meta, clear_devices=False)
    import graphs

    replicate.transform(graphs.build("deep_2"), ["/cpu:0", "/cpu:1"])    # warm-up, untimed
    start = time.perf_counter()
    with tf.Graph().as_default():
        tf.graph_util.import_graph_def(meta.graph_def, name="")
    input_import = time.perf_counter() - start
    for k in towers:
        devices = [f"/cpu:{i}" for i in range(k)]
        best = None
        for _ in range(repeats):
            rss = _memory("VmRSS")
            _reset_peak()
            res = replicate.transform(graph, devices)
            peak = max(0, _memory("VmHWM") - rss)
            if best is None or res.transform_seconds < best[0].transform_seconds:
                best = (res, peak)
            del res
        res, peak = best
        start = time.perf_counter()
        with tf.Graph().as_default():
            tf.graph_util.import_graph_def(res.graph_def, name="")
        out_import = time.perf_counter() - start
        print(json.dumps({
            "towers": k, "input_nodes": len(meta.graph_def.node),
            "output_nodes": len(res.graph_def.node), "transform_s": res.transform_seconds,
            "import_output_s": out_import, "import_input_s": input_import, "peak_bytes": peak,
            "passes_ms": {r.name: r.millis for r in res.records}, "exact": res.report.exact}),
              flush=True)
        del res, best


def _run_worker(args: list[str], timeout: float) -> list[dict]:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", *args]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
        print(f"  worker {' '.join(args)} failed (exit {proc.returncode}):\n{tail}")
    return rows


def _print_row(name: str, row: dict) -> None:
    ratio = row["transform_s"] / row["import_output_s"] if row["import_output_s"] else float("nan")
    passes = ", ".join(f"{k} {v / 1e3:.1f}" for k, v in row["passes_ms"].items() if v >= 50)
    print(f"  {name:15s} {row['input_nodes']:8,d} {row['towers']:3d} {row['output_nodes']:9,d} "
          f"{row['transform_s']:10.2f} {row['import_output_s']:9.2f} {ratio:6.2f} "
          f"{row['peak_bytes'] / 2**20:8.0f}   {passes}")


def main(argv: list[str] | None = None) -> int:
    """Measure the grid; print a table; write the JSON results."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--graphs", default=DEFAULT_GRAPHS,
                        help="comma-separated graph names; NAME:2+4 measures NAME at 2 and 4 "
                             "towers only")
    parser.add_argument("--towers", default=DEFAULT_TOWERS)
    parser.add_argument("--repeats", type=int, default=1, help="transforms per point (fastest kept)")
    parser.add_argument("--max-work", type=float, default=2.5e6,
                        help="skip points whose input nodes x towers exceed this")
    parser.add_argument("--cache", default=_CACHE, help="directory of built graphs")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per worker")
    parser.add_argument("--output", default="compile_time.json")
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        if args.worker[0] == "build":
            _worker_build(args.worker[1], args.worker[2])
        else:
            _worker_measure(args.worker[1], [int(t) for t in args.worker[2].split(",")],
                            int(args.worker[3]))
        return 0
    os.makedirs(args.cache, exist_ok=True)
    info = {"machine": common.machine(), "args": vars(args), "graphs": {}, "results": []}
    print(f"machine: {info['machine']['cpu']}, {info['machine']['cores']} cores; "
          f"load {info['machine']['load_average']}")
    print(f"  {'graph':15s} {'nodes':>8s} {'N':>3s} {'out nodes':>9s} {'transform':>10s} "
          f"{'import':>9s} {'ratio':>6s} {'peak MiB':>8s}   passes (s)")
    for item in args.graphs.split(","):
        name, _, only = item.partition(":")
        path = os.path.join(args.cache, f"{name}.meta")
        if not os.path.exists(path):
            built = _run_worker(["build", name, path], args.timeout)
            if not built:
                continue
            info["graphs"][name] = built[0]
        nodes = _graph_nodes(path)
        towers = ([int(t) for t in only.split("+")] if only else
                  [int(t) for t in args.towers.split(",") if nodes * int(t) <= args.max_work])
        if not towers:
            print(f"  {name}: {nodes:,} nodes; every tower count exceeds --max-work")
            continue
        for k in towers:                  # a fresh process per point: a clean peak RSS
            for row in _run_worker(["measure", path, str(k), str(args.repeats)], args.timeout):
                row["graph"] = name
                info["results"].append(row)
                _print_row(name, row)
            common.write_json(args.output, info)
    info["scaling"] = _scaling(info["results"])
    info["machine_after"] = {"load_average": os.getloadavg(),
                             "busy_processes": common.busy_processes()}
    print("wrote", common.write_json(args.output, info))
    return 0


def _slope(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of log y against log x (1.0 = linear), or None for < 2 points."""
    import math

    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if x > 0 and y > 0]
    if len(pts) < 2:
        return None
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    var = sum((p[0] - mx) ** 2 for p in pts)
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / var if var else None


def _scaling(rows: list[dict]) -> dict:
    """Log-log slopes of transform and import time against nodes x towers, overall and per graph."""
    out = {}
    for label, mine in [("all", rows)] + [(g, [r for r in rows if r["graph"] == g])
                                          for g in dict.fromkeys(r["graph"] for r in rows)]:
        work = [r["input_nodes"] * r["towers"] for r in mine]
        out[label] = {"transform": _slope(work, [r["transform_s"] for r in mine]),
                      "import": _slope(work, [r["import_output_s"] for r in mine]),
                      "peak": _slope(work, [r["peak_bytes"] for r in mine])}
    print("log-log slope against nodes x towers (1.0 = linear): " + "; ".join(
        f"{g}: transform {_fmt(v['transform'])}, import {_fmt(v['import'])}" for g, v in out.items()))
    return out


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _graph_nodes(path: str) -> int:
    from tensorflow.core.protobuf import meta_graph_pb2

    meta = meta_graph_pb2.MetaGraphDef()
    with open(path, "rb") as f:
        meta.ParseFromString(f.read())
    return len(meta.graph_def.node)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    sys.exit(main())
