"""Draw a collapsed graph (:func:`replicate.viz.collapse.collapse`) with Graphviz.

:func:`dot_source` writes the DOT text: one cluster per group (towers side by side,
the split above them, the aggregation and the update below), boxes coloured by device
(a box whose ops run on several devices is striped in proportion), edges labelled with
the number of tensors they stand for (dashed: control dependencies only), and a legend.
:func:`render` lays it out with Graphviz's ``dot`` program into SVG or PNG bytes.

The DOT text needs the ``graphviz`` Python package only; SVG and PNG are laid out by
pygraphviz, whose wheels carry Graphviz (both come with the ``viz`` extra), or else by
Graphviz's ``dot`` program on ``PATH`` (Debian/Ubuntu: ``apt-get install graphviz``).
"""

from __future__ import annotations

import collections
import html
import logging
import math
import shutil

import networkx as nx

from replicate.errors import ReplicateError
from replicate.viz.layout import bundled_edges, columns, inversions, level_towers, relabel
from replicate.viz.style import (CONTROLLER_COLOUR, NO_DEVICE_COLOUR, fill, palette, shade,
                                 short_device, tint)

__all__ = ["FORMATS", "dot_source", "render", "check_dot", "tower_marks", "INSTALL_HINT"]

log = logging.getLogger(__name__)

#: Output formats: DOT text, or laid out by ``dot``.
FORMATS = ("svg", "png", "dot")

#: How to get Graphviz, for error messages.
INSTALL_HINT = ("install the viz extra (pip install 'tf-replicate[viz]', which brings pygraphviz "
                "with Graphviz inside), or Graphviz itself (Debian/Ubuntu: apt-get install graphviz)")

#: Colour of edges that carry only control dependencies (drawn dashed).
CONTROL_COLOUR = "#8888aa77"

#: Resolution of PNG output (Graphviz's own default).
PNG_DPI = 96


def _text(*lines: str) -> str:
    """Lines joined for a DOT label, backslashes kept literal."""
    return "\\n".join(line.replace("\\", "\\\\") for line in lines)


def _tooltip(attrs: dict, group_title: str) -> str:
    devices = ", ".join(f"{n} on {short_device(d)}" for d, n in attrs["devices"].most_common())
    types = ", ".join(f"{t} {n}" for t, n in attrs["types"].most_common(6))
    scope = attrs["scope"] or "(whole group)"
    more = f" ({attrs['more']} scopes)" if attrs["more"] > 1 else ""
    return _text(f"{group_title}: {scope}{more}", f"{_ops(attrs['ops'])}: {devices}",
                 f"op types: {types}")


def _node_label(attrs: dict) -> str:
    label = attrs["label"]
    if attrs["more"] > 1:
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
               dpi: int | None = None, bundle: bool = True,
               show_as: dict[str, str] | None = None, anchor: bool = False) -> str:
    """The DOT text of ``graph`` (no ``dot`` program needed).

    Args:
        graph: the result of :func:`~replicate.viz.collapse.collapse`.
        title: caption at the top.
        controller: the controller device (coloured grey-blue); found when None.
        dpi: resolution for bitmap output.
        bundle: draw the edges between two groups as one edge between the groups, labelled
            with their total; False draws every edge between boxes.
        show_as: ``{tower key: tower key}``: draw a tower's place with another's labels and
            colours (identical towers only; see :func:`replicate.viz.layout.relabel`).
        anchor: add an invisible node that hints the towers' order.
    """
    import graphviz

    colours = palette(graph, controller)
    groups = graph.graph.get("groups", [])
    by_key = {g.key: g for g in groups}
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
    show_as = show_as or {}
    for i, group in enumerate(groups):
        nodes = members.get(group.key, [])
        shown = by_key.get(show_as.get(group.key, group.key), group)
        shown_nodes = [f"{shown.key}:{graph.nodes[n]['scope']}" for n in nodes]
        ops = sum(graph.nodes[n]["ops"] for n in shown_nodes)
        device = _majority(graph, shown_nodes)
        caption = f"{shown.title} · {short_device(device)}"
        if len(nodes) == 1:
            attrs = graph.nodes[shown_nodes[0]]
            where = f"{attrs['label']} · " if attrs["scope"] else ""
            label = _text(caption, f"{where}{_ops(ops)}")
            dot.node(ids[nodes[0]], label=label, tooltip=_tooltip(attrs, shown.title),
                     fontname="Helvetica-Bold", fontsize="12", **fill(attrs["devices"], colours))
            continue
        clusters[group.key] = f"cluster_{i}"
        colour = colours.get(device, NO_DEVICE_COLOUR)
        with dot.subgraph(name=f"cluster_{i}") as sub:
            sub.attr(label=_text(f"{caption} · {ops:,} ops"), style="rounded,filled",
                     fillcolor=tint(colour, 0.8), color=shade(colour),
                     fontname="Helvetica-Bold", fontsize="13", penwidth="1.4")
            for node, drawn in zip(nodes, shown_nodes):
                attrs = graph.nodes[drawn]
                sub.node(ids[node], label=_node_label(attrs), tooltip=_tooltip(attrs, shown.title),
                         **fill(attrs["devices"], colours))
    level_towers(dot, graph, members, ids, anchor)
    for source, target, attrs in bundled_edges(graph, bundle):
        count = attrs["data"] or attrs["control"]
        extra = {} if attrs["data"] else {"style": "dashed", "color": CONTROL_COLOUR}
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


