"""The block ring: the per-component coordinator and its hooks.

One :class:`BlockRing` per streamed component. It uses its transfer's two device slots and owns
the slot events and the block hooks. Before block ``i`` runs, the compute stream waits until
``i`` is in a slot and the ring prefetches block ``i + 1`` (block 0 after the last) into the
other slot; after block ``i``
runs, the slot is marked free on the compute stream and the block's parameters point back at
their host copies. The timeline and its invariants are in ``docs/design.md``,
[Note: block ring timeline].
"""

from __future__ import annotations

import functools
import warnings
from typing import Sequence

import torch

from .layout import BlockLayout, bind
from .plan import StreamedComponent
from .trace import RingTracer
from .transfer.protocol import WeightTransfer

__all__ = ["NUM_SLOTS", "BlockRing"]

_EMPTY = -1
#: Device slots per ring: the block that runs, and the next one arriving.
NUM_SLOTS = 2


class BlockRing:
    """Streams the blocks of one component through two device slots."""

    def __init__(
        self,
        component: StreamedComponent,
        layouts: Sequence[BlockLayout],
        transfer: WeightTransfer,
        device: torch.device,
        parked: Sequence[Sequence[torch.Tensor]],
    ) -> None:
        self.component = component
        self.layouts = tuple(layouts)
        self.transfer = transfer
        self.device = device
        self._cuda = device.type == "cuda"
        sizes = [transfer.device_nbytes(layout.index) for layout in layouts]
        # The transfer allocated the slots once; they are reused for every block of every step:
        # the per-block path allocates nothing and never returns memory to the allocator.
        self.slots = transfer.slots
        if len(self.slots) != NUM_SLOTS:
            raise ValueError(f"{component.name}: the transfer has {len(self.slots)} device slots; "
                             f"the ring needs {NUM_SLOTS} (construct it with num_slots=NUM_SLOTS).")
        # What a block's tensors point at between uses: views into its host buffer (rank-local)
        # or shape-keeping placeholders (allgather, where this rank holds only a shard).
        self._parked = [tuple(v) for v in parked]
        self._slot_views = [[tuple(e.view_in(slot) for e in layout.entries) for layout in layouts]
                            for slot in self.slots]
        self._fill_views = [[slot[:size] for size in sizes] for slot in self.slots]
        # ready[s]: recorded by the transfer when slot s holds its block; the compute stream
        # waits on it before the block runs. free[s]: recorded on the compute stream after the
        # block in slot s ran; the transfer waits on it before overwriting slot s.
        self._ready = [torch.cuda.Event() if self._cuda else None for _ in range(NUM_SLOTS)]
        self._free = [torch.cuda.Event() if self._cuda else None for _ in range(NUM_SLOTS)]
        self._slot_block = [_EMPTY] * NUM_SLOTS
        # The block between its pre- and post-forward, and its slot (blocks do not nest).
        self._current = _EMPTY
        self._current_slot = _EMPTY
        # The last forward was cut short (an exception, or an interrupt that skipped the
        # post-forward): the next on-demand fetch is expected, not an ordering problem.
        self._disrupted = False
        self._next = [(i + 1) % len(layouts) for i in range(len(layouts))]
        self._last_slot = NUM_SLOTS - 1
        self._warm = False
        self._warned_miss = False
        self._warned_grad = False
        self._hooks: list = []
        self.tracer: RingTracer | None = None
        self.setup_s: float | None = None
        """Seconds spent filling and page-locking the host copy (set by ``apply_offload``)."""

    def enable_trace(self) -> None:
        """Record per-block timing marks from now on (see ``trace.py``)."""
        self.tracer = RingTracer([l.name for l in self.layouts], [l.tensor_bytes for l in self.layouts],
                                 self._cuda)

    # -- hooks ---------------------------------------------------------------------------
    def install_hooks(self) -> None:
        for layout in self.layouts:
            self._hooks.append(layout.module.register_forward_pre_hook(
                functools.partial(self._pre_forward, layout.index)))
            # always_call: a block that raises (or is interrupted) still releases its slot.
            self._hooks.append(layout.module.register_forward_hook(
                functools.partial(self._post_forward, layout.index), always_call=True))

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # -- per-block path: no host synchronisation, no allocation -------------------------
    def _pre_forward(self, i: int, module, args) -> None:
        if self._current != _EMPTY:
            # The last block's post-forward never ran: torch calls always_call hooks on
            # Exception only, so a KeyboardInterrupt skips it. Release that block now.
            self._release(self._current, self._current_slot)
            self._disrupted = True
        slot = self._slot_of(i)
        if slot == _EMPTY:
            slot = self._fetch_missing(i)
        stream = torch.cuda.current_stream(self.device) if self._cuda else None
        tracer = self.tracer
        if tracer is not None:
            tracer.before_wait(i, stream)
        if self._cuda:
            stream.wait_event(self._ready[slot])
        if tracer is not None:
            tracer.after_wait(i, stream)
        bind(self.layouts[i].entries, self._slot_views[slot][i])
        self._current, self._current_slot = i, slot
        nxt = self._next[i]
        if self._slot_of(nxt) == _EMPTY:
            self._fill(nxt, 1 - slot)
        if not self._warned_grad and torch.is_grad_enabled():
            self._warn_grad()

    def _post_forward(self, i: int, module, args, output) -> None:
        if self._current != i:  # the pre-forward did not get as far as binding: nothing to release
            return
        if self.tracer is not None:
            self.tracer.after_compute(i, torch.cuda.current_stream(self.device) if self._cuda else None)
        if output is None:  # torch passes no output when the block raised
            self._disrupted = True
        self._release(i, self._current_slot)

    def _release(self, i: int, slot: int) -> None:
        """Block ``i`` is done with ``slot``: mark the slot free on the compute stream and point
        the block's tensors back at their parked storage."""
        if self._cuda:
            self._free[slot].record(torch.cuda.current_stream(self.device))
        bind(self.layouts[i].entries, self._parked[i])
        self._current = self._current_slot = _EMPTY
        self._last_slot = slot

    def _slot_of(self, block: int) -> int:
        for s in range(NUM_SLOTS):
            if self._slot_block[s] == block:
                return s
        return _EMPTY

    def _fill(self, block: int, slot: int) -> None:
        # Mark the slot empty first: if the enqueue is interrupted, the slot must not claim
        # to hold its former block.
        self._slot_block[slot] = _EMPTY
        try:
            marks = self.tracer.transfer_marks(block) if self.tracer is not None else None
            self.transfer.fill(block, self._fill_views[slot][block], self._free[slot], self._ready[slot], marks)
        except RuntimeError as exc:  # e.g. a gloo collective timed out: say which ring and block
            raise RuntimeError(
                f"{self.component.name}: moving block {self.layouts[block].name} with the "
                f"{self.transfer.name} transfer failed: {exc}. With allgather, a rank that died, "
                "or ran other blocks or another number of forwards, stalls the others: every rank "
                "must run the same steps in lockstep."
            ) from exc
        self._slot_block[slot] = block

    def _fetch_missing(self, i: int) -> int:
        """Block ``i`` was not prefetched: the first block ever, the first after a forward that
        was cut short, or blocks ran out of order (warned once)."""
        if self._warm and not self._disrupted and not self._warned_miss:
            self._warned_miss = True
            warnings.warn(
                f"{self.component.name}: block {self.layouts[i].name} ran but was not prefetched "
                "(blocks ran in another order than declared, or some were skipped). Outputs stay "
                "correct; the block is fetched on demand and its transfer is not hidden. If the "
                "order is intended, declare the blocks in execution order.",
                RuntimeWarning, stacklevel=4,
            )
        self._warm = True
        self._disrupted = False
        nxt_slot = self._slot_of(self._next[i])
        slot = 1 - nxt_slot if nxt_slot != _EMPTY else 1 - self._last_slot
        self._fill(i, slot)
        return slot

    def _warn_grad(self) -> None:
        self._warned_grad = True
        warnings.warn(
            f"{self.component.name}: streamed blocks ran with autograd enabled. Offloading is for "
            "inference: the device slots are reused, so a backward pass would read other blocks' "
            "weights. Run under torch.no_grad() or torch.inference_mode().",
            RuntimeWarning, stacklevel=4,
        )

    # -- teardown ------------------------------------------------------------------------
    def restore(self, device: torch.device | None) -> None:
        """Give every block tensor ordinary storage again, on ``device`` (None: where it was
        before offloading), bitwise equal to the streamed bytes. Goes through slot 0, so it is
        collective under allgather: every rank of the weight group calls it."""
        slot = 0
        for layout in self.layouts:
            i = layout.index
            self._slot_block[slot] = _EMPTY
            self.transfer.fill(i, self._fill_views[slot][i], self._free[slot], self._ready[slot])
            if self._cuda:
                self._ready[slot].synchronize()  # teardown, not the per-block path
            bind(layout.entries, [
                torch.empty_strided(v.size(), v.stride(), dtype=v.dtype,
                                    device=device if device is not None else e.origin).copy_(v)
                for e, v in zip(layout.entries, self._slot_views[slot][i])
            ])
            if self._cuda:  # the next fill of slot 0 must wait for these copies out of it
                self._free[slot].record(torch.cuda.current_stream(self.device))

    def release(self) -> None:
        """Free the slots and host buffers. The caller has synchronised the device."""
        self.remove_hooks()
        self.slots = []
        self._slot_views = []
        self._fill_views = []
        self._parked = []
        self.transfer.release()
