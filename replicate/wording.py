"""Words for numbers and reductions in what replicate prints (reports, inspect, verify).

Counts take the right plural (``1 tower``, ``2 towers``); loss reductions are described
in words instead of the analysis' labels (``mean`` -> ``a mean over the batch``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

__all__ = ["plural", "count", "reduction", "reductions"]

log = logging.getLogger(__name__)

#: The analysis' reduction labels (batchflow.loss.Weighting.kind) in words.
REDUCTIONS = {
    "mean": "a mean over the batch",
    "sum": "a sum over the batch",
    "ratio": "a sum over the batch divided by a count of examples (normalized sum)",
    "mixed": "terms reduced over the batch in different ways",
    "shared": "does not depend on the batch",
}


def plural(n: int, word: str, many: str | None = None) -> str:
    """``word`` when ``n`` is 1, else its plural (``many``, or ``word`` + ``s``)."""
    return word if n == 1 else (many or word + "s")


def count(n: int, word: str, many: str | None = None) -> str:
    """``n`` and ``word`` in the right number: ``1 tower``, ``3 towers``, ``0 reasons``."""
    return f"{n} {plural(n, word, many)}"


def reduction(kind: str) -> str:
    """One reduction label in words; an unknown label is shown as it is."""
    return REDUCTIONS.get(kind, kind)


def reductions(by_scope: Mapping[str, str]) -> str:
    """The loss reductions of each gradient computation, in words.

    One computation (the usual case) gives just its reduction; several are named:
    ``'gradients': a mean over the batch; 'gradients_1': a sum over the batch``.
    """
    if not by_scope:
        return "reduction over the batch unknown"
    kinds = list(by_scope.values())
    if len(set(kinds)) == 1:
        return reduction(kinds[0])
    return "; ".join(f"'{scope}': {reduction(kind)}" for scope, kind in by_scope.items())
