"""``Omni``: load a diffusion pipeline, stream it with a layerwise offload config, generate.

    from omni_dist_offload import Omni

    omni = Omni(model="Wan-AI/Wan2.2-T2V-A14B-Diffusers",
                diffusion_offload_config={"mode": "layer", "components": ["dit"]})
    result = omni.generate(prompt="a red fox in snow", num_inference_steps=30, seed=0)
    result.save("out/")

``model`` is a built-in name (``tiny-wan``, ``tiny-flux``: random weights built in code, no
downloads), a local diffusers folder (``save_pretrained`` output) or a hub id whose weights are
cached. Loading and placing is :func:`omni_dist_offload.loading.load_and_place`: with an
offload config a folder or cached snapshot is cold-started (streamed blocks read from the
safetensors files straight into this rank's host buffer or shard), otherwise the pipeline is
built on the host and :func:`apply_offload` streams the selected components; without a config
the whole pipeline moves to the device.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import inspect
import logging
import math
import numbers
import os
import platform
import re
import threading
import time
import types
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from accelerate import init_empty_weights
from torch import nn

# checked_device: apply_offload's own device check, so that Omni refuses a device alike with a
# config or without.
from ..apply import OffloadHandle, RingSummary, checked_device, resolve_device
from ..config import OffloadConfig, OffloadConfigError
from ..loading.adapters import AdapterError, CacheSpec, LoraSpec, enable_cache, load_loras
from ..loading.compiling import compile_dits, compile_seconds, resolve_compile
from ..loading.parallel import (
    ContextParallel,
    ParallelGroups,
    UnevenSplitError,
    check_attention_backend,
    check_cache,
    check_dit_config,
    check_ranks,
    disable_context_parallel,
    enable_context_parallel,
    pipeline_dits,
)
from ..loading.folders import folder_dit_configs, local_folder
from ..loading.pipelines import (
    DTYPES,
    ModelLoadError,
    check_load_kwargs,
    format_bytes,
    load_and_place,
    module_components,
    resolve_dtype,
)
from ..models import BUILTIN_MODELS, BUILTIN_PIPELINE_DEFAULTS, BUILTIN_PIPELINES
from ..runtime.dist import agree_on_step
from ..runtime.logs import is_logged_rank
from .outputs import GenerationResult, to_uint8

__all__ = [
    "AdapterError",
    "BUILTIN_MODELS",
    "DTYPES",
    "GenerationOptionError",
    "LoraSpec",
    "MAX_SEED",
    "ModelLoadError",
    "Omni",
    "SamplingOptions",
    "SetupTimings",
    "format_bytes",
    "resolve_device",
    "resolve_dtype",
]

logger = logging.getLogger(__name__)

#: Frames per second of written videos when the caller gives none (Wan's rate).
DEFAULT_FPS = 16

#: The largest seed torch's generators take (``manual_seed`` reads an unsigned 64-bit value).
MAX_SEED = 2**64 - 1

# Pipeline arguments that Omni sets itself.
_RESERVED = frozenset({"prompt", "generator", "output_type", "return_dict"})

# Options that must be positive integers (a bool is refused).
_POSITIVE_INTS = ("num_inference_steps", "height", "width", "num_frames", "max_sequence_length")

# Outputs per prompt: generate makes, returns and records one.
_PER_PROMPT = ("num_images_per_prompt", "num_videos_per_prompt")

# Prompt texts, one per call: prompt_2/_3 (the prompt for a second or third text encoder: Flux's
# T5, SD3's), negative_prompt and its _2/_3. The pipelines take a list of several and make an
# output for each (or fail mid-forward on a batch the prompt's does not match).
_PROMPT_TEXT = re.compile(r"(negative_)?prompt(_\d+)?")


class GenerationOptionError(ValueError):
    """A generation option the pipeline does not take (``num_frames`` for an image model, say),
    a value it refuses in its own input check, or a seed torch cannot take."""


@dataclass(kw_only=True, slots=True)
class SamplingOptions:
    """Per-call pipeline options; ``None`` leaves the pipeline's (or built-in's) default."""

    num_inference_steps: int | None = None
    height: int | None = None
    width: int | None = None
    num_frames: int | None = None
    """Video pipelines only."""
    guidance_scale: float | None = None
    negative_prompt: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    """Further keyword arguments of the pipeline's ``__call__``."""

    def to_kwargs(self) -> dict[str, Any]:
        kwargs = {k: v for k, v in asdict(self).items() if k != "extra" and v is not None}
        return {**kwargs, **self.extra}


@dataclass(frozen=True, slots=True)
class SetupTimings:
    """Seconds spent before the first generation."""

    load_s: float
    """Building or loading the pipeline on the host."""
    place_s: float
    """``apply_offload`` (consolidating, pinning, moving the rest), or moving it all resident."""

    @property
    def setup_s(self) -> float:
        return self.load_s + self.place_s


