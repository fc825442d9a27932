"""The report of a transform: what was found, replicated and shared, and whether it is exact."""

from __future__ import annotations

import dataclasses
from typing import Any

from replicate.batchflow.facts import Reason
from replicate.wording import count, reductions

__all__ = ["Report"]


def _human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


@dataclasses.dataclass
class Report:
    """A summary of one transform, for people (``str(report)``) and machines (``to_dict()``).

    Attributes:
        exact: True when N towers train exactly as one device would on the same global batch.
        reasons: why not, each naming the op and what to do about it.
    """

    devices: list[str]
    controller: str
    train_op: str
    loss: str | None
    loss_reductions: dict[str, str]
    inputs: list[dict[str, Any]]
    shared_inputs: list[str]
    optimizers: list[str]
    updates: int
    variables: int
    trainable_variables: int
    variable_bytes: int
    global_step: str | None
    input_nodes: int
    nodes_per_tower: int
    shared_nodes: int
    output_nodes: int
    gradients: dict[str, int]
    merged_outputs: int
    update_ops: list[str]
    batch_norm: dict[str, Any]
    synced: list[str]
    rebatched: list[str]
    exact: bool
    reasons: list[Reason]
    warnings: list[str]
    passes: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    mirrored: list[str] = dataclasses.field(default_factory=list)
    shared_why: dict[str, str] = dataclasses.field(default_factory=dict)
    train_ops: list[str] = dataclasses.field(default_factory=list)
    accumulate: dict[str, Any] = dataclasses.field(default_factory=dict)
    random: dict[str, Any] = dataclasses.field(default_factory=dict)
    check: dict[str, Any] = dataclasses.field(default_factory=dict)
    tower0_values: list[str] = dataclasses.field(default_factory=list)
    phases: list[str] = dataclasses.field(default_factory=list)
    options: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serializable dict of the report."""
        out = dataclasses.asdict(self)
        out["reasons"] = [dataclasses.asdict(r) for r in self.reasons]
        return out

    def __str__(self) -> str:
        lines = [f"replicate: {count(len(self.devices), 'tower')} on {', '.join(self.devices)}; "
                 f"shared state on {self.controller}"]
        if self.tower0_values:
            lines.append(f"  NOT MERGED    fetching {', '.join(self.tower0_values)} by the original "
                         "name gives tower 0's value, not the global batch's")
        lines.append(f"  train op      {self.train_op}" + (
            f"  (and {', '.join(self.train_ops[1:])}: every train op is replicated)"
            if len(self.train_ops) > 1 else ""))
        loss = self.loss or "(not found)"
        lines.append(f"  loss          {loss}  ({reductions(self.loss_reductions)})")
        classes = list(dict.fromkeys(inp.get("class", 0) for inp in self.inputs))
        for inp in self.inputs:
            size = inp["static_size"] if inp["static_size"] is not None else "dynamic"
            group = f", batch {classes.index(inp.get('class', 0)) + 1}" if len(classes) > 1 else ""
            where = {"indices": "entries of a SparseTensor, split by the example in column 0",
                     "values": "entries of a SparseTensor, split with its indices",
                     "shape": "dense shape of a SparseTensor, element 0 the tower's batch size"
                     }.get(inp.get("sparse"), f"axis {inp['axis']}")
            lines.append(f"  batch input   {inp['tensor']}  {where}, batch size {size}{group}")
        for name in self.shared_inputs:
            why = self.shared_why.get(name)
            lines.append(f"  shared input  {name}  (not split{': ' + why if why else ''})")
        lines.append(f"  optimizers    {', '.join(self.optimizers) or 'none'}  ({count(self.updates, 'update')})")
        if self.phases:
            lines.append(f"  phases        {len(self.phases) + 1} in one step: the towers' later gradients "
                         f"wait for {', '.join(self.phases)}, applied once from the merged gradients")
        lines.append(f"  variables     {self.variables} ({self.trainable_variables} updated by the optimizer), "
                     f"{_human_bytes(self.variable_bytes)}")
        if self.global_step:
            lines.append(f"  global step   {self.global_step}  (incremented once per step)")
        grads = ", ".join(f"{v} {k}" for k, v in sorted(self.gradients.items())) or "none"
        lines.append(f"  gradients     {grads}")
        lines.append(f"  nodes         {self.input_nodes} in; {self.nodes_per_tower} per tower, "
                     f"{self.shared_nodes} shared; {self.output_nodes} out")
        lines.append(f"  merged        {count(self.merged_outputs, 'forward tensor')} under their "
                     "original names")
        if self.update_ops:
            lines.append(f"  update ops    {len(self.update_ops)} {'runs' if len(self.update_ops) == 1 else 'run'} in tower 0 only "
                         f"(first: {self.update_ops[0]})")
        if self.batch_norm.get("ops"):
            how = ("global statistics across towers, forward and backward" if self.batch_norm["mode"] == "sync"
                   else "each tower uses its slice's statistics")
            lines.append(f"  batch norm    {len(self.batch_norm['ops'])} batch statistics "
                         f"({', '.join(self.batch_norm['ops'][:3])}{'...' if len(self.batch_norm['ops']) > 3 else ''}); "
                         f"mode {self.batch_norm['mode']}: {how}")
        if self.mirrored:
            lines.append(f"  mirrored      {count(len(self.mirrored), 'variable')} copied on every tower device, "
                         "updated in place from all-reduced gradients (checkpoints hold the "
                         "originals; run replicate/mirror/sync after restoring with a Saver "
                         "built after import)")
        if self.accumulate.get("micro", 1) > 1:
            k = self.accumulate["micro"]
            how = ("one after the other (one micro-batch's activations live at a time)"
                   if self.accumulate.get("chained") else
                   f"side by side: {self.accumulate.get('why')}")
            lines.append(f"  accumulate    {k} micro-batches per device ({k * len(self.devices)} in all), "
                         f"gradients summed on each device, optimizer once; run {how}")
        if self.random.get("ops"):
            done = self.random.get("reproduced", {})
            rows = sum(1 for k in done.values() if k in ("rows", "body"))
            lines.append(f"  random ops    {len(done)} of {len(self.random['ops'])} in the towers "
                         "reproduced exactly" + (f" ({rows} per-example: each tower draws its rows "
                                                 "of the single-device draw)" if rows else "")
                         + "; those outside the towers run once per step, as on one device")
        if self.rebatched:
            lines.append(f"  static batch  {count(len(self.rebatched), 'constant')} rewritten per tower")
        if self.exact:
            lines.append("  exact         yes: N towers train as one device on the same global batch")
        else:
            lines.append(f"  exact         NO ({count(len(self.reasons), 'reason')})")
            lines.extend(f"    - {r}" for r in self.reasons)
        if self.check:
            lines.append(f"  check         {self.check.get('summary', '')}")
        lines.extend(f"  warning       {w}" for w in self.warnings)
        return "\n".join(lines)
