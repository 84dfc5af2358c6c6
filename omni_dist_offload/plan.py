"""Which modules of a target stream their blocks, and where the blocks are.

Discovery never changes the target. Its result, a list of :class:`StreamedComponent`, says for
each streamed component its attribute name, category and the ``nn.ModuleList``s that form its
ring, in execution order.

Where the block lists come from, first match wins:

* DiT: the class attribute ``_layerwise_offload_blocks_attrs``; the built-in tables
  :data:`DIT_BLOCK_ATTRS` and :data:`DIT_BLOCK_ALTERNATIVES` (by class name, subclasses
  included); a scan for the ``ModuleList``s of blocks (several when a model has them, ordered as
  its ``forward`` source names them).
* Text encoder: the pipeline's ``OffloadPlan.encoder_block_attrs``; the class attribute; the
  built-in table :data:`ENCODER_BLOCK_ATTRS`; the scan.
"""

from __future__ import annotations

import inspect
import logging
import re
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from .config import COMPONENTS, OffloadConfig, OffloadConfigError

__all__ = [
    "DIT_BLOCK_ALTERNATIVES",
    "DIT_BLOCK_ATTRS",
    "ENCODER_BLOCK_ATTRS",
    "OffloadPlan",
    "StreamedComponent",
    "discover",
    "module_bytes",
    "pipeline_modules",
    "resolve_component",
]

logger = logging.getLogger(__name__)

