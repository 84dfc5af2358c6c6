"""``layer_options.<component>.resident_blocks``: blocks that stay on the device instead of
streaming, bitwise equal to the resident model, with no host copy."""

from __future__ import annotations

import pytest
import torch

import tiny_models as tiny
from omni_dist_offload import OffloadConfig, OffloadConfigError, apply_offload
from omni_dist_offload.plan import module_bytes
from toys import ToyDiT


def _cfg(resident, component: str = "dit") -> dict:
    return {"mode": "layer", "components": [component],
            "layer_options": {component: {"resident_blocks": resident}}}


@pytest.mark.parametrize("resident, expected", [([1, 3], [1, 3]), ([4, 0], [0, 4]), (2, [1, 3]), (1, [2]),
                                                (4, [0, 1, 3, 4]), (0, [])])
def test_resident_blocks_stay_put_and_outputs_stay_bitwise_equal(resident, expected):
    model = ToyDiT(5)
    x = torch.randn(2, 8)
    ref = model(x)
    handle = apply_offload(model, _cfg(resident))
    (row,) = handle.summary_rows()
    assert row.resident_blocks == expected and row.num_blocks == 5 - len(expected)
    assert row.resident_bytes == sum(module_bytes(model.blocks[i]) for i in expected)
    assert row.block_bytes + row.resident_bytes == sum(module_bytes(b) for b in model.blocks)
    # Only the streamed blocks have host buffers (the toy's blocks are all of one size).
    full = apply_offload(ToyDiT(5), _cfg(None))
    assert row.host_bytes * 5 == full.summary_rows()[0].host_bytes * (5 - len(expected))
    full.remove()
    def storage(i):
        return [p.data_ptr() for p in model.blocks[i].parameters()]

    before = {i: storage(i) for i in range(5)}
    seen = {i: set() for i in range(5)}
    # A pre-hook registered after the ring's sees what the block runs with.
    hooks = [b.register_forward_pre_hook(lambda m, a, i=i: seen[i].add(tuple(storage(i))))
             for i, b in enumerate(model.blocks)]
    with torch.no_grad():
        for _ in range(3):  # across the wrap to block 0
            assert torch.equal(model(x), ref)
    for h in hooks:
        h.remove()
    for i in range(5):  # resident blocks run from where they stay; streamed ones from a slot
        assert (seen[i] == {tuple(before[i])}) == (i in expected)
    handle.remove()
    with torch.no_grad():
        assert torch.equal(model(x), ref)


def test_a_wan_pipeline_with_resident_dit_and_encoder_blocks_is_bitwise_equal():
    def run(pipe):
        return pipe(prompt="a red fox", generator=torch.Generator().manual_seed(0), output_type="pt",
                    **tiny.TINY_WAN_DEFAULTS).frames

    ref = run(tiny.tiny_wan_pipeline(seed=1))
    pipe = tiny.tiny_wan_pipeline(seed=1)
    cfg = {"mode": "layer", "components": ["dit", "text_encoder"],
           "layer_options": {"dit": {"resident_blocks": [1]}, "text_encoder": {"resident_blocks": 1}}}
    handle = apply_offload(pipe, cfg)
    assert {r.component: r.resident_blocks for r in handle.summary_rows()} == {"transformer": [1], "text_encoder": [1]}
    assert torch.equal(run(pipe), ref) and torch.equal(run(pipe), ref)
    handle.remove()


@pytest.mark.parametrize("resident, message", [
    (5, "resident_blocks is 5, but the component has 5 blocks: keep at most 4"),
    ([0, 5], "lists [5], but the component has 5 blocks (indices 0 to 4)"),
    ([0, 1, 2, 3, 4], "lists every block of the component"),
])
def test_out_of_range_is_an_error_before_anything_changes(resident, message):
    model = ToyDiT(5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(OffloadConfigError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(").replace(")", r"\)")) as info:
        apply_offload(model, _cfg(resident))
    assert "layer_options.dit.resident_blocks" in str(info.value)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not any(b._forward_pre_hooks for b in model.blocks)


@pytest.mark.parametrize("value", [-1, True, 1.5, "2", [1, 1], [0, -2], [0, 1.0], {"a": 1}])
def test_bad_values_name_the_key(value):
    with pytest.raises(OffloadConfigError, match="layer_options.dit key 'resident_blocks'"):
        OffloadConfig.parse(_cfg(value))


def test_the_config_round_trips():
    cfg = OffloadConfig.parse(_cfg([3, 1]))
    assert cfg.options_for("dit").resident_blocks == (1, 3)
    assert cfg.to_dict()["layer_options"]["dit"]["resident_blocks"] == [1, 3]
    assert OffloadConfig.parse(cfg.to_dict()) == cfg
