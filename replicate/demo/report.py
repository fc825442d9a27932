"""What ``replicate demo`` prints: the set-up, the transform, the loss curves, the verdict."""

from __future__ import annotations

import argparse
import logging
import os

from replicate.demo.data import Dataset
from replicate.demo.model import CNN
from replicate.demo.runner import SideBySide

__all__ = ["print_header", "print_transform", "print_results", "verdict", "AGREEMENT", "DRIFT_FACTOR"]

log = logging.getLogger(__name__)

#: The start of the line that states the agreement (tests look for it).
AGREEMENT = "agreement:"
#: How much further than the permuted-batch reference the replicated graph may drift.
DRIFT_FACTOR = 4.0


def print_header(model: CNN, data: Dataset, args: argparse.Namespace) -> None:
    """The model, the data source and the run's size."""
    c1, c2, dense = model.sizes
    print(f"model: the seeds' MNIST CNN, conv {c1} / conv {c2} / dense {dense} "
          f"({model.parameters():,} parameters), Adam lr {args.lr:g}")
    print(f"data:  {data.source}; {len(data):,} examples")


def print_transform(res, what: str) -> None:
    """How the graph was rewritten and how long it took."""
    rep = res.report
    exact = "exact" if rep.exact else "NOT exact: " + "; ".join(str(r) for r in rep.reasons)
    print(f"transform: {rep.input_nodes:,} nodes -> {rep.output_nodes:,} nodes, "
          f"{len(rep.devices)} towers ({what}), variables on {rep.controller}; "
          f"{res.transform_seconds * 1000:.0f} ms; {exact}")


def _curve(result: SideBySide, points: int = 6) -> None:
    steps = len(result.losses)
    marks = sorted({round(i * (steps - 1) / (points - 1)) for i in range(points)}) if steps > 1 else [0]
    print("  step   loss 1 device   loss towers    |diff|")
    for i in marks:
        a, b = result.losses[i]
        print(f"  {i:4d}   {a:13.6f}   {b:11.6f}   {abs(a - b):.1e}")


def _drift_table(result: SideBySide) -> None:
    print("  after   max rel. diff   |diff|/|params|   reference: 1 device, batch permuted")
    for d in result.drift:
        ref = (f"{d.ref_max_rel:.1e} / {d.ref_global_rel:.1e}" if d.ref_max_rel is not None
               else "-")
        print(f"  {d.step:5d}   {d.max_rel:13.1e}   {d.global_rel:15.1e}   {ref}")


def verdict(result: SideBySide, rtol: float, factor: float = DRIFT_FACTOR) -> tuple[bool, str]:
    """Whether the trainings agree, and why.

    They agree when the first step's parameters differ by at most ``rtol`` (the transform is
    exact) and, at the end, the replicated graph is no further from single-device training
    than ``factor`` times the permuted-batch reference (or within ``rtol`` outright).
    """
    first, last = result.drift[0], result.drift[-1]
    if first.max_rel > rtol:
        return False, f"step {first.step} already differs by {first.max_rel:.1e} > {rtol:g}"
    if all(d.max_rel <= rtol for d in result.drift):
        return True, f"within {rtol:g} at every checkpoint"
    if last.ref_global_rel is None:
        return False, f"drifted to {last.max_rel:.1e} > {rtol:g} (no reference to compare with)"
    bound = factor * last.ref_global_rel
    if last.global_rel <= bound:
        return True, (f"exact at step {first.step}; the later drift ({last.global_rel:.1e} of the "
                      f"parameters' norm) is float rounding, of the order of 1 device's drift from "
                      f"itself when each batch is permuted ({last.ref_global_rel:.1e})")
    return False, (f"drift {last.global_rel:.1e} exceeds {factor:g}x the rounding reference "
                   f"{last.ref_global_rel:.1e}")


def print_results(result: SideBySide, towers: int, rtol: float) -> int:
    """The loss curves, the agreement line and the throughput; returns the exit code."""
    _curve(result)
    _drift_table(result)
    ok, why = verdict(result, rtol)
    first, last = result.drift[0], result.drift[-1]
    print(f"{AGREEMENT} {'OK' if ok else 'DISAGREE'}: max relative parameter difference "
          f"{first.max_rel:.1e} after {first.step} step(s), {last.max_rel:.1e} after "
          f"{last.step} (worst {result.worst}); losses differ by at most "
          f"{result.max_loss_diff:.1e}; {why}")
    single, multi = result.throughput()
    ratio = multi / single if single else float("nan")
    tail = result.accuracies[-10:]
    acc_single = sum(a for a, _ in tail) / max(1, len(tail))
    acc_multi = sum(b for _, b in tail) / max(1, len(tail))
    print(f"throughput: 1 device {single:,.0f} examples/s, {towers} towers {multi:,.0f} examples/s "
          f"({ratio:.2f}x), global batch {result.batch}, "
          f"{max(0, len(result.seconds) - result.warmup)} timed steps")
    print(f"accuracy (last 10 batches): 1 device {acc_single:.3f}, {towers} towers {acc_multi:.3f}")
    cores = os.cpu_count() or 1
    print(f"note: logical CPU devices share this machine's {cores} cores, so on a CPU the towers "
          "add no compute; on GPUs each tower has its own.")
    return 0 if ok else 1
