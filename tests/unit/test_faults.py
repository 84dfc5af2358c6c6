"""Faults in one process: setup failing part-way, host memory that cannot be pinned, interrupted
forwards. The model is never lost. With allgather ranks that fail or die:
dist/test_faults_ranks.py (a diverging rank: dist/test_allgather_ranks.py)."""

from __future__ import annotations

import contextlib
import itertools
import threading
import types
import warnings
from unittest import mock

import pytest
import torch

from faults import failing_pin, interrupt
from omni_dist_offload import apply_offload
from omni_dist_offload.hostmem import HostBuffer, HostPinner, PinMemoryError
from toys import ToyDiT, assert_same, snapshot

DIT = {"mode": "layer", "components": ["dit"]}
PINNED = {**DIT, "pin_memory": True}


def _pipeline() -> types.SimpleNamespace:
    """Two streamed rings (Wan 2.2 A14B shape): a failure in the second must undo the first."""
    return types.SimpleNamespace(transformer=ToyDiT(3, seed=1), transformer_2=ToyDiT(2, seed=2))


def _snapshots(pipe) -> dict:
    return {name: snapshot(module) for name, module in vars(pipe).items()}


def _assert_pipeline_same(before: dict, pipe) -> None:
    for name, snap in before.items():
        assert_same(snap, getattr(pipe, name))


def _unbound(handle) -> list[str]:
    """Block tensors that do not point into their host buffers (a rank-local ring between uses)."""
    stray = []
    for ring in handle.rings:
        for layout, buf in zip(ring.layouts, ring.transfer.buffers):
            lo, hi = buf.tensor.data_ptr(), buf.tensor.data_ptr() + buf.nbytes
            stray += [e.name for e in layout.entries if not lo <= e.tensor.data_ptr() < hi]
    return stray


# -- pinned memory -------------------------------------------------------------------------
def test_pinning_is_decided_by_device_and_config():
    assert not HostPinner.for_device(True, "error", torch.device("cpu")).enabled
    assert HostPinner.for_device(True, "pageable", torch.device("cuda", 0)).enabled
    assert not HostPinner.for_device(False, "error", torch.device("cuda", 0)).enabled
    with pytest.raises(ValueError, match=r"\['error', 'pageable'\]"):
        HostPinner(True, "ignore")
    assert "ulimit -l" in str(PinMemoryError("could not page-lock 1.0 MiB"))


@torch.no_grad()
def test_pin_memory_on_a_cpu_device_pins_nothing(monkeypatch):
    def pin(self):
        raise AssertionError("pinned on a CPU device")

    monkeypatch.setattr(HostBuffer, "pin", pin)
    pipe = _pipeline()
    x = torch.randn(2, 8)
    ref = pipe.transformer(x)
    handle = apply_offload(pipe, PINNED, device="cpu")
    assert not any(b.pinned for ring in handle.rings for b in ring.transfer.buffers)
    assert torch.equal(pipe.transformer(x), ref)
    handle.remove()


@pytest.mark.parametrize("fail_at, component, block", [
    (0, "transformer", "blocks.0"), (2, "transformer", "blocks.2"), (4, "transformer_2", "blocks.1"),
])
def test_pin_failure_is_an_error_that_changes_nothing(fail_at, component, block):
    pipe = _pipeline()
    before = _snapshots(pipe)
    with failing_pin(fail_at), pytest.raises(PinMemoryError) as info:
        apply_offload(pipe, PINNED)
    msg = str(info.value)
    assert msg.startswith(f"{component}: page-locking the host copy of block {block} failed: could not page-lock")
    for fix in ("ulimit -l", '"pin_failure": "pageable"', '"pin_memory": false'):
        assert fix in msg
    _assert_pipeline_same(before, pipe)


