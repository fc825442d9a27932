"""The numeric certificate: a claimed "exact" is checked by running it.

``transform(..., check=True)`` (and ``replicate convert`` unless ``--no-check``) trains the
original graph and the rewrite side by side on logical CPU devices, from the same initial
values, on synthetic inputs (right shapes and dtypes, labels and ids in range; see
:mod:`replicate.check.synthetic`), with the graph's own random seeds: a few steps at an uneven split
(``4N - 1`` examples over N towers) and, when the batch size is dynamic, two steps where a
tower gets no example (flags True, then False). The largest relative parameter difference
decides: a rewrite the report calls exact that differs by more than ``rtol`` is reported inexact, naming the first variable that
differs and by how much, unless the graph is that sensitive to rounding itself: a run above
``rtol`` is compared with one device trained on the same batches with their examples permuted,
and agrees within ``ROUNDING_FACTOR`` times that drift (graphs without random draws only; the
report shows both figures). Only reports that claim exactness are checked.

A model is a program: converting a file must not touch the outside world, so a graph whose
step would run an op that reads or writes files, calls Python or reaches other processes
(``replicate.graph.ops.UNSAFE_OPS``) is not run, and the certificate says what it skipped. Inputs
are fed, so input pipelines never run.

Requires: the transform's own options, to rebuild the same rewrite on logical CPUs.

Produces: a :class:`Certificate` (ran or skipped, why, figures, seconds).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from replicate.batchflow.facts import Reason
from replicate.errors import ReplicateError, RewriteError
from replicate.options import Options

__all__ = ["Certificate", "certify", "attach", "STEPS", "RTOL"]

log = logging.getLogger(__name__)

#: Training steps of the uneven run.
STEPS = 3

#: Largest relative parameter difference of an exact rewrite (float rounding).
RTOL = 1e-5

#: A difference above ``RTOL`` still agrees when it is within this factor of the graph's own
#: rounding sensitivity: one device trained on the same batches with their examples permuted
#: (the same computation in another summation order). Deep batch-norm nets on small synthetic
#: batches amplify rounding: slim ResNet-50 at a batch of 7 differs from itself by 0.17 that
#: way after one Momentum step. Such a graph cannot tell a weighting bug below that level
#: from rounding, and the report says so.
ROUNDING_FACTOR = 10


@dataclasses.dataclass
class Certificate:
    """The outcome of the numeric check.

    Attributes:
        ran: whether the graphs were run.
        skipped: why not (an unsafe op, inputs that cannot be synthesized), when not.
        runs: one entry per run: global batch, steps, largest relative difference, worst
            variable.
        seconds: time the check took.
    """

    ran: bool
    skipped: str = ""
    runs: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    seconds: float = 0.0
    rtol: float = RTOL
    notes: list[str] = dataclasses.field(default_factory=list)
    #: The error of the run with a tower without examples, when only that run failed.
    empty_tower: str = ""

    @property
    def max_rel(self) -> float:
        """The largest relative difference over all runs (0 when nothing ran)."""
        return max((r["max_rel"] for r in self.runs), default=0.0)

    @property
    def ok(self) -> bool:
        """True when it ran and every run agreed within ``rtol``, or within
        ``ROUNDING_FACTOR`` times the graph's own rounding sensitivity at that batch."""
        return self.ran and all(r["max_rel"] <= max(self.rtol, ROUNDING_FACTOR * r.get("rounding", 0.0))
                                for r in self.runs)

    @property
    def worst(self) -> dict[str, Any] | None:
        """The run with the largest difference."""
        return max(self.runs, key=lambda r: r["max_rel"]) if self.runs else None

    def describe(self) -> str:
        """One line for the report."""
        if not self.ran:
            return f"skipped: {self.skipped}"
        runs = "; ".join(f"batch {r['batch']} x {r['steps']} steps: max relative difference "
                         f"{r['max_rel']:.1e}" + (f" (one device on the permuted batch: "
                                                  f"{r['rounding']:.1e})" if "rounding" in r else "")
                         for r in self.runs)
        return f"ran on logical CPUs with synthetic inputs in {self.seconds:.1f} s ({runs})"

    def to_dict(self) -> dict[str, Any]:
        """Plain data for JSON."""
        return {"ran": self.ran, "skipped": self.skipped, "runs": self.runs, "notes": self.notes,
                "seconds": round(self.seconds, 3), "rtol": self.rtol, "ok": self.ok,
                **({"empty_tower": self.empty_tower} if self.empty_tower else {})}


