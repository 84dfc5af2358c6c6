"""The residency planner: which blocks of a ring stay on the device, and how many slots stream
the rest, within a device memory budget.

Pure arithmetic on per-block costs; no tensors. Three parts:

* :func:`simulate` predicts a forward of a ring the way :class:`~omni_dist_offload.ring.BlockRing`
  runs it: one compute stream, one copy stream, ``slots`` device slots, the fill of the ``q``-th
  streamed block starting once the copy stream is free, the streamed block ``slots`` places
  earlier has run (its slot is then free) and the host has issued it (in the pre-forward of the
  streamed block ``slots - 1`` places earlier, which is never before its forward started),
  forward after forward with the measured gap between them (the steady state of a denoising
  loop, where the last blocks prefetch the first ones of the next forward);
* :func:`plan_residency` spends a budget on resident blocks and slots to minimise that
  prediction; :func:`plan_fewest` finds the smallest device footprint whose prediction is within a
  tolerance of the resident forward (``device_budget: "auto"``);
* :func:`prior_costs` stands in for measurements before the first forward has run;
  :func:`pick_resident` picks which blocks a count of resident blocks keeps, from it.

The search and its rules are in ``docs/design.md``, [Note: residency planner].
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
from decimal import Decimal
from typing import Iterable, Sequence

__all__ = [
    "ResidencyPlan",
    "RingCosts",
    "format_bytes",
    "image_slot_bytes",
    "min_budget",
    "parse_bytes",
    "pick_resident",
    "plan_fewest",
    "plan_residency",
    "prior_costs",
    "simulate",
    "slots_bytes",
    "whole_bytes",
]

#: Slot counts the planner considers: two (the block that runs and the one arriving), or a third
#: (and fourth) so copies run further ahead of compute.
SLOT_CHOICES = (2, 3, 4)
#: Forwards simulated back to back; the last one is the steady state.
_FORWARDS = 4

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*(-?)([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: object, key: str) -> int:
    """A byte count from an int or a string with a unit (``"24GiB"``, ``"512MiB"``, ``"40GB"``).
    Raises ``ValueError`` naming ``key`` and the value."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):  # numpy's integers too
        if value < 0:
            raise ValueError(f"config key {key!r} is {value}: a byte count cannot be negative.")
        return int(value)
    if isinstance(value, str):
        match = _SIZE.match(value)
        if match and match.group(3).lower() in _UNITS:
            if match.group(1):
                raise ValueError(f"config key {key!r} is {value.strip()!r}: a byte count cannot be negative.")
            if _UNITS[match.group(3).lower()] == 1 and "." in match.group(2):
                raise ValueError(f"config key {key!r} is {value.strip()!r}: a byte count is a whole number "
                                 "(a fraction goes with a larger unit, such as \"1.5GiB\").")
            # Exact decimal arithmetic ("0.3GB" is 300000000 bytes, not one less through a
            # float); a fraction of a byte left over is dropped.
            return int(Decimal(match.group(2)) * _UNITS[match.group(3).lower()])
    raise ValueError(
        f"config key {key!r} has value {value!r}, which is not a size: give bytes as a whole "
        "number, or a number with a unit such as \"24GiB\", \"512MiB\" or \"40GB\" "
        "(units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB).")