#: Block lists of unmodified diffusers DiT classes, in the order their forward runs them.
DIT_BLOCK_ATTRS: dict[str, tuple[str, ...]] = {
    # Wan 2.1 / 2.2 (A14B's transformer_2 is the same class) and derivatives.
    "WanTransformer3DModel": ("blocks",),
    "WanVACETransformer3DModel": ("vace_blocks", "blocks"),
    "SkyReelsV2Transformer3DModel": ("blocks",),
    "ChronoEditTransformer3DModel": ("blocks",),
    # Flux family: dual-stream blocks, then single-stream blocks.
    "FluxTransformer2DModel": ("transformer_blocks", "single_transformer_blocks"),
    "Flux2Transformer2DModel": ("transformer_blocks", "single_transformer_blocks"),
    "ChromaTransformer2DModel": ("transformer_blocks", "single_transformer_blocks"),
    "QwenImageTransformer2DModel": ("transformer_blocks",),
    "HunyuanVideoTransformer3DModel": ("transformer_blocks", "single_transformer_blocks"),
    "HunyuanVideoFramepackTransformer3DModel": ("transformer_blocks", "single_transformer_blocks"),
    "HunyuanVideo15Transformer3DModel": ("transformer_blocks",),
    "HunyuanImageTransformer2DModel": ("transformer_blocks", "single_transformer_blocks"),
    "LTXVideoTransformer3DModel": ("transformer_blocks",),
    "LTX2VideoTransformer3DModel": ("transformer_blocks",),
    "CogVideoXTransformer3DModel": ("transformer_blocks",),
    "CogView4Transformer2DModel": ("transformer_blocks",),
    "SD3Transformer2DModel": ("transformer_blocks",),
    "MochiTransformer3DModel": ("transformer_blocks",),
    "PixArtTransformer2DModel": ("transformer_blocks",),
    "SanaTransformer2DModel": ("transformer_blocks",),
    "SanaVideoTransformer3DModel": ("transformer_blocks",),
    "AllegroTransformer3DModel": ("transformer_blocks",),
    "CosmosTransformer3DModel": ("transformer_blocks",),
    # Single block lists.
    "AceStepTransformer1DModel": ("layers",),
    "AnyFlowTransformer3DModel": ("blocks",),
    "AnyFlowFARTransformer3DModel": ("blocks",),
    "CogView3PlusTransformer2DModel": ("transformer_blocks",),
    "ConsisIDTransformer3DModel": ("transformer_blocks",),  # its face cross-attention interleaves: resident
    "DiTTransformer2DModel": ("transformer_blocks",),
    "DreamLiteTransformer2DModel": ("transformer_blocks",),
    "EasyAnimateTransformer3DModel": ("transformer_blocks",),
    "ErnieImageTransformer2DModel": ("layers",),
    "GlmImageTransformer2DModel": ("transformer_blocks",),
    "HeliosTransformer3DModel": ("blocks",),
    "HunyuanDiT2DModel": ("blocks",),
    "Ideogram4Transformer2DModel": ("layers",),
    "JoyImageEditTransformer3DModel": ("double_blocks",),
    "JoyImageEditPlusTransformer3DModel": ("double_blocks",),
    "Kandinsky6Transformer3DModel": ("visual_transformer_blocks",),
    "Kandinsky6SRTransformer3DModel": ("visual_transformer_blocks",),
    "Krea2Transformer2DModel": ("transformer_blocks",),
    "LuminaNextDiT2DModel": ("layers",),
    "LongCatAudioDiTTransformer": ("blocks",),
    "Cosmos3OmniTransformer": ("layers",),
    "MiniMaxMusic3RVQDepthDecoder": ("layers",),
    "RFD4ProteinaTransformer": ("transformer_layers",),
    # Per-mode blocks, then joint ones; the image-conditioning mode's blocks run only with a
    # reference image, so they stay resident rather than be prefetched in vain.
    "Flux3Transformer2DModel": ("txt_mode_blocks", "mode_blocks.image", "single_transformer_blocks"),
    "MiniMaxH3Transformer3DModel": ("transformer_blocks",),
    "MiniMaxMusic3Transformer1DModel": ("transformer_blocks",),
    "NucleusMoEImageTransformer2DModel": ("transformer_blocks",),
    "OmniGenTransformer2DModel": ("layers",),
    "PRXTransformer2DModel": ("blocks",),
    "PriorTransformer": ("transformer_blocks",),
    "T5FilmDecoder": ("decoders",),
    "QwenImage21Transformer2DModel": ("transformer_blocks",),
    "SanaWMTransformer3DModel": ("blocks",),
    "SanaWMLTX2RefinerTransformer3DModel": ("transformer_blocks",),
    "StableAudioDiTModel": ("transformer_blocks",),
    "StableAudio3DiTModel": ("transformer_blocks",),
    "Transformer2DModel": ("transformer_blocks",),
    "TransformerTemporalModel": ("transformer_blocks",),
    "WanAnimateTransformer3DModel": ("blocks",),  # its face adapters run between blocks: resident
    "WanAnimate2Transformer3DModel": ("blocks",),
    # Two or more lists, in the order the forward runs them.
    "AuraFlowTransformer2DModel": ("joint_transformer_blocks", "single_transformer_blocks"),
    "BriaTransformer2DModel": ("transformer_blocks", "single_transformer_blocks"),
    "BriaFiboTransformer2DModel": ("transformer_blocks", "single_transformer_blocks"),
    "BriaFibo2Transformer2DModel": ("noise_refiner", "layers"),
    "HiDreamImageTransformer2DModel": ("double_stream_blocks", "single_stream_blocks"),
    "Kandinsky5Transformer3DModel": ("text_transformer_blocks", "visual_transformer_blocks"),
    "LongCatImageTransformer2DModel": ("transformer_blocks", "single_transformer_blocks"),
    "Lumina2Transformer2DModel": ("context_refiner", "noise_refiner", "layers"),
    "MotifVideoTransformer3DModel": ("transformer_blocks", "single_transformer_blocks"),
    "OvisImageTransformer2DModel": ("transformer_blocks", "single_transformer_blocks"),
    # Spatial and temporal blocks take turns: "a|b" runs a[0], b[0], a[1], b[1], ...
    "LatteTransformer3DModel": ("transformer_blocks|temporal_transformer_blocks",),
    # U-Net-shaped models that pipelines hold under DiT names: aMUSEd's ``transformer`` (each
    # level runs a residual block, then an attention block), Wuerstchen's and Stable Cascade's
    # ``prior`` (the prior's two levels; the decoder, which repeats blocks, is not streamed).
    "UVit2DModel": ("down_block.res_blocks|down_block.attention_blocks", "transformer_layers",
                    "up_block.res_blocks|up_block.attention_blocks"),
    "WuerstchenPrior": ("blocks",),
    "StableCascadeUNet": ("down_blocks.0", "down_blocks.1", "up_blocks.0", "up_blocks.1"),
    # Z-Image Omni's SigLIP refiner runs only with condition images: it stays resident rather
    # than be prefetched in vain before every text-to-image forward.
    "ZImageTransformer2DModel": ("noise_refiner", "context_refiner", "layers"),
}

