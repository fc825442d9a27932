"""What passes learn about a graph and hand to later passes (stored in ``ir.facts``)."""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from replicate.batchflow.context import Demand, Position

__all__ = ["BatchInput", "GradScope", "Frontier", "ApplyOp", "VarInfo", "Reason", "Analysis",
           "Towers", "Plan"]


@dataclasses.dataclass
class BatchInput:
    """A tensor that carries examples along ``axis``; split across towers.

    ``cls`` is its batch class: inputs of one class hold the same examples (an image and its
    label) and are split alike; a second class (the noise of a GAN) is split on its own.
    """

    tensor: str
    axis: int
    static_size: int | None
    source_op: str
    cls: int = 0
    #: For a part of a SparseTensor: its (indices, values, dense shape) tensors (None where
    #: one is not fed); the split pass divides its entries by the examples column 0 names.
    sparse: tuple | None = None


@dataclasses.dataclass
class GradScope:
    """One ``tf.gradients`` call: its name scope, its loss and how that loss reduces the batch.

    ``weights`` apply to every aggregated gradient of the scope; ``corrections`` are (tensor,
    weights) pairs: the gradient entering ``tensor`` in tower ``k`` is scaled by its own weight
    over the primary one (a loss adding a mean and a sum, or several losses in one call).
    """

    prefix: str
    loss: str | None
    kind: str
    weights: tuple = ("count",)
    seeds: list = dataclasses.field(default_factory=list)
    losses: list = dataclasses.field(default_factory=list)
    corrections: list = dataclasses.field(default_factory=list)
    #: Gradients a driver fetches, applied by no train op.
    fetched: bool = False


@dataclasses.dataclass
class Frontier:
    """A tensor computed in every tower and read by shared nodes.

    ``role`` is ``dense``, ``sparse_values`` or ``sparse_indices`` for gradients (aggregated), and
    ``concat``, ``mean``, ``sum``, ``ratio``, ``max``, ``min``, ``recompute``, ``first`` or ``global`` for
    forward tensors (merged). ``weights`` says how towers are weighted (see
    :func:`replicate.passes._combine.weight`); ``recompute`` lists, for a tensor no combination of the
    towers' copies gives, the ops to run once on merged inputs instead (a loss adding a sum and a
    shared regularizer, the top-k of a per-example vector).
    """

    tensor: str
    role: str
    gradient: bool
    variable: str | None = None
    weights: tuple = ("count",)
    axis: int = 0
    recompute: tuple = ()
    #: shared rows after the batch rows along ``axis`` (a sampled loss's rows): the towers'
    #: copies of those rows are summed (a gradient) or taken from tower 0 (shared values).
    tail: int = 0
    #: ``concat`` of tensors holding ``outer`` copies of the batch one after the other along
    #: ``axis`` (time-major rows flattened): the towers' rows of each copy are joined in turn.
    outer: int | str = 1


@dataclasses.dataclass
class ApplyOp:
    """An optimizer update and the (gradient, variable) pair it consumes."""

    name: str
    op: str
    optimizer: str
    variable: str
    grad: str
    indices: str | None


@dataclasses.dataclass
class VarInfo:
    """A variable of the graph."""

    name: str
    op: str
    kind: str
    dtype: str
    shape: list[int | None] | None
    bytes: int
    trainable: bool


@dataclasses.dataclass
class Reason:
    """Why the result is not exactly single-device training: the op, what, and what to do."""

    node: str
    what: str
    fix: str

    def __str__(self) -> str:
        return f"{self.node}: {self.what} ({self.fix})"


@dataclasses.dataclass
class Analysis:
    """Roles of the nodes of a training graph, as found by the analyze pass."""

    train_op: str
    variables: dict[str, VarInfo]
    batch_inputs: list[BatchInput]
    shared_inputs: list[str]
    scopes: list[GradScope]
    loss: str | None
    apply_ops: list[ApplyOp]
    optimizers: list[str]
    global_step: str | None
    region: list[str]
    needed: set[str]
    batch_dependent: set[str]
    keep: set[str]
    update_ops: list[str]
    random_ops: list[str]
    frontier: list[Frontier]
    outputs: list[Frontier]
    external_controls: dict[str, list[str]]
    static_batch: int | None
    couplings: list[str] = dataclasses.field(default_factory=list)
    plan: Any = None
    dead: set[str] = dataclasses.field(default_factory=set)
    reasons: list[Reason] = dataclasses.field(default_factory=list)
    warnings: list[str] = dataclasses.field(default_factory=list)
    #: Tensors a driver may fetch by their original names that hold tower 0's value only.
    tower0_values: list[str] = dataclasses.field(default_factory=list)
    train_ops: list[str] = dataclasses.field(default_factory=list)
    classes: dict[int, int | None] = dataclasses.field(default_factory=dict)
    #: The multiple of examples each tower's share of every batch class must be (an op groups
    #: them; 1 when none does).
    granule: int = 1
    demoted: dict[str, str] = dataclasses.field(default_factory=dict)
    auto_sync: list[str] = dataclasses.field(default_factory=list)
    #: Loss denominators (tensor -> the batch reductions it is computed from) that the
    #: gradient code reads as the global batch's values (sync pass); the forward pass keeps
    #: each tower's own.
    denominators: dict[str, tuple] = dataclasses.field(default_factory=dict)
    flow: Any = None
    draws: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: Ops outside the towers that tower gradient code waits for by a control edge: the
    #: train op of an earlier phase of the step (a GAN's discriminator update, pix2pix), applied
    #: once from the merged gradients before the towers compute the next phase's gradients.
    phases: list[str] = dataclasses.field(default_factory=list)
    #: Reads of reference variables an earlier phase updates, by region consumers that wait
    #: for it: consumer -> {input position: (variable, barriers)}; each tower reads again
    #: after the barriers (on one device the consumer sees the buffer updated in place).
    phase_reads: dict[str, dict[int, tuple[str, tuple[str, ...]]]] = dataclasses.field(default_factory=dict)
    #: State writes run once outside the towers -> the region's reads of their variables that
    #: run before them on one device; the write waits for every tower's copy of those reads.
    evicted_reads: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    #: assertions whose condition reads a value of the whole batch -> the merged condition
    #: every tower's copy checks (None: not checked; a reason says why)
    checks: dict[str, dict[int, str] | None] = dataclasses.field(default_factory=dict)
    #: assertions inside function bodies that check the towers' own values: not checked
    #: (function -> node names; a reason says so)
    unchecked: dict[str, list[str]] = dataclasses.field(default_factory=dict)

    @functools.cached_property
    def region_set(self) -> frozenset[str]:
        """The region as a set, for membership tests."""
        return frozenset(self.region)


