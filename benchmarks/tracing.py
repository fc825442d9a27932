"""A traced step of a session: where the time goes, per device and per op type.

TensorFlow's ``RunOptions(trace_level=FULL_TRACE)`` records every kernel's start and duration;
this sums them per device and per op type. It is the profile the step-time results cite.
"""

from __future__ import annotations

import collections
import logging

import tensorflow as tf

__all__ = ["trace_step", "print_traces"]

log = logging.getLogger(__name__)
v1 = tf.compat.v1


def _short(device: str) -> str:
    tail = device.rsplit("/", 1)[-1].lower()
    return tail.replace("device:", "")


def trace_step(step, repeats: int = 3) -> dict:
    """Trace ``repeats`` runs of a session step function; keep the fastest.

    ``step`` is a function made by ``step_time._session_step`` (it carries ``session``,
    ``fetches`` and ``feed``).

    Returns:
        {"wall_ms", "busy_ms" (device -> ms of kernel time), "ops_ms" (op type -> ms),
         "ops" (kernels run)}.
    """
    graph = step.session.graph
    best = None
    for _ in range(repeats):
        meta = v1.RunMetadata()
        opts = v1.RunOptions(trace_level=v1.RunOptions.FULL_TRACE)
        step.session.run(step.fetches, step.feed, options=opts, run_metadata=meta)
        starts, ends = [], []
        busy: dict[str, float] = collections.defaultdict(float)
        ops: dict[str, float] = collections.defaultdict(float)
        count = 0
        for dev in meta.step_stats.dev_stats:
            for node in dev.node_stats:
                if node.node_name in ("_SOURCE", "_SINK"):
                    continue
                micros = node.op_end_rel_micros
                starts.append(node.all_start_micros)
                ends.append(node.all_start_micros + node.all_end_rel_micros)
                busy[_short(dev.device)] += micros / 1e3
                name = node.node_name.split(":")[0]
                try:
                    kind = graph.get_operation_by_name(name).type
                except KeyError:
                    kind = name.split("/")[-1].split("_")[0] or name
                ops[kind] += micros / 1e3
                count += 1
        wall = (max(ends) - min(starts)) / 1e3 if starts else 0.0
        got = {"wall_ms": wall, "busy_ms": dict(busy), "ops_ms": dict(ops), "ops": count}
        if best is None or wall < best["wall_ms"]:
            best = got
    return best


def print_traces(traces: dict[str, dict], top: int = 7) -> None:
    """One block per variant: wall time, kernel time per device, the costliest op types."""
    print("  traced step (fastest of 3; kernel times summed):")
    for label, t in traces.items():
        busy = ", ".join(f"{d} {ms:.0f}" for d, ms in sorted(t["busy_ms"].items()))
        total = sum(t["ops_ms"].values())
        ops = sorted(t["ops_ms"].items(), key=lambda kv: -kv[1])[:top]
        print(f"    {label}: wall {t['wall_ms']:.0f} ms, {t['ops']} kernels, "
              f"{total:.0f} ms kernel time ({busy})")
        print("      " + ", ".join(f"{k} {ms:.0f}" for k, ms in ops))
