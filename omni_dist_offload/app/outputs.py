"""Generation results and how they are written: PNG for images, MP4 or GIF for videos, plus a
JSON sidecar holding the prompt, seed, model, offload config, sizes, timings and versions.

MP4 needs the optional ``video`` extra (``imageio`` with ``imageio-ffmpeg``); without it videos
are written as GIF through Pillow, which comes with diffusers.

Both files are written under hidden temporary names in the same folder and renamed into place,
so an earlier output of the same name stays whole until the new one is complete (a re-run into
the same folder, interrupted or out of disk space).
"""

from __future__ import annotations

import errno
import importlib.util
import json
import logging
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
from PIL import Image

__all__ = [
    "MEDIA_SUFFIXES",
    "VIDEO_FORMATS",
    "GenerationResult",
    "OutputWriteError",
    "SavedOutput",
    "mp4_available",
    "numbered_outputs",
    "resolve_video_format",
    "to_uint8",
]

logger = logging.getLogger(__name__)

#: ``--video-format`` values: ``auto`` is MP4 when the ``video`` extra is installed, else GIF.
VIDEO_FORMATS: tuple[str, ...] = ("auto", "mp4", "gif")

VideoFormat = Literal["auto", "mp4", "gif"]

#: The media files :meth:`GenerationResult.save` writes: images as PNG, videos as MP4 or GIF.
MEDIA_SUFFIXES: tuple[str, ...] = (".png", ".mp4", ".gif")

# What the runner writes for prompt k (``dp``): ``<k:05d>`` and one of the media suffixes or the
# JSON sidecar.
_NUMBERED = re.compile(r"(\d{5,})(?:%s)" % "|".join(re.escape(suffix) for suffix in (*MEDIA_SUFFIXES, ".json")))


class OutputWriteError(OSError):
    """An output file that could not be written (a full disk, a folder made read-only or removed
    since the run started): the message names the file and the reason, ``errno`` is the
    failure's. An earlier output of that name is left as it was."""


@dataclass(frozen=True, slots=True)
class SavedOutput:
    """The files one result was written to."""

    media: Path
    sidecar: Path


@dataclass(kw_only=True, slots=True)
class GenerationResult:
    """One generated image or video, with everything needed to reproduce it."""

    prompt: str
    seed: int
    kind: Literal["image", "video"]
    frames: np.ndarray
    """``uint8`` pixels: ``(height, width, 3)`` for an image, ``(frames, height, width, 3)`` for
    a video."""
    name: str
    """File stem used by :meth:`save` (``<name>.png``, ``<name>.json``)."""
    fps: int = 16
    metadata: dict[str, Any] = field(default_factory=dict)
    """The JSON sidecar's content (prompt, seed, model, config, sizes, timings, versions)."""

    def save(self, directory: str | Path, *, video_format: VideoFormat = "auto",
             replace: bool = False) -> SavedOutput:
        """Write the media file and its JSON sidecar into ``directory`` (created if missing).

        ``replace``: also remove ``<name>`` in the other media formats (a GIF an earlier run of
        a video model wrote where this writes a PNG), which the new sidecar no longer
        describes; nothing else is touched. Off by default: a caller may save one result in
        two formats on purpose.

        Each file is written under a hidden temporary name (``.<name>.part.png``) and renamed
        into place, the media first and the sidecar last, once both are complete: an
        interruption or a failed write leaves an earlier ``<name>`` pair whole (only the two
        renames lie between the old pair and the new one), and no temporary file behind (a
        process killed outright may leave a hidden one, which the next save overwrites). A
        write that fails raises :class:`OutputWriteError` naming the file."""
        out_dir = Path(directory)
        extra: dict[str, Any] = {}
        if self.kind == "image":
            suffix, write = ".png", lambda path: _write_png(path, self.frames)
        elif resolve_video_format(video_format) == "mp4":
            suffix, write = ".mp4", lambda path: _write_mp4(path, self.frames, self.fps)
        else:
            suffix, write = ".gif", lambda path: _write_gif(path, self.frames, self.fps)
            delay = gif_delay_cs(self.fps)
            if 100 / delay != self.fps:  # the sidecar says at what rate the file really plays
                extra["playback_fps"] = round(100 / delay, 3)
                _warn_gif_rate(self.fps, delay)
        # Suffixes are appended: a name with a dot (``fox.v1``) keeps its tail.
        media = out_dir / f"{self.name}{suffix}"
        # Strict JSON (no bare NaN or Infinity), made before anything is written: a value that
        # cannot be written leaves the folder as it was.
        text = _sidecar_text({**self.metadata, "file": media.name, **extra})
        sidecar = out_dir / f"{self.name}.json"
        # Opened "wb" on its own name, a file is empty at once: an interruption or a full disk
        # then left an earlier run's good output 0 bytes beside its sidecar. The suffix stays
        # last (Pillow and ffmpeg pick the format by it); the leading dot hides the file, and
        # numbered_outputs() does not count it.
        parts = {media: _part(media), sidecar: _part(sidecar)}
        target = media
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            write(parts[media])
            target = sidecar
            parts[sidecar].write_text(text)
            for target, part in parts.items():
                os.replace(part, target)
        except BaseException as exc:
            # Ctrl-C (KeyboardInterrupt) too: half a file must not stay in the folder. A signal
            # that ends the process at once (SIGTERM, SIGKILL) can leave a hidden part, never a
            # damaged output; the next save of this name writes over it.
            for part in parts.values():
                try:
                    part.unlink(missing_ok=True)
                except OSError:
                    pass
            if isinstance(exc, OSError):
                raise _write_error(target, exc) from exc
            raise
        if replace:
            # Only once the new pair is written: a failure before it leaves the old media its sidecar.
            for other in MEDIA_SUFFIXES:
                stale = out_dir / f"{self.name}{other}"
                if stale != media and stale.is_file():
                    stale.unlink()
        return SavedOutput(media=media, sidecar=sidecar)