def test_pinning_runs_beside_filling(monkeypatch):
    """Page-locking runs on background threads, so block k pins while block k+1 is filled;
    setup returns only when every block is pinned."""
    seen = []

    def pin(self: HostBuffer) -> None:
        seen.append(threading.current_thread().name)
        self.pinned = True

    monkeypatch.setattr(HostBuffer, "pin", pin)
    monkeypatch.setattr(HostPinner, "for_device", classmethod(lambda cls, p, f, d: cls(p, f)))
    pipe = _pipeline()
    handle = apply_offload(pipe, PINNED)
    assert len(seen) == 5 and all(name.startswith("omni-offload-pin") for name in seen)
    assert all(b.pinned for ring in handle.rings for b in ring.transfer.buffers)
    handle.remove()


def test_pin_threads_follow_the_failure_policy():
    """Under "error" several threads pin at once (registration scales with threads); under
    "pageable" one thread pins in order, so the policy stops exactly at the first failure."""
    from omni_dist_offload import hostmem

    for policy, threads in (("error", hostmem.PIN_THREADS), ("pageable", 1)):
        pinner = HostPinner(True, policy)
        gate = threading.Barrier(threads + 1, timeout=10)
        buffers = [HostBuffer(16) for _ in range(threads)]
        with mock.patch.object(HostBuffer, "pin", lambda self: gate.wait()):
            for b in buffers:
                pinner.pin_later(b, "dit", "b")
            gate.wait()  # every pin runs at once, or this times out (BrokenBarrierError)
            pinner.wait()
        assert pinner._pool._max_workers == threads
        pinner.close()


@pytest.mark.parametrize("huge", ["1", "0"])
def test_large_host_buffers_ask_for_huge_pages(monkeypatch, huge):
    """Buffers of 2 MiB and more start on a 2 MiB boundary with MADV_HUGEPAGE advice, so filling
    them takes 512 times fewer page faults; OMNI_OFFLOAD_HUGE_PAGES=0 keeps 4 KiB pages."""
    from omni_dist_offload import hostmem

    advised = []
    monkeypatch.setenv(hostmem.HUGE_PAGES_ENV, huge)
    monkeypatch.setattr(hostmem, "_advise_huge_pages", lambda ptr, n: advised.append((ptr, n)))
    big, small = HostBuffer(5 << 20), HostBuffer(100_000)
    assert big.tensor.data_ptr() % 4096 == 0 and small.tensor.data_ptr() % 4096 == 0
    assert big.nbytes == 5 << 20 and small.nbytes == 100_000
    if huge == "1":
        assert big.tensor.data_ptr() % (2 << 20) == 0
        assert advised == [(big.tensor.data_ptr(), 5 << 20)]
    else:
        assert advised == []


@torch.no_grad()
def test_pin_failure_pageable_warns_once_and_streams_correctly():
    pipe = _pipeline()
    x = torch.randn(2, 8)
    refs = (pipe.transformer(x), pipe.transformer_2(x))
    before = _snapshots(pipe)
    with failing_pin(1), pytest.warns(RuntimeWarning) as record:
        handle = apply_offload(pipe, {**PINNED, "pin_failure": "pageable"})
    (warning,) = [str(w.message) for w in record]
    assert warning.startswith("transformer: page-locking the host copy of block blocks.1 failed: could not")
    for consequence in ("synchronously with respect to the host", "several times slower", "ulimit -l"):
        assert consequence in warning
    # Blocks before the failure stay pinned; from it on nothing is tried again.
    pinned = [[b.pinned for b in ring.transfer.buffers] for ring in handle.rings]
    assert pinned == [[True, False, False], [False, False]]
    assert [r["weight_transfer"] for r in handle.summary()] == ["rank-local", "rank-local"]
    for _ in range(2):
        assert torch.equal(pipe.transformer(x), refs[0]) and torch.equal(pipe.transformer_2(x), refs[1])
    handle.remove()
    _assert_pipeline_same(before, pipe)


class _FakeCudart:
    """cudaHostRegister that succeeds (without locking anything) until the ``fail_at``-th call,
    which fails with cudaErrorMemoryAllocation; records what is still registered."""

    def __init__(self, fail_at: int | None) -> None:
        self.calls = itertools.count()
        self.fail_at = fail_at
        self.registered: set[int] = set()

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        if next(self.calls) == self.fail_at:
            return 2
        self.registered.add(ptr)
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        self.registered.remove(ptr)
        return 0


