"""The soundness fuzzer over function bodies, random ops, layers with training flags, custom
gradients, shape arithmetic, label-driven segments, vector denominators, masked means and
every ``tf.compat.v1.losses`` reduction (tests/programs.py), with accumulation and
synchronized batch norm.

Each program is transformed and trained 3 steps beside one device, with uneven batches and
masks that leave a tower without masked-in examples. The rules:

- a claim of exactness holds: every variable within 1e-5 of one device, and the fetched loss;
- an inexact rewrite still runs with the original feeds;
- no internal error (a clean refusal is allowed).

``REPLICATE_PROGRAMS`` sets the number of programs, ``REPLICATE_FUZZ_SCALE`` multiplies it
and ``REPLICATE_FUZZ_SEED`` moves the seeds (the soak, tests/soak.py); the suite runs 2
shards of ``PROGRAMS / 2`` from seed 0.
"""

import collections
import os

import numpy as np
import programs
import pytest

import replicate
from replicate.check.equivalence import compare
from replicate.errors import InternalError

CPUS = ["/cpu:1", "/cpu:2", "/cpu:3"]
PROGRAMS = int(int(os.environ.get("REPLICATE_PROGRAMS", "24"))
               * float(os.environ.get("REPLICATE_FUZZ_SCALE", "1")))
SHARDS = 2
#: The first program's seed: 0 in CI; in a soak round, drawn from the round's seed.
BASE = int(os.environ.get("REPLICATE_PROGRAMS_BASE")
           or int(os.environ.get("REPLICATE_FUZZ_SEED") or 0) % 4000 * 1_000_000)
RTOL = 1e-5


def run_program(seed: int) -> str:
    """Transform and check program ``seed``; its outcome: exact, inexact or refused."""
    p = programs.draw(seed)
    graph = programs.build(p)
    try:
        res = replicate.transform(graph, CPUS[:p.towers], **p.options())
    except InternalError as exc:
        raise AssertionError(f"{p.describe()}: internal error: {exc}") from None
    except replicate.ReplicateError:
        return "refused"
    try:
        result = compare(graph, res.meta_graph_def, "train", programs.feeds(p), cpus=p.towers + 1,
                         fetch=("loss:0",))
    except Exception as exc:  # noqa: BLE001 - any failure to run is the finding
        raise AssertionError(f"{p.describe()}: the rewrite ({'exact' if res.report.exact else 'inexact'}) "
                             f"does not run: {type(exc).__name__}: {str(exc)[:400]}") from None
    if not res.report.exact:
        return "inexact"
    single = [float(s[0]) for s, _ in result.fetched]
    assert np.all(np.isfinite(single)), f"{p.describe()}: diverges on one device: {single}"
    assert result.max_rel <= RTOL, (f"{p.describe()}: claimed exact, but {result.worst} differs by "
                                    f"{result.max_rel:.3g} after 3 steps")
    for step, (a, b) in enumerate(result.fetched):
        assert abs(float(a[0]) - float(b[0])) <= 1e-4 * max(1.0, abs(float(a[0]))), (
            f"{p.describe()}: claimed exact, but the merged loss at step {step} is {b[0]} for {a[0]}")
    return "exact"


@pytest.mark.parametrize("shard", range(SHARDS))
def test_generated_programs_keep_the_promise(shard):
    per = PROGRAMS // SHARDS
    tally: collections.Counter = collections.Counter()
    by_category: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for i in range(per):
        seed = BASE + shard * per + i
        outcome = run_program(seed)
        tally[outcome] += 1
        for category in programs.draw(seed).categories():
            by_category[category][outcome] += 1
    print(f"shard {shard}: {dict(tally)}")
    for category, counts in sorted(by_category.items()):
        print(f"  {category}: {dict(counts)}")
    assert sum(tally.values()) == per
    assert tally["exact"] >= per // 4, f"too conservative: {dict(tally)}"
