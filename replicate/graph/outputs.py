"""Where replicate may write: one set of rules for every file and directory a command writes.

Every output of every command (``convert -o``, ``--tensorboard``, ``--dump-dir``, ``show -o``,
``cluster --json``) goes through this module, so the rules are the same everywhere:

- **A file output** must be absent or a regular file; an existing regular file is replaced
  only with ``--force``. Anything else that exists under the name — a device such as
  ``/dev/null``, a FIFO, a socket, a directory — is refused, even with ``--force``: replacing
  it by rename would destroy it.
- **A symbolic link** is refused as an output, even one that points to a regular file, even
  with ``--force``: replicate neither writes through a link (the data would land outside the
  place named) nor replaces it. Name the link's target instead. Links among the *parent*
  directories are the user's own path and are followed.
- **A directory output** (a SavedModel, ``--tensorboard``, ``--dump-dir``) must be absent or
  a real directory. Its parent must exist: replicate creates at most the last component,
  never missing parents — the same rule as for files.
- **Writes are atomic**: data goes to a temporary name in the destination's directory and is
  renamed over it (``os.replace``). Readers see the old file or the whole new one; on any
  error, Ctrl-C included, the temporary is removed and the old file is left alone.
- **Interrupts**: inside :func:`interrupts_held` (the command line wraps every command in it),
  a Ctrl-C that arrives once the first output is being put in place is held until the
  command returns: the outputs are then whole and the command exits 0. A Ctrl-C before that
  point stops the command with status 130 and nothing is put in place.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import stat
import tempfile
import threading
from collections.abc import Iterator

from replicate.errors import OutputError

__all__ = ["check_file", "check_directory", "write_file", "new_staging_directory",
           "commit_directory", "interrupts_held", "InterruptHold"]

log = logging.getLogger(__name__)

#: Prefix of every temporary name replicate creates next to an output.
TEMP_PREFIX = ".replicate-"


def _label(path: str, option: str | None) -> str:
    return f"{option} {path}" if option else path


def _kind(mode: int) -> str:
    """A word for what a non-regular file is."""
    for test, word in ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISDIR, "a directory")):
        if test(mode):
            return word
    return "not a regular file"


def _check_parent(path: str, label: str) -> None:
    """The directory that will hold ``path`` exists, is a directory and is writable."""
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.exists(directory):
        raise OutputError(f"{label}: directory {directory} does not exist")
    if not os.path.isdir(directory):
        raise OutputError(f"{label}: {directory} is not a directory")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise OutputError(f"{label}: directory {directory} is not writable")


def _check_not_source(path: str, source: str | None, label: str) -> None:
    if source is None or not os.path.lexists(path):
        return
    inputs = {os.path.realpath(source)}
    if os.path.basename(source) in ("saved_model.pb", "saved_model.pbtxt"):
        inputs.add(os.path.realpath(os.path.dirname(source) or "."))
    if os.path.realpath(path) in inputs:
        raise OutputError(f"{label}: is the input; write the result somewhere else")


def _check_link(path: str, label: str) -> None:
    if os.path.islink(path):
        raise OutputError(f"{label}: is a symbolic link; replicate does not write through or "
                          f"replace links (name its target, {os.path.realpath(path)}, instead)")


def check_file(path: str, *, force: bool = False, source: str | None = None,
               option: str | None = None) -> None:
    """Fail before any work when ``path`` cannot become a file output.

    Args:
        path: the file to write.
        force: an existing regular file may be replaced.
        source: the input path, which is never an output, even with ``force``.
        option: the option that named ``path`` (``--json``), for the message.

    Raises:
        OutputError: ``path`` is the input, a link, something other than a regular file,
            exists without ``force``, or its directory is missing or not writable.
    """
    label = _label(path, option)
    _check_not_source(path, source, label)
    _check_link(path, label)
    if os.path.lexists(path):
        mode = os.lstat(path).st_mode
        if not stat.S_ISREG(mode):
            raise OutputError(f"{label}: exists and is {_kind(mode)}, not a regular file; "
                              "replicate replaces only regular files (even with --force)")
        if not force:
            raise OutputError(f"{label}: already exists (use --force to overwrite)")
    _check_parent(path, label)


def check_directory(path: str, *, force: bool | None = None, source: str | None = None,
                    option: str | None = None) -> None:
    """Fail before any work when ``path`` cannot become a directory output.

    Args:
        path: the directory to write (created if absent; its parent must exist).
        force: ``None`` when files are added to an existing directory (``--tensorboard``,
            ``--dump-dir``); ``True``/``False`` when the whole directory is replaced
            (a SavedModel), which an existing one needs ``force`` for.
        source: the input path, never an output.
        option: the option that named ``path``, for the message.

    Raises:
        OutputError: ``path`` is the input, a link, exists and is not a directory, exists
            without ``force`` when it would be replaced, or its parent is missing or not
            writable.
    """
    label = _label(path, option)
    _check_not_source(path, source, label)
    _check_link(path, label)
    if os.path.lexists(path):
        mode = os.lstat(path).st_mode
        if not stat.S_ISDIR(mode):
            kind = "a file" if stat.S_ISREG(mode) else _kind(mode)
            raise OutputError(f"{label}: exists and is {kind}, not a directory")
        if force is False:
            raise OutputError(f"{label}: already exists (use --force to overwrite)")
        if force is None and not os.access(path, os.W_OK | os.X_OK):
            raise OutputError(f"{label}: directory is not writable")
    _check_parent(path, label)


def write_file(path: str, data: bytes, *, force: bool = False, option: str | None = None,
               hold: bool = True) -> None:
    """Write ``data`` to ``path`` atomically, under the rules of :func:`check_file`.

    ``hold=False`` for side files written while the command still works (IR dumps): they do
    not start holding Ctrl-C (see :func:`interrupts_held`).

    Raises:
        OutputError: ``path`` may not be written (see :func:`check_file`) or writing failed;
            nothing is left behind then.
    """
    label = _label(path, option)
    check_file(path, force=force, option=option)
    directory = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(prefix=TEMP_PREFIX, dir=directory)
    except OSError as exc:
        raise OutputError(f"{label}: cannot write ({exc.strerror})") from None
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, _default_mode())
        if hold:
            _hold()
        check_file(path, force=force, option=option)    # nothing appeared meanwhile
        os.replace(tmp, path)
    except OSError as exc:
        _remove(tmp)
        raise OutputError(f"{label}: cannot write ({exc.strerror})") from None
    except BaseException:
        _remove(tmp)
        raise


def new_staging_directory(path: str, option: str | None = None, *, beside: bool = False) -> str:
    """A new empty directory in which to assemble the output directory ``path``: inside
    ``path`` when it exists (files are added to it), else, or with ``beside`` (the whole
    directory is replaced), next to it.

    Raises:
        OutputError: the directory cannot be created.
    """
    inside = not beside and os.path.isdir(path) and not os.path.islink(path)
    where = path if inside else os.path.dirname(os.path.abspath(path))
    try:
        return tempfile.mkdtemp(prefix=TEMP_PREFIX, dir=where)
    except OSError as exc:
        raise OutputError(f"{_label(path, option)}: cannot write ({exc.strerror})") from None


def commit_directory(staging: str, path: str, *, replace: bool = False,
                     option: str | None = None) -> None:
    """Put what ``staging`` holds in place at ``path``.

    When ``path`` is absent (or ``replace`` is true: a SavedModel over an old one) the
    staging directory is renamed to ``path``; otherwise each of its files is renamed into
    ``path`` (which refuses to replace anything but regular files). ``staging`` is gone
    afterwards, on success or failure.

    Raises:
        OutputError: the rename failed; the old ``path`` is then left as it was.
    """
    label = _label(path, option)
    old = None
    try:
        os.chmod(staging, _default_mode(directory=True))
        _hold()
        if os.path.isdir(path) and not os.path.islink(path) and not replace:
            for name in sorted(os.listdir(staging)):
                target = os.path.join(path, name)
                if os.path.islink(target) or (os.path.lexists(target) and not os.path.isfile(target)):
                    raise OutputError(f"{label}: {target} exists and is not a regular file")
                os.replace(os.path.join(staging, name), target)
            os.rmdir(staging)
            return
        if os.path.lexists(path):
            old = staging + ".old"
            os.rename(path, old)
        os.rename(staging, path)
    except OSError as exc:
        if old is not None and not os.path.lexists(path):
            os.rename(old, path)
        shutil.rmtree(staging, ignore_errors=True)
        raise OutputError(f"{label}: cannot write ({exc.strerror or exc})") from None
    except BaseException:
        if old is not None and not os.path.lexists(path):
            os.rename(old, path)
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _default_mode(directory: bool = False) -> int:
    mask = os.umask(0)
    os.umask(mask)
    return (0o777 if directory else 0o666) & ~mask


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


class InterruptHold:
    """Holds Ctrl-C (SIGINT) once outputs start being put in place; see :func:`interrupts_held`.

    Attributes:
        received: a SIGINT arrived while held.
    """

    def __init__(self) -> None:
        self.received = False
        self._previous = None
        self._armed = False

    def arm(self) -> None:
        """Start holding SIGINT, if Python's default handler is in charge in the main thread
        (a command with its own handler, such as ``cluster``, keeps it)."""
        if self._armed or threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            return
        self._previous = signal.signal(signal.SIGINT, self._on_signal)
        self._armed = True
        log.debug("holding Ctrl-C until the outputs are in place")

    def _on_signal(self, _signum, _frame) -> None:
        self.received = True

    def release(self) -> None:
        """Stop holding SIGINT (the previous handler comes back)."""
        if self._armed:
            signal.signal(signal.SIGINT, self._previous)
            self._armed = False


_current: InterruptHold | None = None


def _hold() -> None:
    if _current is not None:
        _current.arm()


@contextlib.contextmanager
def interrupts_held() -> Iterator[InterruptHold]:
    """Within the block, a Ctrl-C that comes after the first output starts being put in place
    is held until the block ends (check ``.received``); earlier, Ctrl-C interrupts as usual."""
    global _current
    hold, previous = InterruptHold(), _current
    _current = hold
    try:
        yield hold
    finally:
        _current = previous
        hold.release()
