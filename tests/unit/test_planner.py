"""The residency planner (``residency.py``): its simulation against the real ring's decisions,
the plans it makes within a budget, and size parsing."""

from __future__ import annotations

import functools
import random

import pytest
import torch
from toys import ToyDiT

from omni_dist_offload.config import OffloadConfig
from omni_dist_offload.hostmem import HostBuffer
from omni_dist_offload.layout import align, layout_block
from omni_dist_offload.models import PRESETS, build_model
from omni_dist_offload.plan import discover
from omni_dist_offload.residency import (
    pick_resident,
    RingCosts,
    image_slot_bytes,
    min_budget,
    parse_bytes,
    plan_fewest,
    plan_residency,
    prior_costs,
    simulate,
)
from omni_dist_offload.ring import BlockRing
from omni_dist_offload.transfer import RankLocalTransfer, TransferStreams


# -- the simulation is the ring ------------------------------------------------------------------
def _ring_program(n: int, resident: set[int], slots: int, forwards: int,
                  kept: dict[int, int] | None = None) -> list[tuple]:
    """What the real ring enqueues, forward after forward, as a host-ordered program:
    ("fill", block, slot) on the copy stream (wait free[slot], copy, record ready[slot]) and
    ("run", block, slot) on the compute stream (wait ready[slot] unless resident, compute, record
    free[slot]). Recorded from a BlockRing on the CPU. ``kept``: streamed blocks that keep this
    many leading bytes on the device (one of the ring's cuts)."""
    model = ToyDiT(n)
    (comp,) = discover(model, OffloadConfig.parse({"mode": "layer"}))
    layouts = [layout_block(i, name, b) for i, (name, b) in enumerate(comp.blocks)]
    buffers = [HostBuffer(l.nbytes) if l.index not in resident else None for l in layouts]
    for l, b in zip(layouts, buffers):
        if b is not None:
            for e in l.entries:
                e.view_in(b.tensor).copy_(e.tensor.detach())
    parked = [[e.view_in(b.tensor) for e in l.entries] if b is not None else None for l, b in zip(layouts, buffers)]
    on_device = {i: torch.cat([e.tensor.detach().reshape(-1).view(torch.uint8) for e in layouts[i].entries])
                 for i in resident}
    for i in resident:  # a device buffer laid out like the host one
        buf = torch.empty(layouts[i].nbytes, dtype=torch.uint8)
        for e in layouts[i].entries:
            e.view_in(buf).copy_(e.tensor.detach())
        on_device[i] = buf
    transfer = RankLocalTransfer(buffers, [l.nbytes for l in layouts], TransferStreams(), torch.device("cpu"))
    ring = BlockRing(comp, layouts, transfer, torch.device("cpu"), parked, on_device, num_slots=slots)
    if kept:
        ring.apply_plan(resident, slots, settle=False, kept=kept)
    program: list[tuple] = []
    real_fill = ring._fill

    def fill(block, slot):
        program.append(("fill", block, slot))
        real_fill(block, slot)

    ring._fill = fill
    ring.install_hooks()
    # Prepended after the ring's, so it runs before the ring's pre-forward: the host is there.
    first = [b.register_forward_pre_hook(lambda m, a, i=i: program.append(("pre", i, -1)), prepend=True)
             for i, b in enumerate(model.blocks)]
    hooks = [*first, *[b.register_forward_pre_hook(lambda m, a, i=i: program.append(("run", i, ring._current_slot)))
             for i, b in enumerate(model.blocks)]]
    with torch.no_grad():
        for _ in range(forwards):
            program.append(("forward",))
            model(torch.randn(2, 8))
    for h in hooks:
        h.remove()
    ring.release()
    return program


