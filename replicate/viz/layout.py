"""Layout help for Graphviz: which edges to draw, and how to keep the towers in order.

``dot`` places clusters to minimise edge crossings; towers that look alike cross equally
in any order, so ``dot`` may put tower 2 left of tower 0, and no hint (flat edges,
``ordering``, anchors) holds for every graph. Instead :func:`columns` reads the order
back from the laid-out SVG and :func:`relabel` swaps which tower each column shows —
only among towers that are drawn identically (same boxes, op counts, device shares and
edges: :func:`tower_classes`), so the picture stays an exact drawing of the graph.
"""

from __future__ import annotations

import collections
import logging
import xml.etree.ElementTree as ET

import networkx as nx

__all__ = ["bundled_edges", "depths", "level_towers", "columns", "tower_classes", "relabel",
           "inversions"]

log = logging.getLogger(__name__)

_SVG = "{http://www.w3.org/2000/svg}"


def bundled_edges(graph: nx.DiGraph, bundle: bool) -> list[tuple[str, str, dict]]:
    """The edges to draw: every edge, or per pair of groups one edge with the pair's totals,
    from the source group's deepest box to the target group's shallowest (so a group that
    reads the towers' results sits below them, one that feeds them above)."""
    if not bundle:
        return list(graph.edges(data=True))
    depth = depths(graph)
    inner, pairs = [], {}
    for source, target, attrs in graph.edges(data=True):
        key = (graph.nodes[source]["group"], graph.nodes[target]["group"])
        if key[0] == key[1]:
            inner.append((source, target, attrs))
            continue
        pairs.setdefault(key, []).append((source, target, attrs))
    for edges in pairs.values():
        sources = list(dict.fromkeys(s for s, _, _ in edges))
        targets = list(dict.fromkeys(t for _, t, _ in edges))
        total = {"data": sum(a["data"] for *_, a in edges),
                 "control": sum(a["control"] for *_, a in edges)}
        inner.append((max(sources, key=lambda n: depth[n]), min(targets, key=lambda n: depth[n]),
                      total))
    return inner


def depths(graph: nx.DiGraph) -> dict[str, int]:
    """The longest path from a source to each box (boxes on a cycle share a depth)."""
    dag = nx.condensation(graph)
    level: dict[int, int] = {}
    for scc in nx.topological_sort(dag):
        level[scc] = max((level[p] + 1 for p in dag.predecessors(scc)), default=0)
    return {node: level[scc] for node, scc in dag.graph["mapping"].items()}


def level_towers(dot, graph: nx.DiGraph, members: dict[str, list[str]],
                 ids: dict[str, str], anchor: bool = False) -> None:
    """Put the same box of every tower (the one fed most from outside it, else the
    shallowest) on one rank, so the towers start level; with ``anchor``, also hint their
    order with an invisible node whose out-edges keep their order (``ordering=out``)."""
    towers = [g for g in graph.graph.get("groups", []) if g.kind == "tower" and members.get(g.key)]
    if len(towers) < 2:
        return
    depth = depths(graph)
    first = members[towers[0].key]
    fed = {n: sum(a["data"] for s, _, a in graph.in_edges(n, data=True)
                  if graph.nodes[s]["group"] != towers[0].key) for n in first}
    scope = graph.nodes[min(first, key=lambda n: (-fed[n], depth[n]))]["scope"]
    tops = [ids[f"{g.key}:{scope}"] for g in towers if f"{g.key}:{scope}" in graph]
    if anchor:
        dot.node("order", label="", shape="point", style="invis", width="0", height="0",
                 ordering="out")
        for top in tops:
            dot.edge("order", top, style="invis")
    with dot.subgraph() as same:
        same.attr(rank="same")
        for left, right in zip(tops, tops[1:]):
            same.edge(left, right, style="invis")


def columns(svg: bytes, marks: list[str]) -> list[int]:
    """The towers' left-to-right order in a laid-out SVG.

    Args:
        svg: ``dot``'s SVG output.
        marks: per tower (in index order) the SVG title of its cluster (``cluster_<i>``) or,
            for a tower drawn as one box, of that box.

    Returns:
        Tower indexes sorted by the horizontal position of their label (``[0, 1, ...]``
        when in order); towers not found are left out.
    """
    where = {}
    for group in ET.fromstring(svg).iter(f"{_SVG}g"):
        title = group.find(f"{_SVG}title")
        text = group.find(f"{_SVG}text")
        if title is not None and text is not None and title.text in marks:
            where[marks.index(title.text)] = float(text.get("x", "0"))
    return sorted(where, key=lambda k: where[k])


def _signature(graph: nx.DiGraph, key: str) -> tuple:
    """What a tower looks like, with its own device written as ``self``."""
    boxes = [n for n, a in graph.nodes(data=True) if a["group"] == key]
    own = collections.Counter()
    for n in boxes:
        own.update(graph.nodes[n]["devices"])
    mine = own.most_common(1)[0][0] if own else ""

    def where(device: str) -> str:
        return "self" if device == mine else device

    def end(node: str) -> str:
        attrs = graph.nodes[node]
        return f"self:{attrs['scope']}" if attrs["group"] == key else node

    shape = sorted((graph.nodes[n]["scope"], graph.nodes[n]["ops"],
                    tuple(sorted(graph.nodes[n]["types"].items())),
                    tuple(sorted((where(d), c) for d, c in graph.nodes[n]["devices"].items())))
                   for n in boxes)
    edges = sorted((end(s), end(t), a["data"], a["control"])
                   for n in boxes for s, t, a in list(graph.in_edges(n, data=True))
                   + [e for e in graph.out_edges(n, data=True) if graph.nodes[e[1]]["group"] != key])
    return tuple(shape), tuple(edges)


def tower_classes(graph: nx.DiGraph) -> list[list[str]]:
    """The towers (group keys, in index order) grouped by identical drawings."""
    classes: dict[tuple, list[str]] = {}
    for group in graph.graph.get("groups", []):
        if group.kind == "tower":
            classes.setdefault(_signature(graph, group.key), []).append(group.key)
    return list(classes.values())


def relabel(graph: nx.DiGraph, order: list[int]) -> dict[str, str]:
    """Which tower each tower's place should show so that the columns read in index order.

    Args:
        graph: the collapsed graph.
        order: tower indexes left to right, as :func:`columns` read them.

    Returns:
        ``{drawn tower key: shown tower key}`` for the towers to swap (empty when the order
        is right or no identical towers can be swapped into it).
    """
    towers = [g.key for g in graph.graph.get("groups", []) if g.kind == "tower"]
    place = {towers[k]: p for p, k in enumerate(order) if k < len(towers)}
    swap = {}
    for members in tower_classes(graph):
        drawn = sorted((m for m in members if m in place), key=lambda m: place[m])
        for at, shown in zip(drawn, sorted(drawn, key=towers.index)):
            if at != shown:
                swap[at] = shown
    return swap


def inversions(graph: nx.DiGraph, order: list[int], swap: dict[str, str]) -> int:
    """How many pairs of towers read out of order once ``swap`` is applied (0: in order)."""
    towers = [g.key for g in graph.graph.get("groups", []) if g.kind == "tower"]
    shown = [towers.index(swap.get(towers[k], towers[k])) for k in order if k < len(towers)]
    return sum(a > b for i, a in enumerate(shown) for b in shown[i + 1:])
