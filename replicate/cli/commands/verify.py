"""Prove a conversion by running it: N towers against one device, on synthetic inputs.

Converts IN for as many towers as --devices lists, runs K training steps of the original
and of the replicated graph on logical CPU devices (/cpu:0 ... /cpu:N-1 stand in for the
devices given), from the same initial values and with the same synthetic inputs (right
shapes and dtypes; labels and lookup ids kept in range), and reports the largest
parameter difference. It also lists variables the train op never changes and trainable
variables that get no gradient, which usually means a training run would be wasted.

Because it executes the graph, verify refuses graphs whose steps would run file, network
or Python-callback ops (ReadFile, WriteFile, PyFunc, ...) unless --allow-unsafe-ops is
given. Placeholders, iterator and queue outputs are fed, so input pipelines never run.
convert and inspect never execute a graph.

Exit status: 0 when every variable agrees within --rtol, 1 when one does not, 2 on bad input.

example:
  replicate verify model.meta --devices /gpu:0,/gpu:1,/gpu:2,/gpu:3 --steps 5
"""

from __future__ import annotations

import argparse
import ast
import json
import logging

from replicate.cli.commands._common import (
    add_device_arguments,
    add_strategy_arguments,
    check_input,
    parse_devices,
    relabel,
    strategy_options,
)
from replicate.check.verify import Verification, default_batch, verify
from replicate.errors import InputError, ReplicateError
from replicate.wording import count

__all__ = ["HELP", "add_arguments", "run", "render", "verify", "Verification", "default_batch"]

log = logging.getLogger(__name__)

HELP = "run a conversion on logical CPUs against one device and report the parameter difference"

#: Variables listed by name in the text report (--json lists all).
MAX_NAMES = 10


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``replicate verify``."""
    parser.add_argument("input", metavar="IN", help="a .meta, .pb or .pbtxt file, or a SavedModel directory")
    add_device_arguments(parser)
    parser.add_argument("--steps", type=int, default=3, metavar="K", help="training steps (default 3)")
    parser.add_argument("--batch", type=int, metavar="B",
                        help="global batch size (default: the graph's static one, else 4N-1)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic inputs (default 0)")
    parser.add_argument("--rtol", type=float, default=1e-5,
                        help="largest relative parameter difference accepted (default 1e-5)")
    parser.add_argument("--train-op", metavar="NAME", help="the op a driver runs per step")
    parser.add_argument("--loss", metavar="NAME", help="the loss tensor, e.g. loss:0")
    parser.add_argument("--feed", action="append", default=[], metavar="NAME=VALUE",
                        help="feed this value (a Python literal) instead of a synthetic one; repeatable")
    parser.add_argument("--allow-unsafe-ops", action="store_true",
                        help="run graphs with file, network or Python-callback ops")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    add_strategy_arguments(parser)




def _feeds(items: list[str]) -> dict[str, object]:
    out: dict[str, object] = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep or not name.strip():
            raise InputError(f"--feed '{item}': expected NAME=VALUE, e.g. keep_prob:0=1.0")
        try:
            value = ast.literal_eval(text.strip())
        except (ValueError, SyntaxError):
            raise InputError(f"--feed '{item}': '{text}' is not a number or a list") from None
        name = name.strip()
        out[name if ":" in name else f"{name}:0"] = value
    return out


def run(args: argparse.Namespace) -> int:
    """Verify ``args.input``; return 0 (agrees), 1 (differs) or raise ReplicateError."""
    check_input(args.input)
    devices = parse_devices(args.devices)
    parse_devices(args.controller, "--controller")
    for option, value in (("--steps", args.steps), ("--batch", args.batch or 1)):
        if value < 1:
            raise InputError(f"{option} {value}: must be at least 1")
    if not args.rtol >= 0:
        raise InputError(f"--rtol {args.rtol}: must be a non-negative number")
    feeds = _feeds(args.feed)
    try:
        result = verify(args.input, len(devices), steps=args.steps, batch=args.batch, seed=args.seed,
                        rtol=args.rtol, train_op=args.train_op, loss=args.loss, feeds=feeds,
                        allow_unsafe=args.allow_unsafe_ops, strategy=strategy_options(args))
    except ReplicateError as exc:
        raise relabel(exc, args.input) from None
    if args.json:
        print(json.dumps(dict(result.to_dict(), requested_devices=devices), indent=2, sort_keys=True))
    else:
        print(render(result, devices))
    return 0 if result.ok else 1


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:MAX_NAMES])
    return shown + (f", ... ({len(names) - MAX_NAMES} more)" if len(names) > MAX_NAMES else "")


def verdict_line(ok: bool, max_rel: float, worst: str | None, rtol: float) -> str:
    """The one line that says pass or fail, in words that cannot be read the other way."""
    if ok:
        return (f"verdict: agrees: every parameter is within --rtol {rtol:g} of one device's "
                f"(largest relative difference {max_rel:.3g})")
    where = f" in {worst}" if worst else ""
    return (f"verdict: DIFFERS: the largest relative parameter difference, {max_rel:.3g}{where}, "
            f"is above --rtol {rtol:g}: the rewrite does not train as one device does")


def render(result, requested: list[str]) -> str:
    """The text report of a :class:`replicate.check.verify.Verification`."""
    c = result.comparison
    counts = [result.batch // len(result.devices) + (k < result.batch % len(result.devices))
              for k in range(len(result.devices))]
    lines = [f"{result.source}: {count(len(result.devices), 'tower')} on {', '.join(result.devices)} "
             f"(standing in for {', '.join(requested)}), {count(result.steps, 'step')}, global batch "
             f"{result.batch} ({' + '.join(map(str, counts))}), seed {result.seed}"]
    lines.append("inputs: " + ("; ".join(i.describe() for i in result.inputs) or "none (the graph reads its own)"))
    lines.append(f"max parameter difference: {c.max_abs:.3g} absolute, {c.max_rel:.3g} relative"
                 f"{f' ({c.worst})' if c.worst else ''}")
    if c.reference_rel is not None:
        lines.append(f"rounding reference (1 device, each batch reordered): {c.reference_rel:.3g} "
                     "relative (for comparison only; it does not move the bar)")
    lines.append(verdict_line(result.ok, c.max_rel, c.worst, result.rtol))
    if not result.exact:
        lines.append("not exact by construction: " + "; ".join(result.reasons[:3]))
        if any("random op" in r for r in result.reasons):
            lines.append("hint: random ops draw separate streams per tower; feed values that turn "
                         "them off (e.g. --feed keep_prob=1.0) to compare exactly")
    if result.unchanged:
        lines.append(f"warning: {count(len(result.unchanged), 'variable')} never "
                     f"{'changes' if len(result.unchanged) == 1 else 'change'} in "
                     f"{count(result.steps, 'step')}: {_names(result.unchanged)}")
    if result.no_gradient:
        lines.append(f"warning: {count(len(result.no_gradient), 'trainable variable')} "
                     f"{'gets' if len(result.no_gradient) == 1 else 'get'} no gradient "
                     f"(the train op does not update them): {_names(result.no_gradient)}")
    return "\n".join(lines)