def _stream_times(program, compute, copy, pre, post, gap, issued) -> list[float]:
    """Run the program under CUDA semantics: each stream runs its operations in order; a wait
    holds its stream until the event's latest record *at the time the wait was enqueued* has
    been reached. The host joins the device between forwards (as a loop that synchronises
    does): nothing enqueued for a forward starts before that forward does, and the compute
    stream idles ``gap`` between forwards. The host (a third stream) reaches block ``b``'s
    pre-forward ``issued[b]`` after its forward started; the fills it enqueues there wait for
    it. Returns when each forward started, and the end."""
    ops = {"c": [], "x": [], "h": []}
    latest: dict[tuple, int] = {}  # event -> token of its latest record (in host order)
    tokens: list[float | None] = []

    def record(stream, event):
        tokens.append(None)
        latest[event] = len(tokens) - 1
        ops[stream].append(("record", latest[event]))

    def wait(stream, event):
        if event in latest:
            ops[stream].append(("wait", latest[event]))

    for k, op in enumerate(program):
        if op[0] == "forward":  # the previous forward's tail, the boundary, this forward's head
            if k:
                ops["c"].append(("work", post))
                ops["c"].append(("work", gap))
            ops["c"].append(("mark", None))
            record("c", ("forward", k))
            wait("h", ("forward", k))  # the host starts the forward once the device is there
            host_at = 0.0
            ops["c"].append(("work", pre))
            continue
        kind, block, slot = op
        if kind == "pre":  # the host reaches the pre-forward of this block
            ops["h"].append(("work", issued[block] - host_at))
            host_at = issued[block]
            record("h", ("host", k))
            wait("x", ("host", k))
            k_pre = k
            continue
        if kind == "fill":
            wait("x", ("free", slot))
            ops["x"].append(("work", copy[block]))
            record("x", ("ready", slot))
        else:
            wait("c", ("host", k_pre))  # the block's kernels are launched after its pre-forward
            if slot >= 0:
                wait("c", ("ready", slot))
            ops["c"].append(("work", compute[block]))
            if slot >= 0:
                record("c", ("free", slot))
    ops["c"].append(("work", post))
    ops["c"].append(("mark", None))
    clock = {"c": 0.0, "x": 0.0, "h": 0.0}
    pos = {"c": 0, "x": 0, "h": 0}
    marks: list[float] = []
    progress = True
    while progress:
        progress = False
        for s in ("c", "x", "h"):
            while pos[s] < len(ops[s]):
                kind, arg = ops[s][pos[s]]
                if kind == "wait":
                    if tokens[arg] is None:
                        break
                    clock[s] = max(clock[s], tokens[arg])
                elif kind == "work":
                    clock[s] += arg
                elif kind == "record":
                    tokens[arg] = clock[s]
                else:
                    marks.append(clock[s])
                pos[s] += 1
                progress = True
    assert all(pos[s] == len(ops[s]) for s in ops), "the program deadlocked"
    return marks  # where each forward started, and where the last ended


@pytest.mark.parametrize("case", range(16))
def test_the_simulation_predicts_the_timeline_the_ring_enqueues(case):
    rnd = random.Random(case)
    n = rnd.randint(3, 7)
    slots = rnd.choice([2, 2, 3, 4])
    resident = set(rnd.sample(range(n), rnd.randint(0, n - slots - 1) if n - slots - 1 > 0 else 0))
    compute = [rnd.uniform(0.2, 2.0) for _ in range(n)]
    copy = [rnd.uniform(0.2, 4.0) for _ in range(n)]
    pre, post, gap = rnd.uniform(0, 1), rnd.uniform(0, 1), rnd.choice([0.0, rnd.uniform(0, 3)])
    # When the host reaches each pre-forward: from the forward's start, later block by block
    # (all 0: a host that is never late).
    issued = [0.0] * n if case % 2 else sorted(rnd.uniform(0, 2 * sum(compute)) for _ in range(n))
    forwards = 6
    program = _ring_program(n, resident, slots, forwards)
    marks = _stream_times(program, compute, copy, pre, post, gap, issued)
    steady = marks[-1] - marks[-2]  # the last forward, from its start to its end
    costs = RingCosts(tuple([1] * n), tuple([1] * n), tuple(compute), tuple(copy), pre_ms=pre, post_ms=post,
                      gap_ms=gap, issued_ms=tuple(issued))
    assert simulate(costs, resident, slots) == pytest.approx(steady, rel=1e-9, abs=1e-9)


