"""Rank-aware logging for the entry points (CLI, server, tools, launch scripts).

The library logs through ``logging.getLogger(__name__)`` everywhere and never decides which rank
shows. An entry point calls :func:`setup_logging` once: one handler on the package's logger
whose filter passes INFO and below from the ranks in ``LOG_RANK`` (comma-separated, default 0)
and warnings and errors from every rank, and whose formatter puts ``[rankN] `` in front under
torchrun.
"""

from __future__ import annotations

import logging
import os
import sys

import torch

__all__ = ["LOG_RANK_ENV", "RankFilter", "current_rank", "error_line", "is_logged_rank", "logged_ranks", "rank_prefix",
           "setup_logging"]

#: Comma-separated ranks whose INFO logs show (default 0); warnings show from every rank.
LOG_RANK_ENV = "LOG_RANK"

_PACKAGE = __name__.split(".")[0]


def current_rank() -> int:
    """Global rank: from the process group, else ``RANK`` (set by torchrun), else 0."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", "0"))


def rank_prefix() -> str:
    """``"[rankN] "`` when running under torchrun or a process group, else empty."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return f"[rank{torch.distributed.get_rank()}] "
    rank = os.environ.get("RANK")
    return f"[rank{rank}] " if rank is not None else ""


def error_line(text: str) -> None:
    """``text`` and its newline on stderr in one write: ranks that share the stream (torchrun's
    workers) then never run two lines into one, as ``print``'s separate writes of the text and
    the newline let them."""
    sys.stderr.write(f"{text}\n")
    sys.stderr.flush()


def logged_ranks() -> set[int]:
    """The ranks ``LOG_RANK`` names (default and on a malformed value: rank 0, said once on
    stderr)."""
    value = os.environ.get(LOG_RANK_ENV, "0")
    try:
        return {int(r) for r in value.split(",") if r.strip()}
    except ValueError:
        if value not in _WARNED:
            _WARNED.add(value)
            print(f"{rank_prefix()}{LOG_RANK_ENV}={value!r} is not a comma-separated list of ranks (e.g. "
                  f"'0' or '0,3'): showing rank 0's logs", file=sys.stderr, flush=True)
        return {0}


_WARNED: set[str] = set()


def is_logged_rank() -> bool:
    """Whether this rank's INFO output (logs, progress bars) shows."""
    return current_rank() in logged_ranks()


class RankFilter(logging.Filter):
    """Passes warnings from every rank, the rest only from the ranks in ``LOG_RANK``; adds
    ``record.rank_prefix``. The rank is read per record: the process group may start later."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank_prefix = rank_prefix()
        return record.levelno >= logging.WARNING or is_logged_rank()


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time (tests swap it)."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def setup_logging(level: int = logging.INFO) -> None:
    """Install the package's one stderr handler (rank filter and prefix). Idempotent."""
    package = logging.getLogger(_PACKAGE)
    package.setLevel(level)
    if not any(isinstance(h, _StderrHandler) for h in package.handlers):
        handler = _StderrHandler()
        handler.addFilter(RankFilter())
        handler.setFormatter(logging.Formatter("%(rank_prefix)s%(message)s"))
        package.addHandler(handler)
