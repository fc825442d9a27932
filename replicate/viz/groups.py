"""Which part of a replicated graph each node belongs to: a tower, the split, the aggregation...

A *group* is one box of the picture: a tower (``tower_<k>/``), the input split
(``replicate/split/``, with the towers' weights: their shares of the batch), the gradient
aggregation (``replicate/aggregate/``), synchronized batch statistics (``replicate/sync/``), and, on the shared side,
the inputs, the variables (with their initializers and optimizer slots), the optimizer's
update, the forward tensors merged under their original names, and anything else shared.

The shared side is sorted by :class:`Roles`: names of variables, inputs and update ops.
:func:`roles_from_analysis` takes them from the analyze pass (exact); :func:`roles_from_ops`
guesses them from op types when only a GraphDef is at hand.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Iterable, Sequence

from replicate.graph import ops
from replicate.graph.ir import IR
from replicate.passes.aggregate import SCOPE as AGGREGATE_SCOPE
from replicate.passes.split import SCOPE as SPLIT_SCOPE
from replicate.passes.sync import SCOPE as SYNC_SCOPE

__all__ = ["Group", "Roles", "KINDS", "roles_from_analysis", "roles_from_ops", "tower_prefixes",
           "assign"]

log = logging.getLogger(__name__)

#: Group kinds, in the order the picture lists them (top to bottom, roughly).
KINDS = ("inputs", "variables", "split", "tower", "sync", "aggregate", "update", "outputs",
         "shared")

#: Titles of the shared groups.
_TITLES = {"inputs": "inputs", "variables": "variables and optimizer state",
           "split": "split of the batch", "sync": "synchronized batch statistics",
           "aggregate": "gradient aggregation", "update": "optimizer update",
           "outputs": "merged outputs (original names)", "shared": "other shared ops"}

#: Name scopes of the replicate-made groups: (scope, kind, prefix stripped from names).
_SCOPES = ((SPLIT_SCOPE, "split", SPLIT_SCOPE), (SYNC_SCOPE, "sync", SYNC_SCOPE),
           (AGGREGATE_SCOPE, "aggregate", "replicate"))

#: Suffixes of the helper scopes that merge a forward tensor over the towers.
_MERGE_SUFFIXES = ("_parts", "_merged")

_TOWER = re.compile(r"^((?:replicate_tower_x|replicate_tower|tower)_)(\d+)$")


@dataclasses.dataclass(frozen=True)
class Group:
    """One box of the picture.

    Attributes:
        key: unique id (``tower_0``, ``split``, ``variables``, ...).
        kind: one of :data:`KINDS`.
        title: the caption drawn on the box.
        strip: name prefix (with its ``/``) removed from node names inside the group.
        index: the tower index, or -1.
    """

    key: str
    kind: str
    title: str
    strip: str = ""
    index: int = -1

    def relative(self, name: str) -> str:
        """``name`` without the group's prefix."""
        return name[len(self.strip):] if self.strip and name.startswith(self.strip) else name


@dataclasses.dataclass
class Roles:
    """Names of shared nodes whose role the picture shows.

    Attributes:
        variables: variable ops; nodes named under them (initializers, slots) go with them.
        inputs: input ops (placeholders, iterators, queues).
        update: the train op and the optimizer's update ops; shared nodes in their top-level
            name scopes join them.
        region: names of the original single-device region; shared nodes still called so are
            forward tensors merged over the towers.
    """

    variables: frozenset[str] = frozenset()
    inputs: frozenset[str] = frozenset()
    update: frozenset[str] = frozenset()
    region: frozenset[str] = frozenset()


def roles_from_analysis(analysis) -> Roles:
    """Roles from the analyze pass's :class:`~replicate.batchflow.facts.Analysis`."""
    inputs = {b.source_op for b in analysis.batch_inputs}
    inputs |= {b.tensor.split(":")[0] for b in analysis.batch_inputs}
    inputs |= {t.split(":")[0] for t in analysis.shared_inputs}
    update = {a.name for a in analysis.apply_ops} | {analysis.train_op}
    return Roles(frozenset(analysis.variables), frozenset(inputs), frozenset(update),
                 frozenset(analysis.region))


