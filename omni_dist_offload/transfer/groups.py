"""Choosing the process group that carries weight all-gathers, or why there is none.

Every rank gathers the same facts from every other rank (one exchange over a gloo side group,
so it works whatever the main backend and even when ranks share a GPU), then applies the same
rules to them: all ranks reach the same decision, or all raise the same error.

The process groups this creates belong to a :class:`GroupSession`, which ``apply_offload``'s
handle owns: the side group is released once setup is agreed, the weight group (and a gloo
group of its ranks that ``remove()`` agrees over) with the handle, so nothing outlives the job's
``destroy_process_group()``.

The default weight group is the ranks of one host (one group per host, created with
``new_group`` over the same ranks, so weight collectives never interleave with the
application's). Each host keeps a complete set of shards among its own ranks: weights never
cross the network.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..config import OffloadConfigError
from ..sharedmem import job_name, shared_memory_reason
from .memops import StreamMemOps

try:  # CUDA symmetric memory is in torch >= 2.5; without it the copy-engine gather cannot run
    import torch.distributed._symmetric_memory as symm_mem
except ImportError:  # pragma: no cover - older torch
    symm_mem = None

__all__ = ["AGREED", "ALLOW_GLOO_ENV", "IN_STEP", "ComponentFacts", "GroupSession", "HostRanks", "SetupAsk", "WeightGroup",
           "agree_step"]


#: Set to 1 to let the allgather transfer run over gloo on CPU devices (tests, CI).
ALLOW_GLOO_ENV = "OMNI_OFFLOAD_ALLOW_GLOO"
#: Most thread blocks NCCL may use for weight all-gathers. They run beside the model's kernels,
#: so every SM they hold is one the model waits for; a few saturate what streaming needs.
MAX_CTAS_ENV = "OMNI_OFFLOAD_NCCL_MAX_CTAS"
#: Set on an exception every rank raised alike (all saw the same exchange): no rank tells the
#: others of it again.
AGREED = "_omni_offload_agreed"
#: Set on an exception every rank of a weight group raised at the same point, having made the
#: same collectives (:func:`agree_step`): the ranks are still in step, so a ring that meets it
#: goes on (the other hosts' ranks, outside the weight group, do not know of it: see
#: ``apply.py``'s setup, which still tells them).
IN_STEP = "_omni_offload_in_step"


@dataclass(frozen=True)
class WeightGroup:
    """The group one rank's weight all-gathers run on."""

    group: Any
    rank: int
    size: int
    backend: str
    ranks: tuple[int, ...]
    peer_copy_reason: str | None = "not a CUDA group"
    """None when every GPU of the group can map every other's memory (the copy-engine gather
    can run); otherwise why not."""
    flags: torch.Tensor | None = field(default=None, compare=False, repr=False)
    """One word per rank for :func:`agree_step`, made with the group (on its device for NCCL, on
    the host for gloo): an agreement that a device out of memory calls for needs no allocation."""


@dataclass(frozen=True)
class HostRanks:
    """The ranks of this host, which keep one host copy of the weights between them
    (``weight_transfer: "shared"``)."""

    ranks: tuple[int, ...]
    """Global ranks, lowest first; the first creates the shared copies."""
    index: int
    """This rank's position in ``ranks``."""
    job: str
    """A name for the job, the same on every rank (``sharedmem.job_name``)."""
    node: str

    @property
    def size(self) -> int:
        return len(self.ranks)


@dataclass(frozen=True)
class ComponentFacts:
    """What must match across ranks for one streamed component."""

    transfer: str
    chunk_bytes: int
    gather: str
    block_names: tuple[str, ...]
    block_digests: tuple[str, ...]
    """Per block: the layout (names, dtypes, shapes, offsets)."""
    value_digests: tuple[str, ...] = ()
    """Per block: a sample of the weights' bytes (each tensor's start, middle and end)."""


