"""Pieces of the copy-engine gather that run without a GPU: the watchdog that ends a process
whose weight flags never arrive, and the driver entry points' availability check."""

from __future__ import annotations

import os
import time

import pytest

from omni_dist_offload.transfer import copy_engine, memops


class _Event:
    """Stands in for a CUDA event: ``done`` is what ``query()`` answers."""

    def __init__(self, done: bool) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done


def _exits(monkeypatch) -> list[int]:
    codes: list[int] = []
    monkeypatch.setattr(os, "_exit", codes.append)
    return codes


def _wait_for(cond, seconds: float = 5.0) -> None:
    end = time.monotonic() + seconds
    while not cond() and time.monotonic() < end:
        time.sleep(0.02)


def test_watchdog_ends_the_process_naming_ring_and_block(monkeypatch, capfd):
    codes = _exits(monkeypatch)
    dog = copy_engine._Watchdog(0.2, "transformer")
    try:
        dog.watch(_Event(done=False), 7)
        _wait_for(lambda: codes)
    finally:
        dog.stop()
    assert codes and codes[0] == 70
    err = capfd.readouterr().err
    assert "transformer: block 7 was not rebuilt within 0.2 s (collective_timeout_s)" in err
    assert "died" in err and "lockstep" in err


def test_watchdog_leaves_completed_fills_alone(monkeypatch):
    codes = _exits(monkeypatch)
    dog = copy_engine._Watchdog(0.1, "transformer")
    try:
        dog.watch(_Event(done=True), 0)
        time.sleep(0.5)
        assert codes == []
        # A fill that is late but not yet past the timeout is left alone too.
        dog.timeout_s = 60
        dog.watch(_Event(done=False), 1)
        time.sleep(0.3)
        assert codes == []
    finally:
        dog.stop()
    dog._thread.join(timeout=5)
    assert not dog._thread.is_alive()


def test_stream_memops_availability_is_a_plain_answer():
    # True on a machine with the CUDA driver, False without one; never an exception.
    assert memops.StreamMemOps.available() in (True, False)


def test_cuda_errors_name_the_call():
    with pytest.raises(RuntimeError, match="cuStreamWaitValue32 failed with CUDA driver error 1"):
        memops._check(1, "cuStreamWaitValue32")
    memops._check(0, "cuStreamWaitValue32")
