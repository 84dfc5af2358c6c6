"""Output paths of the tools that can still refuse a run after their flags parse (outside
torchrun, without the devices they need): checked first, their folders made only once the run
starts, so that a refused run leaves nothing behind."""

from __future__ import annotations

import os
from pathlib import Path

from ..runtime.flags import UsageError, output_file, write_error

__all__ = ["check_output_file"]


def check_output_file(flag: str, path: str | os.PathLike[str]) -> None:
    """:func:`~omni_dist_offload.runtime.flags.output_file`'s checks, with the same messages,
    creating no folder: a missing folder must be creatable (the first of its parents that
    exists is a folder a file can be written in). Call ``output_file`` when the run starts: it
    makes the folders."""
    folder = Path(path).expanduser().parent
    if folder.is_dir():
        output_file(flag, path)  # its folder exists: output_file creates nothing
        return
    existing = next((p for p in (folder, *folder.parents) if p.exists()), None)
    if existing is None:  # a relative path ends at ".", an absolute one at "/": not reached
        return
    where = f"{flag} {str(path)!r}"
    if not existing.is_dir():
        raise UsageError(f"{where}: cannot create its folder, {str(existing)!r} is a file.")
    if (reason := write_error(existing)) is not None:
        raise UsageError(f"{where}: cannot create its folder {str(folder)!r}: {reason}.")
