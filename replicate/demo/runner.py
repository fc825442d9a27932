"""Train a single-device graph and its replicated twin side by side, and time both.

Both sessions start from the same variable values (the single-device graph's initial values
are loaded into the replicated one), take the same batch at every step, and fetch their loss
with the step. Step times are measured around ``session.run`` only, alternating which graph
runs first, so the two throughputs come from the same run under the same machine load.

Float rounding makes any two trainings drift apart over hundreds of steps (Adam amplifies
tiny differences once gradients are small), so a difference alone says little. A third
session gives the yardstick: the single-device graph trained on the same batches with the
examples of each batch permuted, which is the same computation in another summation order.
The replicated graph agrees when it stays as close to single-device training as that does.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable

import numpy as np

from replicate.check.equivalence import Trainer, relative_difference

__all__ = ["Drift", "SideBySide", "train_side_by_side", "global_difference"]

log = logging.getLogger(__name__)


def global_difference(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    """||a - b|| / ||a|| over every floating-point variable the two share."""
    num = den = 0.0
    for name, value in a.items():
        if name in b and np.issubdtype(np.asarray(value).dtype, np.floating):
            x = np.asarray(value, np.float64)
            num += float(np.sum((x - np.asarray(b[name], np.float64)) ** 2))
            den += float(np.sum(x ** 2))
    return (num / den) ** 0.5 if den else 0.0


def _per_variable(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> dict[str, float]:
    return {n: relative_difference(a[n], b[n]) for n in a
            if n in b and np.issubdtype(np.asarray(a[n]).dtype, np.floating)}


def _trainable(trainer: Trainer) -> dict[str, np.ndarray]:
    """The values of the trainer's trainable variables (the parameters, not optimizer state)."""
    import tensorflow as tf

    names = {v.op.name for v in trainer.graph.get_collection(
        tf.compat.v1.GraphKeys.TRAINABLE_VARIABLES)}
    values = trainer.values()
    return {n: v for n, v in values.items() if n in names} if names else values


@dataclasses.dataclass
class Drift:
    """Parameter differences after ``step`` steps.

    Attributes:
        step: steps taken.
        max_rel: largest per-variable relative difference, replicated vs single device.
        global_rel: ||replicated - single|| / ||single|| over all parameters.
        ref_max_rel: the same as ``max_rel`` for the permuted-batch reference (or None).
        ref_global_rel: the same as ``global_rel`` for the reference (or None).
    """

    step: int
    max_rel: float
    global_rel: float
    ref_max_rel: float | None = None
    ref_global_rel: float | None = None


@dataclasses.dataclass
class SideBySide:
    """What a side-by-side run measured.

    Attributes:
        losses: per step, (single-device loss, replicated loss) before the step's update.
        accuracies: per step, (single-device, replicated) batch accuracy.
        seconds: per step, (single-device, replicated) wall time of ``session.run``.
        per_variable: relative parameter difference after training, by trainable variable.
        drift: parameter differences at a few steps (1, 10, 100, ..., the last).
        batch: global batch size.
        warmup: leading steps left out of the throughput.
    """

    losses: list[tuple[float, float]]
    accuracies: list[tuple[float, float]]
    seconds: list[tuple[float, float]]
    per_variable: dict[str, float]
    drift: list[Drift]
    batch: int
    warmup: int

    @property
    def max_rel(self) -> float:
        """Largest relative parameter difference over all variables, after training."""
        return max(self.per_variable.values(), default=0.0)

    @property
    def worst(self) -> str:
        """The variable with the largest relative difference."""
        return max(self.per_variable, key=self.per_variable.get) if self.per_variable else ""

    @property
    def max_loss_diff(self) -> float:
        """Largest |single loss - replicated loss| over the steps."""
        return max((abs(a - b) for a, b in self.losses), default=0.0)

    def throughput(self) -> tuple[float, float]:
        """Examples per second of (single device, replicated), warm-up steps left out."""
        timed = self.seconds[self.warmup:] or self.seconds
        single = sum(s for s, _ in timed)
        multi = sum(m for _, m in timed)
        n = len(timed) * self.batch
        return n / single if single else 0.0, n / multi if multi else 0.0


