"""Draw a collapsed graph (:func:`replicate.viz.collapse.collapse`) with Graphviz.

:func:`dot_source` writes the DOT text: one cluster per group (towers side by side,
the split above them, the aggregation and the update below), boxes coloured by device
(a box whose ops run on several devices is striped in proportion), edges labelled with
the number of tensors they stand for (dashed: control dependencies only), and a legend.
:func:`render` lays it out with Graphviz's ``dot`` program into SVG or PNG bytes.

The DOT text needs nothing installed; SVG and PNG need the ``graphviz`` Python package
and Graphviz's ``dot`` on ``PATH`` (Debian/Ubuntu: ``apt-get install graphviz``).
"""

from __future__ import annotations

import collections
import html
import logging
import math
import shutil

import networkx as nx

from replicate.errors import ReplicateError
from replicate.viz.style import (CONTROLLER_COLOUR, NO_DEVICE_COLOUR, fill, palette, shade,
                                 short_device, tint)

__all__ = ["FORMATS", "dot_source", "render", "check_dot", "INSTALL_HINT"]

log = logging.getLogger(__name__)

#: Output formats: DOT text, or laid out by ``dot``.
FORMATS = ("svg", "png", "dot")

#: How to get Graphviz, for error messages.
INSTALL_HINT = ("install Graphviz (Debian/Ubuntu: apt-get install graphviz; macOS: brew install "
                "graphviz) and the Python package (pip install 'tf-replicate[viz]')")

#: Resolution of PNG output (Graphviz's own default).
PNG_DPI = 96


def _text(*lines: str) -> str:
    """Lines joined for a DOT label, backslashes kept literal."""
    return "\\n".join(line.replace("\\", "\\\\") for line in lines)


def _tooltip(attrs: dict, group_title: str) -> str:
    devices = ", ".join(f"{short_device(d)} {n}" for d, n in attrs["devices"].most_common())
    types = ", ".join(f"{t} {n}" for t, n in attrs["types"].most_common(6))
    scope = attrs["scope"] or "(whole group)"
    more = f" (+{attrs['more']} scopes)" if attrs["more"] else ""
    return _text(f"{group_title}: {scope}{more}", f"{attrs['ops']} ops on {devices}", types)


def _node_label(attrs: dict) -> str:
    label = attrs["label"]
    if attrs["more"]:
        label = f"{label} ({attrs['more']} scopes)"
    return _text(label, _ops(attrs["ops"]))


def _ops(count: int) -> str:
    return f"{count:,} op{'s' if count != 1 else ''}"


def _legend(colours: dict[str, str], roles: dict[str, str]) -> str:
    rows = ['<tr><td colspan="2"><b>devices</b></td></tr>']
    for device, colour in colours.items():
        role = roles.get(device, "")
        text = html.escape(short_device(device) + (f"  {role}" if role else ""))
        rows.append(f'<tr><td bgcolor="{colour}" width="18"> </td>'
                    f'<td align="left">{text}</td></tr>')
    rows.append('<tr><td colspan="2" align="left">edge label: tensors between boxes<br/>'
                'dashed: control dependencies only<br/>striped box: ops on several devices</td></tr>')
    body = "".join(rows)
    return f'<<table border="0" cellborder="1" cellspacing="0" cellpadding="3">{body}</table>>'


def dot_source(graph: nx.DiGraph, *, title: str | None = None, controller: str | None = None,
               dpi: int | None = None, bundle: bool = True) -> str:
    """The DOT text of ``graph`` (no ``dot`` program needed).

    Args:
        graph: the result of :func:`~replicate.viz.collapse.collapse`.
        title: caption at the top.
        controller: the controller device (coloured grey-blue); found when None.
        dpi: resolution for bitmap output.
        bundle: draw the edges between two groups as one edge between the groups, labelled
            with their total; False draws every edge between boxes.
    """
    import graphviz

    colours = palette(graph, controller)
    groups = graph.graph.get("groups", [])
    members = collections.defaultdict(list)
    for node, attrs in graph.nodes(data=True):
        members[attrs["group"]].append(node)
    dot = graphviz.Digraph("replicate", graph_attr={
        "rankdir": "TB", "newrank": "true", "compound": "true", "nodesep": "0.2",
        "ranksep": "0.3", "fontname": "Helvetica", "fontsize": "18", "labelloc": "t",
        "label": _text(title or ""), "outputorder": "edgesfirst", "bgcolor": "white",
        "pad": "0.2", **({"dpi": str(dpi)} if dpi else {})},
        node_attr={"shape": "box", "fontname": "Helvetica", "fontsize": "11", "height": "0.3",
                   "margin": "0.08,0.03", "penwidth": "0.8"},
        edge_attr={"fontname": "Helvetica", "fontsize": "10", "color": "#55555599",
                   "fontcolor": "#222222", "arrowsize": "0.6"})
    dot.node("legend", label=_legend(colours, _device_roles(graph, members, colours)),
             shape="plaintext", fontsize="10")
    ids = {node: f"n{i}" for i, node in enumerate(graph.nodes)}
    clusters = {}
    for i, group in enumerate(groups):
        nodes = members.get(group.key, [])
        ops = sum(graph.nodes[n]["ops"] for n in nodes)
        device = _majority(graph, nodes)
        caption = f"{group.title} · {short_device(device)}"
        if len(nodes) == 1:
            attrs = graph.nodes[nodes[0]]
            where = f"{attrs['label']} · " if attrs["scope"] else ""
            label = _text(caption, f"{where}{_ops(ops)}")
            dot.node(ids[nodes[0]], label=label, tooltip=_tooltip(attrs, group.title),
                     fontname="Helvetica-Bold", fontsize="12", **fill(attrs["devices"], colours))
            continue
        clusters[group.key] = f"cluster_{i}"
        colour = colours.get(device, NO_DEVICE_COLOUR)
        with dot.subgraph(name=f"cluster_{i}") as sub:
            sub.attr(label=_text(f"{caption} · {ops:,} ops"), style="rounded,filled",
                     fillcolor=tint(colour, 0.8), color=shade(colour),
                     fontname="Helvetica-Bold", fontsize="13", penwidth="1.4")
            for node in nodes:
                attrs = graph.nodes[node]
                sub.node(ids[node], label=_node_label(attrs), tooltip=_tooltip(attrs, group.title),
                         **fill(attrs["devices"], colours))
    _tower_order(dot, graph, members, ids)
    for source, target, attrs in _edges(graph, bundle):
        count = attrs["data"] or attrs["control"]
        extra = {} if attrs["data"] else {"style": "dashed"}
        group_s, group_t = graph.nodes[source]["group"], graph.nodes[target]["group"]
        if bundle and group_s != group_t:
            extra.update({k: v for k, v in (("ltail", clusters.get(group_s)),
                                             ("lhead", clusters.get(group_t))) if v})
        width = f"{min(4.0, 0.7 + 0.45 * math.log2(count)):.2f}"
        if count > 1:
            # Graphviz places labels on the unclipped path: label the end that is not clipped.
            clipped = ("ltail" in extra, "lhead" in extra)
            key = {(True, False): "headlabel", (False, True): "taillabel"}.get(clipped, "label")
            extra[key] = str(count)
            if key != "label":
                extra.update(labeldistance="1.6", labelangle="35")
        dot.edge(ids[source], ids[target], penwidth=width, **extra)
    return dot.source