def certify(source: Any, towers: int, *, train_op: str | None, loss: str | None,
            strategy: Options, yardstick: bool = True, steps: int = STEPS) -> Certificate:
    """Run the original ``source`` and its rewrite for ``towers`` towers with ``strategy``
    (the transform's options) side by side; see the module docstring. ``yardstick``: measure
    the graph's rounding sensitivity when a run differs (False for graphs with random draws,
    whose masks follow the examples' positions, so a permuted batch is another computation).
    ``steps``: steps at the uneven batch (1 only checks that an inexact rewrite runs).

    Raises:
        RewriteError: the rewrite fails where the original runs."""
    from replicate.check.verify import default_batch, verify
    from replicate.passes._picks import MARKER

    start = time.perf_counter()
    micro = strategy.accumulate
    uneven = default_batch(towers * micro)
    batches = [(None, steps)]                              # 4N-1, or the graph's static batch
    if towers * micro > 1:
        # a tower with no example, two steps: flags True, then False (review 42: an op wrong
        # only with an empty tower and a flag False went unseen)
        batches.append((towers * micro - 1, min(2, steps)))
    cert = Certificate(True)
    for batch, steps in batches:
        try:
            found = verify(source, towers, steps=steps, batch=batch, train_op=train_op, loss=loss,
                           strategy=strategy)
        except RewriteError as exc:
            if batch is None:
                raise
            if MARKER in str(exc):
                # an op that picks by position needs an example in every tower: the rewrite's
                # own assertion, which the report's warnings announce
                cert.notes.append(f"batch {batch} not run: a tower has no example, and the "
                                  "rewrite stops with its assertion that says so")
            else:
                # the rewrite runs at the uneven split: a tower without examples is the case
                # that fails (TensorFlow's oneDNN convolutions on an empty batch), a limit
                # of short batches the report states, not a rewrite to refuse
                cert.empty_tower = _short(str(exc).split(" where one device runs: ")[-1])
                cert.notes.append(f"batch {batch} (a tower with no example) fails: "
                                  f"{cert.empty_tower}")
            continue
        except ReplicateError as exc:
            text = _short(str(exc))
            if not cert.runs:
                cert = Certificate(False, text)
                break
            cert.notes.append(f"batch {batch} not run: {text}")
            continue
        c = found.comparison
        run = {"batch": found.batch, "steps": steps, "max_rel": c.max_rel, "worst": c.worst}
        if c.max_rel > RTOL and train_op is not None and yardstick:
            run["rounding"] = _rounding(source, train_op, found, steps)
        cert.runs.append(run)
        if batch is None and found.batch != uneven:
            break                                          # a static batch: no other size fits
    cert.seconds = time.perf_counter() - start
    log.info("certificate: %s", cert.describe())
    return cert


