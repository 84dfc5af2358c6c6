"""Fault injection shared by the single-process and the multi-rank fault tests: host memory that
cannot be pinned, a shard that cannot be written, an interrupted forward."""

from __future__ import annotations

import contextlib
import itertools
from unittest import mock

import torch
from torch import nn

from omni_dist_offload import apply as apply_mod
from omni_dist_offload.hostmem import HostBuffer, HostPinner, PinMemoryError


@contextlib.contextmanager
def failing_pin(fail_at: int | None):
    """Make the pin path reachable on the CPU: with "pin_memory" set, every host buffer is
    "pinned" (a flag, no cudaHostRegister) except the ``fail_at``-th, which fails the way an
    exhausted memlock limit does."""
    calls = itertools.count()

    def pin(self: HostBuffer) -> None:
        if next(calls) == fail_at:
            raise PinMemoryError("could not page-lock 0.1 MiB of host memory (CUDA error 2)")
        self.pinned = True

    def for_device(cls, pin_memory: bool, on_failure: str, device: torch.device) -> HostPinner:
        return cls(pin_memory, on_failure)

    with mock.patch.object(HostBuffer, "pin", pin), \
            mock.patch.object(HostPinner, "for_device", classmethod(for_device)):
        yield


def only_pinned(monkeypatch, old: HostBuffer) -> list[str]:
    """``old`` "page-locked" (a flag), and every other buffer failing to be, the way an exhausted
    memlock limit does: for a copy that replaces ``old``. Returns the list ``release`` and
    ``pin`` calls are recorded in, in order."""
    calls: list[str] = []
    monkeypatch.setattr(HostBuffer, "release", lambda self: calls.append("release") or setattr(self, "pinned", False))

    def pin(self: HostBuffer) -> None:
        calls.append("pin")
        if self is not old:
            raise PinMemoryError("could not page-lock (simulated)")
        self.pinned = True

    monkeypatch.setattr(HostBuffer, "pin", pin)
    old.pinned = True
    return calls


@contextlib.contextmanager
def failing_shard(fail_at: int):
    """The ``fail_at``-th block's shard cannot be written: setup fails part-way through."""
    calls = itertools.count()
    real = apply_mod.write_shard

    def write_shard(*args):
        if next(calls) == fail_at:
            raise RuntimeError(f"simulated failure writing shard {fail_at}")
        return real(*args)

    with mock.patch.object(apply_mod, "write_shard", write_shard):
        yield


@contextlib.contextmanager
def interrupt(block: nn.Module, where: str, exc: type[BaseException] = KeyboardInterrupt):
    """Raise ``exc`` once, from the block body or between the ring's pre-forward and the body."""
    def raise_once(*args, **kwargs):
        remove()
        raise exc(f"simulated interrupt ({where})")

    if where == "body":
        block.forward = raise_once
        remove = lambda: block.__dict__.pop("forward", None)  # noqa: E731
    else:  # registered after apply_offload, so it runs after the ring's pre-forward
        handle = block.register_forward_pre_hook(lambda m, a: raise_once())
        remove = handle.remove
    try:
        yield
    finally:
        remove()


def nudged_outputs(apply, streamed: str = "rank-local", forwards: int | None = None):
    """``apply`` (the bench's ``_apply_ours``) with the outputs of the variants whose name
    starts with ``streamed`` off by 1e-3: their first ``forwards`` forwards after each apply
    (None: all), a forward hook that the returned handle's ``remove()`` takes off."""

    def nudged(model, variant, device, **kwargs):
        handle = apply(model, variant, device, **kwargs)
        if variant.startswith(streamed):
            seen = itertools.count(1)
            hook = model.register_forward_hook(
                lambda m, a, out: (out[0] + 1e-3, *out[1:]) if forwards is None or next(seen) <= forwards else out)
            remove = handle.remove

            def undo():
                hook.remove()
                remove()

            handle.remove = undo
        return handle

    return nudged