def numbered_outputs(directory: str | Path) -> list[int]:
    """The prompt numbers k of the outputs the runner wrote in ``directory`` (``<k:05d>`` with a
    media suffix or ``.json``), sorted; none when it does not exist."""
    return sorted(set(numbered_files(directory).values()))


def numbered_files(directory: str | Path) -> dict[Path, int]:
    """The files of :func:`numbered_outputs`, each with its prompt number."""
    try:
        names = [entry.name for entry in Path(directory).iterdir()]
    except OSError:  # missing, or not a folder (the CLI refuses that before)
        return {}
    return {Path(directory, name): int(m[1]) for name in names
            if (m := _NUMBERED.fullmatch(name)) and m[1] == f"{int(m[1]):05d}"}


def mp4_available() -> bool:
    """Whether MP4 can be written: ``imageio`` and ``imageio-ffmpeg`` are importable."""
    return all(importlib.util.find_spec(name) is not None for name in ("imageio", "imageio_ffmpeg"))


def resolve_video_format(video_format: str) -> Literal["mp4", "gif"]:
    """``auto`` becomes MP4 when it can be written, else GIF; an explicit MP4 without the
    writer raises naming the install command."""
    if video_format not in VIDEO_FORMATS:
        raise ValueError(f"video format {video_format!r} is not one of {list(VIDEO_FORMATS)}.")
    if video_format == "gif":
        return "gif"
    if mp4_available():
        return "mp4"
    if video_format == "mp4":
        raise ValueError(
            "video format 'mp4' needs imageio and imageio-ffmpeg, which are not installed: "
            "pip install 'omni_dist_offload[video]', or use --video-format gif."
        )
    return "gif"


def to_uint8(pixels: Any) -> np.ndarray:
    """Pipeline output in ``[0, 1]`` (numpy or torch, channels last) to ``uint8``, rounded the
    way diffusers' own ``numpy_to_pil`` rounds."""
    array = np.asarray(pixels.float().cpu() if hasattr(pixels, "cpu") else pixels)
    if array.dtype == np.uint8:
        return array
    return (np.clip(array, 0.0, 1.0) * 255).round().astype(np.uint8)


def _part(path: Path) -> Path:
    """The hidden temporary name ``path`` is written under before it is renamed into place."""
    return path.with_name(f".{path.stem}.part{path.suffix}")


