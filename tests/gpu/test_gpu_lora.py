"""LoRA on streamed models, CUDA: adapters loaded after apply_offload reach the device (they
are created beside the parked host copies), and every diffusers LoRA operation matches the
resident pipeline bitwise, in bf16; on two GPUs, fusing into allgather shards."""

from __future__ import annotations

import pytest
import torch

import tiny_models as tiny
from omni_dist_offload import apply_offload
from ranks import run_ranks

pytest.importorskip("peft")
from dist.test_lora_ranks import fused_on_shards  # noqa: E402
from unit.test_lora import lora_sequence, lora_state_dict  # noqa: E402

pytestmark = pytest.mark.gpu


def _pipe():
    pipe = tiny.tiny_wan_pipeline(seed=1)
    pipe.transformer.to(torch.bfloat16)
    return pipe


@pytest.mark.parametrize("config", [
    {"mode": "layer", "components": ["dit", "text_encoder"]},
    {"mode": "layer", "components": ["dit"], "device_budget": "80KiB"},
], ids=["streamed", "budget"])
def test_lora_operations_after_offload_match_the_resident_pipeline_on_cuda(config):
    loras = (lora_state_dict(0), lora_state_dict(1))
    ref = lora_sequence(_pipe().to("cuda"), loras)
    pipe = _pipe()
    handle = apply_offload(pipe, config)
    outs = lora_sequence(pipe, loras)
    for step, expected in ref.items():
        assert torch.equal(outs[step], expected), step
    adapters = [p for n, p in pipe.transformer.named_parameters() if "lora_" in n]
    assert adapters and all(p.device.type == "cuda" for p in adapters)
    handle.remove()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_fuse_into_allgather_shards_on_gpus():
    for r in run_ranks(fused_on_shards, 2, device="cuda", timeout=300):
        assert r["transfer"] == "allgather"
        assert r["equal"] == [True] * 4 and r["state_equal"], r