#: Classes whose block lists depend on their configuration: alternatives, tried in order.
DIT_BLOCK_ALTERNATIVES: dict[str, tuple[tuple[str, ...], ...]] = {}

#: Block lists of common transformers text encoders. Each entry lists alternatives, tried in
#: order, because attribute paths moved between transformers releases.
ENCODER_BLOCK_ATTRS: dict[str, tuple[tuple[str, ...], ...]] = {
    "T5EncoderModel": (("encoder.block",),),
    "UMT5EncoderModel": (("encoder.block",),),
    "MT5EncoderModel": (("encoder.block",),),
    "CLIPTextModel": (("text_model.encoder.layers",), ("encoder.layers",)),
    "CLIPTextModelWithProjection": (("text_model.encoder.layers",), ("encoder.layers",)),
    "Qwen2Model": (("layers",),),
    "Qwen2ForCausalLM": (("model.layers",),),
    "Qwen2_5_VLForConditionalGeneration": (("model.language_model.layers",), ("model.layers",)),
    "Qwen2VLForConditionalGeneration": (("model.language_model.layers",), ("model.layers",)),
    "Qwen2_5_VLModel": (("language_model.layers",), ("layers",)),
    "Qwen2VLModel": (("language_model.layers",), ("layers",)),
    "Qwen3Model": (("layers",),),
    "Qwen3ForCausalLM": (("model.layers",),),
    "LlamaModel": (("layers",),),
    "LlamaForCausalLM": (("model.layers",),),
    "GemmaModel": (("layers",),),
    "Gemma2Model": (("layers",),),
    "GemmaForCausalLM": (("model.layers",),),
    "Gemma2ForCausalLM": (("model.layers",),),
    "Gemma3ForCausalLM": (("model.layers",),),
    "Gemma3TextModel": (("layers",),),
    "Gemma3ForConditionalGeneration": (("model.language_model.layers",), ("language_model.model.layers",)),
    "Gemma3Model": (("language_model.layers",),),
    "MistralModel": (("layers",),),
    "MistralForCausalLM": (("model.layers",),),
    # Flux 2's encoder and HunyuanVideo I2V's: the language model streams, the vision tower stays.
    "Mistral3ForConditionalGeneration": (("model.language_model.layers",), ("language_model.model.layers",)),
    "Mistral3Model": (("language_model.layers",),),
    "LlavaForConditionalGeneration": (("model.language_model.layers",), ("language_model.model.layers",)),
    "LlavaModel": (("language_model.layers",),),
    "Qwen3VLForConditionalGeneration": (("model.language_model.layers",),),
    "Qwen3VLModel": (("language_model.layers",),),
    "BertModel": (("encoder.layer",),),  # HunyuanDiT's
    "GlmModel": (("layers",),),
    "Glm4Model": (("layers",),),
    "T5GemmaEncoderModel": (("encoder.layers",),),
    "T5GemmaEncoder": (("layers",),),
    "T5Gemma2Encoder": (("text_model.layers",),),  # prompts are text: the vision tower stays
    "Gemma4UnifiedForConditionalGeneration": (("model.language_model.layers",),),
    "Qwen2_5_VLTextModel": (("layers",),),
    "SmolLM3Model": (("layers",),),
    "SmolLM3ForCausalLM": (("model.layers",),),
    "ChatGLMModel": (("encoder.layers",),),  # CogView3/Kolors
    "ClapTextModelWithProjection": (("text_model.encoder.layer",),),
    "ClapModel": (("text_model.encoder.layer",),),  # pipelines call get_text_features: the audio tower stays
    "ContextCLIPTextModel": (("text_model.encoder.layers",),),
    "MultilingualCLIP": (("transformer.encoder.layer",),),
    "RobertaSeriesModelWithTransformation": (("roberta.encoder.layer",),),
    "VitsModel": (("text_encoder.encoder.layers",),),
}

