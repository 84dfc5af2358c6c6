"""Decoding written outputs in tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image


def read_frames(path: Path) -> np.ndarray:
    """Decode a PNG or GIF with Pillow: ``(frames, height, width, 3)`` uint8."""
    with Image.open(path) as image:
        frames = []
        for i in range(getattr(image, "n_frames", 1)):
            image.seek(i)
            frames.append(np.asarray(image.convert("RGB")))
    return np.stack(frames)


def png_size(path: Path) -> tuple[int, int]:
    """A written chart's ``(width, height)``, after checking that it is a valid PNG."""
    with Image.open(path) as image:
        image.verify()
    with Image.open(path) as image:
        assert image.format == "PNG"
        return image.size
