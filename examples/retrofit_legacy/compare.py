"""Compare two checkpoints variable by variable: the largest relative difference.

    python compare.py CHECKPOINT_A CHECKPOINT_B
"""

from __future__ import annotations

import argparse
import logging

import numpy as np
import tensorflow as tf

__all__ = ["max_relative_difference", "main"]

log = logging.getLogger(__name__)


def max_relative_difference(a: str, b: str) -> tuple[float, str]:
    """max |a - b| / max |a| over the variables of two checkpoints, and the worst variable."""
    ra, rb = tf.train.load_checkpoint(a), tf.train.load_checkpoint(b)
    names = sorted(ra.get_variable_to_shape_map())
    if names != sorted(rb.get_variable_to_shape_map()):
        raise SystemExit("the checkpoints hold different variables")
    worst, name = 0.0, ""
    for n in names:
        va = np.asarray(ra.get_tensor(n), np.float64)
        vb = np.asarray(rb.get_tensor(n), np.float64)
        rel = float(np.max(np.abs(va - vb))) / max(float(np.max(np.abs(va))), 1e-6) if va.size else 0.0
        if rel > worst:
            worst, name = rel, n
    return worst, name


def main(argv: list[str] | None = None) -> float:
    """Print and return the largest relative difference."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("a")
    parser.add_argument("b")
    args = parser.parse_args(argv)
    worst, name = max_relative_difference(args.a, args.b)
    print(f"largest relative difference: {worst:.3g}" + (f" ({name})" if name else ""))
    return worst


if __name__ == "__main__":
    main()
