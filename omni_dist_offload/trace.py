"""Per-block tracing of a ring: compute, transfer, exposed wait and bandwidth.

Off by default. With ``apply_offload(trace=True)`` or ``OMNI_OFFLOAD_TRACE=1`` each ring keeps
one set of timing marks per block, created at setup and reused every forward, so tracing adds
event records to the per-block path but no allocation and no host synchronisation. Marks are
read only by :meth:`RingTracer.report`, after the forward. On CUDA a mark is an event recorded
on a stream; on the CPU it is the wall clock (every step there completes before the next).

Per block:

* ``wait``: from ``wait_start`` (recorded on the compute stream before it waits for the block's
  bytes) to ``compute_start`` (after the wait): how long compute stood still, the exposed cost
  of streaming;
* ``compute``: ``compute_start`` to ``compute_end`` (the post-forward);
* ``issued``: when the host reached the block's pre-forward (an event on an idle stream), from
  the component's forward start when that is marked: negative while the host runs ahead of the
  device, positive when the device waits for the host;
* ``transfer``: from the copy stream starting the fill (after the slot is free) to the block
  being in its slot, for the fill this run of the block used (none if the block stayed in its
  slot since it last ran, or stays resident).

The ring also marks the component's own forward (hooks on the component's module), so the
report adds ``pre_ms`` (from the component's forward starting to its first block), ``post_ms``
(from its last block to the forward's end) and ``gap_ms`` (from the previous forward's end to
this one's start), and a forward whose blocks run in another order than declared, or run one
block twice (measured by its first run), is one forward's report.
"""

from __future__ import annotations

import os
import time
from typing import Any, Sequence

import torch

__all__ = ["TRACE_ENV", "RingTracer", "summary_line", "trace_enabled"]

#: Set to 1 to trace every ring.
TRACE_ENV = "OMNI_OFFLOAD_TRACE"

_MARKS = ("wait_start", "compute_start", "compute_end", "issued")


def trace_enabled(trace: bool | None) -> bool:
    return bool(trace) if trace is not None else os.environ.get(TRACE_ENV, "0") == "1"


class _Mark:
    """An event on CUDA, a wall-clock reading on the CPU."""

    __slots__ = ("event", "t")

    def __init__(self, cuda: bool) -> None:
        self.event = torch.cuda.Event(enable_timing=True) if cuda else None
        self.t = 0.0

    def record(self, stream: "torch.cuda.Stream | None" = None) -> None:
        if self.event is not None:
            self.event.record(stream)
        else:
            self.t = time.perf_counter()

    def ms_since(self, base: "_Mark") -> float:
        if self.event is not None:
            return base.event.elapsed_time(self.event)
        return (self.t - base.t) * 1e3