def attach(report, graph: Any, towers: int, options: Options, result=None) -> None:
    """Run the numeric certificate for ``transform(graph, <towers devices>, options)`` and
    record it in ``report`` (a :class:`~replicate.report.Report`); a claimed exact that fails
    becomes inexact, naming the first variable that differs. With ``result`` (the rewrite),
    a claimed exact is also checked on the rewrite's structure: a variable its step reads and
    writes with no order between the two (where the program's own step orders them) makes it
    inexact, naming both ops -- a race a few numeric steps on a quiet machine need not see."""
    distributed = options.between_graph or options.cluster is not None
    if result is not None and report.exact and not distributed:
        _structure(report, result)
    if distributed:
        cert = Certificate(False, "devices of a cluster: run replicate verify on the single-machine graph")
    else:
        # An inexact rewrite runs one step per batch size: it must still run where the original
        # does (the differences are the reasons'; replicate verify measures them over more steps).
        try:
            strategy = Options(aggregation=options.aggregation, batch_norm=options.batch_norm,
                               accumulate=options.accumulate, batch_inputs=options.batch_inputs,
                               shared_inputs=options.shared_inputs,
                               param_devices="mirrored" if options.mirrored else None)
            cert = certify(graph, towers, train_op=report.train_op, loss=options.loss,
                           strategy=strategy,
                           yardstick=report.exact and not report.random.get("ops"),
                           steps=STEPS if report.exact else 1)
        except RewriteError as exc:
            raise RewriteError(f"{exc}; the split the analysis chose cannot run (the inputs named "
                               "with batch_inputs= or shared_inputs=, or an op it could not "
                               "prove, pairs a whole tensor with a tower's slice): name other "
                               "inputs, or train this graph on one device") from None
        if not report.exact and cert.ran:
            cert.notes.insert(0, "the report is inexact already (its reasons say why): one step "
                              "checked that the rewrite runs")
    report.check = cert.to_dict()
    report.check["summary"] = cert.describe()
    if cert.empty_tower:
        report.warnings.append(f"a step whose batch leaves a tower without examples (fewer than "
                               f"{towers} in a step) fails: {cert.empty_tower[:300]} (on CPU "
                               "builds this is usually oneDNN's kernels on an empty batch: set "
                               "TF_ENABLE_ONEDNN_OPTS=0; on GPUs they run)")
    if report.exact and cert.ran and not cert.ok:
        worst = cert.worst
        report.exact = False
        report.check["contradicted"] = True
        report.reasons.append(Reason(worst["worst"], f"the numeric check found '{worst['worst']}' "
                                     f"{worst['max_rel']:.2e} off one device after "
                                     f"{worst['steps']} steps at a global batch of {worst['batch']}, "
                                     "although the analysis found no reason",
                                     "please report the graph: the analysis missed what breaks "
                                     "exactness"))


def _structure(report, result) -> None:
    """The race check of :func:`attach` (``passes/_races.py`` on the rewrite)."""
    from replicate.graph.ir import IR
    from replicate.passes import _races

    start = time.perf_counter()
    ir = IR.from_graph_def(result.graph_def)
    found = _races.racing(ir, ir.to_networkx(), list(result.analysis.train_ops), updates=True)
    own = {w.split("'")[1] for w in report.warnings if "races with itself" in w}
    for variable, (a, b, train_op) in sorted(found.items()):
        if variable in own or len(own) >= 3:
            continue        # the program's own race, which the report states (three at most)
        report.exact = False
        report.reasons.append(Reason(a, f"the rewrite reads or writes variable '{variable}' at "
                                     f"'{a}' with no order against its write at '{b}' in the step "
                                     f"of '{train_op}', where one device orders them",
                                     "please report the graph: the rewrite lost an order"))
        break
    log.info("certificate: race check of the rewrite in %.2f s", time.perf_counter() - start)


def _rounding(source: Any, train_op: str, found, steps: int) -> float:
    """How far one device drifts from itself when each batch's examples are permuted."""
    import numpy as np

    from replicate.check.equivalence import Trainer, relative_difference
    from replicate.check.synthetic import make_feed, permute

    rng, order = np.random.RandomState(11), np.random.RandomState(12).permutation(found.batch)
    a = Trainer(source, train_op, len(found.devices) + 1)
    b = Trainer(source, train_op, len(found.devices) + 1)
    try:
        b.load(a.values())
        for step in range(steps):
            feed = make_feed(found.inputs, found.batch, rng, step=step)
            a.step(feed)
            b.step(permute(found.inputs, feed, order))
        va, vb = a.values(), b.values()
    finally:
        a.close()
        b.close()
    return max((relative_difference(va[n], vb[n]) for n in va
                if n in vb and np.issubdtype(np.asarray(va[n]).dtype, np.floating)), default=0.0)


def _short(text: str) -> str:
    """The useful part of a verify error (without the file name prefix)."""
    return text.split(": ", 1)[1] if ": " in text else text