def format_bytes(n: int) -> str:
    """``n`` bytes in the largest binary unit that keeps it at least 1 (``"1.5 GiB"``)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


@dataclasses.dataclass(frozen=True, slots=True)
class RingCosts:
    """What the planner knows of one ring, per block in ring order."""

    nbytes: tuple[int, ...]
    """Device bytes the block takes when it stays resident."""
    slot_bytes: tuple[int, ...]
    """Slot bytes the block needs when it streams (allgather: the gathered, padded size)."""
    compute_ms: tuple[float, ...]
    copy_ms: tuple[float, ...]
    """Time to bring the block into a slot (host-to-device copy, and the gather under allgather)."""
    pre_ms: float = 0.0
    """Compute of the component before its first block (embeddings), each forward."""
    post_ms: float = 0.0
    """Compute after its last block (output norm and projection), each forward."""
    gap_ms: float = 0.0
    """Between two forwards, the compute stream idles this long (the caller's own work on the
    host, a synchronisation); copies already issued go on."""
    issued_ms: tuple[float, ...] | None = None
    """Per block, when the host reaches its pre-forward (which issues the next fills), from the
    forward's start on the device: negative while the host runs ahead. None: never late."""
    measured: bool = True
    """False for :func:`prior_costs`: the plan is a placeholder until a forward is measured."""
    cuts: tuple[tuple[int, ...], ...] | None = None
    """Per block, the byte counts of a leading part it can keep on the device while the rest
    streams (a block splits between two of its tensors), ascending, each above 0 and below the
    block's slot bytes. None: blocks stay resident or stream whole (rings of 8-bit images)."""
    run_slot_bytes: int = 0
    """A ring that runs every block from a slot, those kept on the device too (a ring of 8-bit
    images, whose kept blocks are upcast into a slot when they run): one slot's bytes, its
    largest block in the compute dtype. Its ``slot_bytes`` add to that a block's share of the
    staging buffers its image passes through when it streams (:func:`image_slot_bytes`). 0: an
    ordinary ring."""

    def __post_init__(self) -> None:
        n = len(self.nbytes)
        if not (len(self.slot_bytes) == len(self.compute_ms) == len(self.copy_ms) == n):
            raise ValueError("RingCosts: every per-block sequence must have one entry per block")
        if self.cuts is not None and len(self.cuts) != n:
            raise ValueError("RingCosts: cuts needs one entry per block")
        if self.run_slot_bytes and any(b < self.run_slot_bytes for b in self.slot_bytes):
            raise ValueError("RingCosts: a ring that runs every block from a slot has slot_bytes of at "
                             "least run_slot_bytes")

    @property
    def through_slots(self) -> bool:
        """Every block runs from a slot (see ``run_slot_bytes``)."""
        return self.run_slot_bytes > 0

    def streamed_ms(self, i: int, kept: int) -> float:
        """Block ``i``'s copy when its first ``kept`` bytes stay on the device (in proportion to
        the bytes that stream)."""
        return self.copy_ms[i] * (self.slot_bytes[i] - kept) / self.slot_bytes[i] if kept else self.copy_ms[i]

    @property
    def resident_ms(self) -> float:
        """The forward with every block on the device."""
        return self.pre_ms + sum(self.compute_ms) + self.post_ms


@dataclasses.dataclass(frozen=True, slots=True)
class ResidencyPlan:
    """Which blocks stay on the device and how many slots stream the others."""

    resident: tuple[int, ...]
    slots: int
    """Device slots of the ring (0 when every block is resident)."""
    device_bytes: int
    """Resident blocks plus slots."""
    predicted_ms: float
    resident_ms: float
    measured: bool = True
    kept: tuple[tuple[int, int], ...] = ()
    """Streamed blocks that keep a leading part on the device: (block, bytes kept), by block."""
    every_block: bool = False
    """Every block stays on the device: nothing streams from the host (a ring of 8-bit images
    still runs them through its slots, upcast there, as its resident reference does)."""

    @property
    def predicted_ratio(self) -> float | None:
        """Predicted forward / resident forward: 1.0 when every block is resident, measured or
        not (nothing streams); None while the costs of a plan that streams are a prior."""
        if self.slots == 0 or self.every_block:
            return 1.0
        if not self.measured or self.resident_ms <= 0:
            return None
        return self.predicted_ms / self.resident_ms


@dataclasses.dataclass(frozen=True, slots=True)
class _Outcome:
    forward_ms: float
    slack_ms: float
    """The smallest margin by which a streamed block's bytes arrived before it was needed."""
    stalls: dict[int, float] = dataclasses.field(default_factory=dict)
    """Per streamed block, how long compute waited for it in the steady-state forward."""


def simulate(costs: RingCosts, resident: Iterable[int], slots: int,
             kept: dict[int, int] | None = None) -> float:
    """The predicted steady-state forward in ms (see the module docstring); ``kept``: bytes
    each partly kept block keeps on the device."""
    return _simulate(costs, frozenset(resident), slots, kept).forward_ms