#: Name-based fallback for pipelines without an OffloadPlan entry for a component: these names,
#: and any ``transformer_<n>`` / ``text_encoder_<n>`` (HiDream's fourth encoder is an 8B Llama).
_NAME_CATEGORIES: dict[str, str] = {
    "transformer": "dit",
    "unconditional_transformer": "dit",  # Ideogram 4: a second DiT, run at every guided step
    "prior": "dit",  # unCLIP, Kandinsky and Shap-E priors (PriorTransformer)
    "prior_prior": "dit",  # the same prior in Kandinsky's combined pipelines
    "text_encoder": "text_encoder",
    "prior_text_encoder": "text_encoder",  # Kandinsky's combined pipelines
}
_NUMBERED_NAMES = re.compile(r"(transformer|text_encoder)_[0-9]+")

#: A module of at least this size that no category names is said to stay on the device whole.
_UNNAMED_LARGE = 2**30


def name_category(name: str) -> str | None:
    """The category a pipeline attribute's name gives it, or None (it stays resident)."""
    if name in _NAME_CATEGORIES:
        return _NAME_CATEGORIES[name]
    numbered = _NUMBERED_NAMES.fullmatch(name)
    if numbered is None:
        return None
    return "dit" if numbered.group(1) == "transformer" else "text_encoder"

#: The scanned ModuleLists together must hold at least this share of their component's bytes.
_SCAN_MIN_SHARE = 0.5
#: A scanned ModuleList holding less than this share of its component stays resident.
_SCAN_MIN_LIST_SHARE = 0.02


@dataclass(frozen=True, kw_only=True)
class OffloadPlan:
    """A pipeline's declaration of its encoders, for pipelines the name-based fallback misses.

    Declare it as a class attribute ``_offload_plan`` or pass it as ``apply_offload(plan=...)``::

        _offload_plan = OffloadPlan(
            encoder_component_types={"prompt_model": "text_encoder"},
            encoder_block_attrs={"prompt_model": ("encoder.layers",)},
        )
    """

    encoder_component_types: Mapping[str, str] = field(default_factory=dict)
    """Pipeline attribute -> category (``"text_encoder"`` streams with the ``text_encoder``
    component; any other category, e.g. ``"image_encoder"``, stays resident)."""

    encoder_block_attrs: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """Pipeline attribute -> dotted paths of its block ``ModuleList``s, in execution order."""

    dit_components: tuple[str, ...] = ()
    """Pipeline attributes holding DiTs, beyond the conventional ``transformer``/``transformer_2``."""

    def __post_init__(self) -> None:
        for name, paths in self.encoder_block_attrs.items():
            if isinstance(paths, str) or not all(isinstance(p, str) for p in paths) or not paths:
                raise OffloadConfigError(
                    f"OffloadPlan.encoder_block_attrs[{name!r}] must be a non-empty tuple of "
                    f"dotted attribute paths such as ('encoder.layers',), found {paths!r}."
                )
        for name, category in self.encoder_component_types.items():
            if not isinstance(category, str):
                raise OffloadConfigError(
                    f"OffloadPlan.encoder_component_types[{name!r}] must be a category name "
                    f"such as 'text_encoder', found {category!r}."
                )
            # Any other category stays resident, so a misspelt streaming one would go unnoticed.
            spelt = category.strip().lower().replace("-", "_").replace(" ", "_")
            if spelt in COMPONENTS and spelt != category:
                raise OffloadConfigError(
                    f"OffloadPlan.encoder_component_types[{name!r}] is {category!r}: the category "
                    f"that streams is spelt {spelt!r}.")
        dits = self.dit_components
        if isinstance(dits, str) or not all(isinstance(n, str) for n in dits):
            hint = " (a one-name tuple needs its comma: ('denoiser',))" if isinstance(dits, str) else ""
            raise OffloadConfigError(
                f"OffloadPlan.dit_components must be a tuple of pipeline attribute names such as "
                f"('denoiser',), found {dits!r}{hint}.")
        both = sorted(set(dits) & set(self.encoder_component_types))
        if both:
            raise OffloadConfigError(
                f"OffloadPlan names {both} in both dit_components and encoder_component_types: "
                "give each attribute one category.")
        object.__setattr__(self, "dit_components", tuple(dits))

    def category_of(self, name: str) -> str | None:
        if name in self.encoder_component_types:
            return self.encoder_component_types[name]
        if name in self.dit_components:
            return "dit"
        return name_category(name)


