"""Cost and speed of the between-graph peer watch: every worker asking every other one (the old
design) against the hub design of ``replicate.runtime.watch.watched_tasks`` (the chief watches
every worker and ps, the others watch the chief and every ps), over 8 and 16 loopback workers.

    python benchmarks/peer_watch.py [--workers 8 16] [--window 4] [--interval 0.2]

For each worker count W, one ``LocalCluster`` of 1 ps + W worker servers (real TensorFlow
servers, 1 thread each, loopback). This process then plays every worker's watch: one
``PeerWatch`` per worker, each with its own thread and channels, as each worker process would
run it, with the peers either design gives it. Measured:

- **polls per second**: answered ``GetStatus`` RPCs over a ``--window``-second window;
- **CPU**: this process's CPU time over the window (the askers, all watches together) and the
  servers' (``/proc/PID/stat`` of every server process: the answerers), minus an idle window
  of the same length with no watch, in cores (1.0 = one core busy), and per 1000 polls;
- **detection**: seconds from SIGKILL to each report, without the hook's grace (1 s per hop,
  add it): the ps (every watch reports ``ps:0``), a non-chief worker (hub: the chief reports
  it; all pairs: every other worker does), then the chief (hub: the remaining workers report
  it: the second hop a lost non-chief worker takes to reach them).

The figures at 256 workers are computed from the design (polls per interval) and the measured
cost per poll; see benchmarks/RESULTS.md. Results go to ``benchmarks/results/peer_watch.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from replicate.runtime.cluster_server import LocalCluster  # noqa: E402
from replicate.runtime.watch import PeerWatch, watched_tasks  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")


def all_pairs(cluster, task: int) -> list[tuple[str, int]]:
    """The old design: every other worker, no ps."""
    return [("worker", t) for t in cluster.tasks("worker") if t != task]


def hub(cluster, task: int) -> list[tuple[str, int]]:
    return watched_tasks(cluster, "worker", task)


def alive(design, dead: set):
    """``design`` without the tasks already killed."""
    return lambda cluster, task: [k for k in design(cluster, task) if k not in dead]


def server_cpu(local: LocalCluster) -> float:
    """CPU seconds used so far by every server process still running."""
    total = 0
    for proc in local.procs.values():
        try:
            with open(f"/proc/{proc.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except OSError:
            pass
    return total / TICKS


def measure_window(local, seconds: float, watches: list[PeerWatch]) -> dict:
    polls0 = sum(w.polls for w in watches)
    cpu0, srv0, t0 = time.process_time(), server_cpu(local), time.monotonic()
    time.sleep(seconds)
    wall = time.monotonic() - t0
    return {"polls": sum(w.polls for w in watches) - polls0, "wall": wall,
            "client_cpu": time.process_time() - cpu0, "server_cpu": server_cpu(local) - srv0}


def arm(cluster, design, tasks, interval, reports) -> list[PeerWatch]:
    watches = []
    for task in tasks:
        def report(message, task=task):
            reports.append((task, time.monotonic(), message))
        watch = PeerWatch(cluster, task, report, interval=interval, peers=design(cluster, task))
        watch.arm()
        watches.append(watch)
    return watches


def detection(local, victim, design, tasks, interval, timeout=20.0) -> dict:
    """Arm watches for ``tasks``, SIGKILL ``victim`` (job, task), return report delays."""
    reports: list = []
    watching = [t for t in tasks if victim in design(local.cluster, t)]
    watches = arm(local.cluster, design, watching, interval, reports)
    time.sleep(3 * interval)
    proc = local.procs[victim]
    killed = time.monotonic()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    while len(reports) < len(watching) and time.monotonic() - killed < timeout:
        time.sleep(0.005)
    for w in watches:
        w.stop()
    named = f"{victim[0]}:{victim[1]} "
    delays = sorted(at - killed for _, at, message in reports if named in message)
    return {"victim": f"{victim[0]}:{victim[1]}", "reporters": len(watching),
            "reported": len(delays), "min_s": round(min(delays), 3) if delays else None,
            "max_s": round(max(delays), 3) if delays else None}


def run(workers: int, window: float, interval: float) -> dict:
    out: dict = {"workers": workers, "ps": 1, "interval": interval}
    with LocalCluster(ps=1, workers=workers, timeout=600) as local:
        cluster = local.cluster
        tasks = cluster.tasks("worker")
        time.sleep(2)
        idle = measure_window(local, window, [])
        out["idle"] = idle
        for name, design in (("all_pairs", all_pairs), ("hub", hub)):
            watches = arm(cluster, design, tasks, interval, [])
            time.sleep(1)
            got = measure_window(local, window, watches)
            for w in watches:
                w.stop()
            time.sleep(3 * interval)
            nominal = sum(len(design(cluster, t)) for t in tasks) / interval
            client = max(0.0, got["client_cpu"] - idle["client_cpu"]) / got["wall"]
            server = max(0.0, got["server_cpu"] - idle["server_cpu"]) / got["wall"]
            rate = got["polls"] / got["wall"]
            out[name] = {"nominal_polls_per_s": round(nominal, 1),
                         "polls_per_s": round(rate, 1),
                         "client_cores": round(client, 3), "server_cores": round(server, 3),
                         "cpu_ms_per_poll": round(1000 * (client + server) / rate, 3)}
            print(f"W={workers:3d} {name:9s}: {rate:8.1f} polls/s (design {nominal:7.1f}), "
                  f"CPU {client:.3f} cores asking + {server:.3f} answering = "
                  f"{out[name]['cpu_ms_per_poll']:.3f} ms per poll", flush=True)
        ps = ("ps", 0)
        chief = ("worker", 0)
        lost = ("worker", tasks[-1])
        out["detect_ps"] = detection(local, ps, hub, tasks, interval)
        out["detect_worker_hub"] = detection(local, lost, alive(hub, {ps}), tasks, interval)
        # The old design on the next victim, so both kills find every other server alive.
        out["detect_worker_all_pairs"] = detection(local, ("worker", tasks[-2]),
                                                   alive(all_pairs, {lost}), tasks[:-1], interval)
        out["detect_chief_hub"] = detection(local, chief, alive(hub, {ps}), tasks[:-2], interval)
        for key in ("detect_ps", "detect_worker_hub", "detect_worker_all_pairs",
                    "detect_chief_hub"):
            d = out[key]
            print(f"W={workers:3d} {key:24s}: {d['reported']}/{d['reporters']} watches reported "
                  f"{d['victim']} after {d['min_s']}-{d['max_s']} s (without grace)", flush=True)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--window", type=float, default=4.0)
    parser.add_argument("--interval", type=float, default=0.2)
    args = parser.parse_args(argv)
    commit = subprocess.run(["git", "-C", HERE, "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    results = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": commit,
               "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
               "runs": [run(w, args.window, args.interval) for w in args.workers]}
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "peer_watch.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(json.dumps({k: results[k] for k in ("date", "commit", "machine")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