@pytest.mark.parametrize("case", range(8))
def test_the_simulation_predicts_a_ring_whose_blocks_keep_a_part(case):
    """Streamed blocks that keep their first tensors on the device: the ring fills only the rest
    (a copy in proportion to the bytes, in the simulation) through smaller slots."""
    rnd = random.Random(100 + case)
    n = rnd.randint(4, 7)
    slots = rnd.choice([2, 3])
    resident = set(rnd.sample(range(n), rnd.randint(0, max(0, n - slots - 2))))
    sizes = [layout_block(i, f"blocks.{i}", b).nbytes for i, b in enumerate(ToyDiT(n).blocks)]
    cuts = [tuple(e.offset for e in layout_block(i, f"blocks.{i}", b).entries[1:])
            for i, b in enumerate(ToyDiT(n).blocks)]
    kept = {i: rnd.choice(cuts[i]) for i in range(n) if i not in resident and rnd.random() < 0.6}
    compute = [rnd.uniform(0.2, 2.0) for _ in range(n)]
    copy = [rnd.uniform(0.2, 4.0) for _ in range(n)]
    pre, post, gap = rnd.uniform(0, 1), rnd.uniform(0, 1), rnd.uniform(0, 2)
    costs = RingCosts(tuple(sizes), tuple(sizes), tuple(compute), tuple(copy), pre_ms=pre, post_ms=post,
                      gap_ms=gap, cuts=tuple(cuts))
    moved = [costs.streamed_ms(i, kept.get(i, 0)) for i in range(n)]
    program = _ring_program(n, resident, slots, 6, kept)
    marks = _stream_times(program, compute, moved, pre, post, gap, [0.0] * n)
    assert simulate(costs, resident, slots, kept) == pytest.approx(marks[-1] - marks[-2], rel=1e-9, abs=1e-9)


# -- plans ----------------------------------------------------------------------------------------
def _flux_like(blocks: int = 19, copy_scale: float = 1.0) -> RingCosts:
    """A third of the blocks large (680 MB, 4.85 ms), the rest small (283 MB, 2.23 ms), copied at 55 GB/s."""
    double = round(blocks / 3)
    nbytes = [680 * 10**6] * double + [283 * 10**6] * (blocks - double)
    compute = [4.85] * double + [2.23] * (blocks - double)
    copy = [b / 55e9 * 1e3 * copy_scale for b in nbytes]
    return RingCosts(tuple(nbytes), tuple(nbytes), tuple(compute), tuple(copy), pre_ms=1.0, post_ms=0.5)


def test_plans_stay_within_the_budget_and_more_budget_is_never_slower():
    costs = _flux_like()
    total = sum(costs.nbytes)
    last = None
    for share in [0.18, 0.25, 0.4, 0.5, 0.6, 0.75, 0.85, 0.95, 1.0]:
        budget = max(int(share * total), min_budget(costs.nbytes, costs.slot_bytes))
        plan = plan_residency(costs, budget)
        streamed = [i for i in range(len(costs.nbytes)) if i not in plan.resident]
        used = sum(costs.nbytes[i] for i in plan.resident) + plan.slots * max((costs.slot_bytes[i] for i in streamed), default=0)
        assert used == plan.device_bytes <= budget
        assert plan.predicted_ms == pytest.approx(simulate(costs, plan.resident, plan.slots)) if streamed else True
        if last is not None:
            assert plan.predicted_ms <= last + 1e-9
        last = plan.predicted_ms
    assert plan.resident == tuple(range(len(costs.nbytes))) and plan.slots == 0 and plan.predicted_ratio == 1.0


