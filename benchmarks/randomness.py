"""Cost of exact randomness: global-shape draws against per-tower streams, side by side.

    python benchmarks/randomness.py                  # the CNN and the LSTM, 2 and 4 devices
    python benchmarks/randomness.py --models cnn --devices 2 --rounds 5
    python benchmarks/randomness.py --models lstm_loop      # the LSTM in dynamic_rnn's loop

For each model (the seeds' CNN with seeded dropout on its dense layer; a char-RNN-style
2-layer LSTM, unrolled, with seeded dropout on every step's input and output; the same LSTM
in ``dynamic_rnn(parallel_iterations=1)``, its draws in the loop's body) and device
count, one process builds three graphs: one device, replicate's output (the global batch's
mask drawn with the original seeds, once per step for a draw at the top level, and each tower
keeps its rows) and the same transform with
the draws left per tower (each tower draws its own mask: what hand-written towers and
MirroredStrategy do; the analysis is told no draw needs care). Rounds are interleaved and
the median step time is reported; ``exact/streams`` is the overhead of exactness. The extra
memory is computed from the shapes: a top-level draw's ``B``-row mask lives beside the towers'
slices until they are cut (one mask, ``B`` rows), a draw in a loop holds ``B`` rows in every
tower instead of ``B/N``. Results go to ``benchmarks/results/randomness.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

import replicate  # noqa: E402
from replicate.check.equivalence import session_config  # noqa: E402
from replicate.passes import _draws  # noqa: E402

v1 = tf.compat.v1


def cnn(batch: int) -> tuple[tf.Graph, dict]:
    graph = tf.Graph()
    with graph.as_default():
        v1.set_random_seed(1)
        x = v1.placeholder(tf.float32, [None, 28, 28, 1], name="x")
        y = v1.placeholder(tf.int64, [None], name="y")
        h = v1.layers.conv2d(x, 32, 5, padding="same", activation=tf.nn.relu)
        h = v1.layers.max_pooling2d(h, 2, 2)
        h = v1.layers.conv2d(h, 64, 5, padding="same", activation=tf.nn.relu)
        h = v1.layers.max_pooling2d(h, 2, 2)
        h = v1.layers.dense(tf.reshape(h, [-1, 7 * 7 * 64]), 1024, activation=tf.nn.relu)
        h = tf.nn.dropout(h, rate=0.5, seed=3)
        logits = v1.layers.dense(h, 10)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits),
                              name="loss")
        v1.train.AdamOptimizer(1e-4).minimize(loss, name="train")
    rng = np.random.RandomState(0)
    return graph, {"x:0": rng.rand(batch, 28, 28, 1).astype(np.float32), "y:0": rng.randint(0, 10, batch)}


def lstm(batch: int, steps: int = 20, hidden: int = 128, vocab: int = 64, loop: bool = False,
         frames: bool = False) -> tuple[tf.Graph, dict]:
    graph = tf.Graph()
    if frames:          # TF1 while loops (Enter/Exit frames), as legacy programs build them
        v1.disable_control_flow_v2()
    with graph.as_default():
        v1.set_random_seed(1)
        x = v1.placeholder(tf.int32, [None, steps], name="x")
        y = v1.placeholder(tf.int32, [None, steps], name="y")
        emb = v1.get_variable("emb", [vocab, hidden])
        inputs = tf.nn.embedding_lookup(emb, x)
        cells = [v1.nn.rnn_cell.DropoutWrapper(v1.nn.rnn_cell.LSTMCell(hidden), input_keep_prob=0.7,
                                               output_keep_prob=0.7, seed=5 + k) for k in range(2)]
        cell = v1.nn.rnn_cell.MultiRNNCell(cells)
        if loop:        # the draws run in the loop's body, one iteration at a time
            outputs, _ = v1.nn.dynamic_rnn(cell, inputs, dtype=tf.float32, parallel_iterations=1)
        else:
            outputs = tf.stack(v1.nn.static_rnn(cell, tf.unstack(inputs, axis=1), dtype=tf.float32)[0], axis=1)
        logits = v1.layers.dense(outputs, vocab)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits),
                              name="loss")
        v1.train.AdamOptimizer(1e-3).minimize(loss, name="train")
    v1.enable_control_flow_v2()
    rng = np.random.RandomState(0)
    return graph, {"x:0": rng.randint(0, vocab, (batch, steps)), "y:0": rng.randint(0, vocab, (batch, steps))}


MODELS = {"cnn": (cnn, 64), "lstm": (lstm, 64), "lstm_loop": (lambda b: lstm(b, loop=True), 64),
          "lstm_loop_v1": (lambda b: lstm(b, loop=True, frames=True), 64)}


def _without_streams():
    """While active, draws in loops are made as the global batch's rows in every tower and
    iteration (the method before counter-based draws), for a side-by-side measurement."""
    import contextlib

    from replicate.passes import _body_draws, draw

    @contextlib.contextmanager
    def scope():
        keep = draw.plan, _body_draws.plan
        draw.plan = _body_draws.plan = lambda *args: None
        try:
            yield
        finally:
            draw.plan, _body_draws.plan = keep
    return scope()


def _step(graph: tf.Graph, feed: dict, cpus: int):
    with graph.as_default():
        init = v1.global_variables_initializer()
    sess = v1.Session(graph=graph, config=session_config(cpus))
    sess.run(init)
    fetches = [graph.get_operation_by_name("train"), graph.get_tensor_by_name("loss:0")]
    return lambda i: sess.run(fetches, feed)


def _extra_bytes(graph: tf.Graph, res) -> int | None:
    """Bytes per example of the global batch that the masks add, all towers together (float32):
    a draw made once per step holds every example's row once until the towers' slices are
    cut; one made in every tower holds it in N - 1 towers more; one a tower makes of its own
    rows from its stream state (in a loop) adds nothing. None for draws in a loop's body
    (kind ``body``) made as the global rows: every tower holds the other towers' rows of a
    draw for one iteration."""
    towers = len(res.towers.devices)
    shared = {n.name for n in res.graph_def.node if n.name.startswith("replicate/draw/")}
    own = {n.name[:-len("/stream/read")] for n in res.graph_def.node if n.op == "RngReadAndSkip"}
    in_bodies = any(n.op == "RngReadAndSkip" for f in res.graph_def.library.function for n in f.node_def)
    extra = 0
    for name, kind in res.report.random.get("reproduced", {}).items():
        if kind == "body":
            if in_bodies:
                continue
            return None
        if any(o.endswith(f"/{name}") for o in own):
            continue
        dims = graph.get_operation_by_name(name).outputs[0].shape.as_list()
        row_bytes = int(np.prod([d for d in dims[1:] if d is not None] or [1])) * 4
        extra += row_bytes * (1 if f"replicate/draw/{name}" in shared else towers - 1)
    return extra


def measure(model: str, n: int, rounds: int, per_round: int) -> dict:
    build, batch = MODELS[model]
    graph, feed = build(batch)
    devices = [f"/cpu:{k}" for k in range(n)]
    exact = replicate.transform(graph, devices)
    keep = _draws.reproducible
    _draws.reproducible = lambda ir, flow, names: ({}, [])
    try:
        streams = replicate.transform(graph, devices)
    finally:
        _draws.reproducible = keep
    steps = {"single device": _step(graph, feed, n), "exact draws": _step(exact.graph, feed, n),
             "per-tower streams": _step(streams.graph, feed, n)}
    if "loop" in model:     # the two ways of exact draws in a loop, side by side
        with _without_streams():
            steps["exact, global rows"] = _step(replicate.transform(graph, devices).graph, feed, n)
    timed = common.interleaved(steps, rounds, per_round, warmup=2)
    out = {"model": model, "devices": n, "batch": batch,
           "reproduced": len(exact.report.random.get("reproduced", {})),
           "random_ops": len(exact.report.random.get("ops", [])),
           "exact": exact.report.exact, "extra_bytes_per_example": _extra_bytes(graph, exact),
           "timed": timed,
           "overhead": timed["exact draws"]["median"] / timed["per-tower streams"]["median"]}
    if "exact, global rows" in timed:
        out["global_rows_overhead"] = timed["exact, global rows"]["median"] / timed["per-tower streams"]["median"]
    print(f"\n{model}, {n} logical CPU devices, global batch {batch}: {out['reproduced']} of "
          f"{out['random_ops']} random ops reproduced, exact={out['exact']}")
    for label, t in timed.items():
        print(f"  {label:20s} {t['median'] * 1e3:8.1f} ms/step  ({t['min'] * 1e3:.0f}-{t['max'] * 1e3:.0f})")
    if "global_rows_overhead" in out:
        print(f"  exact, global rows/streams {out['global_rows_overhead']:.3f}")
    extra = out["extra_bytes_per_example"]
    print(f"  exact/streams {out['overhead']:.3f}; extra mask memory " + (
        f"{extra} B per example of the global batch" if extra is not None else
        "transient, per iteration of the loop (each tower draws the global batch's rows)"))
    if "global_rows_overhead" in out:
        print("  (exact draws in a loop: each tower draws its own rows from its stream state; "
              "global rows: each draws the global batch's rows and keeps its own)")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="cnn,lstm")
    parser.add_argument("--devices", default="2,4")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--per-round", type=int, default=5)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        model, n = args.child[0], int(args.child[1])
        common.logical_cpus(n)
        print("RESULT " + json.dumps(measure(model, n, args.rounds, args.per_round)))
        return 0
    results = []
    print(common.machine())
    for model in args.models.split(","):
        for n in (int(d) for d in args.devices.split(",")):
            proc = subprocess.run([sys.executable, __file__, "--child", model, str(n), "--rounds",
                                   str(args.rounds), "--per-round", str(args.per_round)],
                                  capture_output=True, text=True)
            for line in proc.stdout.splitlines():
                if line.startswith("RESULT "):
                    results.append(json.loads(line[7:]))
                else:
                    print(line)
            if proc.returncode:
                print(proc.stderr[-2000:])
    path = common.write_json("randomness.json", {"machine": common.machine(), "results": results})
    print(f"\nwritten {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
