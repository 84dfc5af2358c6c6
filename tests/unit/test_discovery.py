"""Block discovery: declarations, built-in tables, plans, name fallback, scan, and its errors."""

import types

import pytest
import torch
from torch import nn

from omni_dist_offload import OffloadConfig, OffloadConfigError, OffloadPlan, apply_offload
from omni_dist_offload.plan import DIT_BLOCK_ATTRS, discover
import tiny_models as tiny
from toys import ToyBlock, ToyDiT, assert_same, snapshot

BOTH = OffloadConfig.parse({"mode": "layer", "components": ["dit", "text_encoder"]})
DIT = OffloadConfig.parse({"mode": "layer", "components": ["dit"]})
TE = OffloadConfig.parse({"mode": "layer", "components": ["text_encoder"]})


def _blocks(comp):
    return [name for name, _ in comp.blocks]


def test_unmodified_diffusers_classes_use_the_table():
    (wan,) = discover(tiny.tiny_wan_transformer(num_layers=2), DIT)
    assert wan.source == "built-in table" and _blocks(wan) == ["blocks.0", "blocks.1"]
    (flux,) = discover(tiny.tiny_flux_transformer(num_layers=1, num_single_layers=2), DIT)
    assert _blocks(flux) == ["transformer_blocks.0", "single_transformer_blocks.0", "single_transformer_blocks.1"]


def test_table_names_real_diffusers_classes():
    import importlib

    import diffusers

    # Classes diffusers keeps inside a pipeline's package, not at its top level.
    inside = {"WuerstchenPrior": "diffusers.pipelines.deprecated.wuerstchen.modeling_wuerstchen_prior"}
    missing = [name for name in DIT_BLOCK_ATTRS
               if not hasattr(diffusers, name) and not hasattr(importlib.import_module(inside.get(name, "diffusers")), name)]
    assert not missing, f"not diffusers classes: {missing}"


@pytest.mark.parametrize("build, path", [
    (tiny.tiny_umt5_encoder, "encoder.block"),
    (tiny.tiny_t5_encoder, "encoder.block"),
    (tiny.tiny_clip_text_model, "encoder.layers"),  # text_model.encoder.layers before transformers 5
    (tiny.tiny_qwen2_model, "layers"),
])
def test_text_encoders_by_name_and_table(build, path):
    pipe = types.SimpleNamespace(text_encoder=build(num_layers=2), vae=nn.Linear(2, 2))
    (comp,) = discover(pipe, TE)
    assert comp.category == "text_encoder" and comp.block_attrs[0].endswith(path)
    assert comp.source == "built-in table" and len(comp.blocks) == 2


def test_numbered_and_other_known_names_stream(caplog, monkeypatch):
    import omni_dist_offload.plan as plan_module

    pipe = types.SimpleNamespace(
        transformer=tiny.tiny_wan_transformer(num_layers=2),
        unconditional_transformer=tiny.tiny_wan_transformer(num_layers=2),
        text_encoder=tiny.tiny_t5_encoder(num_layers=2),
        text_encoder_4=tiny.tiny_qwen2_model(num_layers=2),  # HiDream's fourth: an 8B Llama
        vision_language_encoder=tiny.tiny_qwen2_model(num_layers=3),  # no name the fallback knows
        vae=nn.Linear(2, 2),
    )
    monkeypatch.setattr(plan_module, "_UNNAMED_LARGE", 0)
    monkeypatch.setattr(plan_module, "_noted", set())
    with caplog.at_level("WARNING", logger="omni_dist_offload.plan"):
        found = discover(pipe, BOTH)
        discover(pipe, BOTH)
    assert sorted(c.name for c in found) == ["text_encoder", "text_encoder_4", "transformer", "unconditional_transformer"]
    assert {c.name: c.category for c in found}["unconditional_transformer"] == "dit"
    # The large module no name covers is named once, with the way to stream it; the VAE, smaller
    # than every streamed component, is not.
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "vision_language_encoder" in warned[0] and "OffloadPlan" in warned[0], warned


def test_a_text_encoder_offloaded_alone_streams_its_text_layers_only():
    from encoder_recipes import RECIPES

    model, kwargs = RECIPES["Qwen2VLForConditionalGeneration"](0)
    for target, attrs in ((model, ("model.language_model.layers",)), (model.model, ("language_model.layers",))):
        (comp,) = discover(target, DIT)
        # A scan took the vision tower too, which a text forward never runs (each forward then
        # prefetched a vision block for nothing and fetched block 0 unhidden).
        assert comp.source == "built-in table" and comp.block_attrs == attrs, (comp.block_attrs, comp.source)
    with torch.no_grad():
        expected = model(**kwargs).logits
        handle = apply_offload(model, DIT, device="cpu")
        got = model(**kwargs).logits
    handle.remove()
    assert torch.equal(got, expected)