def with_budget(config: OffloadConfig | Mapping[str, Any] | str | None,
                device_budget: int | str | None) -> OffloadConfig | None:
    """``config`` parsed, with ``device_budget`` set when one is given (a budget and no config:
    the DiT streams within it; a size replaces the config's ``"auto"`` and its
    ``activation_reserve``)."""
    if device_budget is None:
        return None if config is None else OffloadConfig.parse(config)
    base = OffloadConfig.parse(config if config is not None else {"mode": "layer", "components": ["dit"]})
    given = {**base.to_dict(), "device_budget": device_budget}
    if not (isinstance(device_budget, str) and device_budget.strip().lower() == "auto"):
        # The config's activation_reserve belongs to the "auto" this budget replaces.
        given["activation_reserve"] = None
    return OffloadConfig.parse(given)


def with_storage(config: OffloadConfig | None, storage_dtype: str | None) -> OffloadConfig | None:
    """``config`` with ``storage_dtype`` set on every streamed component (no config: the DiT
    streams, stored so). Raises :class:`OffloadConfigError` for a value it does not know."""
    if storage_dtype is None:
        return config
    base = (config or OffloadConfig.parse({"mode": "layer", "components": ["dit"]})).to_dict()
    options = {c: {**base["layer_options"].get(c, {}), "storage_dtype": storage_dtype} for c in base["components"]}
    return OffloadConfig.parse({**base, "layer_options": options})


def with_upcast(config: OffloadConfig | None, upcast: str | None) -> OffloadConfig | None:
    """``config`` with ``upcast`` set on its DiT components (text encoders from transformers
    keep ``"block"``: see ``LayerOptions.upcast``). Raises :class:`OffloadConfigError` for a value
    it does not know, where the DiT stores nothing in 8 bits, or for no config (nothing streams)."""
    if upcast is None:
        return config
    if config is None:
        raise OffloadConfigError(f"upcast={upcast!r} says where streamed 8-bit weights are upcast; with "
                                 "diffusion_offload_config=None nothing streams: give a config (or "
                                 "storage_dtype=, which streams the DiT), or drop upcast.")
    base = config.to_dict()
    if "dit" not in base["components"]:
        raise OffloadConfigError(f"upcast {upcast!r} applies to the DiT, which this config does not stream "
                                 f"(components: {base['components']}).")
    options = {**base["layer_options"], "dit": {**base["layer_options"].get("dit", {}), "upcast": upcast}}
    return OffloadConfig.parse({**base, "layer_options": options})


#: The step every rank agrees on after its LoRAs and cache, when setup is collective.
_EXTRAS_STEP = "load its LoRAs and set up its cache"

