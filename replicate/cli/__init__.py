"""The ``replicate`` command line: one subcommand per module in ``replicate.cli.commands``.

Every subcommand exits 0 on success and 2 on bad input, printing one line that names the
file, node or option (``--debug`` adds the traceback). Nothing is written on failure.

Exit status: 0 = success, every output is in place and whole; 2 = bad input, nothing written;
130 = interrupted (Ctrl-C) before any output was put in place, so nothing was written (the
files named keep their old contents). A Ctrl-C that arrives once the outputs are being put in
place is held until they all are (see :func:`replicate.graph.outputs.interrupts_held`): the command
then exits 0 and says so on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import signal
import sys
import threading
import traceback

from replicate.cli import quiet

__all__ = ["main", "COMMANDS"]

#: Subcommands, in the order ``replicate --help`` lists them.
COMMANDS = ("convert", "inspect", "verify", "show", "cluster", "demo")


def _commands() -> dict[str, object]:
    found = {}
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"replicate.cli.commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"replicate.cli.commands.{name}":
                continue
            raise
        found[name] = module
    return found


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, object]]:
    """The argument parser with every available subcommand."""
    parser = argparse.ArgumentParser(
        prog="replicate",
        description="Rewrite single-device TensorFlow training graphs into exact N-tower training.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="log each pass (-v) or everything (-vv)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    modules = _commands()
    for name, module in modules.items():
        p = sub.add_parser(name, help=module.HELP, description=module.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
    return parser, modules


@contextlib.contextmanager
def _native_stderr_silenced(enabled: bool = True):
    """Send file descriptor 2 to /dev/null: TensorFlow's C++ runtime prints start-up lines
    there while it is imported, before its logging can be configured."""
    if not enabled:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def quiet_tensorflow(environ=None) -> None:
    """Hide TensorFlow's informational and warning lines (no GPU found, ``cudart``, the CPU
    feature guard's "rebuild TensorFlow" lines, oneDNN notices) unless the user chose a level:
    sets ``TF_CPP_MIN_LOG_LEVEL=2`` when it is not set, so errors still show; the few
    error-level lines that are chatter (``failed call to cuInit`` without a GPU) are dropped
    by :func:`replicate.cli.quiet.filtered_stderr`. Must run before TensorFlow is imported."""
    environ = os.environ if environ is None else environ
    environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _filter_wanted() -> bool:
    """Whether to filter stderr (:mod:`replicate.cli.quiet`): yes unless ``REPLICATE_RAW_STDERR=1``
    asks to see everything TensorFlow prints (``--debug`` and ``-vv`` also turn it off)."""
    return os.environ.get("REPLICATE_RAW_STDERR", "") in ("", "0")


def main(argv: list[str] | None = None) -> int:
    """Run the command line; return the exit code (see the module docstring)."""
    in_process = argv is not None
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if a in COMMANDS), "")
    verbose = bool({"--debug", "-vv"} & set(argv))
    try:
        with quiet.filtered_stderr(not verbose and _filter_wanted()):
            return _main(argv)
    except KeyboardInterrupt:
        # a late second interrupt must not turn 130 into -2 as the process exits; called in
        # process with its arguments (tests, scripts), Ctrl-C works again afterwards (it stayed
        # ignored, and a later command could not hold it while putting its outputs in place)
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        print(f"replicate {command}: interrupted; no output was written".replace("  ", " "),
              file=sys.stderr)
        if in_process:
            signal.signal(signal.SIGINT, previous)
        return 130


def _main(argv: list[str]) -> int:
    verbose = {"--debug", "-vv"} & set(argv)
    if not verbose:
        quiet_tensorflow()
    seen: list[int] = []

    def interrupt(signum, frame):
        seen.append(signum)
        raise KeyboardInterrupt

    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, interrupt) if main_thread else None
    try:
        with _native_stderr_silenced(not verbose):
            import tensorflow  # noqa: F401 - imported here, quietly, before any subcommand
    except ImportError:
        # a Ctrl-C inside numpy's C-extension import comes out as an ImportError ("could not
        # import module 'datetime'"): it is still the user's interrupt
        if seen:
            raise KeyboardInterrupt from None
        raise
    finally:
        if main_thread:
            signal.signal(signal.SIGINT, previous)
    parser, modules = build_parser()
    args = parser.parse_args(argv)
    level = logging.WARNING if args.verbose == 0 else logging.INFO if args.verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(message)s")
    if args.verbose < 2:
        logging.getLogger("tensorflow").setLevel(logging.ERROR)
    from replicate.errors import ReplicateError
    from replicate.graph import outputs

    try:
        with outputs.interrupts_held() as hold:
            code = int(modules[args.command].run(args) or 0)
    except ReplicateError as exc:
        if args.debug:
            traceback.print_exc()
        print(f"replicate {args.command}: error: {exc}", file=sys.stderr)
        return 2
    if hold.received:
        print(f"replicate {args.command}: interrupted after the outputs were in place; "
              "they are complete", file=sys.stderr)
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