def test_plan_declares_an_encoder():
    class PromptModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = nn.Module()
            self.encoder.layers = nn.ModuleList(ToyBlock(4) for _ in range(3))
            self.head = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    class MyPipeline:
        _offload_plan = OffloadPlan(encoder_component_types={"prompt_model": "text_encoder",
                                                             "image_model": "image_encoder"},
                                    encoder_block_attrs={"prompt_model": ("encoder.layers",)})

        def __init__(self):
            self.prompt_model = PromptModel()
            self.image_model = PromptModel()
            self.transformer = ToyDiT(2)

    comps = discover(MyPipeline(), BOTH)
    assert [(c.name, c.category, c.source) for c in comps] == [
        ("transformer", "dit", "ToyDiT._layerwise_offload_blocks_attrs"),
        ("prompt_model", "text_encoder", "OffloadPlan.encoder_block_attrs"),
    ]
    # plan= overrides the class attribute
    other = OffloadPlan(encoder_component_types={"image_model": "text_encoder"})
    comps = discover(MyPipeline(), TE, plan=other)
    assert [c.name for c in comps] == ["image_model"] and comps[0].source == "scan"


def test_plan_mistakes_are_refused_before_anything_changes():
    def pipeline():
        return types.SimpleNamespace(transformer=ToyDiT(2), text_encoder=tiny.tiny_t5_encoder(num_layers=2),
                                     prompt_model=tiny.tiny_t5_encoder(num_layers=2), image_encoder=None)

    # A misspelt attribute name used to leave its module resident, silently.
    pipe = pipeline()
    before = snapshot(pipe.prompt_model)
    plan = OffloadPlan(encoder_component_types={"prompt_modle": "text_encoder"},
                       encoder_block_attrs={"prompt_modle": ("encoder.block",)})
    with pytest.raises(OffloadConfigError, match=r"names \['prompt_modle'\], which SimpleNamespace does not have "
                                                 r"\(its modules: \['prompt_model', 'text_encoder', 'transformer'\]\)"):
        apply_offload(pipe, BOTH, plan=plan)
    assert_same(before, pipe.prompt_model)
    with pytest.raises(OffloadConfigError, match=r"names \['denoiser'\]"):
        discover(pipeline(), DIT, plan=OffloadPlan(dit_components=("denoiser",)))
    # Block paths for a module that is not a text encoder used to be ignored, silently.
    with pytest.raises(OffloadConfigError, match=r"encoder_block_attrs names \['transformer'\], which are not text "
                                                 r"encoders \('transformer' is 'dit': a DiT's blocks come from"):
        discover(pipeline(), DIT, plan=OffloadPlan(encoder_block_attrs={"transformer": ("no_such_list",)}))
    with pytest.raises(OffloadConfigError, match=r"\('prompt_model' is 'image_encoder': category 'image_encoder' stays"):
        discover(pipeline(), DIT, plan=OffloadPlan(encoder_component_types={"prompt_model": "image_encoder"},
                                                   encoder_block_attrs={"prompt_model": ("encoder.block",)}))
    with pytest.raises(OffloadConfigError, match=r"names \['transformer'\] in both dit_components and encoder_comp"):
        OffloadPlan(encoder_component_types={"transformer": "text_encoder"}, dit_components=("transformer",))
    # So did a misspelt category, which any other category is: resident.
    with pytest.raises(OffloadConfigError, match=r"is 'text-encoder': the category that streams is spelt 'text_encoder'"):
        OffloadPlan(encoder_component_types={"prompt_model": "text-encoder"})
    # A string, ("denoiser") without its comma, matched every attribute named by a substring of it.
    with pytest.raises(OffloadConfigError, match=r"found 'unet_transformer' \(a one-name tuple needs its comma"):
        OffloadPlan(dit_components=("unet_transformer"))
    # What stays valid: an optional component that is None, a list, a resident category.
    plan = OffloadPlan(encoder_component_types={"prompt_model": "text_encoder", "image_encoder": "image_encoder"},
                       dit_components=["transformer"])
    assert plan.dit_components == ("transformer",)
    assert [c.name for c in discover(pipeline(), BOTH, plan=plan)] == ["transformer", "text_encoder", "prompt_model"]
    with pytest.raises(OffloadConfigError, match=r"other categories, \['image_encoder'\], stay resident"):
        discover(types.SimpleNamespace(transformer=ToyDiT(2), image_encoder=tiny.tiny_t5_encoder(num_layers=2)),
                 TE, plan=OffloadPlan(encoder_component_types={"image_encoder": "image_encoder"}))


