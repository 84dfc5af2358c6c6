"""Device budgets: which blocks of each ring start resident, how many slots stream the rest, and
the one re-plan from a measured forward. The arithmetic is :mod:`.residency`; this module applies
it to a call of ``apply_offload`` ([Note: residency planner] in ``docs/design.md``).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Iterable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from .config import OffloadConfig, OffloadConfigError
from .residency import (
    ResidencyPlan,
    RingCosts,
    format_bytes,
    min_budget,
    plan_fewest,
    plan_residency,
    prior_costs,
    whole_bytes,
)
from .ring import NUM_SLOTS, BlockRing
from .transfer.groups import WeightGroup

__all__ = [
    "AUTO_TOLERANCE",
    "MEASURED_FORWARD",
    "Replanner",
    "Residency",
    "RingSizes",
    "auto_budget",
    "free_device_bytes",
    "initial_residency",
]

logger = logging.getLogger(__name__)

#: The forward a budgeted ring measures before planning for good: the first pays one-off costs
#: (kernel autotuning, workspace and allocator growth, compilation) that would misstate compute.
MEASURED_FORWARD = 2
#: A forward in which a step cache skipped blocks measures nothing for them: the planner
#: measures the next forward that ran every block instead, up to this one.
LAST_MEASURED_FORWARD = 10
#: ``device_budget: "auto"`` plans the fewest resident blocks predicted within this of resident.
AUTO_TOLERANCE = 0.01
_MIN_RESERVE = 2 * 2**30


@dataclasses.dataclass(frozen=True, slots=True)
class RingSizes:
    """What planning needs of one ring."""

    name: str
    category: str
    nbytes: tuple[int, ...]
    """Per block: device bytes when it stays resident."""
    slot_bytes: tuple[int, ...]
    """Per block: slot bytes when it streams (allgather: the gathered, padded size)."""
    fixed: tuple[int, ...] | None = None
    """``layer_options.<c>.resident_blocks``, checked: the ring is not planned."""
    run_slot_bytes: int = 0
    """Every block runs from a slot of this size, kept ones too (see ``RingCosts.run_slot_bytes``)."""

    @property
    def through_slots(self) -> bool:
        return self.run_slot_bytes > 0


@dataclasses.dataclass(frozen=True, slots=True)
class Residency:
    """How one ring starts."""

    resident: tuple[int, ...] = ()
    num_slots: int = NUM_SLOTS
    settled: bool = True
    """Final: resident blocks keep no host copy. Otherwise every block keeps one until a
    measured forward has been planned for (:class:`Replanner`)."""
    budget: int | None = None
    """The ring's share of ``device_budget``."""
    fewest: bool = False
    """``device_budget: "auto"``: re-plan to the fewest resident blocks within 1% of resident."""
    plan: ResidencyPlan | None = None


def initial_residency(rings: Sequence[RingSizes], device_budget: int | str | None,
                      resolve_auto: Callable[[], int | None]) -> dict[str, Residency]:
    """Per ring: ``resident_blocks`` where given, else the budget's plan (before anything is
    measured, from :func:`~.residency.prior_costs`), else every block streams. ``resolve_auto``
    gives the bytes ``"auto"`` stands for (None: the whole device). Raises
    ``OffloadConfigError`` when the budget cannot hold the rings, before anything changes."""
    out = {r.name: Residency(resident=r.fixed or ()) for r in rings}
    if device_budget is None:
        return out
    planned = [r for r in rings if r.fixed is None]
    held = sum(_fixed_bytes(r) for r in rings if r.fixed is not None)
    floors = {r.name: min_budget(r.nbytes, r.slot_bytes, r.run_slot_bytes) for r in planned}
    whole = {r.name: whole_bytes(r.nbytes, r.run_slot_bytes) for r in planned}
    budget = device_budget
    auto = budget == "auto"
    if auto:
        budget = resolve_auto()
        if budget is None or budget >= held + sum(whole.values()):
            for r in planned:
                everything = tuple(range(len(r.nbytes)))
                slots = NUM_SLOTS if r.through_slots else 0
                out[r.name] = Residency(resident=everything, num_slots=slots, budget=whole[r.name], plan=ResidencyPlan(
                    everything, slots, whole[r.name], 0.0, 0.0, measured=False, every_block=True))
            logger.info("device_budget auto: %s free for block weights; every block of %s fits and stays "
                        "resident", "the whole device" if budget is None else format_bytes(budget),
                        [r.name for r in planned])
            return out
    smallest = held + sum(floors.values())
    if budget < smallest:
        what = "auto resolved to " if auto else ""
        raise OffloadConfigError(
            f"config key 'device_budget' is {what}{format_bytes(budget)} ({budget} bytes), below the "
            f"smallest budget that works here, {format_bytes(smallest)} ({smallest} bytes): two slots of "
            f"the largest block of each streamed component (less where its largest blocks can stay resident "
            f"instead){' plus the resident_blocks given' if held else ''}. "
            "Raise the budget" + (", lower activation_reserve" if auto else "") +
            ", or drop device_budget to stream every block.")
    shares = _shares(planned, budget - held, floors, whole)
    for r in planned:
        share = shares[r.name]
        prior = plan_residency(prior_costs(r.nbytes, r.slot_bytes, share, r.run_slot_bytes), share)
        everything = len(prior.resident) == len(r.nbytes)
        out[r.name] = Residency(resident=prior.resident, num_slots=prior.slots or NUM_SLOTS,
                                settled=everything,  # everything fits: nothing to measure
                                budget=share, fewest=auto, plan=prior)
    return out


