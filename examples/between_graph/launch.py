"""Between-graph replication on this machine: 2 worker processes (+ 1 ps with --sparse), each
with its own server and client, against one device trained on the concatenated batches.

    python launch.py [--sparse] [--steps 4] [--batch 16,8] [--size small|tiny|full] [--work DIR]

1. writes ``cluster.json`` (free 127.0.0.1 ports) and the single-device graph ``model.meta``
   (the seeds' CNN; with ``--sparse`` an embedding model whose table trains sparsely);
2. ``replicate convert model.meta -o template.meta --between-graph --cluster cluster.json``;
3. starts the ps server (``--sparse``) and one ``worker.py`` process per worker task, all kept
   on loopback by replicate's bind shim, and waits for them;
4. trains ``model.meta`` on one device, from the chief's step-0 checkpoint, on the workers'
   batches concatenated in task order, and prints ``max rel param diff vs single device: X``.

With ``--lose-worker T --lose-after K --save-steps N`` worker ``T`` dies after step ``K`` and
only it is started again; the other worker restarts itself and both resume from the chief's
last checkpoint, so the result must still match one device.

Every process it starts is stopped on exit, on error and on Ctrl-C. Exit code 0 when the
difference is at most ``--rtol``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import tensorflow as tf  # noqa: E402

v1 = tf.compat.v1


def free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def embedding_model() -> tf.Graph:
    """A 1000 x 16 embedding table (sparse gradients, Momentum: kept on the ps) and a dense layer."""
    graph = tf.Graph()
    with graph.as_default():
        v1.set_random_seed(11)
        ids = v1.placeholder(tf.int64, [None, 4], name="ids")
        y = v1.placeholder(tf.int64, [None], name="y")
        table = v1.get_variable("embedding", [1000, 16], use_resource=True)
        w = v1.get_variable("dense/w", [16, 10], use_resource=True)
        logits = tf.matmul(tf.reduce_mean(tf.nn.embedding_lookup(table, ids), axis=1), w)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits),
                              name="loss")
        step = v1.train.get_or_create_global_step()
        v1.train.MomentumOptimizer(0.5, 0.9).minimize(loss, global_step=step, name="train")
    return graph


class Processes:
    """Child processes, all stopped by :meth:`stop` (SIGTERM, then SIGKILL)."""

    def __init__(self, work: str):
        from replicate.runtime.cluster_server import shim_path

        self.work = work
        self.env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
        shim = shim_path()
        self.env["LD_PRELOAD"] = " ".join(p for p in (shim, self.env.get("LD_PRELOAD", "")) if p)
        self.env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.dirname(os.path.dirname(HERE)),
                                                             self.env.get("PYTHONPATH", "")) if p)
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, cmd: list[str]) -> subprocess.Popen:
        log = open(os.path.join(self.work, f"{name}.log"), "wb")
        self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        return self.procs[name]

    def tail(self, name: str) -> str:
        with open(os.path.join(self.work, f"{name}.log"), errors="replace") as f:
            lines = [l for l in f.read().splitlines() if l.strip() and not l.startswith(("I0000", "W0000"))]
        return "\n".join(lines[-8:])

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + 10
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def run(args) -> int:
    from worker import local_batch

    from replicate.demo import build_cnn
    from replicate.runtime.driver import largest_difference

    sizes = {"tiny": (4, 8, 32), "small": (16, 32, 256), "full": (32, 64, 1024)}
    work = args.work or tempfile.mkdtemp(prefix="replicate-between-")
    os.makedirs(work, exist_ok=True)
    batches = [int(b) for b in args.batch.split(",")]
    jobs = {"worker": [f"127.0.0.1:{p}" for p in free_ports(2)]}
    if args.sparse:
        jobs["ps"] = [f"127.0.0.1:{free_ports(1)[0]}"]
    spec = os.path.join(work, "cluster.json")
    with open(spec, "w") as f:
        json.dump(jobs, f)
    kind = "embedding" if args.sparse else "cnn"
    graph = embedding_model() if args.sparse else build_cnn(sizes[args.size]).graph
    model = os.path.join(work, "model.meta")
    template = os.path.join(work, "template.meta")
    v1.train.export_meta_graph(filename=model, graph=graph)
    print(f"cluster: {json.dumps(jobs)}  (files in {work})", flush=True)
    done = subprocess.run([sys.executable, "-m", "replicate", "convert", model, "-o", template,
                           "--between-graph", "--cluster", spec, "--force"],
                          capture_output=True, text=True)
    if done.returncode != 0:
        print(done.stderr, file=sys.stderr)
        return 2
    print("\n".join(l for l in done.stdout.splitlines() if l.startswith(("replicate:", "  exact", "wrote"))))
    procs = Processes(work)
    ckpt = os.path.join(work, "ckpt")
    shutil.rmtree(ckpt, ignore_errors=True)          # a fresh run, not a resumed one
    try:
        if args.sparse:
            procs.start("ps-0", [sys.executable, "-m", "replicate.runtime.cluster_server", "--cluster", spec,
                                 "--job", "ps", "--task", "0", "--parent", str(os.getpid())])
        def command(t: int, *extra: str) -> list[str]:
            return [sys.executable, os.path.join(HERE, "worker.py"), "--cluster", spec,
                    "--task", str(t), "--template", template, "--kind", kind,
                    "--steps", str(args.steps), "--batch", args.batch,
                    "--out", os.path.join(work, f"final_{t}.npz"), "--checkpoint-dir", ckpt,
                    "--save-steps", str(args.save_steps or args.steps), "--wait", str(args.wait),
                    *extra]

        for t in range(2):
            lost = args.lose_worker == t
            procs.start(f"worker-{t}", command(t, *(["--die-after", str(args.lose_after)]
                                                    if lost else [])))
        start = time.monotonic()
        logs = {t: f"worker-{t}" for t in range(2)}
        if args.lose_worker is not None:
            # The drill: that worker dies after --lose-after steps; only it is started again.
            t = args.lose_worker
            code = procs.procs[f"worker-{t}"].wait(timeout=args.timeout)
            print(f"worker {t} died (exit {code}) after step {args.lose_after}; starting only it "
                  "again", flush=True)
            logs[t] = f"worker-{t}-again"
            procs.procs[f"worker-{t}"] = procs.start(logs[t], command(t))
        for t in range(2):
            p = procs.procs[f"worker-{t}"]
            p.wait(timeout=args.timeout)
            if p.returncode != 0:
                print(f"worker {t} failed (exit {p.returncode}):\n{procs.tail(logs[t])}",
                      file=sys.stderr)
                return 1
        print(f"2 workers trained {args.steps} steps on local batches {batches} in "
              f"{time.monotonic() - start:.1f} s", flush=True)
    finally:
        procs.stop()
    finals = [{k.replace("|", "/"): v for k, v in np.load(os.path.join(work, f"final_{t}.npz")).items()}
              for t in range(2)]
    # One device: the same graph, the chief's initial values, the concatenated batches.
    reader = tf.train.load_checkpoint(os.path.join(ckpt, "model.ckpt-0"))
    single = tf.Graph()
    with single.as_default():
        v1.train.import_meta_graph(model)
        variables = v1.global_variables()
        with v1.Session(config=v1.ConfigProto(intra_op_parallelism_threads=1,
                                              inter_op_parallelism_threads=1)) as sess:
            sess.run(v1.global_variables_initializer())
            for v in variables:
                v.load(reader.get_tensor(v.op.name), sess)
            for step in range(args.steps):
                parts = [local_batch(kind, t, step, batches[t % len(batches)]) for t in range(2)]
                sess.run("train", {k: np.concatenate([p[k] for p in parts]) for k in parts[0]})
            expected = {v.op.name: x for v, x in zip(variables, sess.run(variables))}
    diff, worst = largest_difference(finals[0], expected)
    agree, _ = largest_difference(finals[1], finals[0])
    print(f"workers agree with each other: max rel diff {agree:.3g}")
    print(f"max rel param diff vs single device: {diff:.3g} ({worst})")
    return 0 if diff <= args.rtol else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sparse", action="store_true", help="embedding model, table on 1 ps task")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", default="16,8", help="local batch of each worker (uneven is fine)")
    parser.add_argument("--size", choices=("tiny", "small", "full"), default="tiny")
    parser.add_argument("--work", default=None, help="directory for logs, graphs and checkpoints")
    parser.add_argument("--rtol", type=float, default=1e-5)
    parser.add_argument("--wait", type=float, default=60.0, help="seconds to wait for every task")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for training")
    parser.add_argument("--save-steps", type=int, default=None,
                        help="checkpoint every N steps (default: at the start and the end)")
    parser.add_argument("--lose-worker", type=int, choices=(0, 1), default=None,
                        help="fault drill: this worker dies after --lose-after steps and only it "
                             "is started again (the other restarts itself, see worker.py)")
    parser.add_argument("--lose-after", type=int, default=3)
    args = parser.parse_args(argv)
    v1.disable_eager_execution()

    def interrupted(signum, frame):
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, interrupted)
    try:
        return run(args)
    except KeyboardInterrupt:
        print("interrupted: every process stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