def _edges(graph: nx.DiGraph, bundle: bool) -> list[tuple[str, str, dict]]:
    """The edges to draw: every edge, or per pair of groups one edge with the pair's totals,
    from the source group's deepest box to the target group's shallowest (so a group that
    reads the towers' results sits below them, one that feeds them above)."""
    if not bundle:
        return list(graph.edges(data=True))
    depth = _depths(graph)
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


def _depths(graph: nx.DiGraph) -> dict[str, int]:
    """The longest path from a source to each box (boxes on a cycle share a depth)."""
    dag = nx.condensation(graph)
    level: dict[int, int] = {}
    for scc in nx.topological_sort(dag):
        level[scc] = max((level[p] + 1 for p in dag.predecessors(scc)), default=0)
    return {node: level[scc] for node, scc in dag.graph["mapping"].items()}


def _tower_order(dot, graph: nx.DiGraph, members: dict[str, list[str]], ids: dict[str, str]) -> None:
    """Keep the towers left to right in index order: their top boxes on one rank, chained."""
    depth = _depths(graph)
    tops = [min(members[g.key], key=lambda n: depth[n]) for g in graph.graph.get("groups", [])
            if g.kind == "tower" and members.get(g.key)]
    if len(tops) < 2:
        return
    with dot.subgraph() as same:
        same.attr(rank="same")
        for left, right in zip(tops, tops[1:]):
            same.edge(ids[left], ids[right], style="invis")


def _majority(graph: nx.DiGraph, nodes: list[str]) -> str:
    devices: collections.Counter = collections.Counter()
    for node in nodes:
        devices.update(graph.nodes[node]["devices"])
    return devices.most_common(1)[0][0] if devices else ""


def _device_roles(graph: nx.DiGraph, members: dict[str, list[str]],
                  colours: dict[str, str]) -> dict[str, str]:
    """``device -> "controller"`` / ``"tower k"`` for the legend."""
    roles: dict[str, list[str]] = collections.defaultdict(list)
    for group in graph.graph.get("groups", []):
        if group.kind == "tower" and members[group.key]:
            roles[_majority(graph, members[group.key])].append(group.title)
    for device, colour in colours.items():
        if colour == CONTROLLER_COLOUR:
            roles[device].insert(0, "controller")
    return {d: ", ".join(r) for d, r in roles.items()}


def check_dot() -> None:
    """Raise :class:`ReplicateError` unless the ``graphviz`` package and ``dot`` are installed."""
    try:
        import graphviz  # noqa: F401
    except ImportError:
        raise ReplicateError(f"the graphviz Python package is not installed; {INSTALL_HINT}") from None
    if shutil.which("dot") is None:
        raise ReplicateError(f"Graphviz's 'dot' program is not on PATH; {INSTALL_HINT}")


def render(graph: nx.DiGraph, fmt: str, *, title: str | None = None,
           controller: str | None = None) -> bytes:
    """``graph`` drawn as ``fmt`` (``svg``, ``png`` or ``dot``) bytes.

    Raises:
        ReplicateError: an unknown format, or Graphviz missing or failing.
    """
    if fmt not in FORMATS:
        raise ReplicateError(f"picture format '{fmt}' is not one of {', '.join(FORMATS)}")
    try:
        import graphviz
    except ImportError:
        raise ReplicateError(f"the graphviz Python package is not installed; {INSTALL_HINT}") from None
    source = dot_source(graph, title=title, controller=controller,
                        dpi=PNG_DPI if fmt == "png" else None)
    if fmt == "dot":
        return source.encode("utf-8")
    check_dot()
    try:
        return graphviz.Source(source).pipe(format=fmt, engine="dot", quiet=True)
    except graphviz.ExecutableNotFound:
        raise ReplicateError(f"Graphviz's 'dot' program is not on PATH; {INSTALL_HINT}") from None
    except graphviz.CalledProcessError as exc:
        detail = (exc.stderr or b"").decode("utf-8", "replace").strip().splitlines()
        raise ReplicateError("Graphviz's 'dot' failed to lay out the picture"
                             + (f": {detail[-1]}" if detail else "")) from None