@dataclass(frozen=True)
class SetupAsk:
    """What one rank's ``apply_offload`` asks for that the other ranks depend on. Compared before
    any other exchange (:meth:`GroupSession.compare_asks`), so ranks that ask for different
    things raise the same error rather than reach different exchanges."""

    transfers: dict[str, tuple[str, str]]
    """Per streamed component: (config key, value) of its ``weight_transfer``."""
    settings: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per component whose weights the ranks share (allgather or shared): what every rank must
    give alike, by config key (``layer_options.dit.chunk_mib``, ``device_budget``)."""
    process_group: tuple[int, ...] | None = None
    """The global ranks of the ``process_group`` passed; None: one weight group per host."""


@dataclass(frozen=True)
class _RankFacts:
    rank: int
    node: str
    device_type: str
    device_index: int | None
    backend: str
    allow_gloo: bool
    device_uuid: str | None = None
    """The GPU's UUID: unlike its index, unique on the host whatever CUDA_VISIBLE_DEVICES is."""
    peer_uuids: tuple[str, ...] = ()
    """The GPUs this rank's GPU can map memory of (peer access), by UUID."""
    symmetric_memory: bool = False
    stream_memops: bool = False
    """The CUDA driver has stream memory operations (cuStreamWaitValue32 / cuStreamWriteValue32)."""
    components: dict[str, ComponentFacts] | str = field(default_factory=dict)
    """Per component, what must match; or why this rank could not gather that (a string)."""
    shared_reason: str | None = None
    """Why this rank cannot map shared host memory, or None."""
    group_ranks: tuple[int, ...] | None = None
    """The ranks of the ``process_group`` this rank passed; None: one weight group per host."""


