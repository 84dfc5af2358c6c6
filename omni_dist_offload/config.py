"""The offload configuration: parsing and validation.

A config arrives as a dict, a JSON string or an :class:`OffloadConfig`. Everything is checked
before any model is touched, so a bad config changes nothing.
"""

from __future__ import annotations

import difflib
import json
import math
import numbers
import os
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

import torch

from .residency import parse_bytes

__all__ = [
    "COMPONENTS",
    "GATHERS",
    "PIN_FAILURES",
    "STORAGE_DTYPES",
    "UPCASTS",
    "WEIGHT_TRANSFERS",
    "LayerOptions",
    "OffloadConfig",
    "OffloadConfigError",
]

#: Component categories that can be streamed block by block.
COMPONENTS: tuple[str, ...] = ("dit", "text_encoder")
#: How a block's weights reach the device.
WEIGHT_TRANSFERS: tuple[str, ...] = ("rank-local", "shared", "allgather")
#: How allgather moves shards between the GPUs of a host.
GATHERS: tuple[str, ...] = ("auto", "copy-engine", "nccl")
#: What setup does when host memory cannot be page-locked.
PIN_FAILURES: tuple[str, ...] = ("error", "pageable")
#: 8-bit float formats the block weights may be stored in on the host (``storage_dtype``).
STORAGE_DTYPES: tuple[str, ...] = ("float8_e4m3fn", "float8_e5m2")
#: Where 8-bit weights become the compute dtype (``upcast``), see :class:`LayerOptions`.
UPCASTS: tuple[str, ...] = ("block", "layer")
_MODES: tuple[str, ...] = ("layer",)

WeightTransfer = Literal["rank-local", "shared", "allgather"]
PinFailure = Literal["error", "pageable"]
Gather = Literal["auto", "copy-engine", "nccl"]
Upcast = Literal["block", "layer"]


