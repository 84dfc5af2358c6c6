"""The shared host copy in one process: the fallback without torchrun, the descriptor hand-over
and who it refuses, the header's bookkeeping and giving pages back. With ranks:
dist/test_shared_ranks.py."""

from __future__ import annotations

import json
import os
import resource
import threading
import types

import pytest
import torch

from omni_dist_offload import OffloadConfigError, apply_offload
from omni_dist_offload import apply as apply_mod
from omni_dist_offload import sharedmem
from omni_dist_offload.apply import _owners, _RingSpec, _with_shared_copies
from omni_dist_offload.layout import layout_block
from omni_dist_offload.sharedmem import (
    CopyLayout,
    Offer,
    SharedBlocks,
    SharedMemoryError,
    SharedSegment,
    available_host_bytes,
    receive,
    shared_memory_reason,
    small_pages_note,
)
from omni_dist_offload.transfer.groups import GroupSession, HostRanks
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


# -- views a caller keeps, the host-memory check, the cgroup limit, descriptors ---------------
def test_views_a_caller_keeps_read_their_values_after_every_rank_left():
    """A state_dict taken while a shared ring runs views the shared mapping: leaving a block
    gives its pages back all the same, and those views keep their values (a private copy of
    the mapping, which goes with them); the ring's own parked views cost no copy."""
    layout = CopyLayout((3 * 4096, 2 * 4096), ranks=2)
    first = SharedBlocks.create("omni-offload:test", layout, [(0, 1), (0, 1)])
    other = SharedBlocks.open([os.dup(fd) for fd in first.fds()], layout, 1)
    for b in (0, 1):
        first.view(b).view(torch.float32).copy_(torch.arange(layout.sizes[b] // 4, dtype=torch.float32) + b)
    want = [first.view(b).view(torch.float32).clone() for b in (0, 1)]
    # Each rank's ring parks a block's tensors on views of its mapping (as TensorEntry.view_in
    # makes them), and its parameters point at them between uses.
    def view_in(flat: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        return flat.view(torch.float32).as_strided(shape, torch.empty(shape).stride())

    parked = {id(r): [(view_in(r.view(b)[:4096], (32, 32)), view_in(r.view(b)[4096:], (layout.sizes[b] // 4 - 1024,)))
                      for b in (0, 1)] for r in (first, other)}
    for r in (first, other):
        for b in (0, 1):
            r.adopt(b, parked[id(r)][b])
    params = [torch.nn.Parameter(torch.empty(0)) for _ in range(2)]
    for b, p in enumerate(params):
        p.data = parked[id(other)][b][1]
    kept = {k: v for k, v in torch.nn.ParameterDict({"b0": params[0], "b1": params[1]}).state_dict().items()}
    assert [first.outside_views(b) for b in (0, 1)] == [0, 0]  # only the ring's own here
    assert [other.outside_views(b) for b in (0, 1)] == [2, 2]  # the parameter, the state_dict's tensor
    for p in params:  # remove() points the parameters at storage of their own first
        p.data = p.data.clone()
    assert [other.outside_views(b) for b in (0, 1)] == [1, 1]
    first.leave_all()
    other.leave_all()
    assert first.allocated_bytes() == 0  # every page went back to the host
    for b, name in enumerate(("b0", "b1")):
        assert torch.equal(kept[name], want[b][1024:]), name  # ...and the kept views read what they did
    assert other.files[0].private and other.files[1].private and not first.files[0].private
    assert parked[id(first)][0][0].abs().sum() == 0  # the ring's own views were not copied: they read the holes
    kept.clear()
    other.close()
    first.close()


def test_a_copy_made_in_inference_mode_is_left_outside_it():
    """A model built under torch.inference_mode() sets up in that mode, so its copy's header is an
    inference tensor; remove() (or a plan) outside the mode still updates it."""
    layout = CopyLayout((4096,), ranks=1)
    with torch.inference_mode():
        blocks = SharedBlocks.create("omni-offload:test", layout, [(0,)])
        blocks.view(0).fill_(1)
    blocks.mark_written(0)
    assert blocks.written(0)
    blocks.leave(0)
    assert blocks.allocated_bytes() == 0 and not blocks.uses(0)
    blocks.close()


class _OneRank(GroupSession):
    """A host of one rank, without torch.distributed: every exchange hears this rank only."""

    def __init__(self, host: HostRanks) -> None:
        super().__init__(30.0)
        self.host = host

    def all_gather(self, obj, tag):
        return [obj]


def test_the_host_memory_check_adds_up_every_shared_copy_of_the_call(monkeypatch):
    host = HostRanks((0,), 0, "test", "node0")
    models = {"transformer": ToyDiT(3, dim=64), "text_encoder": ToyDiT(2, dim=96)}
    specs = [_RingSpec(types.SimpleNamespace(name=name), [layout_block(i, str(i), b) for i, b in enumerate(m.blocks)],
                       None, host=host) for name, m in models.items()]
    sizes = [CopyLayout(tuple(l.image_nbytes for l in spec.layouts), 1).nbytes for spec in specs]
    created = []
    create = SharedBlocks.create
    monkeypatch.setattr(SharedBlocks, "create", staticmethod(lambda *a: created.append(a[0]) or create(*a)))
    # Room for either copy, not for both: refused, naming the total and each part, and nothing made.
    monkeypatch.setattr(apply_mod, "available_host_bytes", lambda: max(sizes) + 4096)
    with pytest.raises(OffloadConfigError) as err:
        _with_shared_copies(specs, _OneRank(host))
    text = str(err.value)
    assert "host node0 has" in text and "memory available" in text and "storage_dtype" in text, text
    assert f"need {sum(sizes) / 2**20:.2f} MiB together" in text, text
    assert f"transformer {sizes[0] / 2**20:.2f} MiB + text_encoder {sizes[1] / 2**20:.2f} MiB" in text, text
    assert created == []
    # Room for both: both copies are made.
    monkeypatch.setattr(apply_mod, "available_host_bytes", lambda: sum(sizes))
    out = _with_shared_copies(specs, _OneRank(host))
    assert [s.shared is not None for s in out] == [True, True] and len(created) == 2
    for s in out:
        s.shared.close()


def _fake_cgroups(monkeypatch, tmp_path, proc_cgroup: str | None, mountinfo: str | None, files: dict[str, str],
                  available_gib: int | None = 64) -> None:
    """Point available_host_bytes at a fake /proc and cgroup tree under ``tmp_path``."""
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text + "\n")
    for name, text in (("meminfo", f"MemTotal: 1 kB\nMemAvailable: {available_gib * 2**20} kB"
                                   if available_gib is not None else None),
                       ("cgroup", proc_cgroup), ("mountinfo", mountinfo)):
        if text is not None:
            (tmp_path / "proc" / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / "proc" / name).write_text(text + "\n")
    monkeypatch.setattr(sharedmem, "_MEMINFO", str(tmp_path / "proc" / "meminfo"))
    monkeypatch.setattr(sharedmem, "_PROC_CGROUP", str(tmp_path / "proc" / "cgroup"))
    monkeypatch.setattr(sharedmem, "_MOUNTINFO", str(tmp_path / "proc" / "mountinfo"))
    monkeypatch.setattr(sharedmem, "_CGROUP_ROOT", str(tmp_path / "sys"))


GiB = 2**30


def test_the_memory_limit_is_this_process_cgroups_and_its_ancestors(monkeypatch, tmp_path):
    # cgroup v2, mounted where mountinfo says: the job's limit less its usage; a step below it
    # without a limit; the root has none (as on a real host).
    mount = f"30 23 0:26 / {tmp_path}/v2 rw,nosuid - cgroup2 cgroup2 rw"
    tree = {"v2/job.slice/job_42/memory.max": str(8 * GiB), "v2/job.slice/job_42/memory.current": str(GiB),
            "v2/job.slice/job_42/step_0/memory.max": "max", "v2/job.slice/job_42/step_0/memory.current": "5",
            "v2/job.slice/memory.max": "max", "v2/memory.current": str(40 * GiB)}
    _fake_cgroups(monkeypatch, tmp_path, "0::/job.slice/job_42/step_0", mount, tree)
    assert available_host_bytes() == 7 * GiB
    # An ancestor with less room left wins.
    (tmp_path / "v2/job.slice/memory.max").write_text(str(4 * GiB))
    (tmp_path / "v2/job.slice/memory.current").write_text(str(3 * GiB))
    assert available_host_bytes() == GiB
    # No limit anywhere on the path: MemAvailable.
    _fake_cgroups(monkeypatch, tmp_path, "0::/other", mount, {"v2/other/memory.max": "max"})
    assert available_host_bytes() == 64 * GiB


def test_the_memory_limit_of_a_v1_memory_controller(monkeypatch, tmp_path):
    # cgroup v1 beside an empty v2 hierarchy (a hybrid host): the memory controller's cgroup;
    # v1's "unlimited" is a number near 2**63.
    mounts = (f"35 31 0:32 / {tmp_path}/v1mem rw,relatime - cgroup cgroup rw,memory\n"
              f"32 31 0:29 / {tmp_path}/v1cpu rw,relatime - cgroup cgroup rw,cpu\n"
              f"41 31 0:38 / {tmp_path}/unified rw,relatime - cgroup2 cgroup2 rw")
    tree = {"v1mem/memory.limit_in_bytes": "9223372036854771712", "v1mem/memory.usage_in_bytes": str(30 * GiB),
            "v1mem/process_api/abc/memory.limit_in_bytes": str(2 * GiB),
            "v1mem/process_api/abc/memory.usage_in_bytes": str(GiB // 2),
            "v1cpu/process_api/abc/memory.limit_in_bytes": "1"}  # not the memory controller's: not read
    _fake_cgroups(monkeypatch, tmp_path, "9:cpu:/process_api/abc\n4:memory:/process_api/abc\n0::/", mounts, tree)
    assert available_host_bytes() == 3 * GiB // 2
    # A container that sees its own cgroup mounted as the hierarchy's root (mountinfo's root
    # field), without a cgroup namespace: the path is taken below that root.
    mount = f"40 31 0:38 /docker/xyz {tmp_path}/c rw - cgroup2 cgroup2 rw"
    _fake_cgroups(monkeypatch, tmp_path, "0::/docker/xyz/inner", mount,
                  {"c/memory.max": str(6 * GiB), "c/memory.current": str(GiB), "c/inner/memory.max": "max"})
    assert available_host_bytes() == 5 * GiB


def test_the_memory_limit_leaves_out_reclaimable_page_cache(monkeypatch, tmp_path):
    """A container that had just read its checkpoint sat near its limit in page cache, and a
    shared copy that fitted (the kernel reclaims the cache) was refused."""
    mount = f"30 23 0:26 / {tmp_path}/v2 rw,nosuid - cgroup2 cgroup2 rw"
    tree = {"v2/pod/memory.max": str(4 * GiB), "v2/pod/memory.current": str(4 * GiB - 2**20),
            "v2/pod/memory.stat": f"anon {GiB}\nfile {3 * GiB}\ninactive_file {2 * GiB + GiB // 2}\nactive_file 1"}
    _fake_cgroups(monkeypatch, tmp_path, "0::/pod", mount, tree)
    assert available_host_bytes() == 5 * GiB // 2 + 2**20
    mounts = f"35 31 0:32 / {tmp_path}/v1mem rw,relatime - cgroup cgroup rw,memory"
    tree = {"v1mem/job/memory.limit_in_bytes": str(2 * GiB), "v1mem/job/memory.usage_in_bytes": str(2 * GiB),
            "v1mem/job/memory.stat": f"inactive_file 5\ntotal_inactive_file {GiB}"}
    _fake_cgroups(monkeypatch, tmp_path, "4:memory:/job\n0::/", mounts, tree)
    assert available_host_bytes() == GiB


def test_the_memory_limit_falls_back_when_nothing_says_where(monkeypatch, tmp_path):
    # No /proc/self/cgroup nor mountinfo: the roots of the usual mounts, as before.
    _fake_cgroups(monkeypatch, tmp_path, None, None, {"sys/memory.max": str(3 * GiB), "sys/memory.current": "0"})
    assert available_host_bytes() == 3 * GiB
    _fake_cgroups(monkeypatch, tmp_path / "none", None, None, {}, available_gib=None)
    assert available_host_bytes() is None


def test_a_rank_out_of_descriptors_says_so():
    """A receiving rank that hits its ulimit -n gets fewer descriptors than were sent (the kernel
    drops the rest): it says that it may have run out, not that the sender stopped."""
    files = 40
    segments = [SharedSegment.create(f"omni-offload:test:{i}", 4096) for i in range(files)]
    offer = Offer("test", "dit")
    got: list = []
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    thread = threading.Thread(target=lambda: got.append(_receive_or_error(offer, files)))
    try:
        # The receiver's socket, the sender's end of it, and a few descriptors more.
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 6, hard))
        thread.start()
        offer.hand_over([s.fd for s in segments], 1, 5.0)
    finally:
        thread.join()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        offer.close()
        for segment in segments:
            segment.close()
    (error,) = got
    assert isinstance(error, SharedMemoryError), error
    assert "this rank may have run out of file descriptors" in str(error) and "ulimit -n" in str(error), error
    assert f"of the {files} descriptors" in str(error)


def _receive_or_error(offer: Offer, files: int):
    try:
        fds = receive(offer.address, offer.key, files, 5.0)
    except BaseException as exc:  # noqa: BLE001 - handed back to the test
        return exc
    for fd in fds:
        os.close(fd)
    return fds


@pytest.mark.parametrize("huge", ["1", "0"])
def test_shared_files_ask_for_huge_pages_unless_told_not_to(monkeypatch, huge):
    """As private host buffers do: OMNI_OFFLOAD_HUGE_PAGES=0 keeps the shared copy on 4 KiB pages."""
    advised, real = [], sharedmem._libc()

    class Libc:
        def __getattr__(self, name):
            return getattr(real, name)

        def madvise(self, ptr, nbytes, advice):
            advised.append((ptr.value, nbytes.value, advice))
            return 0

    monkeypatch.setenv("OMNI_OFFLOAD_HUGE_PAGES", huge)
    monkeypatch.setattr(sharedmem, "_libc", Libc)
    segment = SharedSegment.create("omni-offload:test:huge", 4 << 20)
    assert advised == ([(segment.tensor.data_ptr(), 4 << 20, 14)] if huge == "1" else [])