@dataclass(frozen=True)
class StreamedComponent:
    """One component whose blocks stream, and the ring they form."""

    name: str
    """Pipeline attribute name (``transformer``, ``transformer_2``, ``text_encoder``...)."""
    category: str
    """``"dit"`` or ``"text_encoder"``."""
    module_ref: weakref.ref
    """The component, held weakly: the module owns its ring (which holds this), and a strong
    reference back would make a cycle, so that a component the user drops would wait for the
    garbage collector (maybe never) to free its host copy and slots. See :attr:`module`."""
    block_attrs: tuple[str, ...]
    """Dotted paths of the block lists, in execution order."""
    blocks: tuple[tuple[str, nn.Module], ...]
    """(qualified name within the component, block) in ring order."""
    source: str
    """Where the block lists came from (for logs)."""

    @property
    def module(self) -> nn.Module:
        module = self.module_ref()
        if module is None:
            raise RuntimeError(f"{self.name}: the component was dropped; its offload went with it")
        return module


def pipeline_modules(target: Any) -> dict[str, nn.Module]:
    """The ``nn.Module`` components of a pipeline-like object, by attribute name."""
    components = getattr(target, "components", None)
    if isinstance(components, Mapping):
        items: Iterable[tuple[str, Any]] = components.items()
    elif isinstance(target, nn.Module):
        items = target.named_children()
    elif hasattr(target, "__dict__"):
        items = vars(target).items()
    else:
        raise OffloadConfigError(
            f"the target is a {type(target).__name__}, which holds no modules: pass a diffusers "
            "pipeline, another object holding nn.Module components as attributes, or an nn.Module."
        )
    return {name: mod for name, mod in items if isinstance(mod, nn.Module)}


def is_bare_module(target: Any) -> bool:
    """A bare model (treated as the ``dit`` component) rather than a pipeline."""
    if not isinstance(target, nn.Module):
        return False
    if hasattr(target, "_offload_plan"):
        return False
    if _declared_attrs(target) is not None or _table_entries(target, "dit"):
        return True
    # An nn.Module that holds conventional components is a pipeline written as a module.
    return not any(name_category(name) is not None for name, _ in target.named_children())


