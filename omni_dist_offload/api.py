"""``Omni``: load a diffusion pipeline, stream it with a layerwise offload config, generate.

    from omni_dist_offload import Omni

    omni = Omni(model="Wan-AI/Wan2.2-T2V-A14B-Diffusers",
                diffusion_offload_config={"mode": "layer", "components": ["dit"]})
    result = omni.generate(prompt="a red fox in snow", num_inference_steps=30, seed=0)
    result.save("out/")

``model`` is a built-in name (``tiny-wan``, ``tiny-flux``: random weights built in code, no
downloads), a local diffusers folder (``save_pretrained`` output) or a hub id whose weights are
cached. With an offload config, a folder or cached snapshot is cold-started
(``omni_dist_offload.coldstart``): streamed components are built without their weights and each
block is read from the safetensors files straight into this rank's host buffer or shard, so no
rank ever holds the whole model; everything else loads as usual. Otherwise the pipeline is built
on the host, then :func:`apply_offload` streams the selected components and moves everything else
to the device; without a config the whole pipeline moves to the device.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import logging
import platform
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .apply import OffloadHandle, apply_offload, resolve_device
from .config import OffloadConfig
from .outputs import GenerationResult, to_uint8
from .ranks import current_rank, rank_prefix

__all__ = [
    "BUILTIN_MODELS",
    "DTYPES",
    "GenerationOptionError",
    "ModelLoadError",
    "Omni",
    "SamplingOptions",
    "SetupTimings",
    "format_bytes",
    "resolve_device",
    "resolve_dtype",
]

logger = logging.getLogger("omni_dist_offload")

#: Built-in pipelines (see ``omni_dist_offload.tiny``): random weights, built in code.
BUILTIN_MODELS: tuple[str, ...] = ("tiny-wan", "tiny-flux", "wan-14b-random")

#: Names accepted for ``dtype`` (and ``--dtype``).
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}

#: Frames per second of written videos when the caller gives none (Wan's rate).
DEFAULT_FPS = 16

# Pipeline arguments that Omni sets itself.
_RESERVED = frozenset({"prompt", "generator", "output_type", "return_dict"})


class GenerationOptionError(ValueError):
    """A generation option the pipeline does not take (``num_frames`` for an image model, say)."""


class ModelLoadError(RuntimeError):
    """The model could not be found or loaded; the message says what was tried."""


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


class Omni:
    """A pipeline on a device, its offload handle, and ``generate``."""

    def __init__(
        self,
        model: str = "tiny-wan",
        diffusion_offload_config: OffloadConfig | Mapping[str, Any] | str | None = None,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | str | None = None,
        progress: bool = True,
        load_kwargs: Mapping[str, Any] | None = None,
        cold_start: bool = True,
    ) -> None:
        """``dtype`` defaults to bfloat16 on a GPU and float32 on the CPU. ``progress`` shows
        denoising progress bars (on rank 0 only). ``load_kwargs`` go to ``from_pretrained``.
        ``cold_start=False`` loads a folder whole before offloading it (the slower, memory-hungry
        path; for comparison and debugging)."""
        self.model = model
        config = diffusion_offload_config
        self.config = None if config is None else OffloadConfig.parse(config)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.handle: OffloadHandle | None = None
        self._progress = progress
        self.cold_start = False
        """Whether the streamed components were cold-started from their safetensors files."""
        start = time.perf_counter()
        cold = self._prepare_cold_start(dict(load_kwargs or {})) if cold_start else None
        try:
            self.pipeline = _load_pipeline(str(cold.folder) if cold else model, self.dtype,
                                           {**(load_kwargs or {}), **(cold.components if cold else {})})
            loaded = time.perf_counter()
            self._place(cold)
        finally:
            if cold is not None:
                cold.close()
        self.timings = SetupTimings(load_s=loaded - start, place_s=time.perf_counter() - loaded)
        self.set_progress(progress)
        self._signature = inspect.signature(self.pipeline.__call__)
        logger.info("%s%s ready on %s (%s) in %.1f s (load %.1f s, %s %.1f s)", rank_prefix(),
                    model, self.device, _dtype_name(self.dtype), self.timings.setup_s,
                    self.timings.load_s, "offload" if self.config else "move",
                    self.timings.place_s)

    # -- setup -------------------------------------------------------------------------
    def _prepare_cold_start(self, load_kwargs: dict[str, Any]) -> Any:
        """Build the streamed components of a folder without their weights, or None when the
        ordinary load applies (no config, a built-in, nothing to cold-start)."""
        if self.config is None or self.model in BUILTIN_MODELS:
            return None
        from .coldstart import cold_start_folder, prepare_cold_start

        folder, reason = cold_start_folder(self.model, load_kwargs)
        if folder is None:
            logger.info("%sloading %s whole before offloading: %s", rank_prefix(), self.model, reason)
            return None
        cold = prepare_cold_start(folder, self.config, device=self.device, dtype=self.dtype)
        if not cold.components:
            cold.close()
            return None
        self.cold_start = True
        logger.info("%scold start: %s built without block weights; their blocks are read from the "
                    "safetensors files into host memory", rank_prefix(), sorted(cold.components))
        return cold

    def _place(self, cold: Any = None) -> None:
        """Stream the selected components; everything else (or all of it) goes to the device.

        Never ``pipeline.to(device)`` after ``apply_offload``: that would pull the streamed
        blocks onto the device and undo the streaming."""
        if self.config is None:
            self.pipeline.to(self.device)
            return
        total = sum(_module_bytes(m) for m in _pipeline_modules(self.pipeline).values())
        logger.info("%soffloading %s of %s (%s of weights in all) to stream from host memory; "
                    "consolidating%s blocks", rank_prefix(), list(self.config.components),
                    self.model, format_bytes(total),
                    " and pinning" if self.config.pin_memory and self.device.type == "cuda" else "")
        self.handle = apply_offload(self.pipeline, self.config, device=self.device,
                                    block_sources=cold.sources if cold else None, progress=self._progress)

    def set_progress(self, show: bool) -> None:
        """Show or hide denoising progress bars; never shown on ranks other than 0."""
        self.pipeline.set_progress_bar_config(disable=not (show and current_rank() == 0))

    # -- queries -----------------------------------------------------------------------
    def summary(self) -> list[dict[str, Any]]:
        """The offload summary: one dict per streamed ring (empty when nothing streams)."""
        return self.handle.summary() if self.handle is not None else []

    def components(self) -> dict[str, nn.Module]:
        """The pipeline's module components by attribute name."""
        return _pipeline_modules(self.pipeline)

    def call_kwargs(self, **options: Any) -> dict[str, Any]:
        """The keyword arguments ``generate`` passes to the pipeline for these options, checked
        against its ``__call__``; raises :class:`GenerationOptionError` for one it does not take."""
        given = {k: v for k, v in options.items() if v is not None}
        params = self._signature.parameters
        open_ended = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        for key in given:
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
        latents on every device and rank."""
        call = self.call_kwargs(**options)
        generator = torch.Generator(device="cpu").manual_seed(seed)
        start = time.perf_counter()
        out = self.pipeline(prompt=prompt, generator=generator, output_type="np", **call)
        pixels = to_uint8(out.frames[0] if hasattr(out, "frames") else out.images[0])
        elapsed = time.perf_counter() - start
        kind = "video" if pixels.ndim == 4 else "image"
        result = GenerationResult(prompt=prompt, seed=seed, kind=kind, frames=pixels,
                                  name=name or f"seed{seed:05d}", fps=fps or DEFAULT_FPS)
        result.metadata = self._metadata(result, call, elapsed)
        return result

    def _metadata(self, result: GenerationResult, call: Mapping[str, Any], elapsed: float) -> dict[str, Any]:
        height, width = result.frames.shape[-3:-1]
        params = self._signature.parameters

        def effective(key: str) -> Any:
            if key in call:
                return call[key]
            default = params[key].default if key in params else None
            return None if default is inspect.Parameter.empty else default

        return {
            "prompt": result.prompt,
            "negative_prompt": call.get("negative_prompt"),
            "seed": result.seed,
            "model": self.model,
            "pipeline_class": type(self.pipeline).__name__,
            "kind": result.kind,
            "height": int(height),
            "width": int(width),
            "num_frames": int(result.frames.shape[0]) if result.kind == "video" else None,
            "fps": result.fps if result.kind == "video" else None,
            "num_inference_steps": effective("num_inference_steps"),
            "guidance_scale": effective("guidance_scale"),
            "pipeline_kwargs": {k: v for k, v in call.items() if _is_json_scalar(v)},
            "device": str(self.device),
            "dtype": _dtype_name(self.dtype),
            "offload_config": self.config.to_dict() if self.config else None,
            "offload_summary": self.summary(),
            "timings": {"setup_s": self.timings.setup_s, "load_s": self.timings.load_s,
                        "place_s": self.timings.place_s, "generation_s": elapsed},
            "versions": _versions(),
        }

    # -- teardown ----------------------------------------------------------------------
    def close(self) -> None:
        """Undo the offload (streamed tensors become ordinary device tensors). Idempotent."""
        if self.handle is not None:
            self.handle.remove()
            self.handle = None

    def __enter__(self) -> Omni:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def resolve_dtype(dtype: torch.dtype | str | None, device: torch.device) -> torch.dtype:
    """``None``: bfloat16 on a GPU, float32 on the CPU; names from :data:`DTYPES`."""
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {['auto', *DTYPES]}.")
    return DTYPES[dtype]


def _load_pipeline(model: str, dtype: torch.dtype, load_kwargs: dict[str, Any]) -> Any:
    """Build a built-in pipeline, or load a local folder or hub id, on the host in ``dtype``."""
    if model in BUILTIN_MODELS:
        from .tiny import BUILTIN_PIPELINES, cast_like_pretrained

        pipe = BUILTIN_PIPELINES[model]()
        if dtype != torch.float32:
            for module in _pipeline_modules(pipe).values():
                cast_like_pretrained(module, dtype)
        return pipe
    path = Path(model).expanduser()
    if path.is_dir() and not (path / "model_index.json").is_file():
        raise ModelLoadError(
            f"folder {str(path)!r} has no model_index.json, so it is not a diffusers pipeline "
            "folder: point --model at the folder that pipe.save_pretrained() wrote."
        )
    if not path.is_dir() and model.startswith((".", "/", "~")):
        raise ModelLoadError(
            f"model folder {model!r} does not exist: give an existing diffusers folder, a hub id "
            f"or a built-in name {list(BUILTIN_MODELS)}."
        )
    from diffusers import DiffusionPipeline

    logger.info("%sloading %s (%s) on the host", rank_prefix(), model, _dtype_name(dtype))
    try:
        # Weights come from safetensors only (no pickled .bin checkpoints), unless the caller
        # passes use_safetensors=False in load_kwargs.
        loader = DiffusionPipeline
        if path.is_dir() and any(isinstance(v, nn.Module) for v in load_kwargs.values()):
            # Components passed in must go through the concrete class: DiffusionPipeline's own
            # from_pretrained treats components with a default (WanPipeline's transformer) as
            # plain options, loads them from disk anyway and then drops them.
            from .coldstart import pipeline_class

            loader = pipeline_class(path)
        return loader.from_pretrained(
            str(path) if path.is_dir() else model, **{_dtype_kwarg(): dtype},
            **{"use_safetensors": True, **load_kwargs})
    except (OSError, ValueError) as exc:
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ModelLoadError(
            f"could not load {model!r} ({type(exc).__name__}: {detail}): give a built-in name "
            f"{list(BUILTIN_MODELS)}, a local diffusers folder, or a hub id whose weights are in "
            "the local cache (set HF_HUB_OFFLINE=1 to skip the network)."
        ) from exc


def _dtype_kwarg() -> str:
    """diffusers 0.42 renamed ``torch_dtype`` to ``dtype`` (the old name warns)."""
    try:
        major, minor = (int(p) for p in importlib.metadata.version("diffusers").split(".")[:2])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return "torch_dtype"
    return "dtype" if (major, minor) >= (0, 42) else "torch_dtype"


def _builtin_defaults(model: str) -> dict[str, Any]:
    if model not in BUILTIN_MODELS:
        return {}
    from .tiny import BUILTIN_PIPELINE_DEFAULTS

    return dict(BUILTIN_PIPELINE_DEFAULTS[model])


def _pipeline_modules(pipe: Any) -> dict[str, nn.Module]:
    components = getattr(pipe, "components", None) or {}
    return {name: m for name, m in components.items() if isinstance(m, nn.Module)}


def _module_bytes(module: nn.Module) -> int:
    seen: set[int] = set()
    total = 0
    for t in [*module.parameters(), *module.buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def format_bytes(n: int) -> str:
    """``n`` bytes in the largest binary unit that keeps it at least 1 (``"1.5 GiB"``)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _is_json_scalar(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def _versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for dist in ("omni_dist_offload", "torch", "diffusers", "transformers"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = "not installed"
    return versions