@pytest.mark.parametrize("policy", ["error", "pageable"])
@torch.no_grad()
def test_the_real_pin_path_failing_in_cuda_host_register(monkeypatch, policy):
    """HostBuffer.pin itself, with cudaHostRegister failing at the fourth block: nothing stays
    registered after the rollback or remove(), and the model is as it was."""
    cudart = _FakeCudart(fail_at=3)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(HostPinner, "for_device", classmethod(lambda cls, pin, on_failure, dev: cls(pin, on_failure)))
    pipe = _pipeline()
    x = torch.randn(2, 8)
    ref = pipe.transformer_2(x)
    before = _snapshots(pipe)
    config = {**PINNED, "pin_failure": policy}
    if policy == "error":
        with pytest.raises(PinMemoryError, match=r"^transformer_2: page-locking the host copy of block blocks\.0 "
                                                 r"failed: could not page-lock 4096 bytes of host memory \(CUDA error 2\)"):
            apply_offload(pipe, config)
    else:
        with pytest.warns(RuntimeWarning, match="transformer_2: page-locking the host copy of block blocks.0"):
            handle = apply_offload(pipe, config)
        assert len(cudart.registered) == 3
        assert torch.equal(pipe.transformer_2(x), ref)
        handle.remove()
    assert cudart.registered == set()
    _assert_pipeline_same(before, pipe)


# -- interrupted forwards ------------------------------------------------------------------
def _raise_in_fill(ring, exc: type[BaseException], when: int):
    """Raise from inside the ring's pre-forward: the ``when``-th fill from now on raises."""
    calls = itertools.count()
    real = ring.transfer.fill

    def fill(*args, **kwargs):
        if next(calls) == when:
            raise exc("simulated interrupt (fill)")
        return real(*args, **kwargs)

    return mock.patch.object(ring.transfer, "fill", fill)


def _interrupt(handle, model, where: str, exc: type[BaseException]):
    if where in ("body", "pre-hook"):
        return interrupt(model.blocks[2], where, exc)
    return _raise_in_fill(handle.rings[0], exc, 0)  # prefetch: block 1's fill in block 0's pre-forward


