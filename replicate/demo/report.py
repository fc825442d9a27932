"""What ``replicate demo`` prints: the set-up, the transform, the loss curves, the verdict."""

from __future__ import annotations

import argparse
import logging
import os

from replicate.check.certificate import ROUNDING_FACTOR
from replicate.demo.data import Dataset
from replicate.demo.model import CNN
from replicate.demo.runner import SideBySide
from replicate.wording import count

__all__ = ["print_header", "print_transform", "print_results", "verdict", "drift_line", "AGREEMENT",
           "EXACT_STEPS"]

log = logging.getLogger(__name__)

#: The start of the line that states the agreement (tests look for it).
AGREEMENT = "agreement:"
#: Exactness is checked at the drift checkpoints up to this step (1 and 10).
EXACT_STEPS = 10


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
          f"{count(len(rep.devices), 'tower')} ({what}), variables on {rep.controller}; "
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


def verdict(result: SideBySide, rtol: float, checked_until: int = EXACT_STEPS) -> tuple[bool, str]:
    """Whether the replicated training is exact where exactness is checked, and the line
    that says so.

    Exactness is checked at the drift checkpoints up to step ``checked_until`` (1 and 10).
    A checkpoint agrees within ``rtol``, or, where the permuted-batch reference ran, within
    ``ROUNDING_FACTOR`` times how far one device moves from itself when only the summation
    order changes (the numeric certificate's yardstick): on a 2-core CPU the CNN's smallest
    parameters drift 2e-3 from themselves by step 10, and the demo called an exact rewrite
    DIFFERS. Later checkpoints are not judged (see :func:`drift_line`).
    """
    checked = [d for d in result.drift if d.step <= checked_until] or result.drift[:1]
    cells = ", ".join(f"step {d.step} {d.max_rel:.1e}" for d in checked)
    over = [d for d in checked if d.max_rel > rtol]
    bad = [d for d in over
           if d.ref_max_rel is None or d.max_rel > ROUNDING_FACTOR * d.ref_max_rel]
    if bad:
        return False, (f"{AGREEMENT} DIFFERS: max relative parameter difference {cells}; "
                       f"step {bad[0].step} is above --rtol {rtol:g} (worst {result.worst}) "
                       f"and above {ROUNDING_FACTOR} times one device's own drift: the towers "
                       "do not train as one device does")
    if over:
        refs = ", ".join(f"step {d.step} {d.ref_max_rel:.1e}" for d in over)
        return True, (f"{AGREEMENT} exact where checked: max relative parameter difference "
                      f"{cells}; above --rtol {rtol:g}, but within {ROUNDING_FACTOR} times how "
                      f"far one device drifts from itself with each batch permuted ({refs})")
    return True, (f"{AGREEMENT} exact where checked: max relative parameter difference {cells} "
                  f"(each within --rtol {rtol:g})")


def drift_line(result: SideBySide, checked_until: int = EXACT_STEPS) -> str | None:
    """Where the two trainings stand after the last step, beside how far one device drifts
    from itself when only the summation order changes; no verdict (none is supported)."""
    last = result.drift[-1]
    if last.step <= checked_until:
        return None
    towers = (f"after {last.step} steps: towers vs 1 device {last.max_rel:.1e} max relative "
              f"({last.global_rel:.1e} of the parameters' norm), losses at most "
              f"{result.max_loss_diff:.1e} apart")
    if last.ref_max_rel is None:
        return (f"drift {towers}; no one-device reference was run (--no-reference), so there is "
                "nothing to set it beside")
    return (f"drift {towers}; beside it, 1 device vs itself with each batch permuted: "
            f"{last.ref_max_rel:.1e} ({last.ref_global_rel:.1e}), how far float rounding alone "
            "moves one device's training")


def print_results(result: SideBySide, towers: int, rtol: float) -> int:
    """The loss curves, the exactness line, the drift line and the throughput; returns the
    exit code (0 when exact where checked, 1 when not)."""
    _curve(result)
    _drift_table(result)
    ok, line = verdict(result, rtol)
    print(line)
    drift = drift_line(result)
    if drift:
        print(drift)
    single, multi = result.throughput()
    ratio = multi / single if single else float("nan")
    tail = result.accuracies[-10:]
    acc_single = sum(a for a, _ in tail) / max(1, len(tail))
    acc_multi = sum(b for _, b in tail) / max(1, len(tail))
    print(f"throughput: 1 device {single:,.0f} examples/s, {count(towers, 'tower')} {multi:,.0f} examples/s "
          f"({ratio:.2f}x), global batch {result.batch}, "
          f"{max(0, len(result.seconds) - result.warmup)} timed steps")
    print(f"accuracy (last 10 batches): 1 device {acc_single:.3f}, {count(towers, 'tower')} {acc_multi:.3f}")
    cores = os.cpu_count() or 1
    print(f"note: logical CPU devices share this machine's {cores} cores, so on a CPU the towers "
          "add no compute; on GPUs each tower has its own.")
    return 0 if ok else 1
