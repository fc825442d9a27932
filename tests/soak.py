"""The fuzz harness: Hypothesis settings, case accounting, the clean-failure property, and
the long soak.

The fuzz tests (``test_fuzz.py``, ``test_registry.py``) size their Hypothesis runs with
:func:`fuzz` and check every case with :func:`transform_cleanly`. In CI they are
derandomized (the same cases every run). A soak runs the same tests with more examples
and a fresh seed per round, each round in its own process (a TensorFlow abort kills only
that round, and is reported with its seed)::

    python tests/soak.py --minutes 30            # 30 minutes, 2 processes
    python tests/soak.py --minutes 5 --scale 10  # rounds of 10x the CI example counts

Environment read by the tests: ``REPLICATE_FUZZ_SCALE`` (multiplies every example count),
``REPLICATE_FUZZ_SEED`` (an integer: random cases from that seed instead of the
derandomized ones) and ``REPLICATE_FUZZ_STATS`` (a file that receives one JSON line of
outcome counts per fuzz test).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

__all__ = ["fuzz", "Tally", "transform_cleanly", "check_importable", "outcome", "SCALE",
           "KNOWN_BUGS", "main"]

SCALE = float(os.environ.get("REPLICATE_FUZZ_SCALE", "1"))
SEED = os.environ.get("REPLICATE_FUZZ_SEED")
STATS = os.environ.get("REPLICATE_FUZZ_STATS")
TESTS = ("tests/test_fuzz.py", "tests/test_registry.py", "tests/test_soundness.py",
         "tests/test_soundness_programs.py")
#: The pytest ``-k`` selection of the fuzz tests among TESTS.
SELECT = "fuzz_ or claimed_exact"


#: Open core bugs the fuzzers found, each with a strict-xfail reproduction: a result that
#: TensorFlow rejects with a message containing a key counts as outcome ``known: <key>``
#: instead of failing the fuzz test. Delete an entry when its reproduction passes. (Every
#: bug found so far is fixed; see docs/testing.md.)
KNOWN_BUGS: dict[str, str] = {}


def fuzz(examples: int, shrink: bool = True):
    """Decorator: Hypothesis settings for ``examples`` cases (times ``REPLICATE_FUZZ_SCALE``),
    derandomized unless ``REPLICATE_FUZZ_SEED`` is set; ``shrink=False`` for slow cases."""
    from hypothesis import HealthCheck, Phase, seed, settings

    count = max(1, round(examples * SCALE))
    phases = [p for p in Phase if shrink or p not in (Phase.shrink, Phase.explain)]
    config = settings(max_examples=count, derandomize=SEED is None, database=None, phases=phases,
                      deadline=None, suppress_health_check=list(HealthCheck), print_blob=True)

    def wrap(test):
        test = config(test)
        return seed(int(SEED))(test) if SEED is not None else test
    return wrap


class Tally:
    """Outcome counts of one fuzz test; written to ``REPLICATE_FUZZ_STATS`` by :meth:`flush`."""

    def __init__(self, name: str):
        self.name = name
        self.counts: collections.Counter[str] = collections.Counter()

    def add(self, outcome: str) -> None:
        """Count one case with ``outcome`` (``ok``, ``registry``, ``tensorflow``, ...)."""
        self.counts[outcome] += 1

    @property
    def total(self) -> int:
        """Cases counted so far."""
        return sum(self.counts.values())

    def flush(self) -> None:
        """Append the counts as one JSON line to the stats file, if one is configured."""
        if STATS:
            with open(STATS, "a", encoding="utf-8") as fh:
                fh.write(json.dumps({"test": self.name, "counts": dict(self.counts)}) + "\n")


def outcome(exc: Exception) -> str:
    """Where a ReplicateError came from: the reader, the registry check, TensorFlow's
    importer, the analysis or a pass's invariants, or ``crash`` for a Python error inside
    a pass (a core bug: the message shows an internal error, not the input's fault)."""
    from replicate.errors import AnalysisError, DeviceError, InputError, PassError

    text = str(exc)
    if isinstance(exc, PassError):
        return "invariant" if type(exc.cause).__name__ == "InvariantError" else "crash"
    if isinstance(exc, InputError) and "cannot be replicated (" in text:
        return "crash"
    if isinstance(exc, InputError) and "TensorFlow cannot import" in text:
        return "tensorflow"
    if isinstance(exc, AnalysisError):
        return "analysis"
    if isinstance(exc, DeviceError):
        return "device"
    return "registry" if " node " in text or "function" in text or "cycle" in text else "reader"


def check_importable(graph_def, origin: str) -> None:
    """The registry check, then TensorFlow's C++ importer (op signatures, input types, shape
    inference) without building Python objects: as strict as ``registry.import_checked``
    and several times faster, which matters for thousands of fuzz cases."""
    import tensorflow as tf

    from replicate.graph import registry

    registry.check_graph_def(graph_def, origin)
    try:
        registry.cpp_import(graph_def)
    except (ValueError, tf.errors.OpError) as exc:
        raise registry.import_error(origin, exc) from None


def transform_cleanly(source, devices, **options):
    """Transform ``source``; return ``(outcome, result or None)``.

    Asserts the contract: either a result whose graph passes the registry check and imports
    into TensorFlow, or a ReplicateError with a non-empty one-line message. Any other
    exception propagates (a failure of the calling test).
    """
    import replicate

    try:
        res = replicate.transform(source, devices, **options)
    except replicate.ReplicateError as exc:
        message = str(exc)
        assert message and "\n" not in message, f"not a one-line message: {message!r}"
        return outcome(exc), None
    try:
        check_importable(res.graph_def, "the transform's result")
    except replicate.ReplicateError as exc:
        known = [key for key in KNOWN_BUGS if key in str(exc)]
        if not known:
            raise
        return f"known: {known[0]}", res
    return "ok", res


def _round(seed: int, scale: float, stats: str, timeout: float) -> tuple[int, str]:
    env = dict(os.environ, REPLICATE_FUZZ_SEED=str(seed), REPLICATE_FUZZ_SCALE=str(scale),
               REPLICATE_FUZZ_STATS=stats)
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *TESTS,
           "-k", SELECT]
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                              cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    except subprocess.TimeoutExpired:
        return -1, f"round with seed {seed} timed out after {timeout:.0f} s"
    return done.returncode, done.stdout[-4000:] + done.stderr[-2000:]


