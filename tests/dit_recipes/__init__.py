"""Tiny builders for every transformer class diffusers exports (``partN.py``): ``RECIPES``
maps a class name to ``build(seed) -> (model, forward kwargs)``; ``SKIPPED`` names the classes
that cannot be built or run at tiny size on a CPU, with the reason."""

from __future__ import annotations

from . import part1, part2, part3, part4

RECIPES: dict = {}
SKIPPED: dict[str, str] = {}
for _part in (part1, part2, part3, part4):
    RECIPES.update(_part.RECIPES)
    SKIPPED.update(getattr(_part, "SKIPPED", {}))
