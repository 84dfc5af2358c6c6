"""Every text encoder a diffusers pipeline takes streams without a declaration. The classes
come from diffusers itself (the annotations of the pipelines' ``text_encoder*`` arguments), so
a new one fails here until it has a tiny recipe (``tests/encoder_recipes.py``) or a reason."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import types

import diffusers.pipelines as pipelines_pkg
import pytest
import torch
from diffusers import DiffusionPipeline
from encoder_recipes import RECIPES, SKIPPED
from unit.test_dit_classes import _tensors, realistic_share

from omni_dist_offload import OffloadConfig, apply_offload
from omni_dist_offload.plan import discover

CONFIG = {"mode": "layer", "components": ["text_encoder"]}
#: Annotations that name no encoder class.
_NOT_CLASSES = {"None", "PreTrainedModel", "OnnxRuntimeModel"}


def diffusers_text_encoder_classes() -> list[str]:
    """Class names in the annotations of every pipeline's ``text_encoder*`` arguments."""
    names: set[str] = set()
    for info in pkgutil.walk_packages(pipelines_pkg.__path__, pipelines_pkg.__name__ + "."):
        if info.ispkg:
            continue
        try:
            mod = importlib.import_module(info.name)
        except ImportError:  # an optional dependency this environment lacks
            continue
        for cls in vars(mod).values():
            if not (inspect.isclass(cls) and issubclass(cls, DiffusionPipeline) and cls.__module__ == mod.__name__):
                continue
            try:
                params = inspect.signature(cls.__init__).parameters
            except (TypeError, ValueError):
                continue
            for pname, param in params.items():
                if not pname.startswith("text_encoder"):
                    continue
                note = param.annotation
                text = note if isinstance(note, str) else getattr(note, "__name__", None) or str(note)
                for part in text.split("|"):
                    name = part.strip().rsplit(".", 1)[-1]
                    if name.isidentifier() and name[0].isupper() and name not in _NOT_CLASSES:
                        names.add(name)
    return sorted(names)


CLASSES = diffusers_text_encoder_classes()


def test_every_encoder_class_has_a_recipe_or_a_reason():
    missing = [c for c in CLASSES if c not in RECIPES and c not in SKIPPED]
    assert not missing, f"no tiny recipe for {missing}: add one to tests/encoder_recipes.py (or a reason to SKIPPED)"
    assert len(CLASSES) > 20


@pytest.mark.parametrize("name", CLASSES)
def test_a_pipeline_text_encoder_streams_bitwise_equal(name):
    if name not in RECIPES:
        pytest.skip(SKIPPED.get(name, "no recipe"))
    model, kwargs = RECIPES[name](0)
    pipe = types.SimpleNamespace(text_encoder=model)
    (comp,) = discover(pipe, OffloadConfig.parse(CONFIG))
    assert realistic_share(model, [b for _, b in comp.blocks]) >= 0.8, (comp.block_attrs, comp.source)
    with torch.no_grad():
        ref = _tensors(model(**kwargs))
        handle = apply_offload(pipe, CONFIG, device="cpu")
        outs = [_tensors(model(**kwargs)) for _ in range(2)]
        handle.remove()
        after = _tensors(model(**kwargs))
    assert ref and all(len(o) == len(ref) for o in (*outs, after))
    for got in (*outs, after):
        assert all(torch.equal(a, b) for a, b in zip(got, ref)), comp.block_attrs
