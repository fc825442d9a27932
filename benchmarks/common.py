"""Shared by the benchmark scripts: the machine's description, interleaved timing, output."""

from __future__ import annotations

import json
import logging
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence

__all__ = ["machine", "busy_processes", "interleaved", "write_json", "RESULTS_DIR", "fmt_ratio"]

log = logging.getLogger(__name__)

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _memory_gib() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / 2 ** 20
    except OSError:
        pass
    return 0.0


def busy_processes(limit: int = 6, threshold: float = 5.0) -> list[str]:
    """Other processes using more than ``threshold`` % CPU right now (``ps``), busiest first."""
    try:
        out = subprocess.run(["ps", "-eo", "pid,pcpu,rss,args", "--sort=-pcpu", "--no-headers"],
                             capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    me, rows = os.getpid(), []
    for line in out.splitlines():
        parts = line.split(None, 3)
        if len(parts) < 4 or int(parts[0]) == me or float(parts[1]) < threshold:
            continue
        rows.append(f"{parts[1]}% cpu, {int(parts[2]) // 1024} MiB: {parts[3][:90]}")
        if len(rows) >= limit:
            break
    return rows


def _commit() -> str:
    """The repository's HEAD, with "+dirty" when replicate/ has uncommitted changes."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--", "replicate"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def machine() -> dict:
    """What the numbers were measured on."""
    import tensorflow as tf

    return {"replicate_commit": _commit(), "cpu": _cpu_model(), "cores": os.cpu_count(), "memory_gib": round(_memory_gib(), 1),
            "python": platform.python_version(), "tensorflow": tf.__version__,
            "platform": platform.platform(), "load_average": os.getloadavg(),
            "busy_processes": busy_processes(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def interleaved(steps: dict[str, Callable[[int], None]], rounds: int, per_round: int,
                warmup: int) -> dict[str, dict]:
    """Time each step function in interleaved rounds; median seconds per step.

    Args:
        steps: label -> function running the step for batch index ``i``.
        rounds: rounds; in each, every function runs ``per_round`` steps in a row, the
            starting function rotating from round to round.
        per_round: consecutive steps per function per round.
        warmup: untimed steps per function before the first round.

    Returns:
        label -> {"median": s, "rounds": [median of each round], "min": s, "max": s}.
    """
    labels = list(steps)
    for label in labels:
        for i in range(warmup):
            steps[label](i)
    times: dict[str, list[float]] = {label: [] for label in labels}
    counter = warmup
    for r in range(rounds):
        order = labels[r % len(labels):] + labels[:r % len(labels)]
        for label in order:
            got = []
            for _ in range(per_round):
                start = time.perf_counter()
                steps[label](counter)
                got.append(time.perf_counter() - start)
                counter += 1
            times[label].append(statistics.median(got))
        log.info("round %d/%d: %s", r + 1, rounds,
                 ", ".join(f"{k} {v[-1] * 1e3:.0f} ms" for k, v in times.items()))
    return {label: {"median": statistics.median(v), "rounds": v, "min": min(v), "max": max(v)}
            for label, v in times.items()}


def fmt_ratio(a: float | None, b: float | None) -> str:
    """``a / b`` to two decimals, or ``-``."""
    return f"{a / b:.2f}" if a and b else "-"


def logical_cpus(count: int) -> None:
    """Split the physical CPU into ``count`` logical devices (before any session exists)."""
    import tensorflow as tf

    cpus = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(
        cpus[0], [tf.config.LogicalDeviceConfiguration() for _ in range(count)])


def write_json(name: str, data: dict, directory: str = RESULTS_DIR) -> str:
    """Write ``data`` to ``directory/name`` (atomically); return the path."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, name)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=str)
    os.replace(tmp, path)
    return path


def median(values: Sequence[float]) -> float:
    """The median (for callers that import only this module)."""
    return statistics.median(values)
