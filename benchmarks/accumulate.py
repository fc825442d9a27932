"""Gradient accumulation: peak memory and step time for k micro-batches at a fixed global batch.

For each model (``models.SPECS``) and each variant, a fresh worker process builds the graph,
runs warm-up steps, and then measures

* **activation peak** (the primary figure) and its parts, from the ``RunMetadata`` of one
  traced step (``FULL_TRACE`` with the partition graphs), by :mod:`memtrace`: every buffer the
  step allocates is replayed in time from the nodes' allocation records and charged to the node
  that allocated it; buffers of nodes that produce or accumulate the gradients an optimizer
  update reads are *gradient buffers*, all others *activations*; what was live before the step
  is *persistent*. Reported: the activation peak, the gradient-buffer peak, the step's peak
  (both together), persistent bytes;
* **allocator peak** (the whole step): the largest ``allocator_bytes_in_use`` that TensorFlow's
  CPU allocator (``mklcpu`` with oneDNN on) reports at any node of the step -- live bytes,
  including variables and optimizer slots, which every variant holds alike;
* **process peak RSS**: ``VmHWM`` of the fresh worker at its end, and the same minus the RSS
  after the variables were initialized (before the first step). The CPU allocator keeps freed
  memory for reuse instead of returning it to the kernel, so RSS only shows the high-water
  mark of the whole run (first steps included), never the live memory of one step;
* **step time**: median of ``--steps`` untraced steps (feeding the global batch, fetching the loss).

Variants, all one device (``/cpu:0``) on the same global batch and Adam:

* ``single``: the single-device graph running the whole batch (replicate's input);
* ``replicate k=K``: ``replicate.transform(graph, ["/cpu:0"], accumulate=K)``;
* ``hand loop k=K``: a hand-written in-graph ``tf.while_loop`` over K micro-batches that adds
  each micro-batch's gradients (weighted by its share of the batch) into loop variables, then
  one ``apply_gradients`` -- the common hand-written accumulation;
* ``hand unrolled k=K``: a hand-written graph that runs the forward and backward pass on batch
  B/K K times in one step (slices of the fed batch, each micro-batch's input gated on the
  previous one's gradients, gradients summed by ``add``, one ``apply_gradients``) -- the least
  machinery accumulation can have, so it isolates the inherent cost of K smaller micro-batches
  on this CPU from replicate's own (split, weights, guards).

Usage::

    python benchmarks/accumulate.py                       # both models, k = 1 2 4 8
    python benchmarks/accumulate.py --models mlp_20m --ks 1,4 --steps 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

DEFAULT_BATCH = {"mnist_cnn": 256, "mlp_20m": 512, "mlp_deep": 512}


def _rss() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process, bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, value = line.split(":")
                out[key] = int(value.split()[0]) * 1024
    return out["VmRSS"], out["VmHWM"]


def _hand_loop(spec, k: int):
    """The hand-written accumulation loop: a while loop over k micro-batches."""
    import tensorflow as tf

    from models import LEARNING_RATE, Built, _inputs_and_params

    v1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        x, y, params = _inputs_and_params(spec)
        names = [n for n, _ in spec.variables]
        variables = [params[n] for n in names]
        batch = tf.shape(x)[0]
        total = tf.cast(batch, tf.float32)

        def body(i, loss_sum, *acc):
            start = i * batch // k
            end = (i + 1) * batch // k
            xs, ys = x[start:end], y[start:end]
            logits = spec.forward(params, xs)
            loss = tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=ys, logits=logits)) / total
            grads = tf.gradients(loss, variables)
            return [i + 1, loss_sum + loss] + [a + g for a, g in zip(acc, grads)]

        zeros = [tf.zeros_like(v) for v in variables]
        out = tf.while_loop(lambda i, *_: i < k, body, [tf.constant(0), tf.constant(0.0)] + zeros,
                            parallel_iterations=1, back_prop=False)
        tf.identity(out[1], name="loss")
        step = v1.train.get_or_create_global_step()
        v1.train.AdamOptimizer(LEARNING_RATE).apply_gradients(
            list(zip(out[2:], variables)), global_step=step, name="train")
    return Built(graph, "train", "loss:0")


def _hand_unrolled(spec, k: int):
    """K forward+backward passes on B/K examples in one step, chained, gradients summed."""
    import tensorflow as tf

    from models import LEARNING_RATE, Built, _inputs_and_params

    v1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        x, y, params = _inputs_and_params(spec)
        variables = [params[n] for n, _ in spec.variables]
        batch = tf.shape(x)[0]
        total = tf.cast(batch, tf.float32)
        acc, losses, gate = None, [], []
        for j in range(k):
            with v1.name_scope(f"micro_{j}"), tf.control_dependencies(gate):
                start, end = j * batch // k, (j + 1) * batch // k
                xs, ys = tf.identity(x[start:end]), tf.identity(y[start:end])
            with v1.name_scope(f"micro_{j}"):
                logits = spec.forward(params, xs)
                loss = tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(
                    labels=ys, logits=logits)) / total
                # gated like compute_gradients (the single graph's minimize), so the kernels and
                # Grappler's fusions are those of replicate's towers
                grads = tf.gradients(loss, variables, gate_gradients=True)
                acc = grads if acc is None else [a + g for a, g in zip(acc, grads)]
            losses.append(loss)
            gate = grads
        tf.identity(tf.add_n(losses), name="loss")
        step = v1.train.get_or_create_global_step()
        v1.train.AdamOptimizer(LEARNING_RATE).apply_gradients(
            list(zip(acc, variables)), global_step=step, name="train")
    return Built(graph, "train", "loss:0")


def _build(model: str, variant: str, k: int):
    """(graph, seconds replicate.transform took or None) of one variant."""
    import replicate
    from models import SPECS, single_graph

    spec = SPECS[model]
    if variant == "hand_loop":
        return _hand_loop(spec, k).graph, None
    if variant == "hand_unrolled":
        return _hand_unrolled(spec, k).graph, None
    graph = single_graph(spec).graph
    if variant != "replicate":
        return graph, None
    start = time.perf_counter()
    res = replicate.transform(graph, ["/cpu:0"], accumulate=k)
    return res.graph, time.perf_counter() - start


def timing_worker(model: str, plan: list, batch: int, rounds: int, per_round: int) -> dict:
    """Step times of every variant in ``plan`` built in one process, timed in interleaved rounds.

    All variants see the same load over the run (the machine is shared), so their ratios are
    steadier than those of separate processes run one after another.
    """
    import tensorflow as tf

    from common import interleaved
    from models import SPECS, feeds

    tf.compat.v1.disable_eager_execution()
    v1 = tf.compat.v1
    data = feeds(SPECS[model], batch, 4)
    steps = {}
    for variant, k in plan:
        graph, _ = _build(model, variant, k)
        with graph.as_default():
            init = v1.global_variables_initializer()
        sess = v1.Session(graph=graph, config=v1.ConfigProto(device_count={"CPU": 1}))
        sess.run(init)
        fetch = [graph.get_operation_by_name("train"), graph.get_tensor_by_name("loss:0")]

        def step(i, sess=sess, fetch=fetch):
            xs, ys = data[i % len(data)]
            sess.run(fetch, {"x:0": xs, "y:0": ys})
        steps[f"{variant}:{k}"] = step
    return interleaved(steps, rounds=rounds, per_round=per_round, warmup=2)


def worker(model: str, variant: str, k: int, batch: int, steps: int) -> dict:
    """Build one variant and measure it (runs in a fresh process)."""
    import tensorflow as tf

    import memtrace
    from models import SPECS, feeds

    tf.compat.v1.disable_eager_execution()
    v1 = tf.compat.v1
    spec = SPECS[model]
    train, loss = "train", "loss:0"
    graph, transform_s = _build(model, variant, k)
    nodes = len(graph.as_graph_def().node)
    config = v1.ConfigProto(device_count={"CPU": 1})
    with graph.as_default():
        init = v1.global_variables_initializer()
    sess = v1.Session(graph=graph, config=config)
    sess.run(init)
    rss_init, _ = _rss()
    data = feeds(spec, batch, 4)
    fetch = [graph.get_operation_by_name(train), graph.get_tensor_by_name(loss)]

    def step(i):
        xs, ys = data[i % len(data)]
        return sess.run(fetch, {"x:0": xs, "y:0": ys})[1]

    for i in range(2):
        step(i)
    meta = v1.RunMetadata()
    xs, ys = data[0]
    sess.run(fetch, {"x:0": xs, "y:0": ys},
             options=v1.RunOptions(trace_level=v1.RunOptions.FULL_TRACE, output_partition_graphs=True),
             run_metadata=meta)
    parts = memtrace.breakdown(meta)
    op_us: dict[str, float] = {}      # traced op time (sum over ops, us) by who added the op
    for d in meta.step_stats.dev_stats:
        for n in d.node_stats:
            who = "replicate" if "replicate/" in n.node_name else "model"
            op_us[who] = op_us.get(who, 0) + n.all_end_rel_micros
    in_use = [m.allocator_bytes_in_use for d in meta.step_stats.dev_stats for n in d.node_stats
              for m in n.memory]
    node_peak = [m.peak_bytes for d in meta.step_stats.dev_stats for n in d.node_stats for m in n.memory]
    times = []
    for i in range(steps):
        start = time.perf_counter()
        value = step(i)
        times.append(time.perf_counter() - start)
    _, hwm = _rss()
    sess.close()
    return {"model": model, "variant": variant, "k": k, "batch": batch, "nodes": nodes,
            "transform_s": transform_s, "loss": float(value),
            "process_peak_rss": hwm, "peak_rss_above_init": hwm - rss_init,
            "allocator_peak_in_use": max(in_use, default=0), "largest_node_peak": max(node_peak, default=0),
            "activation_peak": parts.activation_peak, "gradient_peak": parts.gradient_peak,
            "step_alloc_peak": parts.step_peak, "persistent": parts.persistent,
            "gradient_nodes": parts.gradient_nodes, "untracked": parts.untracked,
            "traced_op_ms": {k: v / 1e3 for k, v in op_us.items()},
            "step_ms": statistics.median(times) * 1e3, "step_ms_all": [t * 1e3 for t in times],
            "parameters": spec.parameters()}


def _run(model, variant, k, batch, steps) -> dict:
    return _child("--worker", [model, variant, k, batch, steps],
                  {"model": model, "variant": variant, "k": k})


def _child(flag: str, args: list, on_error: dict) -> dict:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_USE_LEGACY_KERAS="1")
    cmd = [sys.executable, os.path.abspath(__file__), flag, json.dumps(args)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        return dict(on_error, error=out.stderr.strip().splitlines()[-1:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def _mib(n, digits: int = 0) -> str:
    return f"{n / 2 ** 20:.{digits}f}"


def table(rows: list[dict]) -> str:
    """RESULTS.md table of one model's rows."""
    single = next((r for r in rows if r["variant"] == "single"), None)
    unrolled = {r["k"]: r for r in rows if r["variant"] == "hand_unrolled" and "error" not in r}
    lines = ["| variant | k | activation peak MiB | /single | gradient buffers MiB | step alloc. peak MiB "
             "| persistent MiB | untracked MiB | allocator peak MiB | /single | step ms | /single | /hand unrolled "
             "| replicate ops % | nodes |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['variant']} | {r['k']} | error: {r['error']} |" + " |" * 13)
            continue

        ops = r.get("traced_op_ms", {})
        share = f"{100 * ops.get('replicate', 0) / sum(ops.values()):.1f}" if r["variant"] == "replicate" else "-"

        def ratio(key, base=single):
            return f"{r[key] / base[key]:.2f}" if base and base.get(key) else "-"
        lines.append(f"| {r['variant']} | {r['k']} | {_mib(r['activation_peak'], 1)} "
                     f"| {ratio('activation_peak')} | {_mib(r['gradient_peak'], 1)} "
                     f"| {_mib(r['step_alloc_peak'], 1)} | {_mib(r['persistent'])} | {_mib(r['untracked'])} "
                     f"| {_mib(r['allocator_peak_in_use'])} | {ratio('allocator_peak_in_use')} "
                     f"| {r['step_ms']:.0f} | {ratio('step_ms')} | {ratio('step_ms', unrolled.get(r['k']))} "
                     f"| {share} | {r['nodes']} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--timing-worker", help=argparse.SUPPRESS)
    parser.add_argument("--timing-rounds", type=int, default=8,
                        help="interleaved timing: rounds (0: only the per-process step times)")
    parser.add_argument("--per-round", type=int, default=2, help="interleaved timing: steps per round")
    parser.add_argument("--models", default="mnist_cnn,mlp_20m")
    parser.add_argument("--ks", default="1,2,4,8")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=0, help="global batch (default per model)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="repeat the whole list; each variant's figures are the medians over rounds")
    parser.add_argument("--out", default="accumulate.json", help="results file under results/")
    parser.add_argument("--skip", default="", help="variants to leave out, comma-separated")
    args = parser.parse_args()
    if args.worker:
        model, variant, k, batch, steps = json.loads(args.worker)
        print(json.dumps(worker(model, variant, k, batch, steps)))
        return 0
    if args.timing_worker:
        model, plan, batch, rounds, per_round = json.loads(args.timing_worker)
        print(json.dumps(timing_worker(model, [tuple(p) for p in plan], batch, rounds, per_round)))
        return 0
    from common import machine, write_json

    ks = [int(k) for k in args.ks.split(",")]
    skip = set(filter(None, args.skip.split(",")))
    results = []
    for model in args.models.split(","):
        batch = args.batch or DEFAULT_BATCH[model]
        plan = ([("single", 1)] + [("replicate", k) for k in ks] + [("hand_loop", k) for k in ks if k > 1]
                + [("hand_unrolled", k) for k in ks if k > 1])
        plan = [(variant, k) for variant, k in plan if variant not in skip]
        got: dict[tuple, list[dict]] = {}
        for r in range(args.rounds):
            for variant, k in (plan if r % 2 == 0 else plan[::-1]):
                row = _run(model, variant, k, batch, args.steps)
                got.setdefault((variant, k), []).append(row)
                print(json.dumps({key: row.get(key) for key in ("model", "variant", "k", "activation_peak",
                                                                 "allocator_peak_in_use", "step_ms", "error")}),
                      flush=True)
        timed = {}
        if args.timing_rounds:
            timed = _child("--timing-worker", [model, plan, batch, args.timing_rounds, args.per_round], {})
            if "error" in timed:
                print(f"interleaved timing failed: {timed['error']}", flush=True)
                timed = {}
        rows = []
        for (variant, k), runs in got.items():
            ok = [x for x in runs if "error" not in x]
            if not ok:
                rows.append(runs[0])
                continue
            row = dict(ok[0])
            for key in ("peak_rss_above_init", "process_peak_rss", "allocator_peak_in_use", "step_ms",
                        "activation_peak", "gradient_peak", "step_alloc_peak", "persistent", "untracked"):
                row[key] = statistics.median(x[key] for x in ok)
            row["rounds"] = [{key: x[key] for key in ("allocator_peak_in_use", "peak_rss_above_init",
                                                      "activation_peak", "step_ms")} for x in ok]
            row["process_step_ms"] = row["step_ms"]
            t = timed.get(f"{variant}:{k}")
            if t:
                row["step_ms"] = t["median"] * 1e3
                row["interleaved_rounds_ms"] = [v * 1e3 for v in t["rounds"]]
            rows.append(row)
        results.extend(rows)
        print(f"\n{model}, global batch {batch}\n{table(rows)}\n", flush=True)
    path = write_json(args.out, {"machine": machine(), "args": vars(args), "results": results})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
