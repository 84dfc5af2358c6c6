"""Flag types shared by the command lines: each rejects a bad value with a one-line reason.

The tools' command lines also share how a bad flag is reported: :class:`OneLineParser` raises
:class:`UsageError` where argparse would print its usage block, and :func:`report_usage_error`
prints the one line (``prog: error: ...``) with exit status 2, as ``omni-offload`` does.
:func:`output_file` checks an output path before any work starts. Path flags take
:func:`user_path` (``~`` expanded once, as they are parsed), so a path is checked and later
written as the same file."""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from pathlib import Path
from typing import Any, NoReturn

from .logs import error_line

__all__ = ["OneLineParser", "UsageError", "expand_home", "finite_float", "non_negative_float", "non_negative_int",
           "output_dir_check", "output_file", "port", "positive_float", "positive_int", "report_usage_error",
           "user_path", "write_error"]


class UsageError(Exception):
    """A bad flag or flag value: reported in one line, exit status 2."""


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` that raises :class:`UsageError` on a bad flag: argparse would print
    the usage block and exit; one line that names the problem is enough (its subcommands'
    parsers are of this class too). ``--help`` prints and exits as usual. A flag declared
    ``type=Path`` gets :func:`user_path`, ``~`` expanded, also where the code that adds it does
    not import it (``serve``'s ``--output-dir``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # argparse looks each flag's type up in this registry before it calls it.
        self.register("type", Path, user_path)

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        raise UsageError(message)


def report_usage_error(prog: str, error: BaseException | str, *, show: bool = True) -> int:
    """Print ``prog: error: <error> (see prog --help)`` on stderr (unless ``show`` is false: a
    rank other than the one that reports) and return 2, the exit status of a usage error."""
    if show:
        error_line(f"{prog}: error: {error} (see {prog} --help)")
    return 2


def output_file(flag: str, path: str | os.PathLike[str], *, create: bool = True) -> Path:
    """Check, before any work, that a run can write its output file ``path`` (given with
    ``flag``): missing parent folders are created (as ``generate --output-dir`` creates its
    folder); a path that is a folder, a folder that cannot be created, or one not writable (a
    temporary file is written there and removed: :func:`write_error`) is a :class:`UsageError`
    naming the flag, the path and the reason. Nothing else is written. ``create=False``: the
    same checks, no folder made (for a run that may still be refused: call again with
    ``create=True`` as it starts, so that a refused run leaves nothing behind)."""
    target = Path(os.path.expanduser(path))  # also called with paths no flag parsed
    where = f"{flag} {str(path)!r}"
    if target.is_dir():
        raise UsageError(f"{where} is a folder: give a file path.")
    folder = target.parent
    existing = next((p for p in (folder, *folder.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise UsageError(f"{where}: cannot create its folder, {str(existing)!r} is a file.")
    if not create and existing != folder:
        # The first folder that exists is where the missing ones would be made.
        if existing is not None and (reason := write_error(existing)) is not None:
            raise UsageError(f"{where}: cannot create its folder {str(folder)!r}: {reason}.")
        return target
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"{where}: cannot create its folder {str(folder)!r}: {exc.strerror or exc}.") from None
    if target.is_file():
        # Opened for appending and closed again: its bytes and times stay as they are.
        try:
            os.close(os.open(target, os.O_WRONLY | os.O_APPEND))
        except OSError as exc:
            raise UsageError(f"{where}: the file is not writable ({exc.strerror or exc}).") from None
    elif target.exists():  # a device or a pipe (/dev/stdout): opening it could block, or write
        if not os.access(target, os.W_OK):
            raise UsageError(f"{where}: the file is not writable (permission denied).")
    elif (reason := write_error(folder)) is not None:
        raise UsageError(f"{where}: its folder {str(folder)!r} is not writable ({reason}).")
    return target


def output_dir_check(flag: str, output_dir: Path) -> None:
    """The folder, or the first of its parents that exists, must be a folder a file can be
    written in: a file on the way, a folder without write permission, a read-only mount or
    /proc would fail only when the first output is written, after the model loaded, on every
    rank. The folder itself is not created here (a refused run leaves nothing behind);
    :func:`write_error` writes a temporary file in the one that exists and removes it."""
    existing = next((p for p in (output_dir, *output_dir.parents) if p.exists()), None)
    if existing is None:  # a relative path ends at ".", an absolute one at "/": not reached
        return
    if not existing.is_dir():
        where = "is a file" if existing == output_dir else f"is below {str(existing)!r}, a file"
        raise UsageError(f"{flag} {str(output_dir)!r} {where}: give a folder.")
    reason = write_error(existing)
    if reason is not None:
        where = ("is not writable" if existing == output_dir
                 else f"cannot be created: {str(existing)!r}, the folder it would be made in, is not writable")
        raise UsageError(f"{flag} {str(output_dir)!r} {where} ({reason}): give a folder you can write to.")


def write_error(folder: str | os.PathLike[str]) -> str | None:
    """Why no file can be created in the existing ``folder``, or None when one can: a small
    temporary file is written there and removed. ``os.access`` alone answers from the
    permission bits, and says yes where the write itself fails: for root, in /proc or /sys, on
    some network and FUSE mounts."""
    try:
        fd, name = tempfile.mkstemp(dir=folder, prefix=".omni-offload-write-check-")
    except OSError as exc:
        return exc.strerror or str(exc)
    try:
        os.write(fd, b"\n")
        return None
    except OSError as exc:  # a full disk or quota
        return exc.strerror or str(exc)
    finally:
        os.close(fd)
        try:
            os.unlink(name)
        except OSError:
            pass


def expand_home(text: str) -> str:
    """``text`` with a leading ``~`` or ``~user`` expanded, as the shell expands it where it sees
    one (not in ``--flag=~/x``, nor in a quoted ``'~/x'``). Path flags expand it once, as they
    are parsed: a run checks its output path before its work and writes it after, and both
    must be the same file (a literal ``~`` is a ``./~`` folder, or a file that cannot be opened
    once the work is done). A ``~user`` that names no user known here is refused."""
    expanded = os.path.expanduser(text)
    if expanded.startswith("~"):
        head = text.split("/", 1)[0]
        where = repr(head) if head == text else f"{head!r} (in {text!r})"
        raise argparse.ArgumentTypeError(f"{where} names no home folder known here (no such user, or HOME is not "
                                         f"set): give the path in full, or ./{text} for a folder named {head!r}")
    return expanded


def user_path(text: str) -> Path:
    """A path flag's value, ``~`` expanded (:func:`expand_home`)."""
    return Path(expand_home(text))


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def positive_int(text: str) -> int:
    value = _int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def finite_float(text: str) -> float:
    value = _float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number; give one such as 5.0")
    return value


def non_negative_float(text: str) -> float:
    """A finite number, 0 or more (a tolerance: NaN or infinity would turn its check off)."""
    value = finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is negative; give 0 or more")
    return value


def positive_float(text: str) -> float:
    """A finite number above 0. Infinity is above 0, but the runs turn these into byte counts
    (``int(mib * 2**20)``) or timeouts, which fail with OverflowError after the model is built."""
    value = finite_float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not above 0")
    return value


def non_negative_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is negative; give 0 or more")
    return value


def port(text: str) -> int:
    """A TCP port, or 0: a free one the system picks when the server binds it."""
    value = non_negative_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port (1..65535, or 0 for a free one)")
    return value