class Omni:
    """A pipeline on a device, its offload handle, and ``generate``.

    Safe to share between threads (a Gradio or web app's handlers): generations run one at a
    time, in the order their threads took the lock. A streamed component has one block's weights
    in each slot, and two forwards at once would take each other's: tried here without the lock,
    23 of 24 concurrent tiny-flux generations came out wrong or raised."""

    def __init__(
        self,
        model: str | os.PathLike[str] = "tiny-wan",
        diffusion_offload_config: OffloadConfig | Mapping[str, Any] | str | None = None,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | str | None = None,
        progress: bool = True,
        load_kwargs: Mapping[str, Any] | None = None,
        cold_start: bool = True,
        device_budget: int | str | None = None,
        compile: bool | str | None = None,
        lora: str | os.PathLike[str] | Mapping[str, Any] | LoraSpec
              | Iterable[str | os.PathLike[str] | Mapping[str, Any] | LoraSpec] = (),
        cache: str | Mapping[str, Any] | CacheSpec | None = None,
        storage_dtype: str | None = None,
        upcast: str | None = None,
        context_parallel: ContextParallel | Mapping[str, int] | None = None,
    ) -> None:
        """``dtype`` defaults to bfloat16 on a GPU and float32 on the CPU. ``progress`` shows
        denoising and setup progress bars (on the ranks ``LOG_RANK`` names, default 0).
        ``load_kwargs`` go to ``from_pretrained`` (not the dtype, which is ``dtype``; none for a
        built-in, which is built in code). ``device`` is a CUDA device or the CPU, checked as
        :func:`apply_offload` checks it (:class:`OffloadConfigError`), and ``dtype`` one of
        :data:`DTYPES`, before anything loads, as are the arguments' types (``TypeError``).
        ``cold_start=False`` loads a folder whole before offloading it (the slower, memory-hungry
        path; for comparison and debugging). ``device_budget`` (bytes, ``"24GiB"``, ``"auto"``)
        sets the config's ``device_budget``; without a config it streams the DiT within it.
        ``compile``: ``True``/``"regional"`` compiles each DiT block with ``torch.compile``
        (after offloading; the ring's hooks run between compiled blocks), ``"model"`` each DiT
        whole; compilation happens in the first generation, whose metadata reports it apart.
        ``lora``: LoRA files, each ``PATH`` or ``PATH:SCALE`` (or ``{"path", "scale"}``), loaded
        with diffusers' ``load_lora_weights`` after offloading and weighed with ``set_adapters``.
        ``cache``: a step cache on the DiTs, ``"first-block:0.1"`` or ``{"type": "first-block",
        "threshold": 0.1}`` (:data:`~omni_dist_offload.loading.adapters.CACHES`); its state is
        reset before every generation. Both go on before context parallelism splits the DiTs.
        Both are checked before anything loads (raising
        :class:`AdapterError` for a missing or unreadable LoRA file, a cache option out of range)
        and recorded in the output metadata; a LoRA diffusers cannot load into this model raises
        :class:`AdapterError` once the offload is undone. ``storage_dtype``
        (``"float8_e4m3fn"``, ``"float8_e5m2"``) stores every streamed component's block weights
        (without a config, the DiT's) in 8 bits on the host, upcast on the device (sets
        ``layer_options.<c>.storage_dtype``);
        ``upcast`` (``"block"``, ``"layer"``) says where, for the DiT (``layer_options.dit.upcast``);
        with no config, no ``storage_dtype`` and no ``device_budget`` nothing streams, and it is
        refused (:class:`OffloadConfigError`) before anything loads.
        ``context_parallel``: ``{"ulysses_degree": 2, "ring_degree": 1}`` splits each sample of
        the DiTs across that many ranks with diffusers' context parallelism (after offloading,
        the LoRAs and the cache; under torchrun, in groups of consecutive ranks: :attr:`parallel`);
        every rank of a group must then generate the same prompt with the same seed together
        (``dp.py`` does). A ``first-block`` cache cannot run split: with it, ``context_parallel``
        is refused before anything loads (:class:`ContextParallelError`; ``taylorseer`` and
        ``pyramid-attention`` run split), as is a DiT whose class has no context-parallel plan or
        whose attention heads ``ulysses_degree`` does not divide, where its config can be read
        without loading it (a built-in, a folder, a hub id's snapshot already in the local cache)."""
        # One generation (or teardown) at a time; reentrant, so a pipeline callback that calls
        # back into this object is not deadlocked.
        self._lock = threading.RLock()
        self._generating = False
        # A folder given as a path object is kept (and recorded in the metadata) as its string.
        self.model = model = _model_name(model)
        if _unknown_home(model):  # the loaders' Path.expanduser would raise a bare RuntimeError
            head = model.split("/", 1)[0]
            raise ModelLoadError(f"model {model!r}: {head!r} names no home folder known here (no such user, or HOME "
                                 f"is not set): give the folder's path in full, or ./{model} for a folder named "
                                 f"{head!r}.")
        for flag, value in (("cold_start", cold_start), ("progress", progress)):
            if not isinstance(value, bool):  # "no" would read as true
                raise TypeError(f"{flag} must be True or False, found {type(value).__name__} {value!r}.")
        # The device and dtype before anything loads: torch would refuse a device this host lacks
        # only once the whole model is built (resident), an integer dtype deep in the cast.
        self.device = checked_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        load_kwargs = check_load_kwargs(model, load_kwargs)
        split = ContextParallel.parse(context_parallel)
        self.cache = CacheSpec.parse(cache) if cache is not None else None
        if split is not None:  # before anything loads
            check_cache(split, self.cache)  # the options themselves, before the job's ranks
            check_ranks(split)
            check_attention_backend(split)  # the loaded model's processors attend with the active one
            # Each DiT's class and config (a plan, heads the Ulysses degree divides), read without
            # loading it; enable_context_parallel checks the loaded DiTs again.
            for name, (cls, dit_config) in _dit_configs(model, load_kwargs).items():
                check_dit_config(name, cls, dit_config, split)
        self.compile = resolve_compile(compile)
        self.loras = _lora_specs(lora)
        for spec in self.loras:
            spec.check()
        self.config = with_upcast(with_storage(with_budget(diffusion_offload_config, device_budget), storage_dtype),
                                  upcast)
        dit_per_layer = self.config is not None and "dit" in self.config.components \
            and self.config.options_for("dit").upcast == "layer"
        if self.loras and dit_per_layer:
            # Omni loads LoRAs after offloading; a DiT of 8-bit blocks upcast per layer cannot take
            # an adapter then (its base layer's dtype reads 8 bits): say so before anything loads.
            raise AdapterError(
                "lora= with the DiT's upcast \"layer\": LoRAs are loaded after offloading, and 8-bit blocks "
                "upcast per layer cannot take an adapter then. Use upcast \"block\" (the default) with LoRAs, "
                "or load them before apply_offload (the Python API: they stream with their blocks).")
        if self.compile and dit_per_layer:
            # The per-layer upcast swaps tensors inside each block, which a compiled graph does not
            # follow (the ring refuses it at the first forward): say so before anything loads.
            raise OffloadConfigError(
                f"compile={self.compile!r} with the DiT's upcast \"layer\": the per-layer upcast swaps each "
                "layer's tensors inside the block, which a compiled block does not follow. Use upcast \"block\" "
                "(the default) with compile, or do not compile.")
        # Setup is collective when the ranks share weights or split samples: one rank's failure
        # to load (a folder missing on its host), or to take its LoRAs, is then told to the others
        # before they enter a collective it never reaches (runtime.dist.agree_on_step).
        collective = split is not None or (self.config is not None and any(
            self.config.options_for(c).weight_transfer in ("allgather", "shared") for c in self.config.components))
        # As long as the placing's own setup exchanges wait for a rank.
        within = self.config.collective_timeout_s if self.config is not None else None
        agree = functools.partial(agree_on_step, "load the model", timeout_s=within) if collective else None
        loaded = load_and_place(model, self.config, device=self.device, dtype=self.dtype,
                                load_kwargs=load_kwargs, cold_start=cold_start,
                                progress=progress and is_logged_rank(), agree=agree)
        self.pipeline = loaded.pipeline
        self.handle: OffloadHandle | None = loaded.handle
        self.cold_start = loaded.cold_start
        """Whether the streamed components were cold-started from their safetensors files."""
        self.timings = SetupTimings(load_s=loaded.load_s, place_s=loaded.place_s)
        self.parallel: ParallelGroups | None = None
        """Context parallelism's groups, when ``context_parallel`` split the DiTs."""
        agreed = not collective
        try:
            # After offloading, as users do: the ring adopts the adapters ([Note: tenants]).
            load_loras(self.pipeline, self.loras)
            self._cached = enable_cache(self.pipeline, self.cache) if self.cache is not None else []
            if not agreed:  # before the split's collectives
                agreed = True
                agree_on_step(_EXTRAS_STEP, None, within)
            # Then the split, whose hooks go on the modules as they are now: a LoRA on a module the
            # plan gathers (Wan's root proj_out) replaces that module, whose LoRA layer is then
            # gathered whole (a module replaced later, unloading the LoRA say, is hooked again at
            # the next forward: loading.parallel's _Watch). The caches check_cache allows skip by
            # the step, alike on every rank; enabled first, their hooks sit inside the split's and
            # see this rank's shard, as the block does.
            if split is not None:
                self.parallel = enable_context_parallel(self.pipeline, split, self.device)
            self.compiled = compile_dits(self.pipeline, self.compile) if self.compile else []
            self.set_progress(progress)
            self._signature = inspect.signature(self.pipeline.__call__)
        except BaseException as exc:
            if not agreed:
                with contextlib.suppress(Exception):  # the agreement failing too must not hide this error
                    agree_on_step(_EXTRAS_STEP, exc, within)
            self.close()  # a LoRA that does not fit, say: undo the offload and context parallelism
            raise
        logger.info("%s ready on %s (%s) in %.1f s (load %.1f s, %s %.1f s)", model, self.device,
                    _dtype_name(self.dtype), self.timings.setup_s, self.timings.load_s,
                    "offload" if self.config else "move", self.timings.place_s)

    def set_progress(self, show: bool) -> None:
        """Show or hide denoising progress bars; shown only on the ranks whose logs show
        (``LOG_RANK``, default 0)."""
        self._check_open()
        self.pipeline.set_progress_bar_config(disable=not (show and is_logged_rank()))

    # -- queries -----------------------------------------------------------------------
    def summary(self) -> list[dict[str, Any]]:
        """The offload summary: one dict per streamed ring (empty when nothing streams)."""
        return self.handle.summary() if self.handle is not None else []

    def summary_rows(self) -> list[RingSummary]:
        """The same as typed rows."""
        return self.handle.summary_rows() if self.handle is not None else []

    @property
    def lockstep(self) -> bool:
        """Whether the ranks must run the same forwards at the same shapes together: True when
        a streamed ring moves its blocks with a collective (``weight_transfer`` is
        ``"allgather"`` after any fallback), so every rank of its weight group must enter every
        fill; and under context parallelism, whose ranks split each call between them. Rank-local
        and shared rings leave each rank free to run its own work. The same on every rank:
        fallbacks are agreed across ranks at setup. Front-ends read it to choose between waves
        and free work sharing (``dp.py``, [Note: waves] in ``serve/service.py``)."""
        return self.parallel is not None or any(row.weight_transfer == "allgather" for row in self.summary_rows())

    def components(self) -> dict[str, nn.Module]:
        """The pipeline's module components by attribute name."""
        self._check_open()
        return module_components(self.pipeline)

    def call_kwargs(self, **options: Any) -> dict[str, Any]:
        """The keyword arguments ``generate`` passes to the pipeline for these options, checked
        against its ``__call__``; raises :class:`GenerationOptionError` for one it does not take
        or a value it refuses before anything runs (see :meth:`generate`)."""
        self._check_open()
        given = {k: v for k, v in options.items() if v is not None}
        params = self._signature.parameters
        open_ended = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        for key, value in given.items():
            if _is_non_finite(value):
                raise GenerationOptionError(f"{key}={_show(value)} is not a finite number: give a finite value.")
            if key in _RESERVED:
                raise GenerationOptionError(
                    f"{key!r} is set by Omni.generate itself: drop it (the seed is the 'seed' argument)."
                )
            if key not in params and not open_ended:
                common = [k for k in SamplingOptions.__slots__ if k in params]
                raise GenerationOptionError(
                    f"{key!r} is not an option of {type(self.pipeline).__name__} ({self.model}): "
                    f"drop it; of the common options it takes {common}."
                )
            if key in _PER_PROMPT and (isinstance(value, bool) or value != 1):
                raise GenerationOptionError(
                    f"{key}={value!r}: Omni.generate makes, returns and records one output per call; "
                    f"drop {key} and call generate once per output (seed + i for output i).")
            if (key.endswith("prompt_embeds") or key.endswith("prompt_embeds_mask")) \
                    and isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] != 1:
                raise GenerationOptionError(
                    f"{key} holds {value.shape[0]} prompts (shape {tuple(value.shape)}): Omni.generate makes, "
                    "returns and records one output per call; pass one prompt's embeddings (batch size 1) "
                    "and call generate once per prompt.")
            if _PROMPT_TEXT.fullmatch(key) and not _one_prompt(value):
                # The pipelines take a list of as many as the prompts, and Flux's drops the rest
                # of a negative list (and runs them all); a prompt_2 list of two fails mid-forward
                # on a batch size mismatch; a number fails mid-run.
                what = "the negative prompt" if key.startswith("negative_") else key
                raise GenerationOptionError(
                    f"{key}={value!r}: the prompt is one string, so {what} is one too: give a "
                    "string (or a list of one string), or None for none.")
            if key in _POSITIVE_INTS:
                number = _whole_number(value)
                if number is None or number < 1:
                    raise GenerationOptionError(f"{key}={value!r} is not a positive integer: give an integer "
                                                "of 1 or more (or None for the default).")
                given[key] = number
            if key == "guidance_scale":
                number = _real_number(value)
                if number is None:
                    raise GenerationOptionError(f"guidance_scale={value!r} is not a real number: give a finite "
                                                "number such as 5.0 (or None for the default).")
                given[key] = number
        return {**_builtin_defaults(self.model), **given}

    # -- generation --------------------------------------------------------------------
    def generate(
        self,
        prompt: str,
        *,
        seed: int = 0,
        name: str | None = None,
        fps: int | None = None,
        **options: Any,
    ) -> GenerationResult:
        """Generate one image or video. ``options`` are pipeline arguments
        (``num_inference_steps``, ``height``, ``width``, ``num_frames``, ``guidance_scale``,
        ``negative_prompt`` and any other the pipeline takes); ``None`` keeps the default.
        The noise comes from a CPU generator seeded with ``seed``, so a seed gives the same
        latents on every device and rank. Calls from several threads run one at a time. Raises
        :class:`GenerationOptionError`, before the pipeline runs, for a seed torch cannot take
        (an integer from 0 to :data:`MAX_SEED`), a prompt that is not one string, an ``fps``
        that is not a positive integer, ``num_images_per_prompt``/``num_videos_per_prompt``
        other than 1, a size, step or frame count that is not a positive integer, a
        ``guidance_scale`` that is not a real number, a ``negative_prompt`` that is not one string
        (or a list of one), a non-finite number (Python, numpy or 0-d tensor) or an option the
        pipeline does not take, and for one its own input check refuses (a height its sizes do
        not divide, say)."""
        number = _whole_number(seed)
        if number is None or not 0 <= number <= MAX_SEED:
            raise GenerationOptionError(f"seed {seed!r} is not one torch's generator takes: give an "
                                        f"integer from 0 to {MAX_SEED} (2**64 - 1).")
        seed = number
        if prompt is not None and not isinstance(prompt, str):  # None: with prompt_embeds
            raise GenerationOptionError(
                f"prompt must be one string, not {type(prompt).__name__}: Omni.generate makes one output per "
                "call; call it once per prompt.")
        if fps is not None:
            number = _whole_number(fps)
            if number is None or number < 1:
                raise GenerationOptionError(f"fps={fps!r} is not a positive integer: give the video's frame rate "
                                            f"as an integer of 1 or more (or None for {DEFAULT_FPS}).")
            fps = number
        with self._lock:
            self._check_open()
            if self._generating:
                # The lock is reentrant so that a step callback may read summary() or close();
                # a generation inside one would reset the scheduler the outer one is stepping.
                raise RuntimeError(
                    "Omni.generate was called from inside a generation on the same Omni (a step "
                    "callback?): generations run one at a time. Generate after this one returns, or "
                    "from another thread (it waits its turn), or with another Omni.")
            self._generating = True
            try:
                return self._generate(prompt, seed, name, fps, options)
            finally:
                self._generating = False

    def _generate(self, prompt: str, seed: int, name: str | None, fps: int | None,
                  options: Mapping[str, Any]) -> GenerationResult:
        call = self.call_kwargs(**options)
        generator = torch.Generator(device="cpu").manual_seed(seed)
        compiling = compile_seconds() if self.compile else None
        for module in self._cached:  # a generation's cache starts empty, as the first one's did
            module._reset_stateful_cache()
        start = time.perf_counter()
        try:
            out = self.pipeline(prompt=prompt, generator=generator, output_type="np", **call)
        except UnevenSplitError as exc:
            # Sizes whose sequence the context-parallel group's size does not divide, found before
            # diffusers splits it. Every rank of the group raises there alike (same sizes, same
            # plan), before that split's collectives: the next generation starts afresh.
            if self.parallel is None:
                raise
            raise self._unsplittable(call, exc) from exc
        except ValueError as exc:
            # The pipeline's own argument checks: check_inputs, and encode_prompt's (a negative
            # prompt list whose length differs from the prompt's).
            if not (_raised_in(exc, "check_inputs") or _raised_in(exc, "encode_prompt")):
                raise
            message = " ".join(str(exc).split()).rstrip(".")
            raise GenerationOptionError(f"{type(self.pipeline).__name__} ({self.model}) refused the options in "
                                        f"its input check: {message}. Change the option it names.") from exc
        pixels = to_uint8(out.frames[0] if hasattr(out, "frames") else out.images[0])
        elapsed = time.perf_counter() - start
        after = compile_seconds() if compiling is not None else None
        self._compile_s = after - compiling if after is not None else None
        kind = "video" if pixels.ndim == 4 else "image"
        result = GenerationResult(prompt=prompt, seed=seed, kind=kind, frames=pixels,
                                  name=name or f"seed{seed:05d}", fps=fps or DEFAULT_FPS)
        result.metadata = self._metadata(result, call, elapsed)
        return result

    def _effective(self, call: Mapping[str, Any], key: str) -> Any:
        """An option's value in this call: as given, else the pipeline's default (None if none)."""
        if key in call:
            return call[key]
        params = self._signature.parameters
        default = params[key].default if key in params else None
        return None if default is inspect.Parameter.empty else default

    def _unsplittable(self, call: Mapping[str, Any], exc: UnevenSplitError) -> GenerationOptionError:
        """The error for sizes whose sequence the context-parallel group's size does not divide:
        the image's or video's tokens (height, width, num_frames), or the prompt's text
        embedding, which Flux, Flux2, LTX and QwenImage split with them (:meth:`_text_unsplittable`)."""
        if exc.text:
            return self._text_unsplittable(call, exc)
        size, tokens = exc.size, exc.tokens
        sizes = {key: self._effective(call, key) for key in ("height", "width", "num_frames")
                 if key in self._signature.parameters}
        given = ", ".join(f"{key}={value}" if value is not None else f"{key} (the pipeline's default)"
                          for key, value in sizes.items())
        # Tokens grow in proportion to the height (and the width): scaled so that they divide.
        scale = size // math.gcd(tokens, size)
        height = sizes.get("height")
        example = f" (e.g. height={height * scale}: {tokens * scale} tokens)" if isinstance(height, int) else ""
        return GenerationOptionError(
            f"{given} give {tokens} tokens per sample, which context parallelism over {size} ranks "
            f"({self.parallel.spec.describe()}) cannot split evenly: choose a height, width or num_frames that "
            f"gives a token count {size} divides{example}, or degrees whose product divides {tokens}.")

    def _text_unsplittable(self, call: Mapping[str, Any], exc: UnevenSplitError) -> GenerationOptionError:
        """The error for a text embedding whose length the group's size does not divide. Where it
        is ``max_sequence_length`` long, the pipeline pads or cuts every prompt to that (Flux,
        Flux2, LTX; QwenImage cuts a longer prompt): a length the size divides is the fix. Shorter,
        it is the prompt's own length (QwenImage pads nothing), which only the prompt changes."""
        size, tokens = exc.size, exc.tokens
        limit = self._effective(call, "max_sequence_length") if "max_sequence_length" in self._signature.parameters \
            else None
        whose = "the prompt" + (" (or of negative_prompt, encoded apart)" if call.get("negative_prompt") is not None
                                else "")
        if isinstance(limit, int) and limit == tokens:
            fits = tokens - tokens % size or size  # the largest that is no longer (every pipeline takes it)
            why = f"max_sequence_length={limit}, to which the pipeline pads or cuts the prompt"
            fix = f"give a max_sequence_length that {size} divides (e.g. max_sequence_length={fits})"
        else:
            why = (f"the prompt's own length: {type(self.pipeline).__name__} pads no prompt to a fixed length"
                   + (f" (max_sequence_length={limit} only cuts a longer one)" if isinstance(limit, int) else ""))
            fix = (f"change the prompt (a word more or fewer) until its text length is one {size} divides"
                   + (f", or cut it with a max_sequence_length {size} divides" if isinstance(limit, int) else ""))
        return GenerationOptionError(
            f"the text embedding of {whose} has {tokens} tokens ({why}), which context parallelism over "
            f"{size} ranks ({self.parallel.spec.describe()}) cannot split evenly: {exc.model} splits the text "
            f"sequence across the ranks with the image's, so the height and width do not help. Instead {fix}, or "
            f"use degrees whose product divides {tokens}.")

    def _metadata(self, result: GenerationResult, call: Mapping[str, Any], elapsed: float) -> dict[str, Any]:
        height, width = result.frames.shape[-3:-1]
        return {
            "prompt": result.prompt,
            "negative_prompt": _recorded(call, "negative_prompt"),
            "seed": result.seed,
            "model": self.model,
            "pipeline_class": type(self.pipeline).__name__,
            "kind": result.kind,
            "height": int(height),
            "width": int(width),
            "num_frames": int(result.frames.shape[0]) if result.kind == "video" else None,
            "fps": result.fps if result.kind == "video" else None,
            "num_inference_steps": self._effective(call, "num_inference_steps"),
            "guidance_scale": self._effective(call, "guidance_scale"),
            "pipeline_kwargs": {k: v for k in call if _is_json_scalar(v := _recorded(call, k))},
            "device": str(self.device),
            "dtype": _dtype_name(self.dtype),
            # After close() nothing streams any more: neither the config nor a summary applies.
            "offload_config": self.config.to_dict() if self.config and self._offloaded else None,
            "offload_summary": None if self.config and not self._offloaded else self.summary(),
            "compile": self.compile,
            "lora": [spec.to_dict() for spec in self.loras],
            "cache": self.cache.to_dict() if self.cache is not None else None,
            "context_parallel": {**self.parallel.spec.to_dict(), "group": self.parallel.dp_rank,
                                 "groups": self.parallel.dp_size} if self.parallel is not None else None,
            "timings": {"setup_s": self.timings.setup_s, "load_s": self.timings.load_s,
                        "place_s": self.timings.place_s,
                        # torch.compile's own time in this call (None: not compiled, or this torch
                        # does not say), reported apart from the generation's.
                        "compile_s": self._compile_s if self.compile else None,
                        "generation_s": elapsed - (self._compile_s or 0.0) if self.compile else elapsed},
            "versions": _versions(),
        }

    # -- teardown ----------------------------------------------------------------------
    def close(self) -> None:
        """Free what this Omni holds: undo context parallelism (its process groups), end the
        offload without bringing the model back (:meth:`OffloadHandle.discard`: the slots, host
        copy and process groups freed, the streamed tensors left empty) and let go of the
        pipeline. Generating after it raises. Idempotent; waits for a generation running in
        another thread. To keep the model, resident, call ``omni.handle.remove()`` first: that
        needs device room for every streamed block."""
        with self._lock:
            if self._generating:
                raise RuntimeError(
                    "Omni.close() was called from inside a generation on the same Omni (a step "
                    "callback?): the running generation would lose its weights. Close it after "
                    "generate returns.")
            try:
                if self.parallel is not None:
                    disable_context_parallel(self.pipeline, self.parallel)
                    self.parallel = None
            finally:
                if self.handle is not None:
                    self.handle.discard()
                    self.handle = None
                self.pipeline = None
                self._cached = []
                self.compiled = []

    def __copy__(self) -> Omni:
        raise _not_copied()

    def __deepcopy__(self, memo: dict[int, Any]) -> Omni:
        raise _not_copied()

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise _not_copied()

    @property
    def _offloaded(self) -> bool:
        """Whether the offload is in place (``omni.handle.remove()`` undoes it, the handle kept)."""
        return self.handle is not None and self.handle.active

    def _check_open(self) -> None:
        if self.pipeline is None:
            raise RuntimeError(f"this Omni ({self.model}) is closed: build another Omni to generate.")

    def __enter__(self) -> Omni:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if exc is None:
            self.close()
            return
        try:
            self.close()
        except Exception:  # noqa: BLE001 - the error that left the block is the one to see
            logger.warning("closing %s after %s failed", self.model, exc_type.__name__, exc_info=True)


