"""diffusers' step caches on streamed models: each cache hook on a rank-local ring gives the
cached resident model's outputs, bitwise, step by step. A cache that skips a block still calls
it (diffusers replaces what runs inside the block): the ring reads the hook's decision and
neither copies nor waits for a block that will not run, and nothing is fetched out of turn."""

from __future__ import annotations

import warnings

import pytest
import torch
from diffusers.hooks import (
    FasterCacheConfig,
    FirstBlockCacheConfig,
    LayerSkipConfig,
    MagCacheConfig,
    PyramidAttentionBroadcastConfig,
    SeaCacheConfig,
    TaylorSeerCacheConfig,
    TextKVCacheConfig,
    apply_layer_skip,
)

import tiny_models as tiny
from omni_dist_offload import apply_offload

STEPS = 8
CLOCK = {"t": 0.0}  # the timestep callbacks of PAB and FasterCache read it


def cache_configs() -> dict:
    return {
        "first-block": (FirstBlockCacheConfig(threshold=0.2), True, 1),
        "mag": (MagCacheConfig(mag_ratios=[1.0] * STEPS, num_inference_steps=STEPS, max_skip_steps=2,
                               retention_ratio=0.25), False, 1),
        "taylorseer-lite": (TaylorSeerCacheConfig(cache_interval=3, disable_cache_before_step=2, use_lite_mode=True,
                                                  taylor_factors_dtype=torch.float32), True, 1),
        "pyramid-attention": (PyramidAttentionBroadcastConfig(
            spatial_attention_block_skip_range=2, cross_attention_block_skip_range=3,
            spatial_attention_timestep_skip_range=(100, 950), cross_attention_timestep_skip_range=(100, 950),
            current_timestep_callback=lambda: CLOCK["t"]), False, 1),
        "faster": (FasterCacheConfig(
            spatial_attention_block_skip_range=2, spatial_attention_timestep_skip_range=(-1, 901),
            unconditional_batch_skip_range=3, unconditional_batch_timestep_skip_range=(-1, 901),
            current_timestep_callback=lambda: CLOCK["t"], tensor_format="BCFHW",
            attention_weight_callback=lambda _: 0.5), False, 2),
        "sea": (SeaCacheConfig(threshold=0.5, residual_order=0), True, 1),
        "text-kv": (TextKVCacheConfig(), True, 1),
        # Skip-layer guidance's hook: blocks 1 and 2 never run their forward.
        "layer-skip": (LayerSkipConfig(indices=[1, 2], fqn="blocks"), False, 1),
    }


class Moves:
    """Per forward of a ring: the blocks it filled (copied or gathered) and, per block, whether
    the block's own forward ran (seen by a hook on its first attention, inside the block)."""

    def __init__(self, handle, model) -> None:
        self.fills: list[list[int]] = [[]]
        self.ran: list[list[int]] = [[]]
        self.ring = ring = handle.rings[0]
        fill = ring.transfer.fill

        def counted(block, *args, **kwargs):
            self.fills[-1].append(block)
            return fill(block, *args, **kwargs)

        ring.transfer.fill = counted
        for i, block in enumerate(model.blocks):
            block.attn1.register_forward_pre_hook(lambda *_, i=i: self.ran[-1].append(i))

    def next_forward(self) -> None:
        self.fills.append([])
        self.ran.append([])


def cached_steps(name: str, offload: dict | None, drift: float = 0.001, cache: bool = True,
                 device: str = "cpu", moves: list | None = None,
                 plan: tuple[tuple[int, ...], int] | None = None) -> list[torch.Tensor]:
    """STEPS forwards of the tiny Wan DiT with cache ``name`` (enabled after offloading), the
    input moving by ``drift`` a step: slowly enough that some steps skip by default. ``moves``:
    a list to append a :class:`Moves` of the (offloaded) forwards to. ``plan``: the resident
    blocks and slot count to give the ring."""
    config, needs_context, batch = cache_configs()[name]
    model = tiny.tiny_wan_transformer(num_layers=4).to(device)
    handle = apply_offload(model, offload) if offload is not None else None
    if plan is not None:
        handle.rings[0].apply_plan(*plan, settle=False)
    if moves is not None:
        moves.append(Moves(handle, model))
    if cache and name == "layer-skip":
        apply_layer_skip(model, config)
    elif cache:
        model.enable_cache(config)
    torch.manual_seed(1)
    base = torch.randn(batch, 16, 2, 8, 8, device=device)
    text = torch.randn(batch, 8, tiny.TINY_TEXT_DIM, device=device)
    outs = []
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a block fetched out of turn would warn
        for s in range(STEPS):
            CLOCK["t"] = 999.0 - s * 125
            kwargs = {"hidden_states": base + drift * s, "timestep": torch.full((batch,), CLOCK["t"], device=device),
                      "encoder_hidden_states": text, "return_dict": False}
            if needs_context and cache:
                with model.cache_context("cond", step_index=s, sigma=1.0 - s / STEPS, num_inference_steps=STEPS):
                    outs.append(model(**kwargs)[0])
            else:
                outs.append(model(**kwargs)[0])
            if moves is not None:
                moves[-1].next_forward()
    if cache and name != "layer-skip":
        model.disable_cache()
    if handle is not None:
        handle.remove()
    return outs


@pytest.mark.parametrize("name", list(cache_configs()))
def test_step_caches_on_a_streamed_model_match_the_cached_resident_model(name):
    ref = cached_steps(name, None)
    got = cached_steps(name, {"mode": "layer"})
    assert [torch.equal(a, b) for a, b in zip(got, ref)] == [True] * STEPS