def discover(target: Any, config: OffloadConfig, plan: OffloadPlan | None = None) -> list[StreamedComponent]:
    """Resolve which components stream and their block lists. Changes nothing."""
    if plan is not None and not isinstance(plan, OffloadPlan):
        raise OffloadConfigError(
            f"plan must be an OffloadPlan, found {type(plan).__name__}: pass "
            "omni_dist_offload.OffloadPlan(...), or None to use the pipeline's own _offload_plan."
        )
    if is_bare_module(target):
        if "dit" not in config.components:
            raise OffloadConfigError(
                f"the target is a bare {type(target).__name__}, which streams as the 'dit' "
                f"component (a model given alone does, a text encoder too), but 'components' is "
                f"{list(config.components)}: list 'dit', or pass the pipeline that holds the text encoder."
            )
        return [resolve_component("transformer", "dit", target, plan)]
    plan = plan if plan is not None else getattr(target, "_offload_plan", None) or OffloadPlan()
    if not isinstance(plan, OffloadPlan):
        raise OffloadConfigError(
            f"plan must be an OffloadPlan, found {type(plan).__name__}: pass "
            "omni_dist_offload.OffloadPlan(...), or None to use the pipeline's own _offload_plan."
        )
    modules = pipeline_modules(target)
    _check_plan_names(target, plan, modules)
    missing = [n for n in plan.encoder_block_attrs if n not in plan.encoder_component_types and plan.category_of(n) is None]
    if missing:
        raise OffloadConfigError(
            f"OffloadPlan.encoder_block_attrs names {missing}, which have no category: add them "
            "to encoder_component_types, e.g. {'%s': 'text_encoder'}." % missing[0]
        )
    # Block paths apply to streamed encoders only: for any other category they would be ignored.
    other = {n: plan.category_of(n) for n in plan.encoder_block_attrs if plan.category_of(n) != "text_encoder"}
    if other:
        name, category = next(iter(other.items()))
        how = ("a DiT's blocks come from its class (_layerwise_offload_blocks_attrs) or the built-in table"
               if category == "dit" else f"category {category!r} stays resident")
        raise OffloadConfigError(
            f"OffloadPlan.encoder_block_attrs names {sorted(other)}, which are not text encoders "
            f"({name!r} is {category!r}: {how}). Remove them, or declare "
            f"encoder_component_types={{{name!r}: 'text_encoder'}} to stream them with the text encoders."
        )
    found: list[StreamedComponent] = []
    for category in config.components:
        names = [n for n, m in modules.items() if plan.category_of(n) == category]
        if not names:
            resident = sorted({c for c in plan.encoder_component_types.values() if c not in COMPONENTS})
            also = (f" The OffloadPlan's other categories, {resident}, stay resident." if resident else "")
            raise OffloadConfigError(
                f"'components' lists {category!r}, but {type(target).__name__} has no module of "
                f"that category (its modules: {sorted(modules)}). Remove {category!r} from "
                "'components', or declare the module in an OffloadPlan "
                f"(encoder_component_types / dit_components).{also}"
            )
        found.extend(resolve_component(n, category, modules[n], plan) for n in names)
    _note_unnamed(target, plan, modules, found)
    return found


_noted: set[tuple[str, str]] = set()


def _note_unnamed(target: Any, plan: OffloadPlan, modules: Mapping[str, nn.Module],
                  found: list[StreamedComponent]) -> None:
    """Warn once (per pipeline class and attribute) about a large module that no category names:
    it goes to the device whole, however much the streamed components save. An image encoder or
    a VAE stays resident by design; a model the size of a streamed one, under a name the fallback
    does not know, was most likely meant to stream."""
    if not found:
        return
    smallest = min(module_bytes(c.module) for c in found)
    for name, module in modules.items():
        key = (type(target).__name__, name)
        if plan.category_of(name) is not None or key in _noted:
            continue
        size = module_bytes(module)
        if size >= max(_UNNAMED_LARGE, smallest):
            _noted.add(key)
            logger.warning(
                "%s.%s (%s, %.1f GiB) has no category, so it goes to the device whole while %s "
                "stream: to stream it, pass apply_offload(plan=OffloadPlan(encoder_component_types="
                "{%r: 'text_encoder'})) or OffloadPlan(dit_components=(%r,)), or set the pipeline "
                "class's _offload_plan.", type(target).__name__, name, type(module).__name__,
                size / 2**30, sorted(c.name for c in found), name, name)


def _check_plan_names(target: Any, plan: OffloadPlan, modules: Mapping[str, nn.Module]) -> None:
    """Every attribute a plan names is one the pipeline has (an optional component set to
    ``None`` counts): a misspelt name would otherwise leave its module resident, unnoticed."""
    components = getattr(target, "components", None)
    known = set(modules) | (set(components) if isinstance(components, Mapping) else set())
    named = [*plan.encoder_component_types, *plan.encoder_block_attrs, *plan.dit_components]
    absent = sorted({n for n in named if n not in known and not hasattr(target, n)})
    if absent:
        raise OffloadConfigError(
            f"the OffloadPlan names {absent}, which {type(target).__name__} does not have (its "
            f"modules: {sorted(modules)}): name the pipeline attributes that hold the modules.")


