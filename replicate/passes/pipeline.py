"""The pass runner: a fixed sequence of passes over one IR, logged and checked.

Each pass is an object with a ``name`` and a ``run(ir) -> PassResult``. The runner runs
them once, in order, logs node and edge counts and milliseconds per pass, optionally
validates after each pass and dumps the IR, and turns any failure into a
:class:`~replicate.errors.PassError` naming the pass and its predecessors.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from replicate.errors import OutputError, PassError, ReplicateError
from replicate.graph import outputs
from replicate.graph.ir import IR

__all__ = ["PassResult", "Pass", "PassRecord", "run_pipeline"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class PassResult:
    """What a pass returns: the IR (possibly the same object) and whether it changed."""

    ir: IR
    modified: bool


class Pass(Protocol):
    """The interface every pass class implements."""

    name: str

    def run(self, ir: IR) -> PassResult:  # pragma: no cover - protocol
        ...


@dataclasses.dataclass
class PassRecord:
    """Timing and size of one pass run, kept for reports and benchmarks."""

    name: str
    millis: float
    nodes: int
    edges: int
    modified: bool


def run_pipeline(ir: IR, passes: Sequence[Pass], *, verify_each: bool = False,
                 validator: Pass | None = None, dump_dir: str | None = None,
                 progress: Callable[[str, int, int], None] | None = None) -> tuple[IR, list[PassRecord]]:
    """Run ``passes`` in order over ``ir``.

    Args:
        ir: the IR to transform.
        passes: pass objects, run once each, in order.
        verify_each: run ``validator`` after every pass, not only where listed.
        validator: the validate pass used by ``verify_each``.
        dump_dir: when set, write ``NN_<pass>.pbtxt`` with the IR after each pass.
        progress: called as ``progress(pass_name, index, total)`` before each pass.

    Returns:
        The final IR and one :class:`PassRecord` per pass.

    Raises:
        PassError: a pass failed; ``cause`` holds the original error.
    """
    done: list[str] = []
    records: list[PassRecord] = []
    if dump_dir:
        outputs.check_directory(dump_dir)
        try:
            if not os.path.isdir(dump_dir):
                os.mkdir(dump_dir)
        except OSError as exc:
            raise OutputError(f"{dump_dir}: cannot create the dump directory ({exc.strerror})") from None
    for index, p in enumerate(passes):
        if progress is not None:
            progress(p.name, index, len(passes))
        start = time.perf_counter()
        try:
            result = p.run(ir)
            ir = result.ir
            if verify_each and validator is not None and p is not validator:
                validator.run(ir)
        except ReplicateError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure becomes a PassError naming the pass
            raise PassError(p.name, done, exc) from exc
        millis = (time.perf_counter() - start) * 1000.0
        edges = ir.edge_count() if result.modified or not records else records[-1].edges
        record = PassRecord(p.name, millis, len(ir), edges, result.modified)
        records.append(record)
        log.info("pass %-9s %7d nodes %7d edges %8.1f ms%s", p.name, record.nodes, record.edges,
                 millis, "" if result.modified else " (unchanged)")
        if dump_dir:
            from google.protobuf import text_format

            path = os.path.join(dump_dir, f"{index:02d}_{p.name}.pbtxt")
            outputs.write_file(path, text_format.MessageToString(ir.to_graph_def()).encode("utf-8"),
                               force=True, hold=False)
        done.append(p.name)
    return ir, records
