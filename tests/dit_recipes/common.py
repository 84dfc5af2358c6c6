"""Helpers the recipe parts share: seeded inputs, refilled zero-initialised weights, Flux-style
position ids."""

from __future__ import annotations

import torch


def randn(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=g)


def fill_zero_params(model: torch.nn.Module, seed: int, std: float = 0.02, salt: int = 7) -> None:
    """Give parameters the class initialises to all zeros (zero-init output heads, gates and
    modulations) small seeded values, so the output is not trivially zero and depends on every
    block."""
    g = torch.Generator().manual_seed(seed + salt)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            if p.numel() and not p.any():
                p.copy_(torch.randn(p.shape, generator=g) * std)


def finish(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Eval mode, zero-initialised weights refilled (:func:`fill_zero_params`)."""
    model = model.eval()
    fill_zero_params(model, seed, salt=12345)
    return model


def flux_like_ids(txt_len: int, h: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flux's (text ids, image ids): zeros for text, (0, row, column) for each image token."""
    txt_ids = torch.zeros(txt_len, 3)
    img_ids = torch.zeros(h, w, 3)
    img_ids[..., 1] = torch.arange(h)[:, None]
    img_ids[..., 2] = torch.arange(w)[None, :]
    return txt_ids, img_ids.reshape(h * w, 3)