class GroupSession:
    """The process groups one ``apply_offload`` creates, and the collectives it runs on them.

    All methods are collective over the default group: every rank calls them in the same order.
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        # A gloo side group: exchanging facts must work before we know NCCL can (e.g. when two
        # ranks share a GPU, NCCL refuses the communicator). Created on first use.
        self._exchange: Any | None = None
        # The weight group, when this session created it (not when the caller passed one).
        self._weight: Any | None = None
        # A gloo group over the weight group's ranks, for remove() to agree over (agree_in_step):
        # apart from the weight group's own collectives, which an agreement must never pair with.
        self._agreement: Any | None = None
        self.group: WeightGroup | None = None
        """The weight group :meth:`resolve` chose, or None (no allgather, or a fallback)."""
        self.host: HostRanks | None = None
        """The ranks sharing host copies, as :meth:`resolve_shared` found them, or None."""
        # Whether this rank has reached the shared copies' plan (plan_shared), whether the
        # ranks already told each other of a failure (compare_residency), and whether an
        # exchange broke (a peer gone, a timeout): tell_failure then has no one to tell.
        self._planned = False
        self._told = False
        self._broken = False

    @property
    def active(self) -> bool:
        """Ranks depend on each other's setup (a weight group, or shared host copies that each
        rank fills part of): the end of setup is agreed across them."""
        return self.group is not None or self.host is not None

    def all_gather(self, obj: Any, tag: str) -> list[Any]:
        """Every rank's ``obj``, in rank order (over the side group). ``tag`` names the exchange
        (its step and component): ranks that reach different exchanges raise alike, naming them,
        instead of reading each other's objects as their own."""
        gathered: list[Any] = [None] * dist.get_world_size()
        try:
            dist.all_gather_object(gathered, (tag, obj), group=self._exchange_group())
        except BaseException:
            self._broken = True
            raise
        tags = [t for t, _ in gathered]
        if any(t != tag for t in tags):
            exc = OffloadConfigError(
                f"the ranks reached different steps of apply_offload's setup ({_by_rank(tags)}): every "
                "rank must call apply_offload at the same point, with the same model and config for "
                "the components whose weights the ranks share (allgather or shared).")
            setattr(exc, AGREED, True)
            raise exc
        return [o for _, o in gathered]

    def compare_asks(self, ask: SetupAsk) -> None:
        """Every rank says what it asks for (:class:`SetupAsk`); all raise the same
        ``OffloadConfigError`` where they differ. Does nothing without torch.distributed or with
        one rank. Every rank must call it: ``apply_offload`` does wherever some component asks
        for allgather or shared (a call that streams only rank-local exchanges nothing)."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return
        try:
            asks = self.all_gather(ask, "compare what each rank asks for")
        except OffloadConfigError:
            raise
        except RuntimeError as exc:  # torch.distributed's errors (a timeout, a peer gone)
            raise RuntimeError(
                f"apply_offload on rank {dist.get_rank()}: not every rank joined the comparison of "
                f"configs within collective_timeout_s ({self.timeout_s:g} s): {type(exc).__name__}: "
                f"{exc}. Every rank must call apply_offload with the same model and config; a rank "
                "whose config streams every component rank-local (the default) compares nothing, so "
                "one asking for allgather or shared waits for it. Otherwise a rank failed before it "
                "got here (see its error), died, or is slower to get here than collective_timeout_s "
                "allows (raise it).") from exc
        _check_same_asks(asks)

    def compare_residency(self, rings: dict[str, dict[str, Any]] | str) -> None:
        """allgather: every rank of a weight group starts each ring with the same residency
        (which blocks it gathers, into how many slots, whether a measured forward re-plans); all
        ranks raise alike where they differ. ``rings``: this rank's, by component, or why it
        could not plan them (it raises its own error after this; the others, one naming it).
        Every rank calls it when :meth:`resolve` chose a weight group (the same on every rank)."""
        assert self.group is not None
        gathered = self.all_gather((self.group.ranks, rings), "compare residency plans")
        failed = [(r, why) for r, (_, why) in enumerate(gathered) if isinstance(why, str)]
        self._told = bool(failed)  # every rank knows, and raises: tell_failure has nothing to add
        if failed and not isinstance(rings, str):
            rank, why = failed[0]
            raise OffloadConfigError(
                f"rank {rank} could not plan which blocks stay resident ({why}), so no rank streams: "
                "fix the error on that rank and apply again.")
        if not failed:
            try:
                _check_same_residency(gathered)
            except OffloadConfigError as exc:  # the same on every rank
                self._told = True
                setattr(exc, AGREED, True)
                raise

    def plan_shared(self, plan: dict[str, Any] | str) -> list[Any]:
        """shared: the first exchange of the host copies' setup, which every rank reaches once
        :meth:`resolve_shared` found the ranks sharing them: this rank's ``plan`` (per shared
        ring, what the copy needs from it), or why it could not get here (a string; it raises
        its own error after this, see :meth:`tell_failure`). Returns every rank's plan, in rank
        order; where some rank failed, every other rank raises one error naming it (and
        nothing has changed on any rank)."""
        assert self.host is not None
        self._planned = True
        gathered = self.all_gather(plan, "plan the shared host copies")
        failed = [(r, why) for r, why in enumerate(gathered) if isinstance(why, str)]
        if failed and not isinstance(plan, str):
            rank, why = failed[0]
            exc = OffloadConfigError(
                f"rank {rank} could not set up its shared rings ({why}), so no rank streams: the ranks of a "
                "host share its host copies. Fix the error on that rank and apply again.")
            setattr(exc, AGREED, True)
            raise exc
        return gathered

    def tell_failure(self, exc: BaseException) -> None:
        """Setup's first phase failed on this rank (``exc``) before the shared copies' plan, where
        the other ranks wait for it (:meth:`plan_shared`): tell them why, so that they raise an
        error naming this rank at once rather than a peer's lost connection or a timeout. Does
        nothing where there are no shared copies, where every rank knows already, or where an
        exchange broke. Never raises."""
        if (self.host is None or self._planned or self._told or self._broken
                or getattr(exc, AGREED, False) or not dist.is_initialized()):
            return
        with contextlib.suppress(Exception):
            self.plan_shared(f"{type(exc).__name__}: {exc}")

    def resolve_shared(self, components: dict[str, ComponentFacts] | str,
                       device: torch.device) -> tuple[HostRanks | None, str | None]:
        """The ranks of this host that share host copies, or ``(None, reason)`` when they cannot:
        every rank reaches the same answer. ``components`` a string: why this rank could not
        gather its facts (it raises its own error after this; the others, one naming it)."""
        if not (dist.is_available() and dist.is_initialized()):
            return None, ("torch.distributed is not initialised: start the job with torchrun "
                          "(and init_process_group) to share a host copy across ranks")
        if dist.get_world_size() == 1:
            return None, "the job has a single rank: there is no other rank to share the host copy with"
        facts = _RankFacts(rank=dist.get_rank(), node=os.environ.get("GROUP_RANK") or socket.gethostname(),
                           device_type=device.type, device_index=device.index, backend=str(dist.get_backend()),
                           allow_gloo=False, components=components, shared_reason=shared_memory_reason())
        gathered = self.all_gather(facts, "compare shared components")
        if _failed_facts(gathered, components):
            return None, None
        _check_same_layout(gathered)
        hosts = _by_host(gathered)
        for node, ranks in hosts.items():
            if len(ranks) < 2:
                return None, (f"host {node} runs a single rank ({ranks[0].rank}): a shared host copy "
                              "needs at least two ranks on one host")
        for f in gathered:
            if f.shared_reason is not None:
                return None, f"rank {f.rank} cannot share host memory: {f.shared_reason}"
        mine = sorted(hosts[facts.node], key=lambda f: f.rank)
        ranks = tuple(f.rank for f in mine)
        self.host = HostRanks(ranks, ranks.index(facts.rank), job_name(), facts.node)
        return self.host, None

    def resolve(self, components: dict[str, ComponentFacts] | str, device: torch.device,
                process_group: Any | None) -> tuple[WeightGroup | None, str | None]:
        """The weight group for this rank, or ``(None, reason)`` when allgather cannot run.
        ``components`` a string: as for :meth:`resolve_shared`."""
        if not (dist.is_available() and dist.is_initialized()):
            return None, ("torch.distributed is not initialised: start the job with torchrun "
                          "(and init_process_group) to share weights across ranks")
        world = dist.get_world_size()
        if world == 1:
            return None, "the job has a single rank: there is no other rank to share weights with"
        facts = _RankFacts(
            rank=dist.get_rank(),
            node=os.environ.get("GROUP_RANK") or socket.gethostname(),
            device_type=device.type,
            device_index=device.index,
            backend=str(dist.get_backend()),
            allow_gloo=os.environ.get(ALLOW_GLOO_ENV, "0") == "1",
            components=components,
            group_ranks=tuple(dist.get_process_group_ranks(process_group)) if process_group is not None else None,
            **_gpu_facts(device),
        )
        gathered = self.all_gather(facts, "compare allgather components")
        if _failed_facts(gathered, components):
            return None, None
        _check_same_layout(gathered)
        reason = _fallback_reason(gathered)
        if reason is not None:
            return None, reason
        if process_group is not None:
            ranks = facts.group_ranks
            backend = str(dist.get_backend(process_group))
            size = dist.get_world_size(process_group)
            self.group = WeightGroup(process_group, dist.get_rank(process_group), size, backend,
                                     ranks, _peer_copy_reason([f for f in gathered if f.rank in ranks]),
                                     _flags(size, backend, device))
            groups = [list(r) for r in sorted({f.group_ranks for f in gathered if f.group_ranks}, key=lambda r: r[0])]
        else:
            self.group = _host_group(gathered, device, self.timeout_s)
            self._weight = self.group.group
            groups = sorted((sorted(f.rank for f in host) for host in _by_host(gathered).values()), key=lambda r: r[0])
        # new_group is collective over the whole world: every rank creates every group's, in order.
        for ranks in groups:
            group = dist.new_group(ranks=ranks, backend="gloo", timeout=datetime.timedelta(seconds=self.timeout_s))
            if tuple(ranks) == tuple(self.group.ranks):
                self._agreement = group
        return self.group, None

    def agree(self, error: str | None) -> list[tuple[int, str]]:
        """Every rank says whether its setup succeeded (``error`` None) or why not; returns the
        failures, the same list on every rank."""
        gathered = self.all_gather(error, "agree that setup succeeded")
        return [(rank, err) for rank, err in enumerate(gathered) if err is not None]

    def agree_in_step(self, what: str, fills: dict[str, int]) -> None:
        """Every rank of the weight group checks that all of them have come to ``what``
        (``remove()``) having made the same number of fills per ring. Over a gloo group of the
        weight group's ranks made for this at setup: a rank still in a fill never pairs with it
        (on the weight group it would: gloo aborts the process on the sizes, NCCL rebuilds
        nothing), and other weight groups (other hosts) are not waited for. Raises
        ``RuntimeError`` naming what it found."""
        assert self.group is not None
        gathered = self._gather_in_group(what, {"ranks": self.group.ranks, "fills": fills},
                                         f"the ranks did not all come to {what}")
        if any(g["fills"] != fills for g in gathered):
            counts = {r: g["fills"] for r, g in zip(self.group.ranks, gathered)}
            raise RuntimeError(
                f"the ranks of the weight group are out of step at {what}: fills made so far "
                f"({_by_rank(counts)}). With allgather every rank must run the same forwards (a rank "
                "that skipped or added some has rebuilt blocks from mixed shards): end the job on every "
                "rank and start it again.")

    def agree_done(self, what: str, error: str | None) -> list[tuple[int, str]]:
        """After a step whose collectives every rank of the weight group made in full (``remove()``'s
        gathers, which a rank whose own part failed still makes): whether each rank's own part
        succeeded (``error`` None) or why not. Returns the failures by global rank, the same list
        on every rank, so that all bind or none does. Over the same gloo group as
        :meth:`agree_in_step`, and only after it. Raises ``RuntimeError`` where the ranks do not
        all get here."""
        gathered = self._gather_in_group(f"{what}: done", error, f"the ranks did not all finish {what}'s gathers")
        return [(r, e) for r, e in zip(self.group.ranks, gathered) if e is not None]

    def _gather_in_group(self, tag: str, obj: Any, late: str) -> list[Any]:
        """Every rank of the weight group's ``obj``, in group order, over its gloo agreement group.
        ``tag``: what the ranks have come to (ranks that came to different steps raise alike);
        ``late``: what a timeout means, for its message."""
        assert self.group is not None and self._agreement is not None
        gathered: list[Any] = [None] * self.group.size
        try:
            dist.all_gather_object(gathered, (tag, obj), group=self._agreement)
        except RuntimeError as exc:  # a timeout, a peer gone
            raise RuntimeError(
                f"{late} within collective_timeout_s ({self.timeout_s:g} s): {exc}. With allgather, every "
                "rank calls it at the same point (after the same forwards, for the same models in the "
                "same order).") from exc
        if any(t != tag for t, _ in gathered):
            raise RuntimeError(f"the ranks of the weight group reached different steps ({_by_rank([t for t, _ in gathered])}) "
                               f"where every rank calls {tag}.")
        return [o for _, o in gathered]

    def close_exchange(self) -> None:
        """Release the side group: setup is agreed, nothing more is exchanged."""
        if self._exchange is not None:
            group, self._exchange = self._exchange, None
            _destroy(group)

    def close(self) -> None:
        """Release every group this session created. Idempotent."""
        self.close_exchange()
        if self._weight is not None:
            group, self._weight = self._weight, None
            _destroy(group)
        if self._agreement is not None:
            group, self._agreement = self._agreement, None
            _destroy(group)

    def _exchange_group(self) -> Any:
        if self._exchange is None:
            self._exchange = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=self.timeout_s))
        return self._exchange


def agree_step(group: WeightGroup, device: torch.device, error: BaseException | None, what: str) -> None:
    """The local part of a collective step is done on every rank of the weight group (the device
    buffers it needs allocated, and whatever else could fail on one rank only): before its
    first collective, every rank says whether its part failed (``error``). Where one did, every
    rank raises here, none having made a collective of the step, so they stay in step and the
    caller changes nothing: the failing rank its own ``error``, the others a ``RuntimeError``
    naming it (``what`` failed on it). Both carry :data:`IN_STEP`. Without it, the rank that
    failed would leave the step while the others went on into its collectives, which it would
    answer with its next ones (a forward's fills): gloo aborts the process where the sizes
    differ, and blocks are rebuilt from mixed shards where they match.

    One all-reduce of a word per rank over the weight group, in the words the group was made
    with (:attr:`WeightGroup.flags`: no allocation, as an out-of-memory calls for). Between
    forwards only (plan changes, setup); synchronises."""
    flags = group.flags
    if flags is None:  # a group made without them: made now, on the host for gloo
        flags = _flags(group.size, group.backend, device)
    flags.zero_()
    if error is not None:
        flags[group.rank] = 1
    dist.all_reduce(flags, group=group.group)
    failed = [group.ranks[k] for k, flag in enumerate(flags.tolist()) if flag]
    if not failed:
        return
    if error is not None:
        error.add_note(f"{what} failed on this rank; every rank of its weight group ({list(group.ranks)}) stopped "
                       "there too, before the step's first collective, and changed nothing.")
        setattr(error, IN_STEP, True)
        raise error
    exc = RuntimeError(
        f"{what} failed on rank{'s' if len(failed) > 1 else ''} {', '.join(map(str, failed))} (its own error says "
        f"why); every rank of the weight group {list(group.ranks)} stopped before the step's first collective "
        "and changed nothing.")
    setattr(exc, IN_STEP, True)
    raise exc


def _flags(size: int, backend: str, device: torch.device) -> torch.Tensor:
    """:func:`agree_step`'s words: on the device for NCCL (which reduces device tensors only), on
    the host for gloo."""
    where = device if "nccl" in backend else torch.device("cpu")
    with torch.inference_mode(False):  # written in place whatever mode the step runs in
        return torch.zeros(size, dtype=torch.int32, device=where)


def _destroy(group: Any) -> None:
    # The job may have torn its process groups down already (destroy_process_group() destroys
    # every subgroup too): then there is nothing left to release.
    if dist.is_initialized() and group in dist.distributed_c10d._world.pg_map:
        dist.destroy_process_group(group)


def _failed_facts(gathered: Sequence[_RankFacts], mine: dict[str, ComponentFacts] | str) -> bool:
    """Whether some rank could not gather its facts (its ``components`` is why): then every
    other rank raises one error naming it (agreed: all saw the same exchange), and that rank
    gets True back, to raise its own."""
    failed = [(f.rank, f.components) for f in gathered if isinstance(f.components, str)]
    if not failed:
        return False
    if isinstance(mine, str):
        return True
    rank, why = failed[0]
    exc = RuntimeError(f"apply_offload failed on rank {rank} ({why}) while reading its weights to compare them "
                       "with the other ranks'; no rank changed anything, since the ranks share weights "
                       "(allgather or shared). Fix the error on that rank and apply again.")
    setattr(exc, AGREED, True)
    raise exc


def _check_same_layout(gathered: list[_RankFacts]) -> None:
    ref = gathered[0]
    for other in gathered[1:]:
        if set(other.components) != set(ref.components):
            transfer = next(iter((other.components or ref.components).values())).transfer
            raise OffloadConfigError(
                f"rank {other.rank} streams {sorted(other.components)} with {transfer} but rank 0 "
                f"streams {sorted(ref.components)}: every rank must call apply_offload with the "
                "same model and config."
            )
        for name, mine in other.components.items():
            theirs = ref.components[name]
            if (mine.transfer, mine.chunk_bytes, mine.gather) != (theirs.transfer, theirs.chunk_bytes, theirs.gather):
                raise OffloadConfigError(
                    f"{name}: rank {other.rank} asks for {mine.transfer} (chunk {mine.chunk_bytes} "
                    f"bytes, gather {mine.gather}), rank 0 for {theirs.transfer} (chunk "
                    f"{theirs.chunk_bytes} bytes, gather {theirs.gather}): use the same config on every rank."
                )
            if len(mine.block_digests) != len(theirs.block_digests):
                raise OffloadConfigError(
                    f"rank 0 has {len(theirs.block_digests)} blocks in {name}, rank {other.rank} has "
                    f"{len(mine.block_digests)}: every rank must load the same model (the same checkpoint "
                    "and architecture config, e.g. the number of layers) and stream it with the same config."
                )
            for i in range(max(len(mine.block_digests), len(theirs.block_digests))):
                a = mine.block_digests[i] if i < len(mine.block_digests) else None
                b = theirs.block_digests[i] if i < len(theirs.block_digests) else None
                if a != b:
                    block = mine.block_names[i] if i < len(mine.block_names) else theirs.block_names[i]
                    raise OffloadConfigError(
                        f"{name}: the layout of block {block} (block {i}) differs between rank 0 and "
                        f"rank {other.rank} (names, dtypes, shapes or sizes of its tensors): every "
                        "rank must load the same model with the same dtype."
                    )
            for i, (a, b) in enumerate(zip(mine.value_digests, theirs.value_digests)):
                if a != b:
                    how = ("allgather assembles each block from every rank's shard" if mine.transfer == "allgather"
                           else "each rank fills its part of the host copy the ranks share")
                    raise OffloadConfigError(
                        f"{name}: the weights of block {mine.block_names[i]} differ between rank 0 "
                        f"and rank {other.rank}: {how}, so every rank must load the same checkpoint "
                        "(or seed random initialisation identically)."
                    )


def _check_same_asks(asks: list[SetupAsk]) -> None:
    """Raise where ranks ask for different things (every rank sees the same list, so every rank
    raises the same error). Components that stream rank-local wherever they stream are free to
    differ: no rank depends on them."""
    sharing = sorted({c for a in asks for c, (_, t) in a.transfers.items() if t != "rank-local"})
    for c in sharing:
        key = next(a.transfers[c][0] for a in asks if c in a.transfers)
        _same(c, key, [a.transfers[c][1] if c in a.transfers else "not streamed" for a in asks])
        for key in dict.fromkeys(k for a in asks for k in a.settings.get(c, {})):
            _same(c, key, [a.settings.get(c, {}).get(key) for a in asks])
    if any(t == "allgather" for a in asks for _, t in a.transfers.values()):
        _check_process_groups([a.process_group for a in asks])


def _same(component: str, key: str, values: list[Any]) -> None:
    if any(v != values[0] for v in values):
        raise OffloadConfigError(
            f"{component}: {key} differs across ranks ({_by_rank(values)}): the ranks share this "
            "component's weights, so every rank must call apply_offload with the same config for it.")


def _check_process_groups(groups: list[tuple[int, ...] | None]) -> None:
    """allgather: every rank passes a process_group or none does, and the groups passed split
    the ranks: each rank is in its own, and each member passes the same group."""
    problem = None
    if len({g is None for g in groups}) > 1:
        problem = "some ranks pass one and others do not"
    for r, g in enumerate(groups):
        if problem is not None or g is None:
            continue
        if r not in g:
            problem = f"rank {r}'s group does not hold rank {r}"
        elif (bad := next((q for q in g if q >= len(groups) or groups[q] != g), None)) is not None:
            problem = f"rank {r}'s group holds rank {bad}, which passes another"
    if problem is not None:
        shown = ["None (one group per host)" if g is None else list(g) for g in groups]
        raise OffloadConfigError(
            f"apply_offload's process_group differs across ranks ({_by_rank(shown)}): {problem}. "
            "Pass every rank the group it gathers weights in (the same ranks on every member of a "
            "group), or None on every rank for one group per host.")


def _check_same_residency(gathered: list[tuple[tuple[int, ...], dict[str, dict[str, Any]]]]) -> None:
    """Per weight group, its ranks' residency of every ring must match (the same error on every
    rank: all see every group's)."""
    for ranks, rings in gathered:
        ref = gathered[ranks[0]][1]
        for name, mine in rings.items():
            for key, value in mine.items():
                if value != ref.get(name, {}).get(key):
                    values = {q: gathered[q][1].get(name, {}).get(key) for q in ranks}
                    raise OffloadConfigError(
                        f"{name}: the ranks of its weight group {list(ranks)} would start it with "
                        f"different {key} ({_by_rank(values)}): allgather rebuilds every streamed block "
                        "on all of them at once, so they must keep the same blocks resident and stream "
                        "the rest alike. Give every rank the same device_budget and resident_blocks (in "
                        "layer_options), and stream the same components on every rank (a budget is "
                        "split between them).")


def _shown(value: Any) -> str:
    if value is None:
        return "not set"
    return str(list(value)) if isinstance(value, tuple) else str(value)


def _by_rank(values: list[Any] | dict[int, Any]) -> str:
    """``rank 0: a; ranks 1, 2: b``: each value and the ranks that gave it."""
    ranks: dict[str, list[int]] = {}
    for r, v in (values.items() if isinstance(values, dict) else enumerate(values)):
        ranks.setdefault(_shown(v), []).append(r)
    return "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {v}" for v, rs in ranks.items())


