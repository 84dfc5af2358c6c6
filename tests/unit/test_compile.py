"""torch.compile on streamed models (CPU): the ring's hooks stay outside compiled regions, so
regional compilation after ``apply_offload`` compiles the same graphs as on the resident model,
never recompiles as slots alternate and the ring wraps, and matches it bitwise."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import tiny_models as tiny
from omni_dist_offload import apply_offload


def _eager(num_layers: int) -> tuple[torch.nn.Module, dict, torch.Tensor]:
    """A tiny Wan DiT, its inputs, and its eager output."""
    model = tiny.tiny_wan_transformer(num_layers=num_layers)
    batch = tiny.wan_transformer_inputs(model)
    with torch.no_grad():
        ref = model(**batch)[0]
    return model, batch, ref


def _regional(offload: dict | None, fullgraph: bool = False) -> tuple[list[torch.Tensor], dict]:
    torch._dynamo.reset()
    counters.clear()
    model = tiny.tiny_wan_transformer(num_layers=4)
    batch = tiny.wan_transformer_inputs(model)
    handle = apply_offload(model, offload) if offload is not None else None
    model.compile_repeated_blocks(fullgraph=fullgraph)
    with torch.no_grad():
        # Across the wrap to block 0, and (under a budget) across the re-plan after the second.
        outs = [model(**batch)[0] for _ in range(4)]
    stats = dict(counters["stats"])
    if handle is not None:
        (row,) = handle.summary()
        stats["streamed_blocks"] = row["num_blocks"]
        handle.remove()
    return outs, stats


@pytest.mark.parametrize(("offload", "fullgraph"), [({"mode": "layer"}, False),
                                                   ({"mode": "layer", "device_budget": "96KiB"}, False),
                                                   ({"mode": "layer", "device_budget": "96KiB"}, True)],
                         ids=["streamed", "budget", "budget-fullgraph"])
def test_regional_compile_after_offload_matches_compiled_resident(offload, fullgraph):
    """fullgraph: the block's graph holds no break, so the ring's hooks (run eagerly, lock and
    all) must never be traced."""
    ref, resident = _regional(None, fullgraph)
    outs, streamed = _regional(offload, fullgraph)
    assert streamed["streamed_blocks"] >= 2  # under the budget: one block resident, the rest streamed
    assert all(torch.equal(a, b) for a, b in zip(outs, ref))
    # The same graphs as the compiled resident model: streaming adds none, and none recompiles.
    assert streamed["unique_graphs"] == resident["unique_graphs"]
    assert streamed["calls_captured"] == resident["calls_captured"]


def test_omni_compiles_the_dit_after_offloading_and_reports_compile_time_apart():
    from omni_dist_offload import Omni

    kwargs = dict(prompt="a red fox", seed=0, num_inference_steps=2)
    torch._dynamo.reset()  # compiled code is shared in a process: start from none
    with Omni("tiny-wan", {"mode": "layer", "components": ["dit", "text_encoder"]}, compile=True) as omni:
        assert omni.compile == "regional" and omni.compiled == ["transformer"]
        first = omni.generate(**kwargs)
        second = omni.generate(**kwargs)
    with Omni("tiny-wan", None, compile="regional") as resident:
        ref = resident.generate(**kwargs).frames
    assert (first.frames == ref).all() and (second.frames == ref).all()
    timings = first.metadata["timings"]
    assert first.metadata["compile"] == "regional" and timings["compile_s"] > 0
    assert second.metadata["timings"]["compile_s"] == 0  # compiled once: nothing recompiles
    assert timings["generation_s"] > 0


@pytest.mark.parametrize("value", ["fast", 1, "max-autotune"])
def test_a_bad_compile_mode_is_refused_before_loading(value):
    from omni_dist_offload import Omni

    with pytest.raises(ValueError, match=r"compile=.*use True or \"regional\""):
        Omni("tiny-wan", None, compile=value)


def test_offloading_an_already_compiled_model():
    """compile_repeated_blocks() first, apply_offload after: the hooks added later run outside
    the compiled blocks too; bitwise equal, no graph beyond the compiled resident model's."""
    ref, resident = _regional(None)
    torch._dynamo.reset()
    counters.clear()
    model = tiny.tiny_wan_transformer(num_layers=4)
    batch = tiny.wan_transformer_inputs(model)
    model.compile_repeated_blocks(fullgraph=False)
    handle = apply_offload(model, {"mode": "layer"})
    with torch.no_grad():
        outs = [model(**batch)[0] for _ in range(4)]
    assert all(torch.equal(a, b) for a, b in zip(outs, ref))
    assert counters["stats"]["unique_graphs"] == resident["unique_graphs"]
    handle.remove()
    with torch.no_grad():
        assert torch.equal(model(**batch)[0], ref[0])


