"""Front-end inputs and outputs: GIF frame rates, a ``~user`` model path that cannot be expanded, prompt
texts of more than one prompt, ``--device cuda:N`` under torchrun, and which copy of the package
launch/generate.py runs."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from omni_dist_offload import Omni
from omni_dist_offload.app import cli, outputs
from omni_dist_offload.app.api import GenerationOptionError, ModelLoadError
from omni_dist_offload.app.outputs import GenerationResult

REPO = Path(__file__).resolve().parents[2]
NO_USER = "~omni_offload_no_such_user"


# -- GIF frame delays ----------------------------------------------------------------------
def _gif(tmp_path: Path, fps: int, name: str) -> tuple[int, dict]:
    """A six-frame GIF saved at ``fps``: its stored delay in ms (whole 1/100 s) and its sidecar."""
    frames = np.random.default_rng(0).integers(0, 255, (6, 8, 8, 3), dtype=np.uint8)
    result = GenerationResult(prompt="p", seed=0, kind="video", frames=frames, name=name, fps=fps,
                              metadata={"fps": fps})
    saved = result.save(tmp_path, video_format="gif")
    with Image.open(saved.media) as image:
        delay = image.info["duration"]
    return delay, json.loads(saved.sidecar.read_text())


@pytest.mark.parametrize("fps, delay_ms, playback", [
    (16, 60, 16.667),   # 6/100 s: the nearest a GIF has
    (25, 40, None),     # exact: nothing more to record
    (40, 30, 33.333),   # 3/100 s (33.3 fps) is nearer 40 than 2/100 s (50 fps)
    (60, 20, 50.0),     # was 1/100 s, which browsers play at 10 fps
    (120, 20, 50.0),    # was 0, played at 10 fps too
])
def test_a_gif_plays_at_the_nearest_rate_it_has_and_the_sidecar_says_which(tmp_path, monkeypatch, fps, delay_ms,
                                                                          playback) -> None:
    monkeypatch.setattr(outputs, "_warned_gif_rates", set(), raising=False)
    delay, sidecar = _gif(tmp_path, fps, "v")
    assert delay == delay_ms
    assert sidecar["fps"] == fps
    assert sidecar.get("playback_fps") == playback


def test_a_gif_far_off_its_rate_warns_once(tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setattr(outputs, "_warned_gif_rates", set(), raising=False)
    with caplog.at_level(logging.WARNING, logger="omni_dist_offload"):
        _gif(tmp_path, 16, "a")   # 4 % off: recorded, not worth a line on every run
        _gif(tmp_path, 60, "b")
        _gif(tmp_path, 60, "c")
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1, lines
    assert "60 fps is written as 50 fps, 2/100 s a frame" in lines[0] and "MP4" in lines[0], lines


# -- a ~user that cannot be expanded -------------------------------------------------------
def test_a_model_under_an_unknown_home_is_a_usage_error_naming_it(tmp_path) -> None:
    """Path.expanduser raised RuntimeError('Could not determine home directory.'): a traceback."""
    out_dir = tmp_path / "out"
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        rc = cli.main(["generate", "--model", f"{NO_USER}/wan", "--output-dir", str(out_dir)])
    assert rc == 2, stderr.getvalue()
    lines = stderr.getvalue().strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"omni-offload generate: error: argument --model: '{NO_USER}' (in '{NO_USER}/wan') "
                               "names no home folder known here (no such user, or HOME is not set)"), lines
    assert not out_dir.exists()


def test_omni_refuses_a_model_under_an_unknown_home_before_anything_loads() -> None:
    with pytest.raises(ModelLoadError, match=f"model '{NO_USER}/wan': '{NO_USER}' names no home folder known here"):
        Omni(f"{NO_USER}/wan", progress=False)


# -- prompt texts: one prompt per call -----------------------------------------------------
@pytest.fixture(scope="module")
def flux() -> Omni:
    omni = Omni("tiny-flux", None, progress=False)
    yield omni
    omni.close()


@pytest.mark.parametrize("value", [["b", "c"], ("b", "c", "d"), [], 3])
def test_a_prompt_2_of_several_prompts_is_refused_before_anything_runs(flux, monkeypatch, value) -> None:
    """Flux's prompt_2 (its T5 prompt) as a list of two failed mid-forward on a batch mismatch."""
    calls = []
    monkeypatch.setattr(type(flux.pipeline), "encode_prompt", lambda *a, **k: calls.append(1))
    with pytest.raises(GenerationOptionError, match=r"prompt_2=.*: the prompt is one string, so prompt_2 is one "
                                                    "too: give a string"):
        flux.generate("a", seed=1, prompt_2=value)
    assert calls == []


def test_a_prompt_text_given_as_a_list_of_one_is_recorded_as_its_string(flux) -> None:
    """prompt_2=["b"] ran, but the sidecar's pipeline_kwargs left it out (only scalars are kept)."""
    meta = flux.generate("a", seed=1, num_inference_steps=1, prompt_2=["b"], negative_prompt=["n"]).metadata
    assert meta["pipeline_kwargs"]["prompt_2"] == "b"
    assert meta["pipeline_kwargs"]["negative_prompt"] == "n" and meta["negative_prompt"] == "n"


# -- --device cuda:N under torchrun --------------------------------------------------------
@pytest.mark.parametrize("world, local, device, refused", [
    ("2", "1", "cuda:0", True),    # every rank on GPU 0 while NCCL binds GPU 1
    ("2", "1", "cuda:1", False),   # its own GPU
    ("2", "1", "cuda", False),
    ("2", "1", "cpu", False),
    ("1", "0", "cuda:3", False),   # one process: any GPU
])
def test_an_explicit_gpu_other_than_the_ranks_own_is_refused_under_torchrun(monkeypatch, world, local, device,
                                                                            refused) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("WORLD_SIZE", world)
    monkeypatch.setenv("LOCAL_RANK", local)
    if not refused:
        cli._check_device(device)
        return
    with pytest.raises(cli.UsageError, match=rf"--device '{device}': under torchrun each rank runs on its own GPU, "
                                             rf"cuda:LOCAL_RANK \(cuda:{local} on this rank\): give --device cuda"):
        cli._check_device(device)


# -- launch/generate.py runs its own checkout ----------------------------------------------
def _fake_package(root: Path, says: str) -> None:
    """A stand-in omni_dist_offload whose main prints ``says``."""
    for sub in ("", "app", "runtime"):
        (root / "omni_dist_offload" / sub).mkdir(parents=True, exist_ok=True)
        (root / "omni_dist_offload" / sub / "__init__.py").write_text("")
    (root / "omni_dist_offload" / "app" / "cli.py").write_text(f"def main(argv):\n    print({says!r})\n    return 0\n")
    (root / "omni_dist_offload" / "runtime" / "proc.py").write_text(
        "import sys\ndef exit_with(main, *args):\n    sys.exit(main(*args))\n")


def test_launch_generate_runs_the_checkout_it_is_in_not_an_installed_copy(tmp_path) -> None:
    """bench.sh and serve.sh put the checkout first; generate.py took an installed copy first."""
    checkout, installed = tmp_path / "checkout", tmp_path / "site"
    (checkout / "launch").mkdir(parents=True)
    shutil.copy(REPO / "launch" / "generate.py", checkout / "launch" / "generate.py")
    _fake_package(checkout, "checkout")
    _fake_package(installed, "installed")
    proc = subprocess.run([sys.executable, str(checkout / "launch" / "generate.py")], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(installed)}, cwd=tmp_path)
    assert (proc.returncode, proc.stdout.strip()) == (0, "checkout"), proc.stderr
