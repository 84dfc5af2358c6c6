"""The shared host copy in one process: the fallback without torchrun, the descriptor hand-over
and who it refuses, the header's bookkeeping and giving pages back. With ranks:
dist/test_shared_ranks.py."""

from __future__ import annotations

import threading

import pytest
import torch

from omni_dist_offload import apply_offload
from omni_dist_offload.apply import _owners
from omni_dist_offload.sharedmem import (
    BlockSpans,
    Offer,
    SharedBlocks,
    SharedMemoryError,
    SharedSegment,
    receive,
    shared_memory_reason,
)
from toys import ToyDiT

pytestmark = pytest.mark.skipif(shared_memory_reason() is not None, reason=str(shared_memory_reason()))

SHARED = {"mode": "layer", "components": ["dit"], "layer_options": {"dit": {"weight_transfer": "shared"}}}


@torch.no_grad()
def test_without_torchrun_streams_rank_local_and_says_why():
    model = ToyDiT(3, dim=16)
    x = torch.randn(2, 16)
    ref = model(x)
    handle = apply_offload(model, SHARED)
    (row,) = handle.summary()
    assert torch.equal(model(x), ref)
    assert row["weight_transfer"] == "rank-local" and "torch.distributed is not initialised" in row["fallback_reason"]
    assert row["shared_host_bytes"] is None and row["host_ranks"] is None
    handle.remove()


def _hand_over(key: bytes | None, timeout_s: float) -> tuple[BaseException | None, int | BaseException]:
    """Offer a file and collect it from a thread that presents ``key`` (None: the right one)."""
    segment = SharedSegment.create("omni-offload:test", 8192)
    offer = Offer("test", "dit")
    got: list[int | BaseException] = []

    def collect() -> None:
        try:
            got.append(receive(offer.address, key if key is not None else offer.key, 5.0))
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            got.append(exc)

    thread = threading.Thread(target=collect)
    thread.start()
    error = None
    try:
        offer.hand_over(segment.fd, 1, timeout_s)
    except BaseException as exc:  # noqa: BLE001 - handed back to the test
        error = exc
    finally:
        offer.close()
        thread.join()
    if isinstance(got[0], int):
        other = SharedSegment(got[0], 8192)
        segment.tensor[4096:4100] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
        assert other.tensor[4096:4100].tolist() == [1, 2, 3, 4]  # the same memory, mapped twice
        other.close()
    segment.close()
    return error, got[0]


def test_hand_over_gives_the_descriptor_to_the_key_only():
    error, got = _hand_over(None, 5.0)
    assert error is None and isinstance(got, int)
    # A process without the key (it travels over the job's process group) is turned away.
    error, got = _hand_over(b"x" * 32, 0.5)
    assert isinstance(error, SharedMemoryError) and "did not collect" in str(error)
    assert isinstance(got, BaseException)


def test_header_shares_and_the_last_rank_out_gives_pages_back():
    spans = BlockSpans.plan([10_000, None, 5_000], ranks=2)
    assert spans.spans[1] is None and all(s[0] % 4096 == 0 for s in spans.spans if s is not None)
    segment = SharedSegment.create("omni-offload:test", spans.nbytes)
    ranks = [SharedBlocks(segment, spans, 0), SharedBlocks(segment, spans, 1)]
    ranks[0].init_header([(0, 1), (), (0,)])
    segment.tensor.fill_(7)
    ranks[0].init_header([(0, 1), (), (0,)])
    assert ranks[0].share_bytes() == 5_000 + 5_000 and ranks[1].share_bytes() == 5_000
    assert ranks[0].live_bytes() == 15_000 and ranks[1].uses(0) and not ranks[1].uses(2)
    full = segment.allocated_bytes()
    ranks[1].leave(0)  # rank 0 still reads block 0: nothing goes
    assert segment.allocated_bytes() == full and ranks[0].share_bytes() == 15_000
    ranks[0].leave(0)  # the last reader of block 0: its pages go
    assert segment.allocated_bytes() == full - 12_288 and ranks[0].live_bytes() == 5_000
    ranks[0].leave_all()
    assert segment.allocated_bytes() == 0  # the header too, once no rank reads anything
    segment.close()


def test_blocks_split_evenly_by_bytes():
    owner = _owners([10, 10, None, 10, 30, 10], 2)
    load = [sum(s for s, o in zip([10, 10, 0, 10, 30, 10], owner) if o == r) for r in range(2)]
    assert owner[2] is None and load == [30, 40] or load == [40, 30]