def _fixed_bytes(ring: RingSizes) -> int:
    keep = set(ring.fixed or ())
    streamed = [b for i, b in enumerate(ring.slot_bytes) if i not in keep]
    return sum(ring.nbytes[i] for i in keep) + NUM_SLOTS * max(streamed)


def _shares(rings: Sequence[RingSizes], budget: int, floors: Mapping[str, int],
            whole: Mapping[str, int]) -> dict[str, int]:
    """Split a budget between rings (the rule in ``docs/design.md``, [Note: residency planner]):
    each gets its smallest budget (``min_budget``); what is left goes to the DiTs, in proportion to
    what more they could use (up to all their blocks resident), then to the text encoders alike."""
    share = dict(floors)
    left = budget - sum(floors.values())
    for category in ("dit", "text_encoder"):
        want = {r.name: max(0, whole[r.name] - floors[r.name]) for r in rings if r.category == category}
        total = sum(want.values())
        if total == 0 or left <= 0:
            continue
        give = min(left, total)
        for name, w in want.items():
            share[name] += give * w // total
        left -= give
    return share


def auto_budget(cfg: OffloadConfig, dev: torch.device, modules: Mapping[str, nn.Module],
                block_tensors: Iterable[torch.Tensor], group: WeightGroup | None) -> int | None:
    """``device_budget: "auto"``: what this process can still allocate on the device, plus block
    memory that leaves it, less what the non-streamed modules will take when they move there,
    less the activation reserve. None on the CPU (no device memory apart from the host's: every
    block fits). Under allgather, the smallest over the weight group, so every rank plans alike."""
    free = free_device_bytes(dev)
    if free is None:
        return None
    in_blocks = {id(t): t for t in block_tensors}
    # Block tensors already on the device leave it when they stream: their memory counts as free.
    leaving = sum(t.numel() * t.element_size() for t in in_blocks.values()
                  if t.device == dev and dev.type == "cuda")
    seen: set[int] = set()
    incoming = 0
    for root in modules.values():
        for t in [*root.parameters(), *root.buffers()]:
            if id(t) in seen or id(t) in in_blocks or t.device == dev:
                continue
            seen.add(id(t))
            incoming += t.numel() * t.element_size()
    reserve = cfg.activation_reserve
    if reserve is None:
        reserve = max(_MIN_RESERVE, _total_device_bytes(dev) // 10)
    budget = max(0, free + leaving - incoming - reserve)
    if group is not None:
        budget = int(_group_reduce([float(budget)], group, dev, dist.ReduceOp.MIN)[0])
    return budget


def free_device_bytes(dev: torch.device) -> int | None:
    """What this process can still allocate on ``dev``: free device memory plus what PyTorch's
    allocator holds unused, within ``torch.cuda.set_per_process_memory_fraction`` if set (may
    be negative: over the cap). None for the CPU."""
    if dev.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(dev)
    allocated = torch.cuda.memory_allocated(dev)
    usable = free + torch.cuda.memory_reserved(dev) - allocated
    return min(usable, _device_limit(dev, total) - allocated)


def _device_limit(dev: torch.device, total: int) -> int:
    """The allocator's cap on ``dev`` (the device's memory unless a fraction was set)."""
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda d: 1.0)(dev)
    return int(total * min(1.0, fraction))


def _total_device_bytes(dev: torch.device) -> int:
    if dev.type != "cuda":
        return 0
    return _device_limit(dev, torch.cuda.get_device_properties(dev).total_memory)


def _group_reduce(values: Sequence[float], group: WeightGroup, dev: torch.device, op) -> list[float]:
    """One reduction over the weight group (on the device for NCCL, on the host for gloo)."""
    where = dev if "nccl" in group.backend else torch.device("cpu")
    t = torch.tensor(list(values), dtype=torch.float64, device=where)
    dist.all_reduce(t, op=op, group=group.group)
    return t.tolist()


