"""Start a TensorFlow cluster on this machine to try distributed in-graph training.

Starts one tf.distribute.Server process per task (--ps parameter servers, --workers
workers) on free 127.0.0.1 ports (or --port-base, --port-base+1, ...: ps first, then
workers), listening on loopback only, prints the cluster spec (and writes it to --json),
then serves until Ctrl-C or SIGTERM, which stop every server. A task that dies is
reported; --restart starts it again on its port, as a supervisor would.

Use the spec with the other commands and the API, e.g.
  replicate convert model.meta -o model_dist.meta --cluster cluster.json \\
      --devices worker --controller ps
and run the result with one client session on the master:
  tf.compat.v1.Session("grpc://<worker 0's address>")

example:
  replicate cluster --ps 1 --workers 2 --json cluster.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading

from replicate.errors import ReplicateError
from replicate.graph import outputs

__all__ = ["HELP", "add_arguments", "run"]

log = logging.getLogger(__name__)

HELP = "start a local TensorFlow cluster (ps and worker servers on loopback) until Ctrl-C"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``replicate cluster``."""
    parser.add_argument("--ps", type=int, default=1, metavar="N",
                        help="parameter-server tasks, job 'ps' (default 1; 0 for none)")
    parser.add_argument("--workers", type=int, default=2, metavar="N",
                        help="worker tasks, job 'worker' (default 2)")
    parser.add_argument("--port-base", type=int, metavar="PORT",
                        help="use PORT, PORT+1, ... (default: free ports)")
    parser.add_argument("--cpus-per-task", type=int, default=1, metavar="K",
                        help="logical CPU devices per task, /device:CPU:0..K-1 (default 1)")
    parser.add_argument("--threads", type=int, default=1, metavar="T",
                        help="intra- and inter-op threads per task; 0 for TensorFlow's "
                             "default (default 1)")
    parser.add_argument("--json", metavar="FILE",
                        help="write the cluster spec here (removed when the cluster stops; "
                             "refused if it exists, unless --force)")
    parser.add_argument("--force", action="store_true", help="replace the --json file if it exists")
    parser.add_argument("--restart", action="store_true",
                        help="start a task that dies again on its port")
    parser.add_argument("--timeout", type=float, default=300.0, metavar="S",
                        help="seconds to wait for the servers to come up (default 300)")
    parser.add_argument("--bind-all", action="store_true",
                        help="let the servers listen on every interface (TensorFlow's default); "
                             "without it they listen on 127.0.0.1 only")


def _check(args: argparse.Namespace) -> None:
    if args.workers < 1:
        raise ReplicateError(f"--workers {args.workers}: give at least 1")
    if args.ps < 0:
        raise ReplicateError(f"--ps {args.ps}: give 0 or more")
    if args.cpus_per_task < 1:
        raise ReplicateError(f"--cpus-per-task {args.cpus_per_task}: give at least 1")
    if args.threads < 0:
        raise ReplicateError(f"--threads {args.threads}: give 0 or more")
    if args.port_base is not None and not 1024 <= args.port_base <= 65535 - args.ps - args.workers:
        raise ReplicateError(f"--port-base {args.port_base}: give a port in 1024..65535 with "
                             "room for every task")
    if args.json:
        outputs.check_file(args.json, force=args.force, option="--json")


def _write_json(path: str, text: str, force: bool) -> None:
    outputs.write_file(path, (text + "\n").encode("utf-8"), force=force, option="--json")


def _describe(local) -> str:
    cluster = local.cluster
    master = cluster.master_task()
    lines = []
    for job, task in local.tasks:
        note = f"  master: {cluster.master()}" if (job, task) == master else ""
        lines.append(f"  {f'{job}:{task}':<10s} {cluster.address(job, task):<22s} "
                     f"pid {local.procs[(job, task)].pid}{note}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Start the cluster, print it, and serve until interrupted; return the exit code."""
    from replicate.runtime.cluster_server import LocalCluster

    _check(args)
    stop = threading.Event()
    received: list[int] = []

    def on_signal(signum, _frame) -> None:
        received.append(signum)
        stop.set()

    local = LocalCluster(args.ps, args.workers, port_base=args.port_base,
                         cpus_per_task=args.cpus_per_task, threads=args.threads,
                         bind_all=args.bind_all, timeout=args.timeout)
    # after anything that may refuse the arguments: the handlers come back in the finally only
    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    where = "every interface" if args.bind_all else "127.0.0.1 only"
    print(f"replicate cluster: starting {args.ps} ps + {args.workers} workers ({where}) ...",
          flush=True)
    try:
        local.start()
        spec = local.cluster.to_json()
        if args.json:
            _write_json(args.json, spec, args.force)
        print(_describe(local))
        print(f"cluster spec{f' (in {args.json})' if args.json else ''}:\n{spec}")
        print("TF_CONFIG=" + json.dumps({"cluster": json.loads(spec)}, sort_keys=True))
        print("Ctrl-C stops every server.", flush=True)
        code = _serve(local, args.restart, stop)
    finally:
        local.stop()
        if args.json and os.path.isfile(args.json) and not os.path.islink(args.json):
            os.remove(args.json)
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    why = f" ({signal.Signals(received[0]).name})" if received else ""
    print(f"replicate cluster: stopped {len(local.tasks)} servers{why}", flush=True)
    return code


def _serve(local, restart: bool, stop: threading.Event) -> int:
    """Watch the tasks until ``stop`` is set; report (and optionally restart) dead ones."""
    reported: set[tuple[str, int]] = set()
    while not stop.wait(0.5):
        for (job, task), code in sorted(local.poll().items()):
            if (job, task) in reported and not restart:
                continue
            how = f"signal {-code}" if code < 0 else f"exit code {code}"
            print(f"replicate cluster: {job}:{task} died ({how})", file=sys.stderr, flush=True)
            reported.add((job, task))
            if restart:
                try:
                    local.restart(job, task)
                except ReplicateError as exc:
                    print(f"replicate cluster: {exc}", file=sys.stderr, flush=True)
                    return 1
                print(f"replicate cluster: {job}:{task} restarted on "
                      f"{local.cluster.address(job, task)} (pid {local.procs[(job, task)].pid})",
                      flush=True)
                reported.discard((job, task))
    return 0
