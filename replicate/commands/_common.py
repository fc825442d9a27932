"""Arguments and helpers shared by several subcommands."""

from __future__ import annotations

import argparse

__all__ = ["add_device_arguments", "device_list"]


def add_device_arguments(parser: argparse.ArgumentParser, required: bool = True) -> None:
    """``--devices`` (comma-separated tower devices) and ``--controller``."""
    parser.add_argument("--devices", required=required, metavar="DEV[,DEV...]",
                        help="tower devices, comma-separated, e.g. /gpu:0,/gpu:1")
    parser.add_argument("--controller", default="/cpu:0", metavar="DEV",
                        help="device holding the variables and the optimizer (default /cpu:0)")


def device_list(text: str) -> list[str]:
    """Split ``--devices``: a comma-separated list (empty items are an error later)."""
    return [d.strip() for d in text.split(",")]
