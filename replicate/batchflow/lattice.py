"""The facts of the batch dataflow: what each tensor is with respect to the examples.

Every tensor of the tower region gets one :class:`Fact`:

``SHARED``
    does not depend on the batch: every tower computes the single-device value.
``PART``
    *partitioned* along ``axis``: each index along that axis belongs to one example (or to
    ``block`` consecutive rows of one example, repeated ``outer`` times when a time-major
    tensor was flattened or copies of the batch were joined along its axis: the axis holds
    ``outer`` copies one after the other), every other dimension is the same in every
    tower, and tower ``k``'s copy holds exactly the entries of its own examples. ``ordered``
    says whether the towers' copies concatenate to the single-device tensor in order (a
    time-major merge or a concatenation of two batches is partitioned, but not in order).
``RED``
    depends on the batch but has no batch axis: a reduction over examples. ``merge`` says how
    the single-device value follows from the towers' values (``sum``, ``mean``, ``max``,
    ``min``, ``ratio``, ``count``), or ``other`` when it does not; ``spec`` gives the weights of
    a weighted mean (see :mod:`replicate.passes._combine`).
``MIXED``
    depends on the batch in a way no combination of the towers reproduces (an op that selects
    or mixes examples, or one the analysis has no rule for); ``src`` names the op, ``why`` says
    what it does.

``taint`` collects the batch reductions whose per-tower value flows into a tensor (batch-norm
statistics, the longest sequence of a batch): a *coupling* — each tower sees its slice's value,
not the batch's. ``value`` carries symbolic integer values (shapes, sizes): a tuple of
elements, each an ``int``, a :class:`Sym` (a multiple of a batch size) or ``None``.
``index`` marks integer tensors whose values are row numbers local to a tower (``Range`` over
the batch size, ``Where`` over a partitioned condition).
``tail`` marks a partitioned tensor whose batch rows are followed, along ``axis``, by rows that
belong to no example: ``(count, kind)``, ``kind`` ``"shared"`` (the same rows in every tower: the
sampled classes a sampled loss appends to the batch's labels) or ``"grad"`` (each tower's
gradient with respect to such rows, a share of the single-device gradient). Only the rules of
:mod:`replicate.batchflow.rules.tail` accept such a tensor; any other op makes it mixed.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

__all__ = ["INSIDE", "Fact", "Sym", "batch_size", "SHARED", "PART", "RED", "MIXED", "shared", "part", "red", "mixed",
           "join", "MERGES", "Classes", "LIST", "EMPTY_LIST", "ROWS"]

SHARED = "shared"
PART = "part"
RED = "red"
MIXED = "mixed"

#: The handle of an empty TensorList: the bottom of list facts (nothing pushed yet).
EMPTY_LIST = "list:empty"
#: The handle of a TensorList fact, whose other fields describe its elements.
LIST = "list"
#: The handle of a TensorList with one element per example of the batch, in order (the rows
#: ``tf.map_fn`` iterates over, and the results it collects): the fact is that of the stacked
#: list, partitioned along axis 0.
ROWS = "list:rows"

#: How a RED value combines across towers: linear (sum/mean/ratio/count) or extreme (max/min).
MERGES = ("sum", "mean", "ratio", "count", "size", "max", "min", "other")

#: Joins a function call node's name and the name of a node inside the called function in a
#: taint or a source (``<call>>inner``), so an inner node is never mistaken for the caller's.
INSIDE = ">"


@dataclasses.dataclass(frozen=True)
class Sym:
    """An integer equal to ``coef`` times the number of examples of batch class ``cls``;
    ``coef`` None: some multiple the same in every tower (a dynamic time axis merged in).
    ``outer`` remembers, for the size of a partitioned axis, how many copies of the batch it
    holds one after the other (the fact's ``outer``; ``coef / outer`` rows per example each):
    a tensor drawn or filled to that size takes the same layout. It is not part of the value
    (equality ignores it) and arithmetic forgets it."""

    coef: int | None
    cls: int
    outer: int = dataclasses.field(default=1, compare=False)

    def scaled(self, factor: int | None) -> Sym:
        if self.coef is None or factor is None:
            return Sym(None, self.cls)
        return Sym(self.coef * factor, self.cls)


@dataclasses.dataclass(frozen=True)
class Fact:
    """What one tensor is with respect to the batch (see the module docstring)."""

    kind: str
    axis: int | None = None
    cls: int | None = None
    block: int | None = 1
    outer: int | None = 1
    ordered: bool = True
    filtered: bool = False
    merge: str = "other"
    spec: tuple = ()
    src: str | None = None
    why: str = ""
    taint: frozenset = frozenset()
    value: tuple | None = None
    index: tuple | None = None
    handle: str | None = None
    tail: tuple | None = None

    @property
    def dependent(self) -> bool:
        """True unless the tensor is the same in every tower as on one device."""
        return self.kind != SHARED

    def with_(self, **changes: Any) -> Fact:
        """A copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        """A short human-readable form for reports and tests."""
        if self.kind == PART:
            extra = "" if self.block == 1 else f" block {self.block}"
            extra += "" if self.ordered else " unordered"
            extra += " filtered" if self.filtered else ""
            extra += f" + {self.tail[0]} {self.tail[1]} rows" if self.tail else ""
            return f"part axis {self.axis} class {self.cls}{extra}"
        if self.kind == RED:
            return f"reduced ({self.merge}) over class {self.cls}"
        if self.kind == MIXED:
            return f"mixed at {self.src}: {self.why}"
        return "shared"


def shared(value: tuple | None = None, taint: frozenset = frozenset(), handle: str | None = None) -> Fact:
    """A batch-independent fact."""
    return Fact(SHARED, value=value, taint=taint, handle=handle)


def part(axis: int, cls: int, block: int | None = 1, ordered: bool = True, filtered: bool = False,
         taint: frozenset = frozenset(), value: tuple | None = None, index: tuple | None = None,
         outer: int | None = 1) -> Fact:
    """A fact partitioned along ``axis`` by batch class ``cls``."""
    return Fact(PART, axis=axis, cls=cls, block=block, outer=outer, ordered=ordered,
                filtered=filtered, taint=taint, value=value, index=index)


def red(cls: int | None, merge: str, src: str | None, spec: tuple = (), taint: frozenset = frozenset(),
        value: tuple | None = None) -> Fact:
    """A batch-reduced fact."""
    return Fact(RED, cls=cls, merge=merge, spec=spec, src=src, taint=taint, value=value)


def mixed(src: str, why: str, taint: frozenset = frozenset()) -> Fact:
    """A fact towers cannot reproduce, because of op ``src``."""
    return Fact(MIXED, src=src, why=why, taint=taint)


def batch_size(fact: Fact) -> bool:
    """``fact`` is a batch size: one number, some multiple of a batch's count of examples
    (``tf.shape(x)[0]``, cast or not). The towers' values add up to the batch's, so it can be
    synchronized like a batch sum."""
    return fact.kind == RED and fact.merge == "size" and fact.value is not None \
        and len(fact.value) == 1 and isinstance(fact.value[0], Sym)


def _first_mixed(facts: list[Fact]) -> Fact | None:
    return next((f for f in facts if f.kind == MIXED), None)


def join(facts: list[Fact | None], classes: Classes) -> Fact | None:
    """The least fact covering every fact of ``facts`` (``None`` entries are not known yet),
    as at a ``Merge``: partitioned values must agree on the axis; a shared value joined with a
    partitioned one becomes partitioned (the caller demands that the shared one be split)."""
    known = [f for f in facts if f is not None]
    if len(known) > 1:
        known = [f for f in known if f.handle != EMPTY_LIST] or known[:1]
    if not known:
        return None
    taint = frozenset().union(*(f.taint for f in known))
    bad = _first_mixed(known)
    if bad is not None:
        return bad.with_(taint=taint)
    parts = [f for f in known if f.kind == PART]
    tails = {f.tail for f in parts}
    if any(tails) and (len(tails) > 1 or len(parts) < len(known)):
        return mixed("", "a loop or branch joins rows that are part batch, part shared with other rows",
                     taint)
    if parts:
        axes = {f.axis for f in parts}
        if len(axes) > 1:
            return mixed("", "a loop or branch carries the batch on different axes", taint)
        first = parts[0]
        for other in parts[1:]:
            classes.union(first.cls, other.cls)
        blocks = {f.block for f in parts}
        outers = {f.outer for f in parts}
        return first.with_(taint=taint, block=blocks.pop() if len(blocks) == 1 else None,
                           outer=outers.pop() if len(outers) == 1 else None,
                           ordered=all(f.ordered for f in parts),
                           filtered=any(f.filtered for f in parts), value=None, index=None)
    reds = [f for f in known if f.kind == RED]
    if reds:
        merges = {f.merge for f in reds}
        merge = merges.pop() if len(merges) == 1 else "other"
        specs = {f.spec for f in reds}
        if len(specs) > 1 and merge in ("mean", "ratio"):
            merge = "other"
        sharedv = [f for f in known if f.kind == SHARED]
        if merge in ("sum", "count") and any(f.value != (0,) for f in sharedv):
            merge = "other"                 # towers would each add the shared start value
        # two reductions pair no rows: their batches may differ (a labelled and an
        # unlabelled batch, one per branch; review 48 C1: the union made the split assert the
        # two batches the same size, and a step one device runs stopped)
        values = {f.value for f in known}
        return reds[0].with_(merge=merge, taint=taint, value=values.pop() if len(values) == 1 else None)
    values = {f.value for f in known}
    handles = {f.handle for f in known}
    return shared(values.pop() if len(values) == 1 else None, taint,
                  handles.pop() if len(handles) == 1 else None)


class Classes:
    """Batch classes: sets of tensors' batch axes that hold the same examples (union-find).

    A class is born at a batch input; two classes become one where an op aligns their
    examples (an elementwise op, a loop). Each class may know its static size.
    """

    def __init__(self) -> None:
        self._parent: list[int] = []
        self._static: list[int | None] = []
        self.parts: dict[int, tuple[int, ...]] = {}
        self.conflicts: list[tuple[int, int, str, str]] = []
        #: Class -> the op whose shape fixed its size (the report states the assumption).
        self.pinned: dict[int, str] = {}
        #: (class, g, op): ``op`` regroups the examples in groups of ``g`` consecutive rows
        #: (``tf.reshape(x, [-1, 2, d])``, ``tf.split(x, 2)``), so each tower's share must be a
        #: multiple of ``g`` for it to run at all.
        self.granules: list[tuple[int, int, str]] = []
        #: Classes made one by evidence, not by an op that needs equal sizes (row numbers of
        #: one input picking rows of another): their inputs are split by the same counts, so
        #: a feed of other sizes fails in the split instead of pairing other examples. Each
        #: entry is (the joined class, the op that gave the evidence).
        self.evidence: list[tuple[int, str]] = []

    def join_by_evidence(self, a: int, b: int, where: str) -> None:
        """Make ``a`` and ``b`` one class on evidence from op ``where``."""
        self.evidence.append((self.union(a, b, where), where))

    def evidence_of(self, c: int) -> str | None:
        """The first op whose evidence joined class ``c`` to another (see ``evidence``), or
        None when no evidence joined it."""
        return next((w for e, w in self.evidence if self.find(e) == self.find(c)), None)

    def new(self, static: int | None) -> int:
        """A new class of ``static`` examples (None when dynamic)."""
        self._parent.append(len(self._parent))
        self._static.append(static)
        return len(self._parent) - 1

    def compose(self, members: list[int]) -> int:
        """A class holding the examples of ``members`` one after the other (a concatenation
        of batches along their batch axis)."""
        sizes = [self.static(m) for m in members]
        c = self.new(sum(sizes) if None not in sizes else None)
        self.parts[c] = tuple(self.find(m) for m in members)
        return c

    def find(self, c: int) -> int:
        """The representative of class ``c``."""
        while self._parent[c] != c:
            self._parent[c] = self._parent[self._parent[c]]
            c = self._parent[c]
        return c

    def union(self, a: int | None, b: int | None, where: str = "") -> int | None:
        """Make ``a`` and ``b`` one class; records a conflict when their static sizes differ."""
        if a is None or b is None:
            return a if b is None else b
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return ra
        sa, sb = self._static[ra], self._static[rb]
        if sa is not None and sb is not None and sa != sb:
            self.conflicts.append((ra, rb, where, f"batch sizes {sa} and {sb}"))
            return ra
        keep, drop = (ra, rb) if ra < rb else (rb, ra)
        self._parent[drop] = keep
        self._static[keep] = sa if sa is not None else sb
        return keep

    def pin(self, c: int, size: int, where: str = "") -> None:
        """Class ``c`` must have ``size`` examples: an op needs a dimension of that size next to
        its examples (a static output shape of a transposed convolution fed by a dynamic
        input). A different known size is a conflict."""
        root = self.find(c)
        if self._static[root] is None:
            self._static[root] = size
            self.pinned[root] = where
        elif self._static[root] != size:
            self.conflicts.append((root, root, where, f"batch sizes {self._static[root]} and {size}"))

    def granule(self, c: int, g: int, where: str) -> None:
        """Op ``where`` runs only on a multiple of ``g`` examples of class ``c``."""
        if g > 1 and (c, g, where) not in self.granules:     # rules run again every round
            self.granules.append((c, g, where))

    def granularity(self, c: int) -> tuple[int, str]:
        """The multiple of examples class ``c``'s ops need, and the first op that needs one."""
        root, g, where = self.find(c), 1, ""
        for member, h, op in self.granules:
            if self.find(member) == root:
                g, where = math.lcm(g, h), where or op
        return g, where

    def static(self, c: int) -> int | None:
        """The static number of examples of class ``c``, if known."""
        return self._static[self.find(c)]

    def same(self, a: int | None, b: int | None) -> bool:
        """True when ``a`` and ``b`` are the same class."""
        return a is not None and b is not None and self.find(a) == self.find(b)

    def __len__(self) -> int:
        return len(self._parent)
