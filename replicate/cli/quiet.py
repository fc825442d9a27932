"""Keep the command line's stderr for what the user needs: drop TensorFlow's and Graphviz's
start-up chatter, pass everything else through.

TensorFlow's C++ runtime writes straight to file descriptor 2, some of it before its log
level can apply and some of it at ERROR level although nothing is wrong: no CUDA driver
(``cudart_stub``, ``failed call to cuInit``) on a machine without GPUs, the CPU feature
guard's "rebuild TensorFlow" advice, oneDNN notices. The Graphviz inside pygraphviz's wheel
warns about the system's Fontconfig files. :func:`filtered_stderr` routes descriptor 2
through a pipe and drops exactly those lines (:data:`NOISE`); every other line — real
warnings and errors from TensorFlow, Python's warnings, replicate's own messages — is
written on unchanged.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import threading
from collections.abc import Iterator

__all__ = ["NOISE", "is_noise", "filtered_stderr"]

log = logging.getLogger(__name__)

#: Lines that are chatter, not news (matched at the start of a line, after a log prefix).
NOISE = re.compile(
    r"^(WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR"
    r"|[IWE]\d{4} [\d:.]+ +\d+ (cudart_stub|cuda_platform|cuda_executor|cuda_diagnostics|"
    r"cpu_feature_guard|port|mlir_graph_optimization_pass|cuda_dnn|cuda_fft|cuda_blas)\.cc:\d+\] "
    r"|To enable the following instructions: .* rebuild TensorFlow with the appropriate compiler flags\."
    r"|Fontconfig (warning|error): "
    r"|oneDNN custom operations are on\.)")


def is_noise(line: str) -> bool:
    """True for a line :func:`filtered_stderr` drops."""
    return NOISE.match(line) is not None


def _pump(read_fd: int, out_fd: int) -> None:
    """Copy lines from ``read_fd`` to ``out_fd``, dropping noise, until end of file."""
    with os.fdopen(read_fd, "rb", buffering=0) as source:
        pending = b""
        while True:
            chunk = source.read(65536)
            if not chunk:
                break
            pending += chunk
            *lines, pending = pending.split(b"\n")
            kept = [line for line in lines if not is_noise(line.decode("utf-8", "replace"))]
            if kept:
                _write(out_fd, b"\n".join(kept) + b"\n")
        if pending and not is_noise(pending.decode("utf-8", "replace")):
            _write(out_fd, pending)


def _write(fd: int, data: bytes) -> None:
    with contextlib.suppress(OSError):
        os.write(fd, data)


@contextlib.contextmanager
def filtered_stderr(enabled: bool = True) -> Iterator[None]:
    """Within the block, lines written to file descriptor 2 (by Python or by native code)
    that match :data:`NOISE` are dropped; the rest reach the real stderr in order."""
    if not enabled:
        yield
        return
    try:
        sys.stderr.flush()
        saved = os.dup(2)
        read_fd, write_fd = os.pipe()
    except OSError:                       # no descriptor 2 to filter: nothing to do
        yield
        return
    os.dup2(write_fd, 2)
    os.close(write_fd)
    pump = threading.Thread(target=_pump, args=(read_fd, saved), name="replicate-stderr",
                            daemon=True)
    pump.start()
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os.dup2(saved, 2)                 # the pipe's last writer closes: the pump ends
        pump.join(timeout=5.0)
        os.close(saved)
