"""Stray ops: the leftovers of a scope that got no box of their own join a neighbour's box."""

from __future__ import annotations

import collections
import logging

from replicate.graph.ir import IR, node_of

__all__ = ["MORE", "absorb"]

log = logging.getLogger(__name__)

#: The path component of a box that holds the leftover children of a scope.
MORE = "…"


def absorb(ir: IR, placed: dict[str, str], paths: dict[str, tuple[str, ...]],
            boxes: dict[str, tuple[str, ...]]) -> set[str]:
    """Move ops of ``…`` boxes into the box of a neighbour in their group; return their names.

    A scope's stray top-level ops (the gradient sums of residual connections, a reshape
    before the loss) would otherwise form one box linked to everything around it. Each
    joins the neighbouring box (a producer or consumer in its group) whose scope shares
    the most leading name components with it, then the one that feeds it most, then the
    one it feeds most; this repeats so chains of stray ops follow their neighbours, first
    within their top-level scope (gradients join gradients), then across.
    """
    stray = [n.name for n in ir if boxes[n.name] and boxes[n.name][-1] == MORE]
    joined: set[str] = set()
    waiting = set(stray)
    for need in (1, 0):     # first only boxes in the same top-level scope (gradients to gradients)
        moved = [None]
        while waiting and moved:
            moved = []
            for name in stray:
                if name not in waiting:
                    continue
                node = ir.nodes[name]
                feeds = collections.Counter(_near(boxes, placed, paths, waiting, name, need,
                                                  [node_of(r) for r in node.inputs + node.control]))
                reads = collections.Counter(_near(boxes, placed, paths, waiting, name, need,
                                                  [c.name for c in ir.consumers(name)]))
                if feeds or reads:
                    boxes[name] = max(list(feeds) + list(reads), key=lambda b: (
                        _common(b, paths[name]), feeds[b], reads[b]))
                    moved.append(name)
            waiting.difference_update(moved)
            joined.update(moved)
    return joined


def _near(boxes: dict[str, tuple[str, ...]], placed: dict[str, str],
          paths: dict[str, tuple[str, ...]], waiting: set[str], name: str, need: int,
          neighbours: list[str]) -> list[tuple[str, ...]]:
    """The boxes of ``name``'s settled neighbours in its group that share ``need`` leading
    name components with it."""
    return [boxes[m] for m in neighbours if m in boxes and m not in waiting
            and placed[m] == placed[name] and _common(boxes[m], paths[name]) >= need]


def _common(box: tuple[str, ...], path: tuple[str, ...]) -> int:
    """How many leading name components ``box`` and ``path`` share."""
    n = 0
    while n < min(len(box), len(path)) and box[n] == path[n]:
        n += 1
    return n