def _pygraphviz():
    """pygraphviz, whose wheels carry Graphviz's libraries (no ``dot`` program needed), or None."""
    try:
        import pygraphviz
    except ImportError:
        return None
    return pygraphviz


def check_dot() -> None:
    """Raise :class:`ReplicateError` unless a Graphviz layout engine is available: pygraphviz
    (installed with the ``viz`` extra), or the ``graphviz`` package and ``dot`` on PATH."""
    if _pygraphviz() is not None:
        return
    try:
        import graphviz  # noqa: F401
    except ImportError:
        raise ReplicateError(f"the graphviz Python package is not installed; {INSTALL_HINT}") from None
    if shutil.which("dot") is None:
        raise ReplicateError(f"Graphviz's 'dot' program is not on PATH; {INSTALL_HINT}")


def tower_marks(graph: nx.DiGraph) -> list[str]:
    """Per tower, in index order, the SVG title :func:`dot_source` gives it: its cluster's
    name, or its one box's id."""
    groups = graph.graph.get("groups", [])
    ids = {node: f"n{i}" for i, node in enumerate(graph.nodes)}
    members = collections.defaultdict(list)
    for node, attrs in graph.nodes(data=True):
        members[attrs["group"]].append(node)
    return [f"cluster_{i}" if len(members[g.key]) > 1 else ids[members[g.key][0]]
            for i, g in enumerate(groups) if g.kind == "tower" and members[g.key]]


def render(graph: nx.DiGraph, fmt: str, *, title: str | None = None,
           controller: str | None = None) -> bytes:
    """``graph`` drawn as ``fmt`` (``svg``, ``png`` or ``dot``) bytes.

    The towers should read left to right in index order; when ``dot`` lays identical
    towers out in another order, they are relabelled to read in order (see
    :func:`replicate.viz.layout.relabel`) and laid out again.

    Raises:
        ReplicateError: an unknown format, or Graphviz missing or failing.
    """
    if fmt not in FORMATS:
        raise ReplicateError(f"picture format '{fmt}' is not one of {', '.join(FORMATS)}")
    try:
        import graphviz  # noqa: F401
    except ImportError:
        raise ReplicateError(f"the graphviz Python package is not installed; {INSTALL_HINT}") from None
    options = {"title": title, "controller": controller}
    if fmt == "dot":
        return dot_source(graph, **options).encode("utf-8")
    check_dot()
    marks = tower_marks(graph)
    best = None
    for anchor in (False, True) if len(marks) > 1 else (False,):
        svg = _pipe(dot_source(graph, anchor=anchor, **options), "svg")
        order = columns(svg, marks)
        swap = relabel(graph, order)
        wrong = inversions(graph, order, swap)
        if best is None or wrong < best[0]:
            best = (wrong, anchor, swap, svg)
        if not wrong:
            break
        log.info("towers drawn in order %s (anchor=%s)", order, anchor)
    _, anchor, swap, svg = best
    if swap:
        svg = _pipe(dot_source(graph, show_as=swap, anchor=anchor, **options), "svg")
    if fmt == "svg":
        return svg
    return _pipe(dot_source(graph, show_as=swap, anchor=anchor, dpi=PNG_DPI, **options), fmt)


def _pipe(source: str, fmt: str) -> bytes:
    pygraphviz = _pygraphviz()
    if pygraphviz is not None:
        try:
            return pygraphviz.AGraph(string=source).draw(format=fmt, prog="dot")
        except (pygraphviz.DotError, OSError, ValueError) as exc:
            raise ReplicateError(f"Graphviz failed to lay out the picture: {exc}") from None
    import graphviz

    try:
        return graphviz.Source(source).pipe(format=fmt, engine="dot", quiet=True)
    except graphviz.ExecutableNotFound:
        raise ReplicateError(f"Graphviz's 'dot' program is not on PATH; {INSTALL_HINT}") from None
    except graphviz.CalledProcessError as exc:
        detail = (exc.stderr or b"").decode("utf-8", "replace").strip().splitlines()
        raise ReplicateError("Graphviz's 'dot' failed to lay out the picture"
                             + (f": {detail[-1]}" if detail else "")) from None
