"""Issue 13: classic TF1 programs convert exactly under their own drivers (tests/corpus/).

One test per group of up to five programs: the harness runs them in one subprocess
(``tests/corpus/harness.py PROGRAM... --mode quick``, for each: on the uneven global batch, the single-device program replayed, the API at 3
towers, ``replicate convert`` at 2 towers for the programs in ``harness.QUICK_CLI``, one API
run at 2 towers of every other variant but ``harness.QUICK_SKIP``'s; ``harness.QUICK_LEAD``
names SGD siblings that take an Adam primary's runs) and every record is judged:

- soundness: whenever the report claims exact, every variable and fetched value agrees
  with single-device training within 1e-5 (relative to scale) after the driver's steps;
- the program's expectation (``VARIANTS[...]["expect"]``): what the mathematics allows.

``python tests/corpus/report.py --write`` runs the full matrix (1, 2 and 3 towers, even and
uneven batches, API and CLI) and regenerates docs/corpus.md.
"""

import json
import os
import subprocess
import sys

import pytest

from corpus import PROGRAMS
from corpus.judge import problems, unsound

HARNESS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus", "harness.py")


def run_harness(programs: list[str], directory) -> list[dict]:
    out = os.path.join(str(directory), "records.json")
    # without Grappler, as the suite's other checks run (``Trainer``): 25% less CPU per group;
    # report.py's full matrix runs with it, as the programs' users do
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_USE_LEGACY_KERAS="1", CORPUS_NO_GRAPPLER="1")
    proc = subprocess.run([sys.executable, HARNESS, *programs, "--mode", "quick", "--json", out],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, f"the harness itself failed:\n{proc.stderr[-3000:]}"
    with open(out) as f:
        found = json.load(f)
    return found if isinstance(found, list) else [found]


#: Programs judged together in one harness process (one TensorFlow import per group, ~10 s
#: of CPU each), balanced by their run time.
GROUPS = [PROGRAMS[i::4] for i in range(4)]


@pytest.mark.parametrize("programs", GROUPS, ids=["+".join(g) for g in GROUPS])
def test_program_converts_exactly_under_its_driver(programs, tmp_path):
    failures = []
    for result in run_harness(programs, tmp_path):
        records = result["records"]
        if not records:
            failures.append(f"{result['program']}: no runs")
            continue
        bad = [u for u in (unsound(r) for r in records) if u]
        if bad:
            failures.append("UNSOUND (claimed exact, trained differently):\n" + "\n".join(bad))
        missed = [p for r in records for p in problems(r, result["variants"][r["variant"]])]
        if missed:
            failures.append(f"{len(missed)} of {len(records)} runs miss the expectation:\n"
                            + "\n".join(missed))
    assert not failures, "\n".join(failures)


def _record(**kw):
    base = {"program": "p", "variant": "v", "path": "api", "towers": 2, "batch": 7, "error": None,
            "exact": True, "reasons": [], "max_diff": 1e-7, "var_diff": 1e-7, "fetch_diff": 0.0,
            "var_worst": "w", "fetch_worst": "loss@0"}
    base.update(kw)
    return base


def test_the_judge():
    exact, dropout = {"exact": True}, {"exact": False, "reasons_only": ["random"]}
    either = {"exact": "either", "reasons_only": ["random"]}
    assert problems(_record(), exact) == []
    assert unsound(_record(max_diff=2e-5, var_diff=2e-5)) and problems(_record(max_diff="inf"), exact)
    assert not unsound(_record(exact=False, max_diff=1.0))            # inexact claims are sound
    assert problems(_record(exact=False, reasons=["n: random op"]), exact)
    assert problems(_record(exact=False, reasons=["n: random op"]), dropout) == []
    assert problems(_record(exact=False, reasons=["n: batch norm"]), dropout)   # wrong reason
    assert problems(_record(exact=True), dropout)                     # claimed exact: a miss
    assert problems(_record(exact=True), either) == []
    assert problems(_record(exact=False, reasons=["n: random op"]), either) == []
    assert problems(_record(exact=False, towers=1, reasons=["n: batch norm"]), dropout) == []
    assert problems(_record(error="driver: KeyError: x"), dropout)
    assert problems(_record(exact=False, reasons=["n: random"], max_diff=1e-3),
                    dict(dropout, max_diff=1e-5))
    assert problems(_record(path="self", exact=None, max_diff=0.0, changed=3), exact) == []
    assert problems(_record(path="self", exact=None, max_diff=1e-3, changed=3), exact)
    assert problems(_record(path="self", exact=None, max_diff=0.0, changed=0), exact)
    refused = {"exact": "refused", "refusal": ["concat"]}
    no = "transform: AnalysisError: cannot replicate this graph: x/concat: ConcatV2 adds shared rows"
    assert problems(_record(exact=None, error=no), refused) == []
    assert problems(_record(exact=None, error="convert: exit 2: error: x/concat ..."), refused) == []
    assert problems(_record(), refused)                                     # converted: a miss
    assert problems(_record(exact=None, error="driver: KeyError: concat"), refused)   # not a refusal
    assert problems(_record(exact=None, error="transform: AnalysisError: other op"), refused)
    assert problems(_record(towers=1), refused) == []                      # one tower converts
