"""The shared host copy in one process: the fallback without torchrun, the descriptor hand-over
and who it refuses, the header's bookkeeping and giving pages back. With ranks:
dist/test_shared_ranks.py."""

from __future__ import annotations

import json
import os
import threading

import pytest
import torch

from omni_dist_offload import apply_offload
from omni_dist_offload.apply import _owners
from omni_dist_offload.sharedmem import (
    CopyLayout,
    Offer,
    SharedBlocks,
    SharedMemoryError,
    SharedSegment,
    receive,
    shared_memory_reason,
    small_pages_note,
)
from omni_dist_offload.tools import hostfill
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


def _hand_over(key: bytes | None, timeout_s: float, files: int = 3) -> tuple[BaseException | None, list[int] | BaseException]:
    """Offer ``files`` files and collect them from a thread that presents ``key`` (None: the
    right one)."""
    segments = [SharedSegment.create(f"omni-offload:test:{i}", 8192) for i in range(files)]
    offer = Offer("test", "dit")
    got: list[list[int] | BaseException] = []

    def collect() -> None:
        try:
            got.append(receive(offer.address, key if key is not None else offer.key, files, 5.0))
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            got.append(exc)

    thread = threading.Thread(target=collect)
    thread.start()
    error = None
    try:
        offer.hand_over([s.fd for s in segments], 1, timeout_s)
    except BaseException as exc:  # noqa: BLE001 - handed back to the test
        error = exc
    finally:
        offer.close()
        thread.join()
    if isinstance(got[0], list):
        for i, (segment, fd) in enumerate(zip(segments, got[0], strict=True)):
            other = SharedSegment(fd, 8192)
            segment.tensor[4096:4100] = torch.tensor([1, 2, 3, i % 256], dtype=torch.uint8)
            assert other.tensor[4096:4100].tolist() == [1, 2, 3, i % 256]  # the same memory, mapped twice
            other.close()
    for segment in segments:
        segment.close()
    return error, got[0]


def test_hand_over_gives_the_descriptors_to_the_key_only():
    error, got = _hand_over(None, 5.0)
    assert error is None and len(got) == 3
    # More descriptors than one message carries arrive all the same, in order.
    error, got = _hand_over(None, 5.0, files=300)
    assert error is None and len(got) == 300
    # A process without the key (it travels over the job's process group) is turned away.
    error, got = _hand_over(b"x" * 32, 0.5)
    assert isinstance(error, SharedMemoryError) and "did not collect" in str(error)
    assert isinstance(got, SharedMemoryError) and "sent 0 of 3" in str(got)


def test_header_shares_and_the_last_rank_out_gives_pages_back():
    layout = CopyLayout((10_000, None, 5_000), ranks=2)
    assert layout.files == 3 and layout.nbytes == 4096 + 12_288 + 8192 and layout.header_nbytes == 4096
    first = SharedBlocks.create("omni-offload:test", layout, [(0, 1), (), (0,)])
    other = SharedBlocks.open([os.dup(fd) for fd in first.fds()], layout, 1)
    ranks = [first, other]
    for b in (0, 2):
        first.view(b).fill_(7)
    assert other.view(0).sum().item() == 7 * 10_000 and other.view(1) is None  # one copy, two mappings
    assert ranks[0].share_bytes() == 5_000 + 5_000 and ranks[1].share_bytes() == 5_000
    assert ranks[0].live_bytes() == 15_000 and ranks[1].uses(0) and not ranks[1].uses(2)
    # The writer's "filled" byte reaches the other mapping, and is not a user's byte.
    assert not other.written(2)
    first.mark_written(2)
    assert other.written(2) and not other.written(0) and not ranks[1].uses(2) and ranks[0].uses(2)
    full = first.allocated_bytes()
    assert full == layout.nbytes
    ranks[1].leave(0)  # rank 0 still reads block 0: nothing goes
    assert first.allocated_bytes() == full and ranks[0].share_bytes() == 15_000
    ranks[0].leave(0)  # the last reader of block 0: its pages go
    assert first.allocated_bytes() == full - 12_288 and ranks[0].live_bytes() == 5_000
    ranks[0].leave_all()
    assert first.allocated_bytes() == 0  # the header too, once no rank reads anything
    other.close()
    first.close()
    first.close()  # idempotent


