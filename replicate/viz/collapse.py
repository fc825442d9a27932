"""Collapse a graph of thousands of ops into a few dozen boxes: one per name scope.

:func:`collapse` sorts the nodes into groups (:mod:`replicate.viz.groups`), cuts each
group's name-scope tree into at most ``max_nodes`` boxes (:func:`partition`), and returns
a ``networkx.DiGraph`` whose nodes are the boxes and whose edges count the tensors (and
control dependencies) that flow between them. Every tower is cut the same way, so the
towers look alike.

The cut grows from the group's root, always opening the box that holds the most ops:
a pure name scope opens into its sub-scopes and ops; an op (whose helper ops sit under
its name), a per-op gradient scope (``*_grad``) and a scope of ops only (a layer) stay
closed. When opening a box would
exceed the budget, its largest children get boxes and the rest share one box
(``… N more``).
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import logging
from collections.abc import Iterable, Sequence

import networkx as nx

from replicate.graph.ir import IR, node_of
from replicate.viz.groups import Group, Roles, assign
from replicate.viz.strays import MORE, absorb

__all__ = ["Partition", "partition", "collapse", "MORE", "DEFAULT_MAX_NODES",
           "DEFAULT_SHARED_MAX_NODES"]

log = logging.getLogger(__name__)

#: Boxes per tower when the caller does not say.
DEFAULT_MAX_NODES = 24

#: Boxes per shared group (split, aggregation, variables...) when the caller does not say.
DEFAULT_SHARED_MAX_NODES = 1

#: Children under ``1 / SMALL_FRACTION`` of an average box's ops share a box.
SMALL_FRACTION = 4

#: Longest name component shown in a box's label.
LABEL_PART = 24

#: Scopes with this suffix hold the gradient of one op: they stay closed.
_GRAD_SUFFIX = "_grad"


@dataclasses.dataclass
class _Scope:
    ops: int = 0
    exact: bool = False
    children: dict[str, _Scope] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Partition:
    """A cut of a name-scope tree.

    Attributes:
        opened: scope path -> the children lumped into its ``MORE`` box, largest first,
            with their op counts (empty when every child got a box). Scopes not in here
            are closed boxes.
        only: scopes that are the only child of their parent (left out of labels).
    """

    opened: dict[tuple[str, ...], dict[str, int]] = dataclasses.field(default_factory=dict)
    only: set[tuple[str, ...]] = dataclasses.field(default_factory=set)

    def box(self, path: Sequence[str]) -> tuple[str, ...]:
        """The box of the node whose name has the components ``path``."""
        prefix: tuple[str, ...] = ()
        while prefix in self.opened:
            if len(path) == len(prefix):
                return prefix if not self.opened[prefix] else prefix + (MORE,)
            child = path[len(prefix)]
            if child in self.opened[prefix]:
                return prefix + (MORE,)
            prefix += (child,)
        return prefix


def _tree(paths: Iterable[Sequence[str]]) -> _Scope:
    root = _Scope()
    for path in paths:
        scope = root
        scope.ops += 1
        for part in path:
            scope = scope.children.setdefault(part, _Scope())
            scope.ops += 1
        scope.exact = True
    return root


def _can_open(path: tuple[str, ...], scope: _Scope, depth: int | None) -> bool:
    """A box opens when it is a pure name scope (not an op), not one op's gradient, within
    the depth limit, and holds a sub-scope (a layer whose children are all ops stays whole)."""
    if not scope.children or scope.exact or (depth is not None and len(path) >= depth):
        return False
    if path and path[-1].endswith(_GRAD_SUFFIX):
        return False
    return any(not child.exact for child in scope.children.values())


def partition(paths: Iterable[Sequence[str]], max_nodes: int = DEFAULT_MAX_NODES,
              depth: int | None = None) -> Partition:
    """Cut the scope tree of ``paths`` (node names split at ``/``) into at most ``max_nodes`` boxes.

    Children of an opened scope that hold under a quarter of an average box's ops
    (``ops / max_nodes / 4``) share one ``…`` box, so a scope's stray ops do not use up
    the budget that its sub-scopes need.

    Args:
        paths: one tuple of name components per node.
        max_nodes: the most boxes (at least 1).
        depth: open no scope deeper than this many components (None: no limit).

    Returns:
        The :class:`Partition`; deterministic for the same paths.
    """
    root = _tree(paths)
    small = root.ops / max_nodes / SMALL_FRACTION
    cut = Partition()
    boxes = 1
    heap = [(-root.ops, (), root)]
    while heap:
        _, path, scope = heapq.heappop(heap)
        if not _can_open(path, scope, depth):
            continue
        children = sorted(scope.children.items(), key=lambda kv: (-kv[1].ops, kv[0]))
        keep = [kv for kv in children if kv[1].ops >= small]
        if len(children) - len(keep) == 1:
            keep = children
        room = max_nodes - boxes + 1
        need = len(keep) + (len(keep) < len(children))
        if need > room:
            if room < 2:
                continue
            keep = keep[:room - 1]
        lumped = children[len(keep):]
        if not keep and len(lumped) > 1:
            continue
        cut.opened[path] = {name: child.ops for name, child in lumped}
        if len(children) == 1:
            cut.only.add(path + (children[0][0],))
        boxes += len(keep) + (1 if lumped else 0) - 1
        for name, child in keep:
            heapq.heappush(heap, (-child.ops, path + (name,), child))
    return cut


def collapse(ir: IR, prefixes: Sequence[str] | None = None, roles: Roles | None = None, *,
             max_nodes: int = DEFAULT_MAX_NODES, depth: int | None = None,
             shared_max_nodes: int | None = None) -> nx.DiGraph:
    """The graph of boxes of ``ir``.

    Args:
        ir: the graph (usually a transform's result).
        prefixes: tower scopes (found from the names when None).
        roles: roles of shared nodes (see :func:`replicate.viz.groups.assign`).
        max_nodes: the most boxes per tower.
        depth: the deepest name scope a box may stand for (None: as deep as the budget allows).
        shared_max_nodes: the most boxes per shared group (default 1: the split, the
            aggregation, the variables... each drawn as one box).

    Returns:
        A ``networkx.DiGraph``. Node ids are ``"<group>:<scope>"``; node attributes:
        ``group`` (key), ``kind``, ``scope`` (path inside the group, '' for the whole
        group), ``label``, ``ops`` (count), ``devices`` and ``types`` (``Counter``s of
        device and op type), ``more`` (how many scopes a ``…`` box still holds), ``joined``
        (ops moved in from a ``…`` box: stray ops join the box they feed). Edge
        attributes: ``data`` (tensors read) and ``control`` (control dependencies).
        ``graph.graph["groups"]`` lists the :class:`~replicate.viz.groups.Group`\\ s in
        drawing order, ``graph.graph["nodes"]`` counts the ops.
    """
    if max_nodes < 1:
        raise ValueError(f"max_nodes must be at least 1, not {max_nodes}")
    shared_max = shared_max_nodes if shared_max_nodes is not None else DEFAULT_SHARED_MAX_NODES
    groups, placed = assign(ir, prefixes, roles)
    by_key = {g.key: g for g in groups}
    paths = {name: tuple(by_key[key].relative(name).split("/")) for name, key in placed.items()}
    cuts = _cuts(groups, placed, paths, max_nodes, shared_max, depth)
    boxes = {node.name: cuts["tower" if by_key[placed[node.name]].kind == "tower"
                             else placed[node.name]].box(paths[node.name]) for node in ir}
    joined = absorb(ir, placed, paths, boxes)
    graph = nx.DiGraph(groups=groups, nodes=len(placed))
    box_of: dict[str, str] = {}
    for node in ir:
        group = by_key[placed[node.name]]
        cut = cuts["tower" if group.kind == "tower" else group.key]
        box = boxes[node.name]
        box_id = f"{group.key}:{'/'.join(box)}"
        box_of[node.name] = box_id
        if box_id not in graph:
            graph.add_node(box_id, group=group.key, kind=group.kind, scope="/".join(box),
                           label=_label(group, box, cut), ops=0, devices=collections.Counter(),
                           types=collections.Counter(), more=0, joined=0,
                           lumped=collections.Counter())
        attrs = graph.nodes[box_id]
        if box and box[-1] == MORE:
            attrs["lumped"][paths[node.name][len(box) - 1]] += 1
        attrs["ops"] += 1
        attrs["joined"] += node.name in joined
        attrs["devices"][node.device] += 1
        attrs["types"][node.op] += 1
    for _, attrs in graph.nodes(data=True):
        lumped = attrs.pop("lumped")
        if lumped:
            attrs["more"] = len(lumped)
            attrs["label"] = _more_label(attrs["label"], lumped)
    for node in ir:
        target = box_of[node.name]
        for refs, kind in ((node.inputs, "data"), (node.control, "control")):
            for ref in refs:
                source = box_of.get(node_of(ref))
                if source is None or source == target:
                    continue
                if not graph.has_edge(source, target):
                    graph.add_edge(source, target, data=0, control=0)
                graph.edges[source, target][kind] += 1
    log.info("collapsed %d ops into %d boxes and %d edges", len(placed), graph.number_of_nodes(),
             graph.number_of_edges())
    return graph


def _cuts(groups: list[Group], placed: dict[str, str], paths: dict[str, tuple[str, ...]],
          max_nodes: int, shared_max: int, depth: int | None) -> dict[str, Partition]:
    """One cut for all towers (from their union, so they agree) and one per shared group."""
    members: dict[str, list[tuple[str, ...]]] = collections.defaultdict(list)
    kinds = {g.key: g.kind for g in groups}
    for name, key in placed.items():
        members["tower" if kinds[key] == "tower" else key].append(paths[name])
    return {key: partition(items, max_nodes if key == "tower" else shared_max, depth)
            for key, items in members.items()}


def _label(group: Group, box: tuple[str, ...], cut: Partition) -> str:
    """The text of a box: its scope path without only-child components, shortened to its
    first and last two components."""
    if not box:
        return group.title
    parts = [_short(p) for i, p in enumerate(box) if i == 0 or box[:i + 1] not in cut.only]
    if len(parts) > 3:
        parts = [parts[0], "…"] + parts[-2:]
    return "/".join(parts)


def _more_label(label: str, lumped: collections.Counter) -> str:
    """A ``…`` box's text: the scope it is in and the two largest scopes it holds."""
    names = [_short(n) for n, _ in sorted(lumped.items(), key=lambda kv: (-kv[1], kv[0]))]
    inside = label.rsplit("/", 1)[0] + "/" if "/" in label else ""
    return inside + (names[0] if len(names) == 1 else ", ".join(names[:2]) + ", …")


def _short(part: str) -> str:
    return part if len(part) <= LABEL_PART else part[:LABEL_PART - 1] + "…"