def test_cuda_graphs_are_refused_before_anything_changes():
    """mode="reduce-overhead" records weight addresses that streaming moves: refused by
    apply_offload (compiled first) with the modes that work, the model left as it was."""
    model = tiny.tiny_wan_transformer(num_layers=3)
    model.compile_repeated_blocks(mode="reduce-overhead")
    before = [p.data_ptr() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"transformer block blocks.0 was compiled with CUDA graphs.*max-autotune-no-cudagraphs"):
        apply_offload(model, {"mode": "layer"})
    assert [p.data_ptr() for p in model.parameters()] == before
    assert not model.blocks[0]._forward_pre_hooks


@pytest.mark.parametrize("how", ["backend", "layer"])
def test_cuda_graphs_by_dynamo_s_backend_or_inside_a_block_are_refused(how):
    """backend="cudagraphs", and a layer inside a block compiled with CUDA graphs, record the
    addresses streaming moves as well."""
    model = tiny.tiny_wan_transformer(num_layers=3)
    if how == "backend":
        model.blocks[1].compile(backend="cudagraphs")
        where = "transformer block blocks.1 was compiled"
    else:
        model.blocks[1].ffn.compile(mode="reduce-overhead")
        where = "transformer block blocks.1's ffn was compiled"
    before = [p.data_ptr() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=f"{where} with CUDA graphs"):
        apply_offload(model, {"mode": "layer"})
    assert [p.data_ptr() for p in model.parameters()] == before


def test_cuda_graphs_compiled_after_offload_are_refused_at_the_first_forward():
    model, batch, ref = _eager(num_layers=3)
    handle = apply_offload(model, {"mode": "layer"})
    model.compile(mode="reduce-overhead")
    with pytest.raises(RuntimeError, match=r"transformer was compiled with CUDA graphs"), torch.no_grad():
        model(**batch)
    # Compiled again without CUDA graphs (aot_eager: eager kernels), the ring runs on as before.
    torch._dynamo.reset()
    model.compile(backend="aot_eager")
    with torch.no_grad():
        assert all(torch.equal(model(**batch)[0], ref) for _ in range(2))
    handle.remove()


def test_whole_model_compile_splits_at_the_blocks_and_never_recompiles():
    """A whole-model graph cannot hold the ring's per-block stream work: Dynamo compiles around
    each block's hooks. With eager kernels (aot_eager) the result is the resident model's,
    bitwise, and after the first forward no graph is added as slots alternate and wrap."""
    torch._dynamo.reset()
    counters.clear()
    model, batch, ref = _eager(num_layers=4)
    handle = apply_offload(model, {"mode": "layer"})
    model.compile(backend="aot_eager")
    graphs = []
    with torch.no_grad():
        for _ in range(4):
            assert torch.equal(model(**batch)[0], ref)
            graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] > 0 and graphs[1:] == [graphs[0]] * 3
    handle.remove()


@pytest.mark.parametrize("order", ["before", "after"])
def test_blocks_replaced_by_torch_compile_wrappers(order):
    """``model.blocks[i] = torch.compile(block)``, before or after offloading: bitwise equal to
    the same on the resident model (aot_eager: eager kernels), one graph; and the same with CUDA
    graphs is refused, after offloading at the first forward."""
    torch._dynamo.reset()
    counters.clear()
    model, batch, ref = _eager(num_layers=4)

    def wrap(**kwargs):
        for i, block in enumerate(list(model.blocks)):
            model.blocks[i] = torch.compile(getattr(block, "_orig_mod", block), **kwargs)

    if order == "before":
        wrap(backend="aot_eager")
    handle = apply_offload(model, {"mode": "layer"})
    if order == "after":
        wrap(backend="aot_eager")
    with torch.no_grad():
        assert all(torch.equal(model(**batch)[0], ref) for _ in range(3))
    assert counters["stats"]["unique_graphs"] == 1
    if order == "after":
        wrap(mode="reduce-overhead")
        with pytest.raises(RuntimeError, match="blocks.0 was compiled with CUDA graphs"), torch.no_grad():
            model(**batch)
    handle.remove()
