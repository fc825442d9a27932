"""Helper of the analyze pass: forward outputs once batch statistics are synchronized.

Requires: the frontier's forward outputs and the synchronized reductions (``syncs``: the
couplings of ``batch_norm="sync"`` and those a loss term reads nonlinearly in every mode).

Produces: :func:`global_after_sync` (an output computed only from synchronized reductions
reads tower 0's copy, role ``global``), :func:`global_value` (whether every tower's copy holds
the batch's value) and :func:`synchronized_statistics` (a synchronized fused batch norm's
statistics under its original name are the sync pass's, not recomputed).
"""

from __future__ import annotations

import dataclasses

from replicate.batchflow.loss import sync_sources
from replicate.graph.ir import IR, node_of, parse_tensor

__all__ = ["global_after_sync", "global_value", "synchronized_statistics"]


def global_after_sync(flow, f, syncs: set[str]):
    """A forward value computed only from synchronized reductions is the single-device value
    in every tower: read tower 0's copy (role ``global``; a merge by example shares would
    count it N times)."""
    if f.gradient or f.role in ("concat", "first", "global", "sparse_values", "sparse_indices"):
        return f
    if not global_value(flow, f.tensor, syncs):
        return f
    return dataclasses.replace(f, role="global", recompute=())


def global_value(flow, tensor: str, syncs: set[str]) -> bool:
    """Whether every tower's copy of ``tensor`` holds the batch's value: it is computed only
    from synchronized reductions and shared values (a cond's merge of batch norm's
    synchronized variance and the moving variance, a loss term over synchronized means)."""
    if node_of(tensor) in syncs:
        return False        # the reduction itself: its copies hold the towers' own parts
    found = sync_sources(flow.ctx, tensor, synced=frozenset(syncs))
    return found is not None and set(found[0]) <= syncs


def synchronized_statistics(ir: IR, outputs: list, couplings: list[str]) -> list:
    """A synchronized fused batch norm's statistics under its original name are the sync
    pass's (the global mean and variance the towers normalized with), not a batch norm
    recomputed over the merged activations on the controller: its outputs other than ``y``
    are left to the rewire pass, which reads them from the sync pass. Only where ``y`` is
    merged, so that the original-named node is rebuilt."""
    fused = {c for c in couplings if ir.nodes[c].op == "FusedBatchNormV3"}
    merged = {node_of(f.tensor) for f in outputs if f.role != "recompute"
              and node_of(f.tensor) in fused and parse_tensor(f.tensor)[1] == 0}
    return [f for f in outputs if not (node_of(f.tensor) in merged and parse_tensor(f.tensor)[1] > 0)]