def _dit_configs(model: str, load_kwargs: Mapping[str, Any]) -> dict[str, tuple[type, Mapping[str, Any]]]:
    """The DiTs ``model`` loads as, by pipeline attribute, each with its class and config, read
    without loading a weight or asking the Hub: a built-in's from its pipeline built with empty
    weights (configs only); a folder's, or a hub id's snapshot already in the local cache, from
    its files (``loading.folders.folder_dit_configs``). What cannot be read so is left out: the
    loaded DiTs are checked again when they split."""
    try:
        if model in BUILTIN_MODELS:
            with init_empty_weights(include_buffers=False):
                pipe = BUILTIN_PIPELINES[model]()
            return {name: (type(dit), dict(dit.config)) for name, dit in pipeline_dits(pipe).items()}
        folder = local_folder(model, load_kwargs)
        return folder_dit_configs(folder, load_kwargs) if folder is not None else {}
    except Exception as exc:  # noqa: BLE001 - a check ahead of the loader's own: it must not stop a load
        logger.debug("could not read the DiTs' configs of %s before loading: %s: %s", model, type(exc).__name__, exc)
        return {}


def _not_copied() -> TypeError:
    """The error for ``copy.copy``, ``copy.deepcopy`` or pickling an :class:`Omni`."""
    return TypeError(
        "an Omni cannot be copied (copy.copy or copy.deepcopy) or pickled: it owns its pipeline, the offload "
        "handle and the lock its generations take, which a copy would share (its close() would free this "
        "one's offload) or lose. Build another Omni with the same arguments (in another process: build it "
        "there), or share this one: its generations run one at a time.")


