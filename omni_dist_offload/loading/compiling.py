"""Compiling a loaded pipeline's DiTs with ``torch.compile``, before or after offloading.

``"regional"`` compiles each transformer block on its own: diffusers'
``compile_repeated_blocks()`` where the class declares its repeated blocks, else
``torch.compile`` on every block of the lists discovery finds. One graph serves every block of a
kind, and a streamed ring's hooks run between compiled blocks (they are excluded from
compilation). ``"model"`` compiles each DiT whole (``nn.Module.compile``); under streaming its
graph breaks at every block's hooks.
"""

from __future__ import annotations

from typing import Any

import torch

from ..config import OffloadConfig
from ..plan import discover

__all__ = ["COMPILE_MODES", "compile_dits", "compile_seconds", "resolve_compile", "uncompile"]

#: What ``compile=`` accepts (``True`` means ``"regional"``).
COMPILE_MODES = ("regional", "model")


def resolve_compile(value: bool | str | None) -> str | None:
    """``compile=`` as a mode name, or None. Raises ``ValueError`` naming the allowed values."""
    if value is None or value is False:
        return None
    if value is True:
        return "regional"
    if isinstance(value, str) and value in COMPILE_MODES:
        return value
    raise ValueError(f"compile={value!r}: use True or \"regional\" (each transformer block compiled on its "
                     "own, the recommended way for DiTs), \"model\" (each DiT whole), or False.")


def compile_dits(target: Any, mode: str) -> list[str]:
    """Compile the DiTs of ``target`` (a pipeline, or a bare DiT) in place; returns their names.
    Compilation itself happens at the first forward."""
    config = OffloadConfig.parse({"mode": "layer", "components": ["dit"]})
    done = []
    for comp in discover(target, config):
        module = comp.module
        if mode == "model":
            module.compile()
        elif getattr(module, "_repeated_blocks", None) and hasattr(module, "compile_repeated_blocks"):
            module.compile_repeated_blocks()
        else:
            for _, block in comp.blocks:
                block.compile()
        done.append(comp.name)
    return done


def uncompile(target: Any) -> None:
    """Undo :func:`compile_dits` on a bare module: every submodule runs eagerly again (the
    compiled code stays in torch's cache, so compiling again is quick)."""
    for module in target.modules():
        if getattr(module, "_compiled_call_impl", None) is not None:
            module._compiled_call_impl = None


def compile_seconds() -> float | None:
    """Seconds torch has spent compiling frames in this process so far (None where this torch
    does not say): the difference around a call is that call's compile time."""
    spent = getattr(torch._dynamo.utils, "calculate_time_spent", None)
    if spent is None:
        return None
    try:
        return float(spent().get("entire_frame_compile", 0.0))
    except Exception:  # a private API: its shape may change between releases
        return None
