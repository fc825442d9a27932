"""Judging the harness's records: soundness and the expectation each program states.

Pure Python (no TensorFlow): used by ``tests/test_corpus.py`` and ``report.py``.

- **Sound**: a run whose report claims exact agrees with single-device training within
  ``RTOL`` (relative to scale) in every variable and every fetched value after the driver's
  steps.
- **Expected**: the run converts and the unchanged driver runs; a variant expected exact
  (``"exact": True``) is claimed exact; a variant expected inexact (``"exact": False``) is
  claimed inexact on 2 or more towers with at least one reason, each naming one of
  ``reasons_only``; ``"exact": "either"`` accepts both (exactness is possible but not
  required, e.g. a random draw that does not depend on the batch could be shared by the
  towers); ``max_diff`` bounds the difference even where inexactness is reported (dropout
  fed ``keep_prob=1.0``); ``rtol`` loosens ``RTOL`` for one variant, with its measured
  reason (Adam's normalization of near-zero gradients amplifies float32 rounding: such a
  program also has an SGD variant judged at ``RTOL``).
- ``"exact": "refused"``: the mathematics may allow exactness but replicate cannot establish
  it yet; the run must be *refused at transform time* (the API's ``AnalysisError``, or
  ``replicate convert`` exiting 2) with a message naming one of ``refusal`` — never a
  graph that fails later or trains differently. Towers=1 runs must still convert.
- The judge's own check (path ``self``): the single-device program replayed from the same
  checkpoint reproduces itself, or the comparisons would mean nothing.
"""

from __future__ import annotations

__all__ = ["RTOL", "number", "unsound", "problems"]

#: A claimed-exact run must agree within this relative difference after the driver's steps.
RTOL = 1e-5
#: The single-device program replayed must reproduce itself this closely.
SELF_RTOL = 1e-6


def number(value) -> float:
    """A difference from the JSON records ('inf' and 'nan' are written as strings)."""
    if value is None:
        return float("nan")
    return float(value)


def unsound(record: dict) -> str | None:
    """Why a claimed-exact run is unsound, or None."""
    if record.get("path") == "self" or record.get("error") or not record.get("exact"):
        return None
    diff = number(record.get("max_diff"))
    if diff <= (record.get("rtol") or RTOL):
        return None
    where = (record.get("var_worst") if number(record.get("var_diff")) >= number(record.get("fetch_diff"))
             else record.get("fetch_worst"))
    return f"{label(record)}: claimed exact but differs by {diff:.3g} (worst: {where})"


def label(record: dict) -> str:
    return (f"{record['program']}/{record['variant']} {record['path']} towers={record['towers']} "
            f"batch={record['batch']}")


def problems(record: dict, expect: dict) -> list[str]:
    """Every way ``record`` misses the program's expectation (soundness included)."""
    out = []
    name = label(record)
    if expect.get("exact") == "refused" and record.get("towers", 1) >= 2:
        error = record.get("error") or ""
        if not error:
            return [f"{name}: converted; expected a refusal ({expect.get('why', '')})"]
        if not (error.startswith("transform: AnalysisError") or error.startswith("convert: exit 2")):
            return [f"{name}: failed, but not by a refusal at transform time: {error[:200]}"]
        if not any(s.lower() in error.lower() for s in expect.get("refusal", [])):
            return [f"{name}: refused for another reason than {expect.get('refusal')}: {error[:200]}"]
        return []
    if record.get("error"):
        return [f"{name}: {record['error']}"]
    if record.get("path") == "self":
        diff = number(record.get("max_diff"))
        if not diff <= SELF_RTOL:
            out.append(f"{name}: the single-device program does not reproduce itself "
                       f"(differs by {diff:.3g}); the judge cannot compare")
        if not record.get("changed"):
            out.append(f"{name}: the driver's steps changed no variable")
        return out
    bad = unsound(record)
    if bad:
        out.append("UNSOUND " + bad)
    reasons = record.get("reasons") or []
    if expect.get("exact") == "either" and record.get("exact"):
        pass                                 # exact is allowed (and soundness checked above)
    elif expect.get("exact") is True:
        if not record.get("exact"):
            shown = "; ".join(r[:160] for r in reasons[:2])
            more = f" (+{len(reasons) - 2} more)" if len(reasons) > 2 else ""
            out.append(f"{name}: reported inexact where exact is possible: {shown}{more}")
    elif record.get("towers", 1) >= 2:
        allowed = [s.lower() for s in expect.get("reasons_only", [])]
        if record.get("exact"):
            out.append(f"{name}: claimed exact; expected inexact ({expect.get('why', '')})")
        elif not reasons:
            out.append(f"{name}: inexact without a reason")
        elif allowed:
            wrong = [r for r in reasons if not any(a in r.lower() for a in allowed)]
            if wrong:
                out.append(f"{name}: reason not among {expect['reasons_only']}: {wrong[0][:200]}"
                           + (f" (+{len(wrong) - 1} more)" if len(wrong) > 1 else ""))
    limit = expect.get("max_diff")
    if limit is not None and not number(record.get("max_diff")) <= limit:
        out.append(f"{name}: differs by {number(record.get('max_diff')):.3g} > {limit:g} "
                   f"(worst: {record.get('var_worst')} / {record.get('fetch_worst')})")
    return out