def _fallback_reason(gathered: list[_RankFacts]) -> str | None:
    device_types = {f.device_type for f in gathered}
    if len(device_types) > 1:
        return f"ranks run on different device types {sorted(device_types)}"
    device_type = device_types.pop()
    backend = gathered[0].backend
    if device_type == "cuda" and "nccl" not in backend:
        return (f"the process group backend is {backend!r}: allgather on CUDA devices needs NCCL "
                "(init_process_group('nccl'))")
    if device_type == "cpu":
        if "gloo" not in backend:
            return f"the device is the CPU and the backend is {backend!r}: allgather needs CUDA devices and NCCL"
        if not all(f.allow_gloo for f in gathered):
            return (f"the device is the CPU with backend {backend!r}: allgather over gloo is for "
                    f"tests only; set {ALLOW_GLOO_ENV}=1 to allow it")
    # Every rank's group, not only this rank's: all ranks must reach the same decision.
    groups = {f"host {node}": ranks for node, ranks in _by_host(gathered).items()}
    if gathered[0].group_ranks is not None:  # a process_group on every rank (compare_asks)
        groups = {}
        for f in gathered:
            groups.setdefault(f"process_group {list(f.group_ranks)}", []).append(f)
    for where, ranks in groups.items():
        if len(ranks) < 2:
            return (f"{where} runs a single rank ({ranks[0].rank}): a weight group needs at "
                    "least two ranks")
        if device_type == "cuda":
            seen: dict[str | int | None, int] = {}
            for f in ranks:
                key = f.device_uuid or f.device_index
                if key in seen:
                    return (f"ranks {seen[key]} and {f.rank} in {where} share "
                            f"cuda:{f.device_index}: give every rank its own GPU "
                            "(torch.cuda.set_device(LOCAL_RANK))")
                seen[key] = f.rank
    return None


