"""A process: what the operating system says of it (Linux ``/proc``), and how an entry point
ends it.

[Note: exit without the final collection]
A process that has imported torch, diffusers and transformers holds millions of objects the
cyclic garbage collector tracks. When it exits, CPython clears every module and collects them,
repeatedly: about 2 s after the work is done (measured on a 2-core machine: 1.9 s on Python's
allocator, 2.8 s on the C allocator ``serve`` runs on), paid by every ``omni-offload`` command,
every torchrun rank and every server stop. ``gc.freeze()`` at the end moves them all to the
permanent generation, which no collection visits, and the exit takes 0.4 s. Everything else an
exit does still happens: ``atexit`` handlers (logging's flush, ``weakref.finalize``, torch's own),
the flush of the standard streams, the release of every object no cycle holds. What is skipped is
the ``__del__`` of objects only a reference cycle keeps alive, whose memory the operating system
takes back anyway; the package writes and closes its outputs before an entry point returns, and
tears down its process groups itself. Only entry points do this: an in-process caller of
``main`` keeps its collector as it was.
"""

from __future__ import annotations

import gc
import sys
from typing import Callable, NoReturn

__all__ = ["exit_with", "rss_mib", "skip_final_collection"]


def skip_final_collection() -> None:
    """Leave the objects alive now out of every later collection, the one at exit included
    ([Note: exit without the final collection]). For a process about to end."""
    gc.freeze()


def exit_with(main: Callable[..., int | None], *args: object, **kwargs: object) -> NoReturn:
    """An entry point's ``if __name__ == "__main__"``: run ``main`` and exit with what it returned,
    skipping the final collection ([Note: exit without the final collection]), also when it raises
    (``SystemExit`` from ``--help`` or a usage error included)."""
    try:
        code = main(*args, **kwargs)
    finally:
        skip_final_collection()
    sys.exit(code)


def rss_mib(pid: int | str = "self") -> float | None:
    """Resident set size of process ``pid`` (default: this one) in MiB; None where ``/proc`` is
    not there, or the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None
