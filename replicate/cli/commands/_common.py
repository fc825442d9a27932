"""Arguments and helpers shared by several subcommands."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from replicate.errors import DeviceError, InputError, ReplicateError
from replicate.options import AGGREGATIONS, BATCH_NORM_MODES

__all__ = ["add_device_arguments", "add_graph_arguments", "device_list", "parse_devices",
           "name_list", "check_input", "relabel", "train_op_hint", "Progress", "table",
           "human_bytes"]

log = logging.getLogger(__name__)


def add_device_arguments(parser: argparse.ArgumentParser, required: bool = True) -> None:
    """``--devices`` (comma-separated tower devices) and ``--controller``."""
    parser.add_argument("--devices", required=required, metavar="DEV[,DEV...]",
                        help="tower devices, comma-separated, e.g. /gpu:0,/gpu:1")
    parser.add_argument("--controller", default="/cpu:0", metavar="DEV",
                        help="device holding the variables and the optimizer (default /cpu:0)")


def add_graph_arguments(parser: argparse.ArgumentParser) -> None:
    """``--train-op``, ``--loss`` and ``--outputs``: what the analysis cannot guess."""
    parser.add_argument("--train-op", metavar="NAME",
                        help="the op a driver runs per step, when the graph has several")
    parser.add_argument("--loss", metavar="NAME", help="the loss tensor, e.g. loss:0")
    parser.add_argument("--outputs", metavar="NAME[,NAME...]", default="",
                        help="more tensors to keep fetchable under their names, merged over towers")


def add_strategy_arguments(parser: argparse.ArgumentParser) -> None:
    """``--batch-norm``, ``--aggregation`` and ``--param-devices``: how the towers share work."""
    parser.add_argument("--batch-norm", choices=BATCH_NORM_MODES, default="tower0",
                        help="tower0: each tower normalizes by its slice, moving averages from "
                             "tower 0; sync: statistics over the global batch (exact)")
    parser.add_argument("--aggregation", choices=AGGREGATIONS,
                        default="add_n", help="how gradients are summed (default add_n on each "
                                              "variable's device)")
    parser.add_argument("--param-devices", metavar="DEV[,DEV...]|mirrored", default="",
                        help="spread the variables over these devices by size instead of the "
                             "controller; 'mirrored': a copy on every tower device, gradients "
                             "all-reduced, the update applied on each device")
    parser.add_argument("--batch-inputs", metavar="NAME[@AXIS][,...]", default="",
                        help="split exactly these inputs along their batch axis (default 0) "
                             "instead of the ones the analysis finds, e.g. x:0,state:0@1")
    parser.add_argument("--shared-inputs", metavar="NAME[,...]", default="",
                        help="never split these inputs: every tower reads them whole (a table fed "
                             "each step whose length may equal the batch size), e.g. weights:0")
    parser.add_argument("--accumulate", metavar="K", default="1",
                        help="gradient accumulation: each device runs its slice of the batch as K "
                             "micro-batches in one step, gradients summed, optimizer once (default 1)")


def strategy_options(args: argparse.Namespace) -> dict:
    """transform() keyword arguments from :func:`add_strategy_arguments`' options."""
    if args.param_devices.strip() == "mirrored":
        params = "mirrored"
    else:
        params = parse_devices(args.param_devices, "--param-devices") if args.param_devices else None
    options = {"batch_norm": args.batch_norm, "aggregation": args.aggregation, "param_devices": params}
    accumulate = str(getattr(args, "accumulate", "1")).strip()
    if not accumulate.isdigit() or int(accumulate) < 1:
        raise InputError(f"--accumulate {accumulate}: give a whole number of micro-batches per "
                         "device, 1 or more")
    if int(accumulate) > 1:
        options["accumulate"] = int(accumulate)
    batch_inputs = getattr(args, "batch_inputs", "")
    if batch_inputs:
        names = name_list(batch_inputs)
        for name in names:
            axis = name.rsplit("@", 1)[1] if "@" in name else "0"
            if not axis.isdigit():
                raise InputError(f"--batch-inputs {name}: the axis after '@' must be a whole number")
        options["batch_inputs"] = names
    shared = getattr(args, "shared_inputs", "")
    if shared:
        options["shared_inputs"] = name_list(shared)
    return options


def targets(args: argparse.Namespace, default: str | None = None) -> dict:
    """Tower devices, controller, parameter devices and cluster from the device, strategy and
    ``--cluster`` options, as ``transform()`` keyword arguments (``devices`` included).

    ``default`` stands for ``--devices`` when it is not given (inspect).
    """
    from replicate.cli.commands._cluster_args import cluster_value, default_devices, resolve_devices

    options = strategy_options(args)
    cluster = cluster_value(args)
    if cluster is None:
        devices = parse_devices(args.devices if args.devices is not None else default)
        controller = parse_devices(args.controller, "--controller")
        if len(controller) != 1:
            raise DeviceError(f"--controller '{args.controller}': give exactly one device")
        return {"devices": devices, "controller": controller[0], **options}
    text = args.devices if args.devices is not None else default_devices(cluster)
    devices, controller, params = resolve_devices(cluster, text, args.controller)
    if options["param_devices"] is None:
        options["param_devices"] = params
    return {"devices": devices, "controller": controller, "cluster": cluster, **options}