def _unknown_home(path: str) -> bool:
    """Whether ``path`` starts with a ``~`` or ``~user`` this host cannot expand (no such user,
    or no HOME): ``Path.expanduser`` raises a bare RuntimeError for it, ``os.path.expanduser``
    leaves it as it is."""
    return path.startswith("~") and os.path.expanduser(path).startswith("~")


def _model_name(model: Any) -> str:
    """``model`` as the string it is loaded and recorded by (a path object's string)."""
    if isinstance(model, os.PathLike):
        return os.fspath(model)
    if not isinstance(model, str):
        raise TypeError(f"model must be a built-in name {list(BUILTIN_MODELS)}, a diffusers folder (a str or "
                        f"Path) or a hub id, found {type(model).__name__} {model!r}.")
    return model


def _lora_specs(lora: Any) -> list[LoraSpec]:
    """``lora=`` as specs: one LoRA (a path, ``PATH:SCALE``, a dict, a :class:`LoraSpec`) or an
    iterable of them. Raises ``TypeError`` for anything else."""
    if isinstance(lora, (str, os.PathLike, Mapping, LoraSpec)):
        return [LoraSpec.parse(lora)]
    if not isinstance(lora, Iterable):
        raise TypeError(f"lora must be a path, 'PATH:SCALE', {{'path': ..., 'scale': ...}}, a LoraSpec or a list of "
                        f"them, found {type(lora).__name__} {lora!r}.")
    return [LoraSpec.parse(x) for x in lora]