def resolve_component(name: str, category: str, module: nn.Module, plan: OffloadPlan | None) -> StreamedComponent:
    attempts: list[tuple[tuple[str, ...], str]] = []
    if category == "text_encoder" and plan is not None and name in plan.encoder_block_attrs:
        attempts.append((tuple(plan.encoder_block_attrs[name]), "OffloadPlan.encoder_block_attrs"))
    declared = _declared_attrs(module)
    if declared is not None:
        attempts.append((declared, f"{type(module).__name__}._layerwise_offload_blocks_attrs"))
    if attempts:
        # Declarations are authoritative: a wrong one is an error, not a reason to guess.
        attrs, source = attempts[0]
        return _component(name, category, module, attrs, source, strict=True)
    for attrs in _table_entries(module, category):
        comp = _component(name, category, module, attrs, "built-in table", strict=False)
        if comp is not None:
            return comp
    attrs = _scan(name, module)
    logger.info("%s (%s): blocks found by scan at %s", name, type(module).__name__, list(attrs))
    return _component(name, category, module, attrs, "scan", strict=True)


def _table_entries(module: nn.Module, category: str) -> tuple[tuple[str, ...], ...]:
    """The built-in table's block lists for ``module``'s class: alternatives, tried in order."""
    if category != "dit":
        return _table_attrs(module, ENCODER_BLOCK_ATTRS) or ()
    entry = _table_attrs(module, DIT_BLOCK_ATTRS)
    if entry is not None:
        return (entry,)
    # A text encoder offloaded on its own streams as the 'dit' component: its table entry names
    # the text layers only (a scan would take a vision tower too, which text forwards never run).
    return _table_attrs(module, DIT_BLOCK_ALTERNATIVES) or _table_attrs(module, ENCODER_BLOCK_ATTRS) or ()


def _component(name, category, module, attrs, source, *, strict) -> StreamedComponent | None:
    """``attrs``: dotted paths of block lists in execution order; ``"a|b"`` names lists whose
    blocks take turns (``a[0], b[0], a[1], b[1], ...``)."""
    blocks: list[tuple[str, nn.Module]] = []
    for entry in attrs:
        lists = []
        for path in entry.split("|"):
            lst = _get_path(module, path)
            if not isinstance(lst, nn.ModuleList) or len(lst) == 0:
                if not strict:
                    return None
                what = "does not exist" if lst is None else (
                    "is empty" if isinstance(lst, nn.ModuleList) else f"is a {type(lst).__name__}, not an nn.ModuleList"
                )
                raise OffloadConfigError(
                    f"{name} ({type(module).__name__}): block list {path!r} from {source} {what}. "
                    f"ModuleLists seen: {_module_lists(module) or 'none'}. Fix the declaration to name "
                    "the ModuleList(s) that hold the transformer blocks."
                )
            lists.append((path, lst))
        for i in range(max(len(lst) for _, lst in lists)):
            blocks.extend((f"{path}.{i}", lst[i]) for path, lst in lists if i < len(lst))
    # A block is a module the forward calls (its hooks bind the weights): not a container, and
    # not one already in the list (a list named twice, or one module at two places).
    first: dict[int, str] = {}
    for block_name, block in blocks:
        problem = None
        if isinstance(block, (nn.ModuleList, nn.ModuleDict)):
            problem = (f"block {block_name!r} is a {type(block).__name__}, a container with no forward "
                       "of its own, so its hooks would never run")
        elif id(block) in first:
            problem = f"block {block_name!r} is the same module as block {first[id(block)]!r}"
        if problem is not None:
            if not strict:
                return None
            raise OffloadConfigError(
                f"{name} ({type(module).__name__}): {problem} (block lists {list(attrs)} from {source}). "
                "Name each ModuleList of transformer blocks once, the list whose entries the forward calls.")
        first[id(block)] = block_name
    return StreamedComponent(name, category, weakref.ref(module), tuple(attrs), tuple(blocks), source)


def _declared_attrs(module: nn.Module) -> tuple[str, ...] | None:
    attrs = getattr(type(module), "_layerwise_offload_blocks_attrs", None)
    if attrs is None:
        return None
    if isinstance(attrs, str) or not attrs or not all(isinstance(a, str) for a in attrs):
        raise OffloadConfigError(
            f"{type(module).__name__}._layerwise_offload_blocks_attrs must be a non-empty list of "
            f"dotted attribute paths such as ['blocks'], found {attrs!r}."
        )
    return tuple(attrs)