def test_scan_finds_one_dominant_list_and_refuses_otherwise():
    class Unknown(nn.Module):
        def __init__(self, n):
            super().__init__()
            self.embed = nn.Linear(4, 4)
            self.layers = nn.ModuleList(ToyBlock(4) for _ in range(n))

    (comp,) = discover(types.SimpleNamespace(transformer=Unknown(4)), DIT)
    assert comp.source == "scan" and comp.block_attrs == ("layers",)

    class Flat(nn.Module):
        def __init__(self):
            super().__init__()
            self.big = nn.Linear(64, 64)
            self.small = nn.ModuleList(nn.Linear(2, 2) for _ in range(2))

    flat = Flat()
    before = snapshot(flat)
    with pytest.raises(OffloadConfigError, match=r"no transformer blocks found.*small \(2\).*Declare them with "
                                                 r"Flat._layerwise_offload_blocks_attrs"):
        apply_offload(types.SimpleNamespace(transformer=flat), DIT)
    assert_same(before, flat)


def test_a_model_without_any_module_list_names_the_fix():
    model = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4))
    before = snapshot(model)
    with pytest.raises(OffloadConfigError, match=r"no transformer blocks found\. ModuleLists seen: none\. "
                                                 r"Declare them with Sequential\._layerwise_offload_blocks_attrs"):
        apply_offload(model, DIT)
    assert_same(before, model)


@pytest.mark.parametrize("attrs, needle", [
    (["nope"], "'nope' from Bad._layerwise_offload_blocks_attrs does not exist"),
    (["proj"], "is a Linear, not an nn.ModuleList"),
    (["empty"], "is empty"),
    (["blocks", "blocks"], "block 'blocks.0' is the same module as block 'blocks.0'"),
    (["groups"], "block 'groups.0' is a ModuleList, a container with no forward of its own"),
    ([], "must be a non-empty list of dotted attribute paths such as ['blocks']"),
    ("blocks", "must be a non-empty list"),
])
def test_bad_declarations(attrs, needle):
    class Bad(ToyDiT):
        _layerwise_offload_blocks_attrs = attrs

        def __init__(self):
            super().__init__(2)
            self.proj = nn.Linear(2, 2)
            self.empty = nn.ModuleList()
            self.groups = nn.ModuleList([nn.ModuleList([nn.Linear(2, 2)])])

    model = Bad()
    before = snapshot(model)
    with pytest.raises(OffloadConfigError) as info:
        apply_offload(model, DIT)
    assert needle in str(info.value)
    if "block '" in needle:  # lists that are there, but not lists of blocks
        assert "Name each ModuleList of transformer blocks once" in str(info.value)
    elif isinstance(attrs, list) and attrs:  # a wrong path: the message lists what there is to name
        assert "ModuleLists seen: ['blocks (2)', 'empty (0)', 'groups (1)', 'groups.0 (1)']. Fix the declaration" in str(info.value)
    assert_same(before, model)


def test_component_missing_from_pipeline():
    pipe = types.SimpleNamespace(transformer=ToyDiT(2), vae=nn.Linear(2, 2))
    before = {name: snapshot(m) for name, m in vars(pipe).items()}
    with pytest.raises(OffloadConfigError, match=r"lists 'text_encoder'.*\['transformer', 'vae'\]\)\. Remove "
                                                 r"'text_encoder' from 'components', or declare the module"):
        apply_offload(pipe, BOTH)
    for name, snap in before.items():
        assert_same(snap, getattr(pipe, name))
    model = ToyDiT(2)
    before_model = snapshot(model)
    with pytest.raises(OffloadConfigError, match="bare ToyDiT.*list 'dit', or pass the pipeline"):
        apply_offload(model, TE)
    assert_same(before_model, model)


