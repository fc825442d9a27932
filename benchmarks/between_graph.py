"""Step time of in-graph against between-graph replication over 2 and 4 worker tasks on
loopback, at the same global batch, and the share of a step spent communicating.

    python benchmarks/between_graph.py [--workers 2 4] [--batch 64] [--steps 12] [--size full]

For each worker count W, one ``LocalCluster`` of W worker servers (1 thread each, loopback):

- **in-graph**: ``transform(cnn, "worker", controller="/job:worker/task:0/cpu:0")`` -- one
  client (this process) feeds the global batch to worker 0, which splits it over the W towers;
  the variables and Adam's update live on worker 0's CPU.
- **between-graph**: ``transform(cnn, "worker", between_graph=True)`` -- W client processes,
  one per worker, each feeding its local batch (global / W) to its own worker; gradients are
  all-reduced with collectives, every worker applies Adam to its own copy.

Step time is the median over ``--steps`` timed steps (after 3 warm-up steps) of worker 0's
client (between-graph steps are synchronous: every worker waits for the all-reduce).
Communication share: one traced step (``RunOptions.FULL_TRACE``); the union of the intervals
of the ops that move data between tasks over the traced step's wall time: for in-graph the
receives of tensors from another task (variables to the towers, gradients to worker 0), on every
task; for between-graph the collective ops on worker 0, which include waiting for the slowest
peer to arrive. Results go to ``benchmarks/results/between_graph.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

v1 = tf.compat.v1
SIZES = {"tiny": (4, 8, 32), "small": (16, 32, 256), "full": (32, 64, 1024)}
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "between_graph.json")


def _feed(rng, batch: int) -> dict:
    return {"x:0": rng.rand(batch, 784).astype(np.float32),
            "y:0": rng.randint(0, 10, size=batch).astype(np.int64)}


def _union(intervals: list[tuple[int, int]]) -> int:
    total, end = 0, -1
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _comm_share(run_metadata, task: int | None, kinds: tuple[str, ...]) -> float:
    """Union of the intervals of ops whose trace label holds one of ``kinds``, on ``task``'s
    devices (every task's when None), over the step's span."""
    spans, comm = [], []
    for dev in run_metadata.step_stats.dev_stats:
        if task is not None and f"/task:{task}/" not in dev.device:
            continue
        for node in dev.node_stats:
            a, b = node.all_start_micros, node.all_start_micros + node.all_end_rel_micros
            spans.append((a, b))
            if node.node_name.split(":")[0] and any(k in (node.timeline_label or node.node_name)
                                                    for k in kinds):
                comm.append((a, b))
    if not spans:
        return float("nan")
    wall = max(b for _, b in spans) - min(a for a, _ in spans)
    return _union(comm) / wall if wall else float("nan")


def _time_steps(sess, train_op, feeds, steps: int, kinds: tuple[str, ...], task: int | None = 0):
    for feed in feeds[:3]:
        sess.run(train_op, feed)
    times = []
    for i in range(steps):
        start = time.perf_counter()
        sess.run(train_op, feeds[(3 + i) % len(feeds)])
        times.append(time.perf_counter() - start)
    meta = v1.RunMetadata()
    sess.run(train_op, feeds[0], options=v1.RunOptions(trace_level=v1.RunOptions.FULL_TRACE),
             run_metadata=meta)
    return float(np.median(times)), _comm_share(meta, task, kinds)


def client(args) -> int:
    """One between-graph worker's client (a process of its own)."""
    from replicate.runtime.between import CHIEF, import_meta_graph

    v1.disable_eager_execution()
    cluster = json.load(open(args.cluster))
    graph = tf.Graph()
    with graph.as_default():
        import_meta_graph(args.template, task_index=args.task)
        init = v1.global_variables_initializer()
        local_init = graph.get_collection(v1.GraphKeys.LOCAL_INIT_OP)[0]
    rng = np.random.RandomState(args.task)
    feeds = [_feed(rng, args.batch) for _ in range(4)]
    with v1.Session(f"grpc://{cluster['worker'][args.task]}", graph=graph) as sess:
        if args.task == CHIEF:
            sess.run(init)
        sess.run(local_init)
        median, share = _time_steps(sess, "train", feeds, args.steps,
                                    ("Collective",), args.task)
    with open(args.out, "w") as f:
        json.dump({"step_s": median, "comm_share": share}, f)
    return 0


def measure(workers: int, batch: int, steps: int, size: str) -> dict:
    import replicate
    from replicate.demo import build_cnn
    from replicate.runtime.cluster_server import LocalCluster

    model = build_cnn(SIZES[size])
    out: dict = {"workers": workers, "global_batch": batch}
    with LocalCluster(ps=0, workers=workers, threads=1, timeout=300) as local:
        # in-graph: one client, global batch to the master
        res = replicate.transform(model.graph, "worker", controller="/job:worker/task:0/cpu:0",
                                  cluster=local.cluster)
        graph = res.graph
        with graph.as_default():
            init = v1.global_variables_initializer()
        rng = np.random.RandomState(0)
        feeds = [_feed(rng, batch) for _ in range(4)]
        with v1.Session(local.cluster.master(), graph=graph) as sess:
            sess.run(init)
            out["in_graph_s"], out["in_graph_comm_share"] = _time_steps(
                sess, "train", feeds, steps, (" from /job:",), None)   # tensors between tasks
        # between-graph: one client process per worker, local batch each
        with tempfile.TemporaryDirectory() as work:
            res = replicate.transform(model.graph, "worker", between_graph=True,
                                      cluster=local.cluster)
            template = os.path.join(work, "template.meta")
            with open(template, "wb") as f:
                f.write(res.meta_graph_def.SerializeToString())
            spec = os.path.join(work, "cluster.json")
            with open(spec, "w") as f:
                json.dump(local.cluster.as_dict(), f)
            procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--client",
                                       "--cluster", spec, "--task", str(t), "--template", template,
                                       "--batch", str(batch // workers), "--steps", str(steps),
                                       "--out", os.path.join(work, f"{t}.json")])
                     for t in range(workers)]
            try:
                codes = [p.wait(timeout=900) for p in procs]
            finally:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                        p.wait()
            if any(codes):
                raise RuntimeError(f"between-graph clients failed: {codes}")
            chief = json.load(open(os.path.join(work, "0.json")))
            out["between_s"], out["between_comm_share"] = chief["step_s"], chief["comm_share"]
    out["between_over_in_graph"] = out["between_s"] / out["in_graph_s"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--batch", type=int, default=64, help="global batch")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cluster", help=argparse.SUPPRESS)
    parser.add_argument("--task", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--template", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.client:
        return client(args)
    v1.disable_eager_execution()
    rows = []
    for w in args.workers:
        row = measure(w, args.batch, args.steps, args.size)
        row["size"] = args.size
        rows.append(row)
        print(json.dumps(row), flush=True)
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        json.dump({"cpu_count": os.cpu_count(), "tensorflow": tf.__version__, "rows": rows}, f, indent=1)
    print(f"\n| workers | global batch | in-graph ms | between-graph ms | between / in-graph | "
          "comm share in-graph | comm share between |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['workers']} | {r['global_batch']} | {1000 * r['in_graph_s']:.1f} | "
              f"{1000 * r['between_s']:.1f} | {r['between_over_in_graph']:.2f} | "
              f"{r['in_graph_comm_share']:.0%} | {r['between_comm_share']:.0%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