@pytest.mark.parametrize("plan", [((), 2), ((), 3), ((0,), 2), ((2,), 2)], ids=lambda p: f"resident{list(p[0])}-slots{p[1]}")
@pytest.mark.parametrize("name", ["first-block", "mag", "sea", "layer-skip"])
def test_blocks_a_cache_skips_are_not_copied(name, plan):
    """Rank-local, four blocks: a block whose forward does not run is never filled, except those
    the prefetch issued before the decision was known (the first ``slots`` streamed blocks: a
    cache decides while the first block runs, and what the next forward skips is not known
    before it starts). Outputs stay the cached resident model's, and nothing warns (no on-demand fetch
    out of turn)."""
    resident, slots = plan
    moves = []
    got = cached_steps(name, {"mode": "layer"}, moves=moves, plan=plan)
    ref = cached_steps(name, None)
    assert [torch.equal(a, b) for a, b in zip(got, ref)] == [True] * STEPS
    m = moves[0]
    ran, fills = m.ran[:STEPS], m.fills[:STEPS]
    assert any(r != [0, 1, 2, 3] for r in ran), (name, ran)  # the cache did skip blocks
    streamed = [b for b in range(4) if b not in resident]
    early = set(streamed[:slots])
    for s in range(STEPS):
        wanted = set(ran[s]) | set(ran[s + 1] if s + 1 < STEPS else streamed)
        assert set(fills[s]) - wanted <= early, (name, s, ran, fills)
    assert sum(map(len, fills)) < len(streamed) * STEPS  # skipping saved copies


def test_a_budget_plans_from_the_first_forward_that_ran_every_block(caplog):
    """Under ``device_budget`` the planner measures forward 2, or the first complete one after
    it: here forwards 2 to 4 skip blocks and forward 5 runs them all."""
    from omni_dist_offload.layout import layout_block
    block = layout_block(0, "blocks.0", tiny.tiny_wan_transformer(num_layers=4).blocks[0]).nbytes
    moves = []
    cfg = {"mode": "layer", "components": ["dit"], "device_budget": 3 * block}
    got = cached_steps("first-block", cfg, drift=0.1, moves=moves)
    ref = cached_steps("first-block", None, drift=0.1)
    assert [torch.equal(a, b) for a, b in zip(got, ref)] == [True] * STEPS
    ran = [len(r) for r in moves[0].ran[:STEPS]]
    assert ran[:5] == [4, 1, 1, 1, 4], ran
    ring = moves[0].ring
    assert ring.plan is not None and ring.plan.measured and ring.costs is not None
    assert "keeping the unmeasured" not in caplog.text


def test_a_cache_enabled_before_offloading():
    """The usual pipeline order can also be the other way round: cache first, then offload."""
    config = cache_configs()["first-block"][0]
    model = tiny.tiny_wan_transformer(num_layers=4)
    torch.manual_seed(1)
    x, text = torch.randn(1, 16, 2, 8, 8), torch.randn(1, 8, tiny.TINY_TEXT_DIM)

    def steps() -> list[torch.Tensor]:
        outs = []
        with torch.no_grad():
            for s in range(STEPS):
                with model.cache_context("cond"):
                    outs.append(model(hidden_states=x + 0.1 * s, timestep=torch.full((1,), 999.0 - s),
                                      encoder_hidden_states=text, return_dict=False)[0])
        model._reset_stateful_cache()
        return outs

    model.enable_cache(config)
    ref = steps()
    handle = apply_offload(model, {"mode": "layer"})
    fills = []
    fill = handle.rings[0].transfer.fill
    handle.rings[0].transfer.fill = lambda block, *a, **k: (fills.append(block), fill(block, *a, **k))[1]
    got = steps()
    handle.remove()
    assert [torch.equal(a, b) for a, b in zip(got, ref)] == [True] * STEPS
    assert len(fills) < 4 * STEPS  # the ring saw the cache's skips


def test_a_single_block_dit_whose_head_hook_decides_runs_on_its_weights():
    """On a DiT of one block diffusers puts MagCache's head hook beside the block hook, whose
    state still holds the last forward's decision when the block is called: the block counts as
    running, and is bound. Under 8-bit storage a block left unbound runs on placeholders (NaN on
    the CPU, where the parked copy is on the block's device). The reference: the resident model
    under diffusers' layerwise casting."""
    config, _, _ = cache_configs()["mag"]
    ran = []

    def steps(offload: bool) -> list[torch.Tensor]:
        model = tiny.tiny_wan_transformer(num_layers=1)
        model.blocks[0].attn1.register_forward_pre_hook(lambda *_: ran.append(offload))
        if offload:
            handle = apply_offload(model, {"mode": "layer", "layer_options": {"dit": {"storage_dtype": "float8_e4m3fn"}}})
        else:
            model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
        model.enable_cache(config)
        torch.manual_seed(1)
        base, text = torch.randn(1, 16, 2, 8, 8), torch.randn(1, 8, tiny.TINY_TEXT_DIM)
        outs = []
        with torch.no_grad():
            for s in range(STEPS):
                kwargs = {"hidden_states": base + 0.001 * s, "timestep": torch.full((1,), 999.0 - s * 125),
                          "encoder_hidden_states": text, "return_dict": False}
                outs.append(model(**kwargs)[0])
        if offload:
            handle.remove()
        return outs

    assert [torch.equal(a, b) for a, b in zip(steps(True), steps(False))] == [True] * STEPS
    assert 0 < ran.count(True) == ran.count(False) < STEPS  # the head skipped the block, and ran it