def _simulate(costs: RingCosts, resident: frozenset[int], slots: int,
              kept: dict[int, int] | None = None) -> _Outcome:
    compute = costs.compute_ms
    copy = ([costs.streamed_ms(i, kept.get(i, 0)) for i in range(len(compute))] if kept
            else costs.copy_ms)
    n = len(compute)
    host = costs.issued_ms or (-math.inf,) * n
    order = [i for i in range(n) if i not in resident]
    m = len(order)
    if m == 0:
        return _Outcome(costs.resident_ms, math.inf)
    if slots < 2:
        raise ValueError(f"a streamed ring needs at least 2 slots, found {slots}")
    if m <= slots:  # every streamed block has a slot of its own: after the first forward none moves
        return _Outcome(costs.resident_ms, math.inf)
    t = 0.0                      # compute stream clock
    copy_clock = 0.0             # copy stream clock
    ready: list[float] = []      # per fill (in issue order): when its bytes are in the slot
    done: list[float] = []       # per streamed run (same numbering): when its compute ended
    starts: list[float] = []     # per forward: when it started
    slack = math.inf
    stalls: dict[int, float] = {}
    q = 0                        # streamed runs so far
    for f in range(_FORWARDS):
        if f:
            t += costs.gap_ms
        starts.append(t)
        t += costs.pre_ms
        for i in range(n):
            t = max(t, starts[-1] + host[i])  # a block runs once the host has launched it
            if i in resident:
                t += compute[i]
                continue
            # Fills are issued in ring order; fill k reuses the slot of run k - slots, so it starts
            # once that run has ended, the copy stream has finished the fill before it, and the
            # host has issued it: in the pre-forward of run k - slots + 1, never before that
            # run's forward started.
            while len(ready) <= q:
                k = len(ready)
                free = done[k - slots] if k >= slots else 0.0
                by = max(0, k - slots + 1)
                issued = starts[by // m] + max(0.0, host[order[by % m]])
                copy_clock = max(copy_clock, free, issued) + copy[order[k % m]]
                ready.append(copy_clock)
            slack = min(slack, t - ready[q])
            if f == _FORWARDS - 1:
                stalls[i] = max(0.0, ready[q] - t)
            t = max(t, ready[q]) + compute[i]
            done.append(t)
            q += 1
        t += costs.post_ms
    return _Outcome(t - starts[-1], slack, stalls)


def image_slot_bytes(compute_nbytes: Sequence[int], image_nbytes: Sequence[int]) -> tuple[int, ...]:
    """Per block, one slot's share of what streaming it costs in a ring of 8-bit images: every
    block, kept ones too, is upcast into a slot, so each slot holds the largest block in its
    compute dtype whichever blocks stream; the streamed images pass through two staging buffers
    (``transfer/casting.py``), here one image per slot of a two-slot ring. With these, a
    two-slot plan costs two times the largest share among the blocks it streams, as for any
    ring; :func:`slots_bytes` counts other slot counts."""
    most = max(compute_nbytes)
    return tuple(most + image for image in image_nbytes)


def slots_bytes(slots: int, cap: int, run_slot_bytes: int = 0) -> int:
    """Device bytes of a ring's ``slots`` slots when the largest block it streams needs ``cap``
    (its ``slot_bytes``). On a ring of 8-bit images (``run_slot_bytes``) the slots hold its
    largest block and the two staging buffers hold the largest streamed image, whatever the
    slot count."""
    if not run_slot_bytes:
        return slots * cap
    return slots * run_slot_bytes + SLOT_CHOICES[0] * (cap - run_slot_bytes)


def whole_bytes(nbytes: Sequence[int], run_slot_bytes: int = 0) -> int:
    """Device bytes with every block kept: the blocks, and on a ring of 8-bit images the two
    slots they are upcast into (no staging buffer: no image streams)."""
    return sum(nbytes) + SLOT_CHOICES[0] * run_slot_bytes


def min_budget(nbytes: Sequence[int], slot_bytes: Sequence[int], run_slot_bytes: int = 0) -> int:
    """The smallest budget a ring runs in: two slots of its largest block, unless less will do,
    where blocks differ in size or are few: every block resident, or the blocks larger than a
    smaller slot resident and the rest streamed through two such slots (what :func:`_search`
    plans at that budget). ``run_slot_bytes``: see ``RingCosts``."""
    slots = SLOT_CHOICES[0]
    n, best = len(nbytes), whole_bytes(nbytes, run_slot_bytes)
    for cap in set(slot_bytes):
        forced = [i for i in range(n) if slot_bytes[i] > cap]
        if n - len(forced) > slots:  # more streamed blocks than slots, as _search plans them
            best = min(best, slots_bytes(slots, cap, run_slot_bytes) + sum(nbytes[i] for i in forced))
    return best


def plan_residency(costs: RingCosts, budget: int) -> ResidencyPlan:
    """Spend ``budget`` bytes on resident blocks and slots so the predicted forward is shortest.
    Raises ``ValueError`` below :func:`min_budget`."""
    return _search(costs, budget, tolerance=None)


def plan_fewest(costs: RingCosts, budget: int, tolerance: float = 0.01) -> ResidencyPlan:
    """The plan with the smallest device footprint, within ``budget``, whose predicted forward is
    within ``tolerance`` of the resident one; the fastest plan in ``budget`` if none is."""
    return _search(costs, budget, tolerance=tolerance)


def _search(costs: RingCosts, budget: int, tolerance: float | None) -> ResidencyPlan:
    n = len(costs.nbytes)
    floor = min_budget(costs.nbytes, costs.slot_bytes, costs.run_slot_bytes)
    if budget < floor:
        raise ValueError(f"a budget of {format_bytes(budget)} is below the {format_bytes(floor)} the ring "
                         "needs at least (see min_budget)")
    # Every block on the device; a ring that runs every block from a slot keeps two slots too.
    total = whole_bytes(costs.nbytes, costs.run_slot_bytes)
    everything = ResidencyPlan(tuple(range(n)), SLOT_CHOICES[0] if costs.through_slots else 0, total,
                               costs.resident_ms, costs.resident_ms, costs.measured, every_block=True)
    if total <= budget and tolerance is None:
        return everything
    goal = costs.resident_ms * (1 + tolerance) if tolerance is not None else -math.inf
    # Ranking (_rank): plans that meet the goal first, the smallest of them; otherwise the
    # fastest, then the one that streams fewest bytes (copies slow the model's own kernels: on a
    # GPU at its power limit, what the copy engines and the link draw comes off the SM clock;
    # tools/contention.py), then the one that keeps most on the device (more margin against
    # timings that vary).
    best: tuple | None = None
    if total <= budget:
        best = ((0, total, everything.predicted_ms, 0.0), everything)
    for cap in sorted(set(costs.slot_bytes)):
        forced = frozenset(i for i in range(n) if costs.slot_bytes[i] > cap)
        for slots in SLOT_CHOICES:
            room = budget - slots_bytes(slots, cap, costs.run_slot_bytes) - sum(costs.nbytes[i] for i in forced)
            if room < 0 or n - len(forced) <= slots:
                continue
            for plan, outcome in _greedy(costs, forced, cap, slots, room):
                key = _rank(plan, goal, costs, 0.0)
                if best is None or key < best[0]:
                    best = (key, plan)
                if plan.predicted_ms <= goal:
                    break  # more resident blocks would only cost memory
    for plan in _partial_plans(costs, budget) if costs.cuts is not None else ():
        key = _rank(plan, goal, costs, 1.0)  # ties: whole blocks (simpler) first
        if best is None or key < best[0]:
            best = (key, plan)
    assert best is not None  # budget >= floor: the plan min_budget counted always fits
    return best[1]


def _rank(plan: ResidencyPlan, goal: float, costs: RingCosts, last: float) -> tuple:
    """Plans that meet the goal first, the smallest of them; otherwise the fastest (to 0.1% of
    the resident forward), then the one that streams fewest bytes, then the one that keeps most
    on the device."""
    if plan.predicted_ms <= goal:
        return (0, plan.device_bytes, plan.predicted_ms, last)
    return (1, round(plan.predicted_ms / costs.resident_ms, 3), streamed_bytes(costs, plan), -plan.device_bytes, last)


def streamed_bytes(costs: RingCosts, plan: ResidencyPlan) -> int:
    """Bytes the plan copies to the device each forward: every block it does not keep (its
    image, on a ring of 8-bit images), less the parts partly kept blocks keep."""
    kept = dict(plan.kept)
    resident = set(plan.resident)
    moved = costs.nbytes if costs.through_slots else costs.slot_bytes
    return sum(moved[i] - kept.get(i, 0) for i in range(len(moved)) if i not in resident)


#: Partial plans: slot sizes closer than this share of the largest block count as one.
_PARTIAL_CAP_STEP = 1 / 64
#: The smallest step by which a partial plan keeps more of a block, as a share of the block.
_PARTIAL_STEP = 1 / 16


def _partial_plans(costs: RingCosts, budget: int):
    """Plans where streamed blocks keep a leading part on the device (``costs.cuts``), so a
    slot holds only what streams and every block streams about what its neighbours' compute
    hides. For each slot size (a share of the largest block: blocks keep what does not fit,
    whole blocks stay resident where no cut fits) and 2 or 3 slots, starting from the least
    kept: keep more of the block whose bytes arrived latest, one step at a time, while the
    budget holds. Yields every plan on the way."""
    sizes, nbytes, cuts = costs.slot_bytes, costs.nbytes, costs.cuts
    n = len(sizes)
    for cap in _partial_caps(sizes, cuts):
        kept: dict[int, int] = {}
        resident: set[int] = set()
        for i in range(n):
            if sizes[i] <= cap:
                continue
            fit = [c for c in cuts[i] if sizes[i] - c <= cap]
            if fit:
                kept[i] = fit[0]
            else:
                resident.add(i)
        for slots in (2, 3):
            plan_kept, plan_resident = dict(kept), set(resident)
            while True:
                streamed = [i for i in range(n) if i not in plan_resident]
                if len(streamed) <= slots:
                    break
                slot = max(sizes[i] - plan_kept.get(i, 0) for i in streamed)
                device = (sum(nbytes[i] for i in plan_resident) + sum(plan_kept.values()) + slots * slot)
                if device > budget:
                    break
                outcome = _simulate(costs, frozenset(plan_resident), slots, plan_kept)
                yield ResidencyPlan(tuple(sorted(plan_resident)), slots, device, outcome.forward_ms,
                                    costs.resident_ms, costs.measured,
                                    tuple(sorted((i, b) for i, b in plan_kept.items() if i not in plan_resident)))
                late = sorted((w, i) for i, w in outcome.stalls.items() if w > 0)
                if not late:
                    break
                step = None
                for _, i in reversed(late):  # the latest block first; the next if it cannot grow
                    now = plan_kept.get(i, 0)
                    more = [c for c in cuts[i] if c >= now + sizes[i] * _PARTIAL_STEP]
                    if more:
                        step = (i, more[0])
                        break
                if step is None:
                    break
                plan_kept[step[0]] = step[1]


def _partial_caps(sizes: Sequence[int], cuts: Sequence[Sequence[int]]) -> list[int]:
    """Slot sizes for partial plans: the sizes a streamed part can have (a block less one of its
    cuts, or the whole block), those within :data:`_PARTIAL_CAP_STEP` of the largest block
    below a larger one dropped (the larger one holds both). A slot of exactly a part's size
    wastes nothing on that part, and where blocks copy much slower than they compute, the parts
    that fit under the compute are small, so the small sizes are the ones that matter."""
    step = max(sizes) * _PARTIAL_CAP_STEP
    caps: list[int] = []
    for part in sorted({s - c for s, cs in zip(sizes, cuts) for c in cs} | set(sizes), reverse=True):
        if not caps or caps[-1] - part >= step:
            caps.append(part)
    return caps[::-1]


def _rounded(ms: float) -> float:
    """Simulated times compare equal below a nanosecond (sums in another order differ in the last bits)."""
    return round(min(ms, 1e18), 6)


def _greedy(costs: RingCosts, forced: frozenset[int], cap: int, slots: int, room: int):
    """Plans with ever more resident blocks among those that fit a slot of ``cap`` bytes: each step
    keeps the block whose residency shortens the predicted forward most (then: raises the
    smallest arrival margin most, then: costs fewest bytes). Yields (plan, outcome) after every
    step, starting with only the forced blocks resident."""
    resident = set(forced)
    candidates = [i for i in range(len(costs.nbytes)) if i not in forced]
    outcome = _simulate(costs, frozenset(resident), slots)
    yield _plan(costs, resident, slots, cap, outcome), outcome
    # More streamed blocks than slots, or they would sit in their slots for good: resident
    # blocks with extra steps.
    while len(costs.nbytes) - len(resident) - 1 > slots:
        choice = _next_resident(costs, resident, [i for i in candidates if costs.nbytes[i] <= room], slots)
        if choice is None:
            return
        i, outcome = choice
        resident.add(i)
        room -= costs.nbytes[i]
        yield _plan(costs, resident, slots, cap, outcome), outcome


def _next_resident(costs: RingCosts, resident: set[int], candidates: Iterable[int], slots: int
                   ) -> tuple[int, _Outcome] | None:
    """The candidate whose residency, beside ``resident``, shortens the predicted forward most
    (then: raises the smallest arrival margin most, then: costs fewest bytes), with its outcome;
    None when there is none."""
    choice = None
    for i in candidates:
        if i in resident:
            continue
        trial = _simulate(costs, frozenset(resident | {i}), slots)
        key = (_rounded(trial.forward_ms), -_rounded(trial.slack_ms), costs.nbytes[i])
        if choice is None or key < choice[0]:
            choice = (key, i, trial)
    return None if choice is None else choice[1:]


def _plan(costs: RingCosts, resident: set[int], slots: int, cap: int, outcome: _Outcome) -> ResidencyPlan:
    # The ring sizes its slots to the largest block it streams, which may be below the cap once
    # the largest ones are resident.
    need = max(b for i, b in enumerate(costs.slot_bytes) if i not in resident)
    assert need <= cap
    device = sum(costs.nbytes[i] for i in resident) + slots_bytes(slots, need, costs.run_slot_bytes)
    return ResidencyPlan(tuple(sorted(resident)), slots, device, outcome.forward_ms, costs.resident_ms,
                         costs.measured)


def prior_costs(nbytes: Sequence[int], slot_bytes: Sequence[int], budget: int,
                run_slot_bytes: int = 0) -> RingCosts:
    """Costs to plan with before anything is measured: compute in proportion to bytes, at the
    ratio where the blocks the budget cannot hold take as long to copy as the whole ring takes to
    compute. That is where the choice of which blocks stream matters most, so the plan spreads
    them as well as the budget allows; the first measured forward replaces it."""
    total = sum(nbytes)
    streamed = max(total - max(0, budget - SLOT_CHOICES[0] * max(slot_bytes)), max(slot_bytes))
    scale = streamed / total if total else 0.0  # copy of all streamed bytes == compute of the whole ring
    return RingCosts(tuple(nbytes), tuple(slot_bytes), tuple(b * scale for b in nbytes),
                     tuple(float(b) for b in nbytes), measured=False, run_slot_bytes=run_slot_bytes)


def pick_resident(nbytes: Sequence[int], slot_bytes: Sequence[int], count: int,
                  run_slot_bytes: int = 0) -> tuple[int, ...]:
    """Which ``count`` blocks a ring keeps on the device when told how many, not which
    (``layer_options.<component>.resident_blocks`` as a count), streaming the rest through two
    slots. Picked at setup from :func:`prior_costs` (no forward has run; the pick is final, so the
    kept blocks never get a host copy): one block at a time, the one whose residency shortens the
    predicted forward most (then: raises the smallest arrival margin most, then: the smaller).
    Where spreading them evenly through the ring predicts a forward as short (blocks all of one
    size, where any even spread is as good as another), the even spread. Where blocks differ in
    size, keeping the large ones is what shortens the copies most, which an even spread misses."""
    n = len(nbytes)
    if not 0 <= count < n:
        raise ValueError(f"a ring of {n} blocks keeps 0 to {n - 1} of them resident, found {count}")
    if count == 0:
        return ()
    even = frozenset(int((j + 0.5) * n / count) for j in range(count))
    held = sum(sorted(nbytes)[-count:]) + SLOT_CHOICES[0] * max(slot_bytes)
    costs = prior_costs(nbytes, slot_bytes, held, run_slot_bytes)
    slots = SLOT_CHOICES[0]
    picked: set[int] = set()
    for _ in range(count):
        picked.add(_next_resident(costs, picked, range(n), slots)[0])
    # The greedy pick only where it predicts clearly better (0.1%) than the even spread.
    if simulate(costs, picked, slots) < simulate(costs, even, slots) * (1 - 1e-3):
        return tuple(sorted(picked))
    return tuple(sorted(even))