@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError])
@pytest.mark.parametrize("where", ["body", "pre-hook", "prefetch", "first-fill"])
@torch.no_grad()
def test_an_interrupted_forward_is_followed_by_correct_ones(where, exc):
    """``pre-hook``: between the ring's pre-forward and the block body. ``first-fill``: the
    cold-start fetch of block 0. The next forwards are bitwise equal, every block goes back to
    its host copy, and remove() restores the model."""
    model = ToyDiT(4)
    x = torch.randn(2, 8)
    ref = model(x)
    before = snapshot(model)
    handle = apply_offload(model, DIT)
    if where != "first-fill":
        model(x)
    with _interrupt(handle, model, where, exc), pytest.raises(exc, match="simulated interrupt"):
        model(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the next step starts with block 0 not prefetched
        for _ in range(3):
            assert torch.equal(model(x), ref)
    assert _unbound(handle) == []
    handle.remove()
    assert_same(before, model)


def _warm_toy():
    """A four-block toy streamed rank-local after one forward (block 0 prefetched): the
    model, an input, the resident output and the handle."""
    model = ToyDiT(4)
    x = torch.randn(2, 8)
    ref = model(x)
    handle = apply_offload(model, DIT)
    model(x)
    return model, x, ref, handle


@torch.no_grad()
def test_a_keyboard_interrupt_is_released_by_the_next_forward_without_a_false_warning():
    """torch runs always_call forward hooks on Exception only, so after a KeyboardInterrupt the
    interrupted block stays bound to its slot until the next forward releases it."""
    model, x, ref, handle = _warm_toy()
    with interrupt(model.blocks[2], "body"), pytest.raises(KeyboardInterrupt):
        model(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # recovering is not an ordering problem
        assert torch.equal(model(x), ref)
    try:
        assert _unbound(handle) == []
    finally:
        handle.remove()


@torch.no_grad()
def test_an_exception_in_a_block_gives_no_false_order_warning():
    model, x, ref, handle = _warm_toy()
    with interrupt(model.blocks[1], "body", RuntimeError), pytest.raises(RuntimeError):
        model(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(model(x), ref)
    with pytest.warns(RuntimeWarning, match="not prefetched"):  # a real order problem still warns
        model(x, order=[0, 2, 3])
    handle.remove()


@torch.no_grad()
def test_a_forward_from_another_thread_while_a_block_runs_is_refused_and_changes_nothing():
    model, x, ref, handle = _warm_toy()
    inside, go = threading.Event(), threading.Event()
    body = model.blocks[2].forward

    def held(*args, **kwargs):  # thread A stays inside block 2 until told to go on
        inside.set()
        go.wait(30)
        return body(*args, **kwargs)

    model.blocks[2].forward = held
    results: dict[str, torch.Tensor] = {}

    def run_a():
        with torch.no_grad():
            results["a"] = model(x)

    a = threading.Thread(target=run_a)
    a.start()
    try:
        assert inside.wait(30)
        del model.blocks[2].forward  # thread B's forward would run block 2 as it is
        with pytest.raises(RuntimeError, match=r"block blocks.0 started in one thread while block blocks.2 .* another"):
            model(x)
    finally:
        go.set()
        a.join(30)
    assert torch.equal(results["a"], ref)  # thread A's forward went on untouched
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(model(x), ref)
    handle.remove()


@torch.no_grad()
def test_a_forward_from_another_thread_while_a_block_is_being_fetched_waits_then_one_is_refused():
    """Thread A is inside a pre-forward, its fill under way (a copy lets other threads run),
    when thread B's forward starts: B's hook waits for A's to finish, then the two cannot both
    own the ring. Every output that comes back is right; at most one call is refused; the ring
    stays sound."""
    model, x, ref, handle = _warm_toy()
    ring = handle.rings[0]
    fill, inside, go = ring.transfer.fill, threading.Event(), threading.Event()
    a_thread: list[threading.Thread] = []

    def slow_fill(*args, **kwargs):
        if threading.current_thread() in a_thread and not inside.is_set():
            inside.set()
            go.wait(30)
        return fill(*args, **kwargs)

    results: dict[str, object] = {}

    def run(name: str) -> None:
        try:
            with torch.no_grad():
                results[name] = model(x)
        except RuntimeError as exc:
            results[name] = exc

    a, b = threading.Thread(target=run, args=("a",)), threading.Thread(target=run, args=("b",))
    a_thread.append(a)
    ring.forget_slots()  # A's first block is fetched on demand: its fill comes before its claim
    with mock.patch.object(ring.transfer, "fill", side_effect=slow_fill):
        a.start()
        assert inside.wait(30)
        b.start()
        b.join(0.3)  # B is held at A's hook
        go.set()
        a.join(30)
        b.join(30)
    outputs = [r for r in results.values() if isinstance(r, torch.Tensor)]
    refused = [r for r in results.values() if isinstance(r, RuntimeError)]
    assert len(results) == 2 and outputs and all(torch.equal(o, ref) for o in outputs), results
    assert all("started in one thread" in str(r) for r in refused), refused
    for _ in range(2):
        assert torch.equal(model(x), ref)
    handle.remove()
    assert torch.equal(model(x), ref)


@torch.no_grad()
def test_a_block_left_by_a_thread_that_ended_is_released_by_the_next_forward():
    """A thread whose forward was cut short (a KeyboardInterrupt skips the post-forward) and
    that then ended: the next forward, from any thread, releases its block."""
    model, x, ref, handle = _warm_toy()

    def run():
        with torch.no_grad(), interrupt(model.blocks[2], "body"), contextlib.suppress(KeyboardInterrupt):
            model(x)

    t = threading.Thread(target=run)
    t.start()
    t.join(30)
    assert handle.rings[0]._current == 2  # left bound by the interrupted forward
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(model(x), ref)
    assert _unbound(handle) == []
    handle.remove()