class OffloadConfigError(ValueError):
    """A configuration, plan or model that cannot be offloaded as asked.

    Raised before anything is changed; the message names what was found and how to fix it.
    """


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerOptions:
    """Per-component options of ``mode: "layer"``."""

    weight_transfer: WeightTransfer = "rank-local"
    """``"rank-local"``: every rank keeps the full block in host memory and copies it to its
    device. ``"shared"``: the ranks of a host keep one copy of every block in shared host memory
    and each copies whole blocks to its own device, never waiting for another rank (ranks may run
    different work). ``"allgather"``: every rank keeps one shard; the device rebuilds the block
    by an all-gather across the ranks of this host (every rank runs the same forwards)."""

    chunk_mib: float = 64
    """allgather only: a block moves in chunks of this many MiB (gathered size), so one chunk's
    all-gather overlaps the next chunk's host-to-device copy."""

    gather: Gather = "auto"
    """allgather only: how the other ranks' shards reach this GPU. ``"copy-engine"``: peer
    copies over NVLink out of CUDA symmetric memory, on the copy engines, so rebuilding a block
    takes no SMs from the model. ``"nccl"``: NCCL's all-gather kernels. ``"auto"``: copy-engine
    where every GPU of the weight group can reach the others' memory, else nccl (and on the CPU,
    gloo's all-gather)."""

    resident_blocks: int | tuple[int, ...] | None = None
    """Blocks that stay on the device instead of streaming (they keep no host copy, and
    allgather keeps no shard of them). An int: how many; the planner picks which, from the
    blocks' sizes (``residency.pick_resident``: where sizes differ, the large blocks; where they
    do not, an even spread, so the streamed blocks' copies hide under their compute); a list:
    exactly these block indices (ring order, from 0). ``None``: every block streams."""

    storage_dtype: str | None = None
    """How the block weights are stored in host memory and move to the device. ``None``: as the
    model holds them. ``"float8_e4m3fn"`` or ``"float8_e5m2"``: the weights diffusers' layerwise
    casting would store in 8 bits (Linear and Conv layers outside norms and embeddings, see
    ``docs/integration.md``) are stored so, halving the bytes that move; each block is upcast to
    the model's dtype on the device, on the copy side of the ring. Outputs equal the resident
    model's under ``enable_layerwise_casting`` at the same dtypes, bit for bit."""

    upcast: Upcast = "block"
    """With ``storage_dtype``, where the 8-bit weights become the model's dtype. ``"block"``: a
    whole block at a time, into a slot of the model's dtype, on the copy side of the ring (the
    compute stream never casts; every slot takes the block's full compute-dtype bytes).
    ``"layer"``: blocks stay 8-bit on the device (slots and resident blocks take the 8-bit
    bytes, so a ``device_budget`` holds about twice as many blocks) and each layer upcasts its
    weights just before it runs, on the compute stream, as diffusers' layerwise casting does;
    see [Note: upcast per layer] in ``storage.py``. Diffusers models only (their layers read
    their weights only in their own forward); not with ``torch.compile``; LoRA adapters are
    loaded before offloading (after it, peft would create them in 8 bits)."""

    def __post_init__(self) -> None:
        _check_choice("storage_dtype", self.storage_dtype, STORAGE_DTYPES, "layer_options.<component>",
                      optional=True)
        if self.storage_dtype is not None and not hasattr(torch, self.storage_dtype):
            raise OffloadConfigError(
                f"layer_options.<component> key 'storage_dtype' is {self.storage_dtype!r}, which this "
                f"torch ({torch.__version__}) does not have: upgrade torch, or drop the key.")
        _check_choice("upcast", self.upcast, UPCASTS, "layer_options.<component>")
        if self.upcast != "block" and self.storage_dtype is None:
            raise OffloadConfigError(
                f"layer_options.<component> key 'upcast' is {self.upcast!r} without a storage_dtype: "
                "it says where 8-bit weights are upcast. Add storage_dtype (e.g. \"float8_e4m3fn\"), "
                "or drop upcast.")
        object.__setattr__(self, "resident_blocks", _checked_resident(self.resident_blocks))
        _check_choice("weight_transfer", self.weight_transfer, WEIGHT_TRANSFERS, "layer_options.<component>")
        _check_choice("gather", self.gather, GATHERS, "layer_options.<component>")
        chunk_mib = _positive_number(self.chunk_mib, _MAX_CHUNK_MIB)
        if chunk_mib is None:
            raise OffloadConfigError(
                f"layer_options.<component> key 'chunk_mib' must be a positive number of MiB up to {_MAX_CHUNK_MIB}, "
                f"found {_shown(self.chunk_mib)}: use e.g. 64, or drop the key for the default."
            )
        object.__setattr__(self, "chunk_mib", chunk_mib)  # numpy's numbers too, as plain ones