def _one_prompt(value: Any) -> bool:
    """Whether ``value`` is one prompt: a string, or a list or tuple of one string."""
    if isinstance(value, (list, tuple)) and len(value) == 1:
        value = value[0]
    return isinstance(value, str)


def _raised_in(exc: BaseException, function: str, module: str | None = None) -> types.FrameType | None:
    """The innermost frame of a function of that name (in that module, if given) that ``exc``
    passed through, or None: diffusers pipelines check their arguments in ``check_inputs``
    before they run."""
    tb, found = exc.__traceback__, None
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name == function and (module is None or frame.f_globals.get("__name__") == module):
            found = frame
        tb = tb.tb_next
    return found


def _recorded(call: Mapping[str, Any], key: str) -> Any:
    """An option as the sidecar records it: a number as a Python one, a prompt text given as a
    list of one string (``prompt_2=["b"]``, which generate takes) as that string."""
    value = call.get(key)
    if _PROMPT_TEXT.fullmatch(key) and isinstance(value, (list, tuple)) and _one_prompt(value):
        return value[0]
    return _scalar(value)


def _scalar(value: Any) -> Any:
    """A numpy scalar or 0-d array, or a 0-d tensor, as a Python number; anything else as it is."""
    if isinstance(value, torch.Tensor) and value.ndim == 0:
        return value.item()
    if isinstance(value, (np.ndarray, np.generic)) and value.ndim == 0:
        return value.item()
    return value


