"""Every text encoder a diffusers pipeline takes streams without a declaration. The classes
come from diffusers itself (the annotations of the pipelines' ``text_encoder*`` arguments), so
a new one fails here until it has a tiny recipe (``tests/encoder_recipes.py``) or a reason."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import types
from collections.abc import Iterator

import diffusers.pipelines as pipelines_pkg
import pytest
import torch
from diffusers import DiffusionPipeline
from encoder_recipes import RECIPES, SKIPPED
from unit.test_dit_classes import assert_same_outputs, assert_same_tensors, assert_streams_bitwise, realistic_share

from omni_dist_offload import OffloadConfig, apply_offload
from omni_dist_offload.plan import discover

CONFIG = {"mode": "layer", "components": ["text_encoder"]}
#: Annotations that name no encoder class.
_NOT_CLASSES = {"None", "PreTrainedModel", "OnnxRuntimeModel"}


def pipeline_arguments() -> Iterator[tuple[str, str, list[str]]]:
    """``(pipeline class, argument, annotated class names)`` for every argument of every
    diffusers pipeline's ``__init__``."""
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
                note = param.annotation
                text = note if isinstance(note, str) else getattr(note, "__name__", None) or str(note)
                yield cls.__name__, pname, [part.strip().rsplit(".", 1)[-1] for part in text.split("|")]


def diffusers_text_encoder_classes() -> list[str]:
    """Class names in the annotations of every pipeline's ``text_encoder*`` arguments."""
    return sorted({name for _, pname, names in pipeline_arguments() if pname.startswith("text_encoder")
                   for name in names if name.isidentifier() and name[0].isupper() and name not in _NOT_CLASSES})


CLASSES = diffusers_text_encoder_classes()

#: Pipeline attributes holding a DiT or text encoder class that are left resident, and why.
UNNAMED = {
    ("SpectrogramDiffusionPipeline", "decoder"): "a music decoder; 'decoder' names VAEs' halves elsewhere",
    ("StableCascadeDecoderPipeline", "decoder"): "the decoder runs some blocks several times a forward",
    ("StableCascadeCombinedPipeline", "decoder"): "the decoder runs some blocks several times a forward",
}


def test_every_dit_or_text_encoder_a_pipeline_takes_is_named_by_its_attribute():
    """A DiT or text encoder class under an attribute name the fallback does not know goes to
    the device whole (HiDream's 8B ``text_encoder_4``, Ideogram 4's second DiT did)."""
    from omni_dist_offload.plan import DIT_BLOCK_ALTERNATIVES, DIT_BLOCK_ATTRS, ENCODER_BLOCK_ATTRS, name_category

    wrong = []
    for pipeline, pname, names in pipeline_arguments():
        for name in names:
            want = ("dit" if name in DIT_BLOCK_ATTRS or name in DIT_BLOCK_ALTERNATIVES else
                    "text_encoder" if name in ENCODER_BLOCK_ATTRS else None)
            if want and name_category(pname) != want and (pipeline, pname) not in UNNAMED:
                wrong.append((pipeline, pname, name, want))
    assert not wrong, f"(pipeline, attribute, class, category) the name fallback misses: {sorted(set(wrong))}"


def test_every_class_a_pipeline_holds_under_a_dit_or_encoder_name_is_in_the_tables():
    """The other way round: a class under a name the fallback streams has its blocks in the
    tables (or declares them), rather than leaving them to a scan that may refuse it or miss
    lists (Stable Cascade's and Wuerstchen's priors, aMUSEd's transformer did). Abstract
    annotations (``...PreTrainedModel``) name no class to look up."""
    from omni_dist_offload.plan import DIT_BLOCK_ALTERNATIVES, DIT_BLOCK_ATTRS, ENCODER_BLOCK_ATTRS, name_category

    missing = set()
    for pipeline, pname, names in pipeline_arguments():
        category = name_category(pname)
        for name in names:
            if category is None or not (name.isidentifier() and name[0].isupper()) or name in _NOT_CLASSES:
                continue
            if name.endswith("PreTrainedModel") or (pipeline, pname) in UNNAMED:
                continue
            if name not in (ENCODER_BLOCK_ATTRS if category == "text_encoder" else {**DIT_BLOCK_ATTRS, **DIT_BLOCK_ALTERNATIVES}):
                missing.add((pipeline, pname, name))
    assert not missing, f"(pipeline, attribute, class) with no table entry: {sorted(missing)}"


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
    assert_streams_bitwise(model, kwargs, pipe, CONFIG, comp.block_attrs)


@pytest.mark.parametrize("name", CLASSES)
def test_a_transformers_text_encoder_cold_starts_bitwise_equal(name, tmp_path):
    """Saved with ``save_pretrained``, cold-started (the library's meta load, blocks read from
    the safetensors files into host buffers), it equals ``from_pretrained`` + ``apply_offload``:
    every tensor, and the forward. Classes outside transformers (defined in diffusers' pipeline
    modules) load the ordinary way: no cold start to compare."""
    import json

    import transformers

    from omni_dist_offload.loading.coldstart import prepare_cold_start

    if name not in RECIPES:
        pytest.skip(SKIPPED.get(name, "no recipe"))
    model, kwargs = RECIPES[name](0)
    cls = type(model)
    if getattr(transformers, cls.__name__, None) is not cls:
        pytest.skip(f"{cls.__name__} is not a transformers class: cold start leaves it to the ordinary loader")
    model.save_pretrained(tmp_path / "text_encoder", safe_serialization=True)
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "DiffusionPipeline",
                                                           "text_encoder": ["transformers", cls.__name__]}))
    ref = cls.from_pretrained(tmp_path / "text_encoder", dtype=torch.float32).eval()
    # Fresh, aligned storage, as a device load gives: tensors left inside the memory-mapped file
    # sit at unaligned addresses, where CPU GEMMs round differently.
    for t in [*ref.parameters(), *ref.buffers()]:
        t.data = t.data.clone()
    ref_handle = apply_offload(types.SimpleNamespace(text_encoder=ref), CONFIG, device="cpu")
    cold = prepare_cold_start(tmp_path, CONFIG, device=torch.device("cpu"), dtype=torch.float32)
    try:
        got = cold.components["text_encoder"].eval()
        handle = apply_offload(types.SimpleNamespace(text_encoder=got), CONFIG, device="cpu",
                               block_sources=cold.sources)
    finally:
        cold.close()
    assert_same_tensors(ref, got)
    assert_same_outputs(ref, got, kwargs)
    handle.remove()
    ref_handle.remove()
