"""Draw what `convert` would make of a saved training graph, collapsed to name scopes.

The picture shows the towers side by side, each coloured by its device, the split of the
batch inputs above them, the gradient aggregation and the optimizer update below, and the
variables, all shared on the controller. A box is a name scope (the number of ops in it
below its name); a box striped in several colours holds ops on several devices; an edge
is labelled with the number of tensors it stands for. Edges between parts (the split and
a tower, a tower and the aggregation) are drawn once per pair of parts.

OUT's extension picks the format: .svg (zoomable, with tooltips), .png, or .dot (the
Graphviz source). SVG and PNG are laid out by Graphviz through pygraphviz, whose wheel
carries Graphviz (the viz extra; no system package needed).
--max-nodes bounds the boxes per tower (big scopes are opened first; stray ops join the
box they feed); --depth caps how deep a box's scope may go. Nothing is written on failure;
OUT is refused if it exists, unless --force, and always if it is a device, a FIFO, a
directory or a symbolic link.

example:
  replicate show model.meta --devices /gpu:0,/gpu:1,/gpu:2,/gpu:3 -o towers.svg
"""

from __future__ import annotations

import argparse
import logging
import os

from replicate.cli.commands._common import (
    Progress,
    add_device_arguments,
    add_graph_arguments,
    check_input,
    name_list,
    parse_devices,
    relabel,
    train_op_hint,
)
from replicate.errors import DeviceError, ReplicateError
from replicate.wording import count

__all__ = ["HELP", "add_arguments", "run"]

log = logging.getLogger(__name__)

HELP = "draw the replicated graph collapsed to name scopes (.svg, .png, .dot)"


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"'{text}' must be at least 1")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``replicate show``."""
    from replicate.options import BATCH_NORM_MODES
    from replicate.viz.collapse import DEFAULT_MAX_NODES, DEFAULT_SHARED_MAX_NODES
    from replicate.viz.render import FORMATS

    parser.add_argument("input", metavar="IN", help="a .meta, .pb or .pbtxt file, or a SavedModel directory")
    parser.add_argument("-o", "--output", required=True, metavar="OUT",
                        help="the picture to write: .svg, .png or .dot (refused if it exists, "
                             "unless --force)")
    add_device_arguments(parser)
    add_graph_arguments(parser)
    parser.add_argument("--batch-norm", choices=BATCH_NORM_MODES, default="tower0",
                        help="batch statistics per tower (tower0, default) or over the global "
                             "batch (sync)")
    parser.add_argument("--max-nodes", type=_positive, default=DEFAULT_MAX_NODES, metavar="N",
                        help=f"at most N boxes per tower (default {DEFAULT_MAX_NODES})")
    parser.add_argument("--shared-max-nodes", type=_positive, default=DEFAULT_SHARED_MAX_NODES,
                        metavar="N", help="at most N boxes for each shared part: split, "
                                          f"aggregation, variables... (default {DEFAULT_SHARED_MAX_NODES})")
    parser.add_argument("--depth", type=_positive, default=None, metavar="D",
                        help="open name scopes at most D levels deep (default: as the budget allows)")
    parser.add_argument("--format", choices=FORMATS, default=None,
                        help="picture format (default: from OUT's extension)")
    parser.add_argument("--title", default=None, help="caption (default: devices, op count, exactness)")
    parser.add_argument("--force", action="store_true", help="replace OUT if it exists")
    parser.add_argument("-q", "--quiet", action="store_true", help="print nothing on success")


def run(args: argparse.Namespace) -> int:
    """Draw ``args.input`` replicated over ``args.devices`` into ``args.output``."""
    import replicate
    from replicate.graph import io
    from replicate.viz import show
    from replicate.viz.render import check_dot

    progress = Progress("replicate show")
    check_input(args.input)
    devices = parse_devices(args.devices)
    controller = parse_devices(args.controller, "--controller")
    if len(controller) != 1:
        raise DeviceError(f"--controller '{args.controller}': give exactly one device")
    fmt = show.picture_format(args.output, args.format)
    io.check_writable(args.output, args.force, source=args.input, directory=False)
    if fmt != "dot":
        check_dot()
    loaded = io.load(args.input)
    source = loaded.meta if loaded.meta is not None else loaded.graph_def
    try:
        result = replicate.transform(
            source, devices, controller=controller[0], progress=progress,
            train_op=train_op_hint(args.train_op, loaded.meta), loss=args.loss,
            outputs=name_list(args.outputs), batch_norm=args.batch_norm)
    except ReplicateError as exc:
        raise relabel(exc, args.input) from None
    progress.note(f"drawing {args.output}")
    title = args.title if args.title is not None else show.title_of(
        result, os.path.basename(os.path.normpath(args.input)))
    shown = show.draw(result, args.output, fmt=fmt, force=args.force, max_nodes=args.max_nodes,
                      shared_max_nodes=args.shared_max_nodes, depth=args.depth, title=title)
    progress.done("done")
    if not args.quiet:
        boxes = shown.boxes
        print(f"wrote {args.output} ({fmt}, {count(len(devices), 'tower')}, {boxes.number_of_nodes()} boxes "
              f"for {boxes.graph['nodes']:,} ops; drawn in {shown.seconds:.1f} s)")
    return 0