def _table_attrs(module: nn.Module, table: Mapping[str, Any]) -> Any:
    for cls in type(module).__mro__:
        if cls.__name__ in table:
            return table[cls.__name__]
    return None


def _get_path(root: nn.Module, path: str) -> Any:
    obj: Any = root
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _module_lists(module: nn.Module) -> list[str]:
    return [f"{n} ({len(m)})" for n, m in module.named_modules() if isinstance(m, nn.ModuleList) and n]


def _is_block_list(lst: nn.Module) -> bool:
    """A ModuleList of blocks: one class throughout, each a composite of layers with weights that
    is called as a whole (not a list of bare Linear layers, of containers whose parts are called
    one by one, or of mixed helpers such as a feed-forward's ``net``)."""
    if not isinstance(lst, nn.ModuleList) or len(lst) == 0 or len({type(b) for b in lst}) != 1:
        return False
    first = lst[0]
    if type(first).forward is nn.Module.forward:  # a container (ModuleList, ModuleDict): never called
        return False
    return sum(1 for m in first.modules() if m is not first and any(True for _ in m.parameters(recurse=False))) >= 2


def _forward_source(module: nn.Module) -> str:
    try:
        return inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return ""


def _forward_order(source: str, paths: list[str]) -> list[str]:
    """``paths`` in the order the component's ``forward`` source first names them (then in
    registration order), read without running anything; lists the source walks together
    (``zip(self.a, self.b)``) become one entry ``"a|b"``, whose blocks take turns."""

    def first_use(item: tuple[int, str]) -> tuple[int, int]:
        k, path = item
        at = source.find(f"self.{path.split('.')[0]}")
        return (at if at >= 0 else len(source) + 1, k)

    ordered = [p for _, p in sorted(enumerate(paths), key=first_use)]
    for a, b in re.findall(r"zip\(\s*self\.(\w+)\s*,\s*self\.(\w+)\s*\)", source):
        if a in ordered and b in ordered:
            ordered[ordered.index(a)] = f"{a}|{b}"
            ordered.remove(b)
    return ordered


def _indexed_only(source: str, path: str) -> bool:
    """The forward picks entries of this list by index (``self.adapters[i]``) and never walks
    it: its blocks run between others' (a face adapter every few blocks), so they stay
    resident rather than break the ring's order."""
    name = path.split(".")[0]
    if "." in path or not re.search(rf"self\.{name}\s*\[", source):
        return False
    return not re.search(rf"in\s+(?:enumerate\(|zip\()?[^\n]*self\.{name}\b(?!\s*\[)", source)


def _scan(name: str, module: nn.Module) -> tuple[str, ...]:
    """Every top-level ModuleList of blocks (:func:`_is_block_list`; lists inside a chosen one
    are part of its blocks) holding at least 2% of the component's bytes, in the order the
    forward names them, when together they hold most of its bytes."""
    total = module_bytes(module)
    source = _forward_source(module)
    found: list[tuple[str, int]] = []
    for path, lst in module.named_modules():
        if not path or any(path.startswith(f"{p}.") for p, _ in found) or not _is_block_list(lst):
            continue
        found.append((path, module_bytes(lst)))
    chosen = [p for p, size in found if total and size >= _SCAN_MIN_LIST_SHARE * total
              and not _indexed_only(source, p)]
    held = sum(size for p, size in found if p in chosen)
    if not chosen or held < _SCAN_MIN_SHARE * total:
        raise OffloadConfigError(
            f"{name} ({type(module).__name__}): no transformer blocks found. ModuleLists seen: "
            f"{_module_lists(module) or 'none'}. Declare them with "
            f"{type(module).__name__}._layerwise_offload_blocks_attrs = ['<path>'] or, for an "
            "encoder, OffloadPlan(encoder_block_attrs={...})."
        )
    return tuple(_forward_order(source, chosen))


def module_bytes(module: nn.Module) -> int:
    """Bytes of a module's distinct parameters and buffers (a tied tensor counts once)."""
    tensors = {id(t): t for t in [*module.parameters(), *module.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())