def test_shared_tensors_are_rejected_naming_both_owners():
    model = ToyDiT(3)
    model.blocks[2].lin.weight = model.blocks[0].lin.weight
    before = snapshot(model)
    with pytest.raises(OffloadConfigError, match="shared with") as info:
        apply_offload(model, DIT)
    assert "blocks.0.lin.weight" in str(info.value) and "blocks.2.lin.weight" in str(info.value)
    assert_same(before, model)

    model = ToyDiT(3)
    model.proj_out.weight = model.blocks[1].lin.weight
    before = snapshot(model)
    with pytest.raises(OffloadConfigError, match=r"blocks\.1\.lin\.weight.*proj_out\.weight \(a resident module\)"
                                                 r".*Untie the weights \(clone one of them\)"):
        apply_offload(model, DIT)
    assert_same(before, model)

    model = ToyDiT(3)  # distinct tensor objects over one storage count as shared too
    model.blocks[1].register_buffer("alias", model.proj_in.weight.detach()[0])
    before = snapshot(model)
    with pytest.raises(OffloadConfigError, match="shared with"):
        apply_offload(model, DIT)
    assert_same(before, model)

    model = ToyDiT(3)  # two parameters over one storage, in two blocks
    model.blocks[2].lin.weight = nn.Parameter(model.blocks[0].lin.weight.data)
    before = snapshot(model)
    with pytest.raises(OffloadConfigError, match=r"blocks\.0\.lin\.weight \(streamed with block transformer\.blocks\.0\) "
                                                 r"is shared with transformer\.blocks\.2\.lin\.weight"):
        apply_offload(model, DIT)
    assert_same(before, model)

    model = ToyDiT(3)  # a submodule shared by two blocks
    model.blocks[2].norm = model.blocks[0].norm
    before = snapshot(model)
    with pytest.raises(OffloadConfigError, match=r"module LayerNorm is shared by transformer\.blocks\.0 and "
                                                 r"transformer\.blocks\.2.*Give each block its own copy"):
        apply_offload(model, DIT)
    assert_same(before, model)


def test_meta_tensors_are_rejected():
    with torch.device("meta"):
        model = ToyDiT(2)
    before = snapshot(model)
    with pytest.raises(OffloadConfigError, match="meta device: load real weights before offloading"):
        apply_offload(model, DIT)
    assert_same(before, model)

    model = ToyDiT(3)  # one parameter left on meta, e.g. by a partial load
    model.blocks[1].lin.bias = nn.Parameter(torch.empty(8, device="meta"))
    before = snapshot(model)
    with pytest.raises(OffloadConfigError, match=r"blocks\.1\.lin\.bias is on the meta device"):
        apply_offload(model, DIT)
    assert_same(before, model)

    # Outside the blocks too (it would move to the device in the second phase, where torch's
    # "Cannot copy out of meta tensor" named nothing).
    model = ToyDiT(3)
    model.proj_out.bias = nn.Parameter(torch.empty(8, device="meta"))
    before = snapshot(model)
    with pytest.raises(OffloadConfigError, match=r"transformer\.proj_out\.bias is on the meta device"):
        apply_offload(model, DIT)
    assert_same(before, model)


@pytest.mark.parametrize("device", ["cuda:7", 3, "bogus"] if not torch.cuda.is_available() else ["cuda:99", "bogus"])
def test_a_device_that_is_not_here_is_a_config_error(device):
    model = ToyDiT(2)
    before = snapshot(model)
    with pytest.raises(OffloadConfigError, match=r"device .*(CUDA device|not a device here)"):
        apply_offload(model, DIT, device=device)
    assert_same(before, model)


def test_plan_must_be_a_plan_for_a_bare_model_too():
    model = ToyDiT(2)
    with pytest.raises(OffloadConfigError, match="plan must be an OffloadPlan, found str"):
        apply_offload(model, DIT, plan="not a plan")
    assert not hasattr(model, "_omni_offload_handle")


def test_process_group_must_be_a_group():
    with pytest.raises(OffloadConfigError, match=r"found str: pass a group from torch\.distributed\.new_group"):
        apply_offload(ToyDiT(2), {"mode": "layer", "components": ["dit"],
                                  "layer_options": {"dit": {"weight_transfer": "allgather"}}},
                      process_group="world")


def test_a_quantized_model_is_refused_naming_its_method_before_anything_changes():
    """A model loaded with a quantization_config carries its quantizer (``hf_quantizer``, in
    diffusers and transformers alike); its layers' weights are not ordinary tensors."""
    model = ToyDiT(2)
    before = snapshot(model)
    model.hf_quantizer = types.SimpleNamespace(quantization_config=types.SimpleNamespace(quant_method="bitsandbytes"))
    with pytest.raises(OffloadConfigError, match=r"transformer \(ToyDiT\) is quantized \(bitsandbytes\): .* "
                                                 r"without quantization_config"):
        apply_offload(model, {"mode": "layer", "components": ["dit"]}, device="cpu")
    assert_same(before, model)
    model.hf_quantizer = None  # what an unquantized diffusers model carries
    apply_offload(model, {"mode": "layer", "components": ["dit"]}, device="cpu").remove()