@dataclass(frozen=True, kw_only=True, slots=True)
class OffloadConfig:
    """What to stream and how. See ``docs/integration.md`` for the full schema."""

    mode: str = "layer"
    """Only ``"layer"``: one block on the device at a time, the next prefetched."""

    components: tuple[str, ...] = ("dit",)
    """Which component categories stream their blocks: ``"dit"``, ``"text_encoder"`` or both."""

    layer_options: Mapping[str, LayerOptions] = field(default_factory=dict)
    """Options per listed component; a component without an entry uses the defaults."""

    pin_memory: bool = True
    """Page-lock the host copies when an accelerator is present (needed for asynchronous
    copies). Ignored on a machine without one."""

    pin_failure: PinFailure = "error"
    """What setup does when a host copy cannot be page-locked (the memlock limit or host memory
    ran out). ``"error"``: raise ``PinMemoryError`` and leave the model as it was.
    ``"pageable"``: warn once and keep that block and every block set up after it in pageable
    memory, whose host-to-device copies run synchronously and several times slower."""

    collective_timeout_s: float = 600.0
    """allgather only: a weight collective that cannot complete (a rank died or diverged)
    raises after this many seconds instead of hanging. At most ``10**9`` (about 31 years): larger
    timeouts overflow torch.distributed's (gloo's near ``1e13``, ``datetime.timedelta`` near
    ``8.6e13``) and Python's waits (``threading.TIMEOUT_MAX``, about ``9.2e9``)."""

    device_budget: int | str | None = None
    """Device memory the streamed components' block weights may take in total, resident blocks
    plus streaming slots: bytes, or a size such as ``"24GiB"`` (stored as bytes). ``"auto"``: the
    memory free once the other modules are on the device, less ``activation_reserve``. ``None``:
    every block streams through two slots. The planner decides which blocks stay resident
    (``docs/design.md``, [Note: residency planner])."""

    activation_reserve: int | str | None = None
    """``device_budget: "auto"`` leaves this much free for activations: bytes or a size. ``None``:
    a tenth of the device's memory, at least 2 GiB."""

    def __post_init__(self) -> None:
        _check_choice("mode", self.mode, _MODES)
        components = self.components
        if isinstance(components, str) or not isinstance(components, (list, tuple)):
            raise OffloadConfigError(
                f"config key 'components' must be a non-empty list of {list(COMPONENTS)}, "
                f"found {components!r}."
            )
        if not components:
            raise OffloadConfigError(
                f"config key 'components' is empty: list at least one of {list(COMPONENTS)}."
            )
        for name in components:
            _check_choice("components[]", name, COMPONENTS)
        repeated = sorted({c for c in components if components.count(c) > 1})
        if repeated:
            raise OffloadConfigError(
                f"config key 'components' repeats {repeated}: list each component once."
            )
        object.__setattr__(self, "components", tuple(components))
        if not isinstance(self.layer_options, Mapping):
            raise OffloadConfigError(
                f"config key 'layer_options' must be a mapping from component to options, "
                f"found {type(self.layer_options).__name__}."
            )
        for name, options in self.layer_options.items():
            if name not in COMPONENTS:
                # A pipeline attribute (transformer, text_encoder_2): options go by category.
                guess = "text_encoder" if "text" in str(name) or "encoder" in str(name) else "dit"
                raise OffloadConfigError(
                    f"config key 'layer_options' has options for {name!r}: it is keyed by category, "
                    f"one of {list(COMPONENTS)}, whose options apply to every component of that kind "
                    f"(a pipeline's transformer and transformer_2 are 'dit'; text_encoder, text_encoder_2, "
                    f"... are 'text_encoder'): use {guess!r}."
                )
            if name not in self.components:
                raise OffloadConfigError(
                    f"config key 'layer_options' has options for {name!r}, which is not in "
                    f"'components' {list(self.components)}: add it to 'components' or drop its options."
                )
            if not isinstance(options, LayerOptions):
                raise OffloadConfigError(
                    f"config key 'layer_options.{name}' must be LayerOptions, found "
                    f"{type(options).__name__}: build the config with OffloadConfig.parse() to "
                    "pass options as a dict."
                )
        # The config's own mapping: the caller's dict, changed later, cannot change a checked config.
        object.__setattr__(self, "layer_options", dict(self.layer_options))
        if not isinstance(self.pin_memory, bool):
            raise OffloadConfigError(
                f"config key 'pin_memory' must be true or false, found {self.pin_memory!r}."
            )
        _check_choice("pin_failure", self.pin_failure, PIN_FAILURES)
        timeout = _positive_number(self.collective_timeout_s, _MAX_TIMEOUT_S)
        if timeout is None:
            raise OffloadConfigError(
                f"config key 'collective_timeout_s' must be a positive number of seconds up to {_MAX_TIMEOUT_S} (about 31 years), "
                f"found {_shown(self.collective_timeout_s)}: use e.g. 600, or drop the key for the default."
            )
        object.__setattr__(self, "collective_timeout_s", timeout)  # numpy's numbers too, as plain ones
        if isinstance(self.device_budget, str) and self.device_budget.strip().lower() == "auto":
            object.__setattr__(self, "device_budget", "auto")
        if self.device_budget is not None and self.device_budget != "auto":
            object.__setattr__(self, "device_budget", _size("device_budget", self.device_budget, "or \"auto\""))
        if self.activation_reserve is not None:
            if self.device_budget != "auto":
                raise OffloadConfigError(
                    f"config key 'activation_reserve' ({self.activation_reserve!r}) is what device_budget \"auto\" "
                    f"leaves free for activations; with device_budget {self.device_budget!r} it would do nothing. "
                    "Set device_budget to \"auto\", or drop activation_reserve.")
            object.__setattr__(self, "activation_reserve", _size("activation_reserve", self.activation_reserve))

    def options_for(self, category: str) -> LayerOptions:
        """The layer options of one component category (defaults when none were given)."""
        return self.layer_options.get(category, _DEFAULT_LAYER_OPTIONS)

    @classmethod
    def parse(cls, config: "OffloadConfig | Mapping[str, Any] | str") -> "OffloadConfig":
        """Build a config from a dict, a JSON string or a config (returned as is)."""
        if isinstance(config, OffloadConfig):
            return config
        if isinstance(config, (str, bytes)):
            try:
                config = json.loads(config, object_pairs_hook=_reject_repeated_keys)
            except UnicodeDecodeError as exc:  # bytes: json.loads decodes them as UTF-8 (or 16/32 by BOM)
                raise OffloadConfigError(
                    f"offload config is not UTF-8 JSON: byte {exc.object[exc.start:exc.start + 1]!r} at "
                    f"offset {exc.start} is not valid {exc.encoding}: pass the JSON text as a str or as "
                    'UTF-8 bytes, such as {"mode": "layer", "components": ["dit"]}.'
                ) from None
            except json.JSONDecodeError as exc:
                text = config.decode(errors="replace") if isinstance(config, bytes) else config
                path = text.strip().endswith(".json") or (len(text) < 4096 and os.path.isfile(text.strip()))
                hint = (" It looks like a file path: the config is the JSON text itself; pass the "
                        "file's contents (in a shell, \"$(cat FILE)\")." if path else "")
                raise OffloadConfigError(
                    f"offload config is not valid JSON ({exc.msg} at line {exc.lineno}, column "
                    f"{exc.colno}): pass an object such as "
                    '{"mode": "layer", "components": ["dit"]}.' + hint
                ) from None
        if not isinstance(config, Mapping):
            hint = (" Pass the file's contents (json.loads(path.read_text())), not its path."
                    if isinstance(config, os.PathLike) else "")
            raise OffloadConfigError(
                f"offload config must be a JSON object or dict, found {type(config).__name__}.{hint}"
            )
        return cls._from_mapping(config)

    @classmethod
    def _from_mapping(cls, raw: Mapping[str, Any]) -> "OffloadConfig":
        _check_keys("config", raw, _TOP_KEYS)
        if "mode" not in raw:
            raise OffloadConfigError(
                "config key 'mode' is missing: set \"mode\": \"layer\"."
            )
        kwargs: dict[str, Any] = {"mode": raw["mode"]}
        if "components" in raw:
            kwargs["components"] = raw["components"]
        for key in ("pin_memory", "pin_failure", "collective_timeout_s", "device_budget", "activation_reserve"):
            if key in raw:
                kwargs[key] = raw[key]
        raw_options = raw.get("layer_options", {})
        if not isinstance(raw_options, Mapping):
            raise OffloadConfigError(
                f"config key 'layer_options' must be an object keyed by component, "
                f"found {raw_options!r}."
            )
        options = {}
        for name, value in raw_options.items():
            if not isinstance(value, Mapping):
                raise OffloadConfigError(
                    f"config key 'layer_options.{name}' must be an object such as "
                    f'{{"weight_transfer": "rank-local"}}, found {value!r}.'
                )
            _check_keys(f"layer_options.{name}", value, LayerOptions.__slots__, nested=True)
            try:
                options[name] = LayerOptions(**value)
            except OffloadConfigError as exc:  # name the component the options belong to
                raise OffloadConfigError(
                    str(exc).replace("layer_options.<component>", f"layer_options.{name}")) from None
        kwargs["layer_options"] = options
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        """The config as plain JSON-able data (the schema :meth:`parse` reads)."""
        return {
            "mode": self.mode,
            "components": list(self.components),
            "layer_options": {
                name: {"weight_transfer": opts.weight_transfer, "chunk_mib": opts.chunk_mib,
                       "gather": opts.gather,
                       "resident_blocks": list(opts.resident_blocks)
                       if isinstance(opts.resident_blocks, tuple) else opts.resident_blocks,
                       "storage_dtype": opts.storage_dtype, "upcast": opts.upcast}
                for name, opts in self.layer_options.items()
            },
            "pin_memory": self.pin_memory,
            "pin_failure": self.pin_failure,
            "collective_timeout_s": self.collective_timeout_s,
            "device_budget": self.device_budget,
            "activation_reserve": self.activation_reserve,
        }