def _distinct(counts: collections.Counter[str]) -> int:
    """Cases counted, less the repeats of an input already checked."""
    return sum(counts.values()) - counts["repeat"]


def main(argv: list[str] | None = None) -> int:
    """Run fuzz rounds with fresh seeds until the time is up; print the totals."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="how long to soak")
    parser.add_argument("--scale", type=float, default=3.0, help="examples per round, times CI's")
    parser.add_argument("--seed", type=int, default=int(time.time()), help="first round's seed")
    parser.add_argument("--jobs", type=int, default=2, help="rounds run at the same time")
    args = parser.parse_args(argv)
    began = time.monotonic()
    deadline = began + args.minutes * 60
    totals: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    failures: list[str] = []
    rounds, seed = 0, args.seed
    with tempfile.TemporaryDirectory(prefix="replicate-soak-") as tmp:
        while time.monotonic() < deadline:
            batch = []
            for _ in range(max(1, args.jobs)):
                stats = os.path.join(tmp, f"{seed}.jsonl")
                batch.append((seed, stats))
                seed += 1
            with ThreadPoolExecutor(len(batch)) as pool:
                runs = list(pool.map(lambda b: _round(b[0], args.scale, b[1], 3600.0), batch))
            for (s, stats), (code, text) in zip(batch, runs):
                rounds += 1
                if code != 0:
                    failures.append(f"seed {s}: exit {code}; reproduce with REPLICATE_FUZZ_SEED={s} "
                                    f"REPLICATE_FUZZ_SCALE={args.scale:g} python -m pytest "
                                    f"{' '.join(TESTS)} -k '{SELECT}'\n{text}")
                if os.path.exists(stats):
                    for line in open(stats, encoding="utf-8"):
                        row = json.loads(line)
                        totals[row["test"]].update(row["counts"])
            print(f"[{rounds} rounds] " + ", ".join(f"{t}: {_distinct(c)}"
                                                    for t, c in sorted(totals.items())), flush=True)
    grand = sum(_distinct(c) for c in totals.values())
    print(f"\nsoak: {rounds} rounds in {(time.monotonic() - began) / 60:.1f} minutes, {grand} "
          f"distinct cases, {len(failures)} failing rounds")
    for test, counts in sorted(totals.items()):
        print(f"  {test}: {_distinct(counts)} cases " + json.dumps(dict(sorted(counts.items()))))
    for failure in failures:
        print("\n" + failure)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