def test_a_peer_that_gets_the_wrong_files_closes_them_all():
    layout = CopyLayout((10_000, 5_000), ranks=2)
    first = SharedBlocks.create("omni-offload:test", layout, [(0, 1), (0, 1)])
    fds = [os.dup(fd) for fd in first.fds()[:2]]
    with pytest.raises(SharedMemoryError, match="got 2 descriptors for a copy of 3 files"):
        SharedBlocks.open(fds, layout, 1)
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)
    first.close()


def test_blocks_split_evenly_by_bytes():
    owner = _owners([10, 10, None, 10, 30, 10], 2)
    load = [sum(s for s, o in zip([10, 10, 0, 10, 30, 10], owner) if o == r) for r in range(2)]
    assert owner[2] is None and load == [30, 40] or load == [40, 30]


def test_hostfill_measures_each_kind_of_host_memory(capsys):
    assert hostfill.main(["--gib", "0.03", "--procs", "2", "--threads", "2"]) == 0
    facts, *rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert "shmem_enabled" in facts
    assert [(r["kind"], r["how"]) for r in rows] == [("private", "faults")] + [
        (k, h) for k in ("shared-one-file", "shared-file-per-block") for h in ("faults", "populate", "fallocate")]
    block = int(0.03 * 2**30) // 12 // 4096 * 4096
    for r in rows:
        assert r["gib"] == round(12 * block / 2**30, 3) and r["seconds"] > 0
        assert (r["procs"], r["threads"]) == ((1, 4) if r["kind"] == "private" else (2, 2))


def test_hostfill_refuses_more_memory_than_the_host_has(capsys):
    assert hostfill.main(["--gib", str(2**20)]) == 2
    assert "more than 90% of the" in capsys.readouterr().err
    assert hostfill.main(["--gib", "0"]) == 2
    assert "'0' is not above 0" in capsys.readouterr().err


@pytest.mark.parametrize(("top", "pmd", "small"), [
    ("always within_size advise [never] deny force", None, True),
    ("always within_size advise never [deny] force", "always inherit within_size [advise] never", True),
    ("always within_size [advise] never deny force", None, False),
    ("always within_size advise [never] deny force", "always inherit within_size [advise] never", False),
    ("always within_size advise [never] deny force", "always [inherit] within_size advise never", True),
    (None, None, False),  # not readable: nothing said
])
def test_a_host_with_small_shared_pages_is_named(tmp_path, top, pmd, small):
    if top is not None:
        (tmp_path / "shmem_enabled").write_text(top + "\n")
    if pmd is not None:
        (tmp_path / "hugepages-2048kB").mkdir()
        (tmp_path / "hugepages-2048kB" / "shmem_enabled").write_text(pmd + "\n")
    note = small_pages_note(str(tmp_path))
    assert (note is not None) == small
    if small:
        assert "4 KiB pages" in note and "'advise'" in note and "shmem_enabled: " in note


def test_a_copy_that_cannot_be_made_whole_leaves_no_file(monkeypatch):
    create, made = SharedSegment.create, []

    def third_fails(name: str, nbytes: int) -> SharedSegment:
        if len(made) == 2:
            raise OSError(24, "Too many open files")
        made.append(create(name, nbytes))
        return made[-1]

    monkeypatch.setattr(SharedSegment, "create", staticmethod(third_fails))
    with pytest.raises(OSError, match="Too many open files"):
        SharedBlocks.create("omni-offload:test", CopyLayout((4096, None, 4096, 4096), ranks=2), [(0,), (), (0,), (0,)])
    assert len(made) == 2 and all(segment.fd == -1 for segment in made)  # the header and block 0, closed