def _checkpoints(steps: int | None) -> set[int]:
    marks = {1, 10, 100, 1000, 10000}
    return marks | ({steps} if steps else set())


def _permuted(feed: dict, size: int, rng: np.random.RandomState) -> dict:
    order = rng.permutation(size)
    return {k: (np.asarray(v)[order] if np.ndim(v) and len(v) == size else v)
            for k, v in feed.items()}


def train_side_by_side(original, replicated, train_op: str, batches: Iterable[tuple[dict, int]],
                       cpus: int, fetch: tuple[str, str] = ("loss:0", "accuracy:0"),
                       warmup: int = 5, reference: bool = True, steps: int | None = None,
                       on_step: Callable[[int, SideBySide], None] | None = None) -> SideBySide:
    """Train both graphs on the same feeds; see the module docstring.

    Args:
        original: the single-device graph (tf.Graph or MetaGraphDef).
        replicated: the replicated graph (tf.Graph or MetaGraphDef).
        train_op: the train op's name (the same in both).
        batches: (feed dict, batch size) per step; every fed array has the batch on axis 0.
        cpus: logical CPU devices of the sessions.
        fetch: the loss and accuracy tensor names (the same in both).
        warmup: leading steps left out of the throughput.
        reference: also train the permuted-batch reference (untimed).
        steps: the number of steps, when known, so the last one is a drift checkpoint.
        on_step: called after every step with its index and the results so far.
    """
    # timed: both run as users run them, Grappler on (the reference is not timed)
    single = Trainer(original, train_op, cpus, optimize=True)
    multi = Trainer(replicated, train_op, cpus, optimize=True)
    ref = Trainer(original, train_op, cpus) if reference else None
    result = SideBySide([], [], [], {}, [], 0, warmup)
    marks, rng = _checkpoints(steps), np.random.RandomState(1)
    try:
        start = single.values()
        multi.load(start)
        if ref is not None:
            ref.load(start)
        for i, (feed, size) in enumerate(batches):
            result.batch = size
            got: list[tuple[list, float]] = [([], 0.0), ([], 0.0)]
            for k in ((0, 1) if i % 2 == 0 else (1, 0)):
                begin = time.perf_counter()
                values = (single, multi)[k].step(feed, fetch)
                got[k] = (values, time.perf_counter() - begin)
            (s_vals, s_sec), (m_vals, m_sec) = got
            if ref is not None:
                ref.step(_permuted(feed, size, rng))
            result.losses.append((float(s_vals[0]), float(m_vals[0])))
            result.accuracies.append((float(s_vals[1]), float(m_vals[1])))
            result.seconds.append((s_sec, m_sec))
            if i + 1 in marks:
                result.drift.append(_drift(i + 1, single, multi, ref))
            if on_step is not None:
                on_step(i, result)
        a, b = _trainable(single), _trainable(multi)
        if not result.drift or result.drift[-1].step != len(result.losses):
            result.drift.append(_drift(len(result.losses), single, multi, ref))
    finally:
        for trainer in (single, multi, ref):
            if trainer is not None:
                trainer.close()
    result.per_variable = _per_variable(a, b)
    return result


def _drift(step: int, single: Trainer, multi: Trainer, ref: Trainer | None) -> Drift:
    a, b = _trainable(single), _trainable(multi)
    rel = _per_variable(a, b)
    drift = Drift(step, max(rel.values(), default=0.0), global_difference(a, b))
    if ref is not None:
        c = _trainable(ref)
        drift.ref_max_rel = max(_per_variable(a, c).values(), default=0.0)
        drift.ref_global_rel = global_difference(a, c)
    return drift