def roles_from_ops(ir: IR) -> Roles:
    """Roles guessed from op types: variable ops, input sources and optimizer updates."""
    variables = {n.name for n in ir if n.op in ops.VARIABLE_OPS}
    inputs = {n.name for n in ir if n.op in ops.INPUT_SOURCE_OPS}
    update = {n.name for n in ir if ops.apply_spec(n.op) is not None}
    return Roles(frozenset(variables), frozenset(inputs), frozenset(update))


def tower_prefixes(names: Iterable[str]) -> list[str]:
    """The tower scopes (``tower_0``, ``tower_1``, ...) used by ``names``, in index order.

    Only a run ``<base>0 .. <base>N-1`` counts, so a model's own ``tower_3`` scope alone
    is not mistaken for a tower.
    """
    found: dict[str, set[int]] = {}
    for name in names:
        match = _TOWER.match(name.split("/", 1)[0])
        if match:
            found.setdefault(match.group(1), set()).add(int(match.group(2)))
    for base in ("tower_", "replicate_tower_", "replicate_tower_x_"):
        indexes = found.get(base, set())
        if indexes and indexes == set(range(len(indexes))):
            return [f"{base}{k}" for k in range(len(indexes))]
    return []


def _top_scopes(names: Iterable[str]) -> set[str]:
    return {n.split("/", 1)[0] for n in names}


def assign(ir: IR, prefixes: Sequence[str] | None = None,
           roles: Roles | None = None) -> tuple[list[Group], dict[str, str]]:
    """Sort every node of ``ir`` into a group.

    Args:
        ir: the (replicated) graph.
        prefixes: tower scopes; found from the names when None.
        roles: roles of shared nodes; guessed from op types when None.

    Returns:
        The groups that hold nodes, in :data:`KINDS` order (towers by index), and a map
        from node name to group key.
    """
    if prefixes is None:
        prefixes = tower_prefixes(ir.nodes)
    roles = roles if roles is not None else roles_from_ops(ir)
    towers = {p: Group(p, "tower", f"tower {k}", p + "/", k) for k, p in enumerate(prefixes)}
    shared = {kind: Group(kind, kind, _TITLES[kind]) for kind in KINDS if kind != "tower"}
    for scope, kind, strip in _SCOPES:
        shared[kind] = dataclasses.replace(shared[kind], strip=strip + "/")
    update_scopes = _top_scopes(roles.update) - _top_scopes(roles.variables) - _top_scopes(
        roles.region)
    placed: dict[str, str] = {}
    for node in ir:
        placed[node.name] = _kind_of(node.name, towers, roles, update_scopes)
    used = set(placed.values())
    groups = [g for kind in KINDS for g in (towers.values() if kind == "tower" else [shared[kind]])
              if g.key in used]
    log.debug("groups: %s", ", ".join(f"{g.key}" for g in groups))
    return groups, placed


def _kind_of(name: str, towers: dict[str, Group], roles: Roles, update_scopes: set[str]) -> str:
    """The group key of node ``name``."""
    top = name.split("/", 1)[0]
    if top in towers and "/" in name:
        return top
    for scope, kind, _ in _SCOPES:
        if name.startswith(scope + "/"):
            return kind
    if name in roles.inputs:
        return "inputs"
    parts = name.split("/")
    scopes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    if any(s in roles.variables for s in scopes):
        return "variables"
    if name in roles.update or top in update_scopes:
        return "update"
    if name in roles.region or any(s.endswith(suffix) and s[:-len(suffix)] in roles.region
                                   for s in scopes for suffix in _MERGE_SUFFIXES):
        return "outputs"
    if not roles.region and any(s.endswith(_MERGE_SUFFIXES) for s in scopes):
        return "outputs"
    return "shared"
