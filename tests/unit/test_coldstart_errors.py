"""Cold start, in one process: a hub id resolved as from_pretrained resolves it, an I/O error
while reading named with its file, a config.json value of the wrong type named on both load
paths, and optional components saved as null left alone. One rank's failure to load told to the
others by load_offloaded: dist/test_coldstart_agreement_ranks.py."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
from diffusers import DiffusionPipeline

from omni_dist_offload.loading import ModelLoadError, load_pipeline
from omni_dist_offload.loading.checkpoint import CheckpointError, SafetensorsCheckpoint, find_weight_files
from omni_dist_offload.loading.coldstart import cold_start_folder, load_offloaded, prepare_cold_start

DIT = {"mode": "layer", "components": ["dit"]}
BOTH = {"mode": "layer", "components": ["dit", "text_encoder"]}
OLD, NEW = "a" * 40, "b" * 40


# -- a hub id: the Hub is asked, as from_pretrained asks it ------------------------------------
@pytest.fixture
def hub_cache(wan_folder, tmp_path) -> Path:
    """A hub cache holding ``org/tiny-wan`` at revision OLD, which refs/main points at."""
    repo = tmp_path / "cache" / "models--org--tiny-wan"
    shutil.copytree(wan_folder, repo / "snapshots" / OLD)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(OLD)
    return tmp_path / "cache"


@pytest.fixture
def online(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)


def test_a_hub_id_is_resolved_through_the_hub_when_online(hub_cache, online, monkeypatch):
    """The Hub's main is at NEW now (or the cache lacks a component): from_pretrained would fetch
    what is missing and load NEW; the cold start took the cached OLD without asking."""
    new = hub_cache / "models--org--tiny-wan" / "snapshots" / NEW
    shutil.copytree(hub_cache / "models--org--tiny-wan" / "snapshots" / OLD, new)
    calls = []

    def download(name, **kwargs):
        calls.append((name, kwargs))
        return str(new)

    monkeypatch.setattr(DiffusionPipeline, "download", download)
    folder, reason = cold_start_folder("org/tiny-wan", {"cache_dir": str(hub_cache), "token": "t", "revision": "main"})
    assert (folder, reason) == (new, None)
    assert calls == [("org/tiny-wan", {"cache_dir": str(hub_cache), "token": "t", "revision": "main",
                                       "use_safetensors": True})]
    pipe, handle = load_offloaded("org/tiny-wan", DIT, device="cpu", dtype=torch.float32, cache_dir=str(hub_cache))
    assert pipe.transformer.config._name_or_path == str(new / "transformer")
    handle.remove()


@pytest.mark.parametrize("how", ["HF_HUB_OFFLINE", "local_files_only"])
def test_a_hub_id_offline_is_the_cached_snapshot_without_asking(hub_cache, online, monkeypatch, how):
    def download(name, **kwargs):
        raise AssertionError("the Hub was asked while offline")

    monkeypatch.setattr(DiffusionPipeline, "download", download)
    kwargs = {"cache_dir": str(hub_cache)}
    if how == "HF_HUB_OFFLINE":
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    else:
        kwargs["local_files_only"] = True
    folder, reason = cold_start_folder("org/tiny-wan", kwargs)
    assert (folder, reason) == (hub_cache / "models--org--tiny-wan" / "snapshots" / OLD, None)


def test_a_hub_that_cannot_be_reached_falls_back_to_the_cache_and_says_so(hub_cache, online, monkeypatch,
                                                                          caplog):
    def download(name, **kwargs):
        raise ConnectionError("Name or service not known")

    monkeypatch.setattr(DiffusionPipeline, "download", download)
    with caplog.at_level(logging.WARNING, logger="omni_dist_offload"):
        folder, reason = cold_start_folder("org/tiny-wan", {"cache_dir": str(hub_cache)})
    assert (folder, reason) == (hub_cache / "models--org--tiny-wan" / "snapshots" / OLD, None)
    assert "org/tiny-wan: the Hub could not be asked for its files (ConnectionError: Name or service not known); " \
           "looking for a snapshot in the local cache instead" in caplog.text, caplog.text
    # Neither the Hub nor the cache: the ordinary loader is left to say why.
    folder, reason = cold_start_folder("org/elsewhere", {"cache_dir": str(hub_cache)})
    assert folder is None and "'org/elsewhere' is not a local folder" in reason


def test_a_path_that_is_not_there_is_not_asked_of_the_hub(online, monkeypatch, caplog):
    # A path (not a hub id) that does not exist: no warning that the Hub could not be asked
    # before the loader's own "does not exist".
    def download(name, **kwargs):
        raise AssertionError(f"the Hub was asked for {name!r}")

    monkeypatch.setattr(DiffusionPipeline, "download", download)
    with caplog.at_level(logging.WARNING, logger="omni_dist_offload"):
        for model in ("/nonexistent/wan-folder", "./typo", "~/nonexistent-wan"):
            folder, reason = cold_start_folder(model)
            assert folder is None and f"{model!r} is not a local folder" in reason
    assert caplog.records == []


# -- an I/O error while reading -------------------------------------------------------------
def _failing_preadv(code: int, real=os.preadv):
    def preadv(fd, buffers, offset):
        if sum(len(b) for b in buffers) > 256:  # the blocks' reads, not the first elements apply_offload samples
            raise OSError(code, os.strerror(code))
        return real(fd, buffers, offset)
    return preadv


def test_an_io_error_reading_is_a_checkpoint_error_naming_file_offset_and_size(wan_folder, monkeypatch):
    files = find_weight_files(wan_folder / "transformer")
    checkpoint = SafetensorsCheckpoint(files)
    name, info = max(checkpoint.tensors.items(), key=lambda kv: kv[1].stop - kv[1].start)
    monkeypatch.setattr(os, "preadv", _failing_preadv(errno.EIO))
    with pytest.raises(CheckpointError) as raised:
        checkpoint.load(name, info.dtype)
    assert str(raised.value).startswith(
        f"{info.path}: reading {info.stop - info.start} bytes at byte {info.start} failed (EIO: Input/output error): "
        "the storage returned an error"), raised.value
    assert isinstance(raised.value.__cause__, OSError)
    checkpoint.close()


def test_a_file_that_cannot_be_opened_any_more_is_named(wan_folder, monkeypatch):
    checkpoint = SafetensorsCheckpoint(find_weight_files(wan_folder / "transformer"))
    name, info = next(iter(checkpoint.tensors.items()))

    def stale(path, flags, *args):
        raise OSError(errno.ESTALE, os.strerror(errno.ESTALE), str(path))

    with monkeypatch.context() as patch:
        patch.setattr(os, "open", stale)
        with pytest.raises(CheckpointError, match=r"^[^\n]*\.safetensors: cannot be opened to read its tensors "
                                                  r"\(ESTALE: .*remount it"):
            checkpoint.load(name, info.dtype)
    assert checkpoint._fds == {}  # nothing half-opened is kept: the file opens once it can be
    assert checkpoint.load(name, info.dtype).shape == info.shape
    checkpoint.close()


def test_the_cli_says_an_io_error_in_one_line(wan_folder, monkeypatch, capsys):
    from omni_dist_offload.app.cli import main

    monkeypatch.setattr(os, "preadv", _failing_preadv(errno.EIO))
    rc = main(["inspect", "--model", str(wan_folder)])
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" not in err, err
    assert "omni-offload inspect: error: " in err and ".safetensors: reading " in err and "(EIO: " in err, err


# -- a config.json value of the wrong type ----------------------------------------------------
def _damaged(wan_folder: Path, tmp_path: Path, component: str, **values) -> Path:
    folder = tmp_path / "damaged"
    shutil.copytree(wan_folder, folder)
    path = folder / component / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **values}))
    return folder


CASES = {
    "dit str": ("transformer", {"num_layers": "3"}, "num_layers='3' (an integer, as the default 40)"),
    "dit null": ("transformer", {"num_layers": None}, "num_layers=None (an integer, as the default 40)"),
    "dit float": ("transformer", {"ffn_dim": 47.5}, "ffn_dim=47.5 (an integer, as the default 13824)"),
    "encoder str": ("text_encoder", {"num_layers": "3"}, "Field 'num_layers' expected int, got str (value: '3')"),
}


@pytest.mark.parametrize("case", CASES)
def test_a_config_value_of_the_wrong_type_is_named_when_cold_started(wan_folder, tmp_path, case):
    component, values, found = CASES[case]
    folder = _damaged(wan_folder, tmp_path, component, **values)
    default = torch.get_default_dtype()
    with pytest.raises(ModelLoadError) as raised:
        load_offloaded(folder, BOTH, device="cpu", dtype=torch.bfloat16)
    message = str(raised.value)
    assert message.startswith(f"{component} (") and str(folder / component / "config.json") in message, message
    assert found in message and "fix the value" in message and "\n" not in message, message
    assert torch.get_default_dtype() == default  # diffusers builds under the run dtype: set back


@pytest.mark.parametrize("case", CASES)
def test_a_config_value_of_the_wrong_type_is_named_when_loaded_whole(wan_folder, tmp_path, case):
    component, values, found = CASES[case]
    folder = _damaged(wan_folder, tmp_path, component, **values)
    with pytest.raises(ModelLoadError) as raised:
        load_pipeline(str(folder), torch.float32, {})
    message = str(raised.value)
    assert f"{component}/config.json" in message and found in message and "fix the value" in message, message


@pytest.mark.parametrize("cold", [True, False], ids=["cold", "no-cold-start"])
def test_the_cli_names_a_config_value_of_the_wrong_type_in_one_line(wan_folder, tmp_path, capsys, cold):
    from omni_dist_offload.app.cli import main

    folder = _damaged(wan_folder, tmp_path, "transformer", num_layers="3")
    rc = main(["inspect", "--model", str(folder), *([] if cold else ["--no-cold-start"])])
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" not in err and "num_layers='3'" in err, err


def test_a_sound_folder_has_no_config_value_of_the_wrong_type(wan_folder):
    from omni_dist_offload.loading.folders import wrong_config_values

    assert wrong_config_values(wan_folder) == []


# -- optional components saved as null ----------------------------------------------------------
def test_an_optional_component_saved_as_null_is_not_reported(wan_folder, caplog):
    assert json.loads((wan_folder / "model_index.json").read_text())["transformer_2"] == [None, None]
    with caplog.at_level(logging.INFO, logger="omni_dist_offload"):
        cold = prepare_cold_start(wan_folder, {"mode": "layer", "components": ["dit"]}, device=torch.device("cpu"),
                                  dtype=torch.float32)
    cold.close()
    assert sorted(cold.components) == ["transformer"]
    assert "None.None" not in caplog.text and "transformer_2" not in caplog.text, caplog.text