class RingTracer:
    """Timing marks for every block of one ring, most recent forward only."""

    def __init__(self, names: Sequence[str], nbytes: Sequence[int], cuda: bool,
                 device: torch.device | None = None) -> None:
        # A stream of the ring's device that never runs anything: an event recorded on it
        # completes as soon as the host enqueues it, so its time is when the host got there
        # (``issued``).
        self._clock = torch.cuda.Stream(device) if cuda else None
        self.names = list(names)
        self.nbytes = list(nbytes)
        self.marks = [{k: _Mark(cuda) for k in _MARKS} for _ in names]
        # Two (start, end) pairs per block, used in turn: the last block prefetches block 0 for
        # the next forward before this forward's report is read, and must not overwrite the
        # marks of the fill this forward's block 0 used.
        self.xfer = [[(_Mark(cuda), _Mark(cuda)) for _ in range(2)] for _ in names]
        self._cuda = cuda
        self._ran: list[int] = []          # blocks of the current forward, in run order
        self._ran_set: set[int] = set()
        self._again = [False] * len(names)  # block i's current run is a repeat: not marked
        self._next_pair = [0] * len(names)
        self._fresh = [-1] * len(names)     # pair of a fill since the block last ran, else -1
        self._used = [-1] * len(names)      # pair this forward's run of the block used, else -1
        self._last_index = len(names)
        # The component's forward: its start, its end, and the end of the one before it (two end
        # marks used in turn, so the gap between forwards can be read after the second).
        self._start = _Mark(cuda)
        self._ends = [_Mark(cuda), _Mark(cuda)]
        self._end_turn = 0
        self._framed = False  # the current forward's start was marked
        self._ended = 0       # forwards whose end was marked, since the last one cut short
        self._open = False    # a forward started and has not ended

    def forward_start(self, stream) -> None:
        """The component's forward begins (before its first block)."""
        if self._open:  # the last forward raised: the end before it does not say how long the gap was
            self._ended = 0
        self._open = True
        self._start.record(stream)
        self._framed = True
        self._ran = []
        self._ran_set.clear()
        self._last_index = len(self.names)

    def forward_end(self, stream) -> None:
        """The component's forward ends (after its last block)."""
        self._end_turn ^= 1
        self._ends[self._end_turn].record(stream)
        self._ended += 1
        self._open = False

    @property
    def _end(self) -> _Mark:
        return self._ends[self._end_turn]

    def transfer_marks(self, block: int) -> tuple[_Mark, _Mark]:
        """Marks for a fill of ``block`` (the transfer records them on its streams)."""
        k = self._next_pair[block]
        self._next_pair[block] = 1 - k
        self._fresh[block] = k
        return self.xfer[block][k]

    def before_wait(self, i: int, stream) -> None:
        if self._framed:
            if i in self._ran_set:  # run again in the same forward: its first run is measured
                self._again[i] = True
                return
        elif i <= self._last_index:  # unframed: back at (or before) the start, a new forward
            self._ran = []
            self._ran_set.clear()
        self._again[i] = False
        self._last_index = i
        self._ran.append(i)
        self._ran_set.add(i)
        self._used[i] = self._fresh[i]
        self._fresh[i] = -1
        self.marks[i]["issued"].record(self._clock)
        self.marks[i]["wait_start"].record(stream)

    def after_wait(self, i: int, stream) -> None:
        if not self._again[i]:
            self.marks[i]["compute_start"].record(stream)

    def after_compute(self, i: int, stream) -> None:
        if not self._again[i]:
            self.marks[i]["compute_end"].record(stream)

    def report(self) -> dict[str, Any]:
        """The most recent forward, in ms from its first block's wait. Synchronises."""
        if not self._ran:
            return {"forward_ms": 0.0, "exposed_wait_ms": 0.0, "exposed_share": 0.0, "blocks": [],
                    "pre_ms": None, "post_ms": None, "gap_ms": None}
        base = self.marks[self._ran[0]]["wait_start"]
        last = self.marks[self._ran[-1]]["compute_end"]
        if self._cuda:
            (self._end if self._framed else last).event.synchronize()
        blocks = []
        for i in self._ran:
            m = self.marks[i]
            start = m["compute_start"].ms_since(base)
            row = {"index": i, "name": self.names[i], "bytes": self.nbytes[i],
                   "compute_start_ms": start, "compute_ms": m["compute_end"].ms_since(base) - start,
                   "wait_ms": start - m["wait_start"].ms_since(base),
                   "issued_ms": m["issued"].ms_since(self._start) if self._framed else None,
                   "transfer_start_ms": None, "transfer_ms": None, "gbps": None}
            if self._used[i] >= 0:
                start_mark, end_mark = self.xfer[i][self._used[i]]
                t0 = start_mark.ms_since(base)
                row.update(transfer_start_ms=t0, transfer_ms=end_mark.ms_since(base) - t0)
                if row["transfer_ms"] > 0:
                    row["gbps"] = self.nbytes[i] / row["transfer_ms"] / 1e6
            blocks.append(row)
        forward = last.ms_since(base)
        exposed = sum(b["wait_ms"] for b in blocks)
        framed = self._framed
        return {"forward_ms": forward, "exposed_wait_ms": exposed,
                "exposed_share": exposed / forward if forward > 0 else 0.0, "blocks": blocks,
                "pre_ms": base.ms_since(self._start) if framed else None,
                "post_ms": self._end.ms_since(last) if framed else None,
                "gap_ms": self._start.ms_since(self._ends[self._end_turn ^ 1]) if framed and self._ended > 1 else None}


def summary_line(reports: Sequence[dict[str, Any]]) -> str:
    """One line for the end of a run: each ring's exposed wait in its last forward."""
    parts = [f"{r['component']} {r['exposed_wait_ms']:.1f} ms of {r['forward_ms']:.1f} ms "
             f"({100 * r['exposed_share']:.1f}%)" for r in reports]
    return "offload trace, last forward, exposed wait: " + ("; ".join(parts) or "no streamed ring")