def _with_cuts(costs: RingCosts, pieces: int = 16) -> RingCosts:
    """The same ring, every block splittable into ``pieces`` equal parts."""
    cuts = tuple(tuple(b * k // pieces for k in range(1, pieces)) for b in costs.slot_bytes)
    return RingCosts(costs.nbytes, costs.slot_bytes, costs.compute_ms, costs.copy_ms, pre_ms=costs.pre_ms,
                     post_ms=costs.post_ms, cuts=cuts)


def test_blocks_that_keep_a_part_beat_whole_blocks_within_the_same_budget():
    whole, split = _flux_like(), _with_cuts(_flux_like())
    total = sum(whole.nbytes)
    for share in (0.25, 0.5, 0.6, 0.7, 0.75, 0.85):
        budget = int(share * total)
        a, b = plan_residency(whole, budget), plan_residency(split, budget)
        assert b.predicted_ms <= a.predicted_ms + 1e-9, share
        kept = dict(b.kept)
        streamed = [i for i in range(len(split.nbytes)) if i not in b.resident]
        slot = max(split.slot_bytes[i] - kept.get(i, 0) for i in streamed)
        used = sum(split.nbytes[i] for i in b.resident) + sum(kept.values()) + b.slots * slot
        assert used == b.device_bytes <= budget and not set(kept) & set(b.resident)
        assert all(c in split.cuts[i] for i, c in kept.items())
        assert b.predicted_ms == pytest.approx(simulate(split, b.resident, b.slots, kept))
    # Flux-shaped, copies 2.5x compute: 70% of the bytes is enough when every block streams
    # what its neighbours' compute hides; whole blocks are still far off there.
    at70 = plan_residency(split, int(0.7 * total))
    assert at70.predicted_ratio <= 1.01 and at70.kept
    assert plan_residency(whole, int(0.7 * total)).predicted_ratio > 1.1


@functools.cache
def _flux12b_layouts():
    """One double- and one single-stream block of Flux-12B, real diffusers classes at real size
    (uninitialised memory: only the shapes are read), as the ring lays them out."""
    model = build_model(PRESETS["flux-12b"], 2, torch.device("meta"), torch.bfloat16).to_empty(device="cpu")
    (comp,) = discover(model, OffloadConfig.parse({"mode": "layer"}))
    return [layout_block(i, name, b) for i, (name, b) in enumerate(comp.blocks)]


def _module_order_cuts(layout) -> tuple[int, ...]:
    """The cuts the block would offer laid out in module order (as it was before)."""
    rank = {id(t): k for k, t in enumerate(t for m in layout.module.modules()
                                           for t in (*m._parameters.values(), *m._buffers.values()) if t is not None)}
    offset, cuts = 0, []
    for e in sorted(layout.entries, key=lambda e: rank[id(e.tensor)]):
        if offset:
            cuts.append(offset)
        offset = align(offset + e.nbytes)
    return tuple(cuts)


def _flux12b_at_512px(module_order: bool = False) -> RingCosts:
    """Flux-12B's 19 blocks (6 double-, 13 single-stream), computing as at 512 px on an H200,
    where a block copies in about six times its compute."""
    double, single = _flux12b_layouts()
    layouts = [double] * 6 + [single] * 13
    nbytes = tuple(l.nbytes for l in layouts)
    cuts = tuple(_module_order_cuts(l) if module_order else tuple(e.offset for e in l.entries[1:]) for l in layouts)
    compute = tuple(21.9 * b / sum(nbytes) for b in nbytes)
    copy = tuple(b / 55.47e9 * 1e3 for b in nbytes)
    return RingCosts(nbytes, nbytes, compute, copy, cuts=cuts)


def test_parts_are_sized_to_what_the_compute_hides_where_copies_are_slow():
    # At 85% of the bytes the parts that stream must be small (54 MiB of a 270 MiB single-stream
    # block, about 90 of a 648 MiB double-stream one). Laid out largest first, a block's tail
    # is its 18 MiB attention weights, so it can stream any multiple of 18 MiB up to 144; in
    # module order a double-stream block streamed 72 or 144 MiB, and the plan came out at 1.29x.
    costs = _flux12b_at_512px()
    plan = plan_residency(costs, int(0.85 * sum(costs.nbytes)))
    assert plan.kept and plan.predicted_ratio < 1.2
    kept = dict(plan.kept)
    parts = {costs.slot_bytes[i] - kept.get(i, 0) for i in range(19) if i not in plan.resident}
    assert min(parts) < 60 * 2**20 < max(parts)
    before = _flux12b_at_512px(module_order=True)
    assert plan_residency(before, int(0.85 * sum(before.nbytes))).predicted_ratio > 1.25
    # Biases and norm weights come first, so a streamed part is weights only: few tensors to
    # rebind at every use.
    double, single = _flux12b_layouts()
    for layout in (double, single):
        big = [e for e in layout.entries if e.nbytes >= 2**20]
        assert layout.entries[-len(big):] == tuple(sorted(big, key=lambda e: -e.nbytes))


def test_a_third_slot_is_bought_where_it_beats_a_resident_block():
    # Uneven compute (alternating short and long blocks) with copies as long as the average
    # block: two slots expose the copy behind every short block, three absorb it.
    n = 12
    costs = RingCosts(tuple([100] * n), tuple([100] * n), tuple([0.4, 1.6] * (n // 2)), tuple([1.0] * n))
    two, three = simulate(costs, (), 2), simulate(costs, (), 3)
    assert three < two
    plan = plan_residency(costs, 300)  # three slots, or two slots and one resident block
    assert plan.slots == 3 and plan.resident == ()


def test_the_fewest_resident_blocks_within_the_tolerance():
    costs = _flux_like()
    total = sum(costs.nbytes)
    fewest = plan_fewest(costs, total - 1, tolerance=0.01)
    assert fewest.predicted_ratio <= 1.01
    # No plan with fewer device bytes meets the tolerance (within what the search considers).
    tighter = plan_residency(costs, fewest.device_bytes - 1)
    assert tighter.predicted_ratio > 1.01
    # When nothing streamed comes within the tolerance and it all fits, it all stays.
    slow = _flux_like(copy_scale=50.0)
    assert plan_fewest(slow, total, tolerance=0.01).resident == tuple(range(len(slow.nbytes)))


def test_below_two_slots_of_the_largest_block_is_refused():
    costs = _flux_like()
    assert min_budget(costs.nbytes, costs.slot_bytes) == 2 * max(costs.slot_bytes)
    with pytest.raises(ValueError, match="below the .* the ring needs at least"):
        plan_residency(costs, min_budget(costs.nbytes, costs.slot_bytes) - 1)


def test_the_smallest_budget_keeps_large_or_few_blocks_resident_where_that_takes_less():
    """One large block among small ones: resident, with two small slots, takes less than two
    slots of it; a single block takes less resident than in two slots. Both plan at that budget."""
    uneven = [26880] + [1536] * 7
    assert min_budget(uneven, uneven) == 26880 + 2 * 1536 < 2 * 26880
    plan = plan_residency(prior_costs(uneven, uneven, 26880 + 2 * 1536), 26880 + 2 * 1536)
    assert plan.resident == (0,) and plan.slots == 2 and plan.device_bytes == 26880 + 2 * 1536
    assert min_budget([13568], [13568]) == 13568
    assert plan_residency(prior_costs([13568], [13568], 13568), 13568).resident == (0,)
    # A ring of 8-bit images (1024-byte images, 2048-byte blocks upcast): two slots of the
    # largest block and two staging buffers of an image, or every image kept and the two slots
    # (no staging: nothing streams), whichever is smaller.
    slots = image_slot_bytes([2048] * 3, [1024] * 3)
    assert min_budget([1024] * 3, slots, run_slot_bytes=2048) == 2 * 2048 + 2 * 1024
    assert min_budget([1024], slots[:1], run_slot_bytes=2048) == 1024 + 2 * 2048


def test_a_prior_plan_spreads_the_streamed_blocks_and_predicts_nothing():
    nbytes = [100] * 10
    prior = prior_costs(nbytes, nbytes, 600)
    assert not prior.measured
    plan = plan_residency(prior, 600)
    assert plan.predicted_ratio is None and plan.device_bytes <= 600
    streamed = [i for i in range(10) if i not in plan.resident]
    assert len(streamed) == 6 and plan.slots in (2, 3, 4)
    gaps = [(b - a) % 10 for a, b in zip(streamed, streamed[1:] + streamed[:1])]
    assert max(gaps) <= 3  # spread through the ring, not bunched


def test_a_count_of_resident_blocks_keeps_the_ones_that_shorten_the_forward_most():
    """``resident_blocks`` as a count: the planner picks which. Flux-12B's 6 dual-stream blocks
    (680 MB) and 13 single-stream ones (283 MB), at its measured 1024 px compute (4.6 and 2.35 ms)
    and 55 GB/s: the pick, made from sizes alone, predicts a forward 5-14% shorter than spreading
    the same count evenly (which keeps single-stream blocks and streams dual-stream ones)."""
    nbytes = [680] * 6 + [283] * 13
    measured = RingCosts(tuple(nbytes), tuple(nbytes), (4.6,) * 6 + (2.35,) * 13, tuple(b / 55 for b in nbytes))
    for count in (5, 6, 8):
        picked = pick_resident(nbytes, nbytes, count)
        even = [int((j + 0.5) * 19 / count) for j in range(count)]
        assert len(picked) == count and picked != tuple(even)
        assert simulate(measured, picked, 2) < 0.95 * simulate(measured, even, 2), count
    # Blocks all of one size: any even spread is as good as another, so the even one.
    assert pick_resident([100] * 10, [100] * 10, 5) == (1, 3, 5, 7, 9)
    assert pick_resident([100] * 10, [100] * 10, 0) == ()
    for bad in (-1, 10):
        with pytest.raises(ValueError, match="0 to 9"):
            pick_resident([100] * 10, [100] * 10, bad)


@pytest.mark.parametrize("value, expected", [(0, 0), (1536, 1536), ("24GiB", 24 * 2**30), ("512MiB", 512 * 2**20),
                                             ("40GB", 40 * 10**9), ("1.5 gib", int(1.5 * 2**30)), ("7", 7),
                                             # Exact: through a float, 2.01 GB was one byte short.
                                             ("2.01GB", 2_010_000_000), ("2.07MB", 2_070_000)])
def test_sizes_parse(value, expected):
    assert parse_bytes(value, "device_budget") == expected


@pytest.mark.parametrize("value", [-1, 1.5, True, "", "24 parsecs", "GiB", None, [1]])
def test_bad_sizes_name_the_key_and_value(value):
    with pytest.raises(ValueError, match=r"config key 'device_budget'"):
        parse_bytes(value, "device_budget")


@pytest.mark.parametrize("value", [-1, "-1", "-2GiB"])
def test_negative_sizes_say_so_as_ints_and_strings_alike(value):
    # The CLI passes strings, the API ints: one message for both.
    with pytest.raises(ValueError, match=r"cannot be negative"):
        parse_bytes(value, "device_budget")


@pytest.mark.parametrize("value", ["auto", "AUTO", " Auto "])
def test_auto_is_read_in_any_case(value):
    config = OffloadConfig.parse({"mode": "layer", "device_budget": value, "activation_reserve": "1GiB"})
    assert config.device_budget == "auto" and config.activation_reserve == 2**30
