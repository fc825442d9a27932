"""Errors raised by replicate: every bad input surfaces as a ReplicateError subclass."""

from __future__ import annotations

__all__ = [
    "ReplicateError",
    "InputError",
    "AnalysisError",
    "DeviceError",
    "PassError",
    "OutputError",
    "InternalError",
]


class ReplicateError(Exception):
    """Base class of every error replicate raises on purpose.

    The message is one sentence that names the file, node or option at fault. It is kept on
    one line: names read from a damaged graph may hold line breaks or other control
    characters, which are shown escaped (``\\n``) instead.
    """

    def __init__(self, *args):
        if len(args) == 1 and isinstance(args[0], str):
            args = (_one_line(args[0]),)
        super().__init__(*args)


def _one_line(message: str) -> str:
    """``message`` with every control character written as its escape sequence."""
    if message.isprintable():
        return message
    return "".join(c if c.isprintable() or c == " " else c.encode("unicode_escape").decode("ascii")
                   for c in message)


class InputError(ReplicateError):
    """The input could not be read: missing file, not a graph, corrupt protobuf, bad NodeDef."""


class AnalysisError(ReplicateError):
    """The graph was read but is not a training graph replicate can rewrite."""


class RewriteError(AnalysisError):
    """The rewrite fails at run time on inputs the original graph runs on (found by the
    numeric check): the analysis could not make the split consistent, so it refuses."""


class DeviceError(ReplicateError):
    """A device or controller string is malformed, duplicated or unusable."""


class OutputError(ReplicateError):
    """The output could not be written (exists without --force, unwritable, too large)."""


#: What every internal error asks of the user.
REPORT = "this is a bug in replicate, not in your graph: please report it with the graph"


class InternalError(ReplicateError):
    """replicate failed on a graph it accepted: a bug in replicate, not the input's fault.

    The message says so, names where it happened, and asks for a report with the graph.
    """


class PassError(InternalError):
    """A pass failed; the message names the pass and the passes that ran before it."""

    def __init__(self, pass_name: str, done: list[str], cause: BaseException):
        self.pass_name = pass_name
        self.done = list(done)
        self.cause = cause
        after = ", ".join(done) if done else "nothing"
        first = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
        super().__init__(f"internal error in pass '{pass_name}' (after {after}): "
                         f"{type(cause).__name__}: {first}; {REPORT}")