def device_list(text: str) -> list[str]:
    """Split ``--devices``: a comma-separated list (empty items are an error later)."""
    return [d.strip() for d in text.split(",")]


def parse_devices(text: str, option: str = "--devices") -> list[str]:
    """``text`` as a list of canonical device names.

    Raises:
        DeviceError: an item is empty or malformed, or two items name the same device.
    """
    from replicate.api import normalize_device

    raw = device_list(text)
    seen: dict[str, str] = {}
    for item in raw:
        if not item:
            raise DeviceError(f"{option} '{text}': empty device in the list")
        try:
            dev = normalize_device(item, "device")
        except DeviceError as exc:
            raise DeviceError(f"{option}: {exc}") from None
        if dev in seen:
            raise DeviceError(f"{option}: device '{item}' is listed twice "
                              f"(as '{seen[dev]}' and '{item}')")
        seen[dev] = item
    return list(seen)


def name_list(text: str | None) -> list[str]:
    """Split a comma-separated list of names, dropping empty items."""
    return [n.strip() for n in (text or "").split(",") if n.strip()]


def check_input(path: str) -> None:
    """Fail fast, before any TensorFlow work, when ``path`` does not exist or is unreadable."""
    if not os.path.exists(path):
        raise InputError(f"{path}: no such file or directory")
    if not os.access(path, os.R_OK):
        raise InputError(f"{path}: not readable")


def train_op_hint(given: str | None, meta_graph_def) -> str | None:
    """``--train-op`` if given, else the one op a SavedModel's ``saved_model_train_op`` names."""
    from replicate.graph import meta

    if given is not None or meta_graph_def is None:
        return given
    hinted = meta.collection_ops(meta_graph_def, "saved_model_train_op")
    return hinted[0] if len(hinted) == 1 else None


def relabel(exc: ReplicateError, path: str) -> ReplicateError:
    """The same error with a message that starts with ``path`` (the file the user named)."""
    text = str(exc)
    for generic in ("MetaGraphDef: ", "GraphDef: "):
        if text.startswith(generic):
            text = text[len(generic):]
    for api_word, option in (("train_op=", "--train-op NAME"), ("loss=", "--loss NAME"),
                             ("outputs=", "--outputs NAME")):
        text = text.replace(f"with {api_word}", f"with {option}").replace(f"pass {api_word}",
                                                                          f"pass {option}")
    if not text.startswith(path):
        text = f"{path}: {text}"
    if text == str(exc):
        return exc
    new = type(exc).__new__(type(exc))
    Exception.__init__(new, text)
    new.__dict__.update(exc.__dict__)
    return new


class Progress:
    """Per-pass progress lines on a stream, shown only once the work takes over ``delay``.

    Use an instance as ``transform``'s ``progress`` callback. Lines look like
    ``replicate convert: [3/8] clone (1.4 s)``.

    Args:
        label: prefix of each line (the command).
        stream: where to write (stderr by default).
        delay: seconds of quiet before the first line.
        clock: time source (seconds), for tests.
    """

    def __init__(self, label: str, stream: TextIO | None = None, delay: float = 1.0,
                 clock: Callable[[], float] = time.monotonic):
        self.label = label
        self.stream = stream
        self.delay = delay
        self.clock = clock
        self.start = clock()
        self.shown = 0

    def elapsed(self) -> float:
        """Seconds since the instance was made."""
        return self.clock() - self.start

    def __call__(self, pass_name: str, index: int, total: int) -> None:
        elapsed = self.elapsed()
        if elapsed < self.delay:
            return
        self._write(f"{self.label}: [{index + 1}/{total}] {pass_name} ({elapsed:.1f} s)")

    def note(self, what: str) -> None:
        """A line about work outside the passes, once past the delay."""
        if self.elapsed() >= self.delay:
            self._write(f"{self.label}: {what} ({self.elapsed():.1f} s)")

    def done(self, what: str) -> None:
        """A closing line, written only when progress lines were shown."""
        if self.shown:
            self._write(f"{self.label}: {what} ({self.elapsed():.1f} s)")

    def _write(self, line: str) -> None:
        stream = self.stream or sys.stderr
        stream.write(line + "\n")
        stream.flush()
        self.shown += 1


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], indent: str = "  ") -> str:
    """A plain-text table: a header row, a rule, one line per row, columns left-aligned."""
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, indent + "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def human_bytes(n: float) -> str:
    """``n`` bytes as ``B``, ``KiB``, ``MiB`` or ``GiB``."""
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