class Replanner:
    """Called by a ring after each complete forward until it returns True
    (``BlockRing.watch_forwards``): after the measured forward it plans from what was measured
    (agreed across the weight group: the slowest rank's figures), applies the plan and drops the
    host copies of the blocks that stay."""

    def __init__(self, residency: Residency, group: WeightGroup | None, device: torch.device,
                 keep_trace: bool) -> None:
        self.budget = residency.budget
        self.fewest = residency.fewest
        self.group = group
        self.device = device
        self.keep_trace = keep_trace
        self.forwards = 0
        # The plan made from the measured forward, until it is applied: a plan change that
        # failed (the device out of memory) is tried again after the next forward as it was,
        # not planned again from that forward's figures. A final plan cut short part way has
        # given up host bytes of the blocks it kept by then, which only the same plan can
        # follow; under a gather every rank retries the same plan, in step, with no collective.
        self._planned: tuple[ResidencyPlan, RingCosts] | None = None

    def __call__(self, ring: BlockRing) -> bool:
        self.forwards += 1
        if self.forwards < MEASURED_FORWARD:
            return False
        if self._planned is not None:
            plan, costs = self._planned
            ring.apply_plan(plan.resident, plan.slots or NUM_SLOTS, settle=True, kept=dict(plan.kept))
            return self._applied(ring, plan, costs)
        costs = ring.measured_costs(ring.tracer.report())
        if self.group is not None:  # every rank must take the same plan: agree on the figures first
            costs = _agreed(costs, len(ring.layouts), self.group, self.device)
        if costs is None and self.forwards < LAST_MEASURED_FORWARD:
            return False  # a cache skipped blocks (on some rank): measure the next forward
        if costs is None:  # every forward skipped blocks: keep the current plan, and settle it
            ring.apply_plan(ring.on_device(), ring.num_slots or NUM_SLOTS, settle=True)
            logger.warning("%s: none of forwards %d to %d ran every block; keeping the unmeasured "
                           "residency plan", ring.component.name, MEASURED_FORWARD, LAST_MEASURED_FORWARD)
        else:
            plan = plan_fewest(costs, self.budget, AUTO_TOLERANCE) if self.fewest else plan_residency(costs, self.budget)
            self._planned = (plan, costs)
            ring.apply_plan(plan.resident, plan.slots or NUM_SLOTS, settle=True, kept=dict(plan.kept))
            return self._applied(ring, plan, costs)
        if not self.keep_trace:
            ring.tracer = None
        return True

    def _applied(self, ring: BlockRing, plan: ResidencyPlan, costs: RingCosts) -> bool:
        self._planned = None
        ring.plan, ring.costs = plan, costs
        _log_plan(ring, plan, costs)
        if not self.keep_trace:
            ring.tracer = None
        return True


def _agreed(costs: RingCosts | None, n: int, group: WeightGroup, dev: torch.device) -> RingCosts | None:
    """The slowest rank's figures, per block (all ranks call this; a rank without a complete
    measurement makes every rank keep its current plan)."""
    flat = [0.0] * (3 * n + 3)
    if costs is not None:
        flat = [*costs.compute_ms, *costs.copy_ms, *(costs.issued_ms or [-1e9] * n), costs.pre_ms,
                costs.post_ms, costs.gap_ms]
    worst = _group_reduce(flat, group, dev, dist.ReduceOp.MAX)
    complete = _group_reduce([1.0 if costs is not None else 0.0], group, dev, dist.ReduceOp.MIN)[0]
    if costs is None or complete < 1.0:
        return None
    return dataclasses.replace(costs, compute_ms=tuple(worst[:n]), copy_ms=tuple(worst[n:2 * n]),
                               issued_ms=tuple(worst[2 * n:3 * n]), pre_ms=worst[3 * n],
                               post_ms=worst[3 * n + 1], gap_ms=worst[3 * n + 2])


def _log_plan(ring: BlockRing, plan: ResidencyPlan, costs: RingCosts) -> None:
    streamed = len(ring.layouts) - len(plan.resident)
    logger.info(
        "%s: residency plan from a measured forward: %d of %d blocks resident (%s), %d streamed "
        "(%d of them keeping %s of their largest tensors on the device) through %d slots (%s); "
        "predicted forward %.1f ms, %.3fx resident (%.1f ms); budget %s",
        ring.component.name, len(plan.resident), len(ring.layouts),
        format_bytes(sum(ring.resident_nbytes(i) for i in plan.resident)), streamed, len(plan.kept),
        format_bytes(sum(b for _, b in plan.kept)), ring.num_slots,
        format_bytes(sum(s.numel() for s in ring.slots)), plan.predicted_ms, plan.predicted_ratio or 0.0,
        costs.resident_ms, format_bytes(ring.budget or 0))