def _by_host(gathered: list[_RankFacts]) -> dict[str, list[_RankFacts]]:
    """The ranks' facts by host (``GROUP_RANK``, else the host name), in rank order."""
    hosts: dict[str, list[_RankFacts]] = {}
    for f in gathered:
        hosts.setdefault(f.node, []).append(f)
    return hosts


def _host_group(gathered: list[_RankFacts], device: torch.device, timeout_s: float) -> WeightGroup:
    hosts = {node: [f.rank for f in ranks] for node, ranks in _by_host(gathered).items()}
    me = dist.get_rank()
    backend = "nccl" if device.type == "cuda" else "gloo"
    mine = None
    # new_group is collective over the whole world: every rank creates every host's group, in
    # the same order (by lowest rank), and keeps its own.
    options = _nccl_options() if backend == "nccl" else None
    for ranks in sorted((sorted(r) for r in hosts.values()), key=lambda r: r[0]):
        group = dist.new_group(ranks=ranks, backend=backend, timeout=datetime.timedelta(seconds=timeout_s),
                               pg_options=options)
        if me in ranks:
            mine = WeightGroup(group, ranks.index(me), len(ranks), backend, tuple(ranks),
                               _peer_copy_reason([f for f in gathered if f.rank in ranks]),
                               _flags(len(ranks), backend, device))
    assert mine is not None
    return mine


