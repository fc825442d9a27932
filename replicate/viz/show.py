"""``replicate show``'s engine: transform a graph and draw the result collapsed to name scopes.

:func:`cluster_graph` turns a :class:`~replicate.api.Result` into the graph of boxes,
:func:`picture` draws it as bytes, :func:`draw` writes it to a file (SVG, PNG or DOT,
picked by the extension) atomically, and :func:`show` does everything from an input.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import networkx as nx

from replicate.errors import OutputError
from replicate.graph.ir import IR
from replicate.viz.collapse import DEFAULT_MAX_NODES, DEFAULT_SHARED_MAX_NODES, collapse
from replicate.viz.groups import roles_from_analysis
from replicate.viz.render import FORMATS, check_dot, render
from replicate.viz.style import short_device
from replicate.wording import count

__all__ = ["cluster_graph", "picture", "draw", "show", "picture_format", "title_of", "Shown",
           "DEFAULT_MAX_NODES", "DEFAULT_SHARED_MAX_NODES", "FORMATS"]

log = logging.getLogger(__name__)

#: Output file extensions and the formats they mean.
EXTENSIONS = {".svg": "svg", ".png": "png", ".dot": "dot", ".gv": "dot"}


@dataclasses.dataclass
class Shown:
    """What :func:`show` wrote.

    Attributes:
        path: the file written.
        format: ``svg``, ``png`` or ``dot``.
        boxes: the collapsed graph that was drawn.
        result: the transform's result.
        seconds: time spent drawing (collapse and layout), after the transform.
    """

    path: str
    format: str
    boxes: nx.DiGraph
    result: Any
    seconds: float


def picture_format(path: str, requested: str | None = None) -> str:
    """The format to write ``path`` in: ``requested``, else from its extension.

    Raises:
        OutputError: unknown extension or format.
    """
    if requested is not None:
        if requested not in FORMATS:
            raise OutputError(f"--format '{requested}': choose one of {', '.join(FORMATS)}")
        return requested
    ext = os.path.splitext(path)[1].lower()
    if ext not in EXTENSIONS:
        raise OutputError(f"{path}: unknown picture type '{ext or '(none)'}'; name it .svg, .png "
                          "or .dot, or pass --format")
    return EXTENSIONS[ext]


def cluster_graph(result, *, max_nodes: int = DEFAULT_MAX_NODES,
                  shared_max_nodes: int = DEFAULT_SHARED_MAX_NODES,
                  depth: int | None = None) -> nx.DiGraph:
    """The collapsed graph of a transform's result (towers and roles from the result)."""
    ir = IR.from_graph_def(result.graph_def)
    return collapse(ir, result.towers.prefixes, roles_from_analysis(result.analysis),
                    max_nodes=max_nodes, shared_max_nodes=shared_max_nodes, depth=depth)


def title_of(result, name: str | None = None) -> str:
    """A one-line caption: what was replicated over which devices, and whether it is exact."""
    report = result.report
    devices = [short_device(d) for d in report.devices]
    shown = ", ".join(devices) if len(devices) <= 4 else f"{devices[0]} … {devices[-1]}"
    exact = "exact" if report.exact else f"not exact ({count(len(report.reasons), 'reason')})"
    head = f"{name}: " if name else ""
    return (f"{head}{count(len(devices), 'tower')} on {shown}, shared state on "
            f"{short_device(report.controller)} · {report.output_nodes:,} ops · {exact}")


def picture(result, fmt: str = "svg", *, max_nodes: int = DEFAULT_MAX_NODES,
            shared_max_nodes: int = DEFAULT_SHARED_MAX_NODES, depth: int | None = None,
            title: str | None = None) -> bytes:
    """``result`` drawn as ``fmt`` bytes (see :func:`replicate.viz.render.render`)."""
    boxes = cluster_graph(result, max_nodes=max_nodes, shared_max_nodes=shared_max_nodes,
                          depth=depth)
    return render(boxes, fmt, title=title if title is not None else title_of(result),
                  controller=result.report.controller)


def draw(result, output: str, *, fmt: str | None = None, force: bool = False,
         max_nodes: int = DEFAULT_MAX_NODES, shared_max_nodes: int = DEFAULT_SHARED_MAX_NODES,
         depth: int | None = None, title: str | None = None) -> Shown:
    """Write the picture of a transform's ``result`` to ``output``, atomically.

    Args:
        result: what :func:`replicate.transform` returned.
        output: the file to write; its extension picks the format unless ``fmt`` is given.
        fmt: ``svg``, ``png`` or ``dot``.
        force: replace ``output`` if it exists.
        max_nodes: the most boxes per tower.
        shared_max_nodes: the most boxes per shared part (split, aggregation, variables...).
        depth: the deepest name scope a box may stand for.
        title: the caption (default: :func:`title_of`).

    Raises:
        ReplicateError: Graphviz missing or failing, or ``output`` not writable; nothing is
            written then.
    """
    from replicate.graph import io

    fmt = picture_format(output, fmt)
    io.check_writable(output, force, directory=False)
    start = time.perf_counter()
    boxes = cluster_graph(result, max_nodes=max_nodes, shared_max_nodes=shared_max_nodes,
                          depth=depth)
    data = render(boxes, fmt, title=title if title is not None else title_of(result),
                  controller=result.report.controller)
    io.write_atomic(output, data, force)
    seconds = time.perf_counter() - start
    log.info("drew %d boxes in %.2f s", boxes.number_of_nodes(), seconds)
    return Shown(output, fmt, boxes, result, seconds)


def show(source: Any, devices: Sequence[str], output: str, *, fmt: str | None = None,
         force: bool = False, max_nodes: int = DEFAULT_MAX_NODES,
         shared_max_nodes: int = DEFAULT_SHARED_MAX_NODES, depth: int | None = None,
         title: str | None = None, progress: Callable[[str, int, int], None] | None = None,
         **options: Any) -> Shown:
    """Transform ``source`` for ``devices`` and write its picture to ``output``.

    Checks the output and Graphviz before the transform, so nothing slow runs in vain.

    Args:
        source: anything :func:`replicate.transform` reads.
        devices: one device per tower.
        output: the file to write (see :func:`draw`).
        progress: passed to the transform (per-pass progress).
        **options: more :func:`replicate.transform` options (controller, train_op, loss...).
        fmt, force, max_nodes, shared_max_nodes, depth, title: as for :func:`draw`.

    Raises:
        ReplicateError: bad input, Graphviz missing, or ``output`` not writable; nothing is
            written then.
    """
    import replicate
    from replicate.rewrite import _devices
    from replicate.graph import io

    _devices(devices, options.get("controller", "/cpu:0"))     # bad devices before the output
    fmt = picture_format(output, fmt)
    io.check_writable(output, force, source=source if isinstance(source, str) else None,
                      directory=False)
    if fmt != "dot":
        check_dot()
    result = replicate.transform(source, devices, progress=progress, **options)
    if title is None and isinstance(source, str):
        title = title_of(result, os.path.basename(os.path.normpath(source)))
    return draw(result, output, fmt=fmt, force=force, max_nodes=max_nodes,
                shared_max_nodes=shared_max_nodes, depth=depth, title=title)