def _write_error(path: Path, exc: OSError) -> OutputWriteError:
    reason = exc.strerror or str(exc)
    fix = ("free some space there" if exc.errno in (errno.ENOSPC, errno.EDQUOT)
           else "check that its folder exists and can be written")
    error = OutputWriteError(f"cannot write {str(path)!r} ({reason}); an earlier output of that name is left as it "
                             f"was: {fix}, or write to another folder.")
    error.errno = exc.errno
    return error


def _write_png(path: Path, frame: np.ndarray) -> None:
    Image.fromarray(frame).save(path)


#: The shortest GIF frame delay, in 1/100 s, that players honour: browsers play a delay of 0 or 1
#: at 10 fps, so 50 fps is the fastest a GIF plays.
_GIF_MIN_DELAY_CS = 2
#: A GIF whose rate is further than this from the one asked for gets a warning (16 fps plays at
#: 16.67, 4 % faster, the nearest a GIF has: not worth a line on every run).
_GIF_RATE_TOLERANCE = 0.05
_warned_gif_rates: set[int] = set()


def gif_delay_cs(fps: int) -> int:
    """The GIF frame delay, in 1/100 s (GIF's unit), that plays nearest ``fps``: at least
    :data:`_GIF_MIN_DELAY_CS` (50 fps), which is as fast as players go."""
    exact = 100 / fps
    candidates = {max(_GIF_MIN_DELAY_CS, math.floor(exact)), max(_GIF_MIN_DELAY_CS, math.ceil(exact))}
    return min(candidates, key=lambda cs: (abs(100 / cs - fps), cs))


def _warn_gif_rate(fps: int, delay_cs: int) -> None:
    """One warning per process and rate, when the GIF plays visibly off the rate asked for."""
    played = 100 / delay_cs
    if abs(played - fps) / fps <= _GIF_RATE_TOLERANCE or fps in _warned_gif_rates:
        return
    _warned_gif_rates.add(fps)
    logger.warning("a GIF frame delay is a whole number of 1/100 s (2 or more; browsers play shorter ones at 10 "
                   "fps): %d fps is written as %.4g fps, %d/100 s a frame, which the sidecar records as "
                   "playback_fps. For %d fps write MP4 (pip install 'omni_dist_offload[video]'), or ask for "
                   "50, 25, 20 or 10 fps, which a GIF plays exactly.", fps, played, delay_cs, fps)


def _write_gif(path: Path, frames: np.ndarray, fps: int) -> None:
    images = [Image.fromarray(frame) for frame in frames]
    # Pillow takes milliseconds and stores whole 1/100 s (GIF's unit), cut down: give it a
    # whole number of those. loop=0 repeats forever.
    images[0].save(path, save_all=True, append_images=images[1:], duration=10 * gif_delay_cs(fps), loop=0)


def _write_mp4(path: Path, frames: np.ndarray, fps: int) -> None:
    import imageio.v2 as imageio  # optional: the video extra (resolve_video_format checked it)

    # H.264 in yuv420p needs even sizes; a macro block of 2 pads odd ones instead of resizing
    # every frame to a multiple of 16.
    imageio.mimwrite(path, list(frames), fps=fps, codec="libx264", quality=8, macro_block_size=2)


def _sidecar_text(record: dict[str, Any]) -> str:
    """``record`` as strict JSON; raises ValueError naming a value that is not a finite number."""
    try:
        return json.dumps(record, indent=2, default=_json_default, allow_nan=False) + "\n"
    except ValueError as exc:
        where = _non_finite_path(json.loads(json.dumps(record, default=_json_default)), "metadata")
        raise ValueError(f"{where or 'a metadata value'} is not a finite number, which strict JSON cannot "
                         "hold: give finite values (or fix result.metadata) before save().") from exc


def _non_finite_path(value: Any, path: str) -> str | None:
    if isinstance(value, float) and not math.isfinite(value):
        return f"{path} = {value!r}"
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = _non_finite_path(item, f"{path}[{key!r}]")
        if found:
            return found
    return None


def _json_default(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    return repr(value)