def _gpu_facts(device: torch.device) -> dict[str, Any]:
    if device.type != "cuda":
        return {}
    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = _uuid(index)
    peers = tuple(_uuid(j) for j in range(torch.cuda.device_count())
                  if j != index and torch.cuda.can_device_access_peer(index, j))
    symmetric = (symm_mem is not None and callable(getattr(symm_mem, "empty", None))
                 and callable(getattr(symm_mem, "rendezvous", None)))
    return {"device_uuid": uuid, "peer_uuids": peers, "symmetric_memory": symmetric,
            "stream_memops": StreamMemOps.available()}


def _uuid(index: int) -> str:
    return str(getattr(torch.cuda.get_device_properties(index), "uuid", f"cuda:{index}"))


def _peer_copy_reason(ranks: list[_RankFacts]) -> str | None:
    """Why the copy-engine gather cannot run on this weight group, or None when it can: every
    GPU must reach every other's memory directly, and torch must have symmetric memory."""
    if any(f.device_type != "cuda" for f in ranks):
        return "the weight group is not on CUDA devices"
    for f in ranks:
        if not f.symmetric_memory:
            return f"rank {f.rank}'s torch has no CUDA symmetric memory (torch.distributed._symmetric_memory)"
        if not f.stream_memops:
            return f"rank {f.rank}'s CUDA driver has no stream memory operations (cuStreamWaitValue32)"
        for g in ranks:
            if g is not f and g.device_uuid not in f.peer_uuids:
                return (f"rank {f.rank}'s GPU cannot map rank {g.rank}'s GPU memory (no peer access, or the "
                        "GPU is hidden from it by CUDA_VISIBLE_DEVICES)")
    return None


def _nccl_options():
    options = dist.ProcessGroupNCCL.Options()
    # High priority: the block scheduler dispatches the all-gather's thread blocks ahead of the
    # model's pending ones, so both ranks enter the collective together instead of one rank's
    # blocks spinning on SMs until the other's compute kernel drains.
    options.is_high_priority_stream = True
    max_ctas = int(os.environ.get(MAX_CTAS_ENV, "0") or 0)
    if max_ctas > 0:
        options.config.max_ctas = max_ctas
        options.config.min_ctas = 1
    return options
