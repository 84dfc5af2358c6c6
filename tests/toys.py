"""Small hand-written models for ring and layout edge cases."""

from __future__ import annotations

import torch
from torch import nn


class ToyBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.register_buffer("scale", torch.randn(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.lin(x)) * self.scale + x


class ToyDiT(nn.Module):
    """A DiT-shaped model whose forward can run its blocks in any order."""

    _layerwise_offload_blocks_attrs = ["blocks"]

    def __init__(self, num_blocks: int = 3, dim: int = 8, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.proj_in = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(ToyBlock(dim) for _ in range(num_blocks))
        self.proj_out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, order: list[int] | None = None) -> torch.Tensor:
        x = self.proj_in(x)
        for i in order if order is not None else range(len(self.blocks)):
            x = self.blocks[i](x)
        return self.proj_out(x)


class OddBlock(nn.Module):
    """Mixed dtypes, a transposed (non-contiguous) weight, a tied weight and an integer buffer."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 2 * dim, bias=False).to(torch.bfloat16)
        self.down = nn.Linear(2 * dim, dim, bias=False).to(torch.bfloat16)
        self.down.weight = nn.Parameter(self.down.weight.detach().t().contiguous().t())
        self.gate = nn.Linear(dim, dim, bias=False).to(torch.bfloat16)
        self.gate_again = nn.Linear(dim, dim, bias=False).to(torch.bfloat16)
        self.gate_again.weight = self.gate.weight  # tied inside the block
        self.norm = nn.LayerNorm(dim)  # fp32 beside bf16
        self.register_buffer("index", torch.arange(dim))
        self.register_buffer("empty", torch.zeros(0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.down(self.up(x.to(torch.bfloat16))) + self.gate(x.to(torch.bfloat16)) - self.gate_again(x.to(torch.bfloat16))
        return self.norm(h.float())[..., self.index] + x


class OddDiT(nn.Module):
    _layerwise_offload_blocks_attrs = ["blocks"]

    def __init__(self, num_blocks: int = 3, dim: int = 8, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.blocks = nn.ModuleList(OddBlock(dim) for _ in range(num_blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class UnevenBlock(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class UnevenDiT(nn.Module):
    """Blocks of very different sizes in one ring (shards of different sizes)."""

    _layerwise_offload_blocks_attrs = ["blocks"]

    def __init__(self, hiddens: tuple[int, ...] = (8, 64, 3, 200, 16)) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(UnevenBlock(16, h) for h in hiddens)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def snapshot(module: nn.Module) -> dict[str, tuple]:
    """Everything a test needs to say a module is unchanged: identity, values, device, layout."""
    out = {}
    for name, t in list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers(remove_duplicate=False)):
        out[name] = (id(t), t.detach().clone(), t.device, t.stride(), t.dtype)
    return out


def assert_same(before: dict, module: nn.Module) -> None:
    after = snapshot(module)
    assert before.keys() == after.keys()
    for name, (ident, value, device, stride, dtype) in before.items():
        a_ident, a_value, a_device, a_stride, a_dtype = after[name]
        assert a_ident == ident, f"{name} is a different tensor object"
        assert a_device == device and a_dtype == dtype, name
        assert a_stride == stride, f"{name} strides {a_stride} != {stride}"
        assert value.is_meta or torch.equal(a_value, value), f"{name} changed"  # meta has no values
    for m in module.modules():
        assert not m._forward_pre_hooks and not m._forward_hooks, f"hooks left on {type(m).__name__}"
        assert not hasattr(m, "_omni_offload_handle")