@dataclasses.dataclass
class Towers:
    """What the split pass made: per-tower input tensors, example counts and weights.

    ``counts``/``static_counts``/``batch_size`` are those of the first batch class; every class
    has its own in ``class_counts`` (count tensors), ``class_static`` (static counts or None),
    ``class_batch`` (the global size tensor) and ``class_offsets`` (where each tower's examples
    start, as tensors). With gradient accumulation (``micro`` > 1) every device holds ``micro``
    consecutive virtual towers, one per micro-batch: ``devices`` repeats each device ``micro``
    times and :meth:`chains` groups the towers by device; ``sums`` holds each device's running
    sums (its towers, their parts in order, the adds) for the accumulate and defer passes.
    """

    devices: list[str]
    prefixes: list[str]
    inputs: list[dict[str, str]]
    counts: list[str]
    static_counts: list[int] | None
    weights: dict[tuple[int, int], str] = dataclasses.field(default_factory=dict)
    batch_size: str = ""
    class_counts: dict[int, list[str]] = dataclasses.field(default_factory=dict)
    class_static: dict[int, list[int] | None] = dataclasses.field(default_factory=dict)
    class_batch: dict[int, str] = dataclasses.field(default_factory=dict)
    class_offsets: dict[int, list[str]] = dataclasses.field(default_factory=dict)
    micro: int = 1
    sums: list[tuple[list[int], list[str], list[str]]] = dataclasses.field(default_factory=list)

    @property
    def running(self) -> list[tuple[str, int]]:
        """The running sums' adds: (op name, the tower whose part it adds)."""
        return [(add, chain[i + 1]) for chain, _, adds in self.sums for i, add in enumerate(adds)]

    def chains(self) -> list[list[int]]:
        """Tower indices per physical device, in order (one per tower without accumulation)."""
        m = self.micro
        return [list(range(i, i + m)) for i in range(0, len(self.devices), m)]


@dataclasses.dataclass
class Plan:
    """What the rewrite must do per tower so that every tower computes its own examples."""

    splits: dict[str, Demand] = dataclasses.field(default_factory=dict)
    consts: dict[str, Demand] = dataclasses.field(default_factory=dict)
    slices: dict[str, Demand] = dataclasses.field(default_factory=dict)
    elements: dict[tuple[str, int | None], list[Position]] = dataclasses.field(default_factory=dict)
    substitutes: dict[str, Position] = dataclasses.field(default_factory=dict)
    attrs: dict[tuple[str, str], tuple[int, int, int]] = dataclasses.field(default_factory=dict)
    factors: dict[str, tuple[int, float]] = dataclasses.field(default_factory=dict)
    promote: dict[str, Demand] = dataclasses.field(default_factory=dict)
    resized: dict[str, tuple] = dataclasses.field(default_factory=dict)
    #: Reshapes that keep rows part batch, part shared: node -> the row shape after them
    #: (the rewrite gives them ``-1`` rows).
    row_shapes: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    #: Gradient ``Pad`` ops of slices of such rows: node -> forward ``Slice`` (the rewrite
    #: computes their paddings from the tower's own slice).
    slice_pads: dict[str, str] = dataclasses.field(default_factory=dict)
    reasons: list[Reason] = dataclasses.field(default_factory=list)
    #: Reasons that rule out any split (a variable with one row per example of the batch):
    #: one tower still runs the single-device step, two or more are refused.
    unsplittable: list[Reason] = dataclasses.field(default_factory=list)

    def absorb(self, other: Plan) -> None:
        """Add what an earlier round planned (later rounds see those tensors resized and do
        not plan them again)."""
        for field in ("splits", "consts", "slices", "elements", "substitutes", "attrs", "factors",
                      "promote", "resized", "row_shapes", "slice_pads"):
            mine = getattr(self, field)
            for key, value in getattr(other, field).items():
                if field == "elements" and key in mine:
                    mine[key].extend(p for p in value if all(q.via != p.via for q in mine[key]))
                else:
                    mine.setdefault(key, value)
        for mine, theirs in ((self.reasons, other.reasons), (self.unsplittable, other.unsplittable)):
            mine.extend(r for r in theirs if r not in mine)

    @property
    def empty(self) -> bool:
        return not (self.splits or self.consts or self.slices or self.elements or self.substitutes
                    or self.attrs or self.factors or self.row_shapes or self.slice_pads)
