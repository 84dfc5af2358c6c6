"""What the operating system says of a process (Linux ``/proc``)."""

from __future__ import annotations

__all__ = ["rss_mib"]


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