_TOP_KEYS = ("mode", "components", "layer_options", "pin_memory", "pin_failure", "collective_timeout_s",
             "device_budget", "activation_reserve")


def _check_keys(where: str, raw: Mapping[str, Any], allowed: tuple[str, ...], nested: bool = False) -> None:
    """``nested``: the keys of a component's layer_options (else the config's own)."""
    unknown = [k for k in raw if k not in allowed]
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(str(key), allowed, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        # The right key at the other level (Omni's and the CLI's knobs are all top-level).
        if not nested and key in LayerOptions.__slots__:
            hint = (f"{key!r} is a per-component option: put it under layer_options, e.g. "
                    f'{{"layer_options": {{"dit": {{"{key}": ...}}}}}}. ')
        elif nested and key in _TOP_KEYS:
            hint = f"{key!r} is an option of the whole config: put it at the top level, beside 'mode'. "
        raise OffloadConfigError(
            f"unknown key {key!r} in {where}: {hint}allowed keys are {list(allowed)}."
        )


def _reject_repeated_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """JSON objects keep the last of repeated keys silently; a config should not."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise OffloadConfigError(
                f"offload config JSON sets key {key!r} twice: keep one of them."
            )
        out[key] = value
    return out


def _positive_number(value: Any, most: float) -> int | float | None:
    """``value`` as a plain int or float when it is a real number (numpy's too, not a bool) in
    ``(0, most]``, else None. Never raises: an int too large for a float is simply out of range."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    try:
        number = int(value) if isinstance(value, numbers.Integral) else float(value)
    except (OverflowError, ValueError, TypeError):
        return None
    if isinstance(number, float) and not math.isfinite(number):
        return None
    return number if 0 < number <= most else None


def _shown(value: Any) -> str:
    """``repr(value)`` for a message, shortened when it is very long (an int of 400 digits)."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}... ({len(text)} characters)"


#: A chunk larger than this (1 TiB) is larger than any block: the bound keeps byte counts finite.
_MAX_CHUNK_MIB = 2**20
#: The longest ``collective_timeout_s`` (about 31 years): torch.distributed's and Python's waits
#: overflow well before ``datetime.timedelta.max``; see the field's docstring.
_MAX_TIMEOUT_S = 10**9


def _is_index(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 0


def _checked_resident(value: Any) -> int | tuple[int, ...] | None:
    """``resident_blocks`` as an int, a sorted tuple of distinct indices, or None."""
    where = "layer_options.<component> key 'resident_blocks'"
    if value is None or _is_index(value):
        return None if value is None else int(value)  # numpy's integers too, as plain ints
    if isinstance(value, (list, tuple)):
        bad = [v for v in value if not _is_index(v)]
        if bad:
            raise OffloadConfigError(
                f"{where} lists {bad[0]!r}, which is not a block index: give whole numbers from 0, "
                "e.g. [0, 4, 8]."
            )
        repeated = sorted({v for v in value if list(value).count(v) > 1})
        if repeated:
            raise OffloadConfigError(f"{where} repeats {repeated}: list each block once.")
        return tuple(sorted(int(v) for v in value))
    raise OffloadConfigError(
        f"{where} must be a count (a whole number from 0) or a list of block indices, found "
        f"{value!r}: e.g. 4, or [0, 4, 8]."
    )


def _size(key: str, value: Any, also: str = "") -> int:
    """A byte count from an int or a size string; ``OffloadConfigError`` names the key."""
    try:
        return parse_bytes(value, key)
    except ValueError as exc:
        hint = f" ({also.strip()})" if also else ""
        raise OffloadConfigError(str(exc).replace("which is not a size:", f"which is not a size{hint}:")) from None


def _check_choice(key: str, value: Any, allowed: tuple[str, ...], where: str = "config",
                  optional: bool = False) -> None:
    if optional and value is None:
        return
    if not isinstance(value, str) or value not in allowed:
        shown = [*allowed, None] if optional else list(allowed)
        raise OffloadConfigError(
            f"{where} key {key!r} has value {value!r}: allowed values are {shown}."
        )


_DEFAULT_LAYER_OPTIONS = LayerOptions()