def _is_non_finite(value: Any) -> bool:
    """Whether ``value`` is a number (a Python, numpy or 0-d torch one) that is NaN or infinite."""
    number = _scalar(value)
    if isinstance(number, (bool, numbers.Integral)) or not isinstance(number, numbers.Number):
        return False
    try:
        return not all(math.isfinite(part) for part in (number.real, number.imag))
    except (TypeError, ValueError, OverflowError):
        return False


def _whole_number(value: Any) -> int | None:
    """``value`` as an int when it is an integer (Python, numpy, 0-d tensor; not a bool)."""
    number = _scalar(value)
    if isinstance(number, bool) or not isinstance(number, numbers.Integral):
        return None
    return int(number)


def _real_number(value: Any) -> float | None:
    """``value`` as a float when it is a real number (Python, numpy, 0-d tensor; not a bool)."""
    number = _scalar(value)
    if isinstance(number, bool) or not isinstance(number, numbers.Real):
        return None
    return float(number)


def _show(value: Any) -> str:
    number = _scalar(value)
    return repr(number) if isinstance(number, float) else repr(value)


def _builtin_defaults(model: str) -> dict[str, Any]:
    return dict(BUILTIN_PIPELINE_DEFAULTS.get(model, {}))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _is_json_scalar(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def _versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for dist in ("omni_dist_offload", "diffusers", "transformers"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = "not installed"
    # The running build's own version, with its local tag (+cu130, +cpu): an installer's record
    # can leave the tag out.
    versions["torch"] = torch.__version__
    return versions
