"""``Omni``: built-in and folder pipelines, offload vs resident, results and their files."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from omni_dist_offload import GenerationOptionError as TopLevelGenerationOptionError, Omni
from omni_dist_offload.app.api import MAX_SEED, GenerationOptionError
from omni_dist_offload.config import OffloadConfigError
from omni_dist_offload.loading.pipelines import ModelLoadError, resolve_dtype
from omni_dist_offload.app.outputs import GenerationResult, mp4_available
from media import read_frames

STREAM_ALL = {"mode": "layer", "components": ["dit", "text_encoder"]}
SIDECAR_KEYS = {"prompt", "seed", "model", "offload_config", "offload_summary", "height", "width",
                "num_frames", "num_inference_steps", "timings", "versions", "file"}


def test_builtin_flux_image_summary_and_files(tmp_path: Path) -> None:
    omni = Omni("tiny-flux", STREAM_ALL)
    assert [r["component"] for r in omni.summary()] == ["transformer", "text_encoder", "text_encoder_2"]
    assert {r["weight_transfer"] for r in omni.summary()} == {"rank-local"}
    result = omni.generate("a red fox in snow", seed=3)
    assert result.kind == "image" and result.frames.shape == (16, 16, 3)
    assert result.frames.dtype == np.uint8

    saved = result.save(tmp_path)
    assert saved.media == tmp_path / "seed00003.png"
    assert np.array_equal(read_frames(saved.media)[0], result.frames)
    sidecar = json.loads(saved.sidecar.read_text())
    assert SIDECAR_KEYS <= sidecar.keys()
    assert (sidecar["prompt"], sidecar["seed"], sidecar["model"]) == ("a red fox in snow", 3, "tiny-flux")
    assert sidecar["offload_config"]["components"] == ["dit", "text_encoder"]
    assert sidecar["offload_summary"] == omni.summary()
    assert (sidecar["height"], sidecar["width"], sidecar["num_frames"]) == (16, 16, None)
    assert sidecar["num_inference_steps"] == 2
    assert sidecar["timings"]["generation_s"] > 0 and sidecar["timings"]["setup_s"] > 0
    assert sidecar["versions"]["torch"] == torch.__version__


def test_streamed_video_equals_resident_and_seeds_matter() -> None:
    streamed = Omni("tiny-wan", STREAM_ALL)
    resident = Omni("tiny-wan", None)
    assert resident.summary() == [] and resident.handle is None
    a = streamed.generate("a cat", seed=1)
    assert a.kind == "video" and a.frames.shape == (5, 32, 32, 3)
    assert np.array_equal(a.frames, resident.generate("a cat", seed=1).frames)
    assert np.array_equal(a.frames, streamed.generate("a cat", seed=1).frames)
    assert not np.array_equal(a.frames, streamed.generate("a cat", seed=2).frames)


def test_close_frees_without_bringing_the_model_back(monkeypatch) -> None:
    """``close()`` (and leaving ``with``) frees the offload and the pipeline. It restored every
    streamed block on the device first, which a model that fits only streamed has no room for:
    it failed with the device out of memory at the end of every such run."""
    import gc
    import weakref

    from omni_dist_offload.ring import BlockRing

    def no_room(self, device):
        raise RuntimeError("CUDA out of memory (the whole model does not fit)")

    monkeypatch.setattr(BlockRing, "restored_streamed", no_room)
    with Omni("tiny-flux", STREAM_ALL, progress=False) as omni:
        omni.generate("a dog", seed=0, num_inference_steps=1)
        transformer = weakref.ref(omni.pipeline.transformer)
        block = omni.pipeline.transformer.transformer_blocks[0]
        rings = [weakref.ref(r) for r in omni.handle.rings]
        omni.close()
        assert omni.summary() == [] and omni.handle is None and omni.pipeline is None
        assert all(p.numel() == 0 for p in block.parameters())  # nothing restored
        omni.close()  # idempotent
        with pytest.raises(RuntimeError, match=r"is closed: build another Omni"):
            omni.generate("a dog")
    del block
    gc.collect()
    assert transformer() is None and all(r() is None for r in rings)


def test_remove_before_close_keeps_the_model_resident() -> None:
    omni = Omni("tiny-flux", STREAM_ALL, progress=False)
    pipe = omni.pipeline

    def run():
        return pipe(prompt="a dog", generator=torch.Generator().manual_seed(0), output_type="np",
                    num_inference_steps=1, height=16, width=16).images[0]

    before = run()
    omni.handle.remove()  # as close()'s docstring says: remove() first to keep the model
    omni.close()
    assert np.array_equal(run(), before)


def test_leaving_with_keeps_the_error_that_left_it(monkeypatch, caplog) -> None:
    from omni_dist_offload.apply import OffloadHandle

    def failing(self):
        raise RuntimeError("discard failed")

    monkeypatch.setattr(OffloadHandle, "discard", failing)
    with pytest.raises(KeyError, match="the user's"):
        with Omni("tiny-flux", STREAM_ALL, progress=False):
            raise KeyError("the user's")
    assert "closing tiny-flux after KeyError failed" in caplog.text


def test_close_from_a_step_callback_is_refused_and_the_omni_stays_usable() -> None:
    omni = Omni("tiny-flux", STREAM_ALL, progress=False)

    def closing(pipe, step, timestep, kwargs):
        omni.close()
        return kwargs

    with pytest.raises(RuntimeError, match="inside a generation"):
        omni.generate("a dog", num_inference_steps=1, callback_on_step_end=closing)
    assert omni.generate("a dog", num_inference_steps=1).frames.shape == (16, 16, 3)
    omni.close()


def test_threads_sharing_one_omni_get_what_they_would_alone() -> None:
    # A web app's handlers call generate from several threads; a streamed ring holds one block
    # per slot, so the calls run one at a time (without that, most came out wrong or raised).
    from concurrent.futures import ThreadPoolExecutor

    with Omni("tiny-flux", STREAM_ALL, progress=False) as omni:
        seeds = list(range(6))
        alone = [omni.generate("a red fox", seed=s).frames for s in seeds]
        with ThreadPoolExecutor(3) as pool:
            together = list(pool.map(lambda s: omni.generate("a red fox", seed=s).frames, seeds))
    assert [np.array_equal(a, b) for a, b in zip(together, alone)] == [True] * len(seeds)


def test_local_folder_loads_through_from_pretrained(tmp_path: Path) -> None:
    from tiny_models import TINY_FLUX_DEFAULTS, tiny_flux_pipeline

    tiny_flux_pipeline().save_pretrained(tmp_path / "flux")
    omni = Omni(str(tmp_path / "flux"), STREAM_ALL, progress=False)
    assert type(omni.pipeline).__name__ == "FluxPipeline"
    assert len(omni.summary()) == 3
    # A folder gets the pipeline's own defaults; pass the built-in's to compare.
    result = omni.generate("a red fox", seed=0, **TINY_FLUX_DEFAULTS)
    reference = Omni("tiny-flux", STREAM_ALL).generate("a red fox", seed=0)
    # Same weights; mmapped safetensors are not 64-byte aligned, so CPU kernels may differ by an ulp.
    assert np.abs(result.frames.astype(int) - reference.frames.astype(int)).max() <= 1
    assert result.metadata["model"] == str(tmp_path / "flux")


def test_folder_without_model_index_names_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="model_index.json"):
        Omni(str(tmp_path), STREAM_ALL)


def test_option_the_pipeline_does_not_take() -> None:
    omni = Omni("tiny-flux", None)
    with pytest.raises(GenerationOptionError, match="'num_frames' is not an option of FluxPipeline"):
        omni.generate("a cat", num_frames=5)
    with pytest.raises(GenerationOptionError, match="'generator' is set by Omni.generate"):
        omni.generate("a cat", generator=None or torch.Generator())
    with pytest.raises(GenerationOptionError, match="guidance_scale=nan is not a finite number"):
        omni.generate("a cat", guidance_scale=float("nan"))
    with pytest.raises(GenerationOptionError, match="seed 18446744073709551616 is not one torch's generator takes"):
        omni.generate("a cat", seed=2**64)
    assert omni.generate("a cat", seed=MAX_SEED).seed == MAX_SEED
    # Refused by the pipeline's own check_inputs; other ValueErrors pass through as they are.
    with pytest.raises(GenerationOptionError, match=r"FluxPipeline \(tiny-flux\) refused the options in its input "
                       "check: `max_sequence_length` cannot be greater than 512"):
        omni.generate("a cat", max_sequence_length=1024)

    def callback(*args):
        raise ValueError("from a callback")

    with pytest.raises(ValueError, match="from a callback") as raised:
        omni.generate("a cat", callback_on_step_end=callback)
    assert type(raised.value) is ValueError


def test_dtype_defaults_and_names() -> None:
    assert resolve_dtype(None, torch.device("cpu")) == torch.float32
    assert resolve_dtype(None, torch.device("cuda", 0)) == torch.bfloat16
    assert resolve_dtype("bf16", torch.device("cpu")) == torch.bfloat16
    with pytest.raises(ValueError, match="'float8'"):
        resolve_dtype("float8", torch.device("cpu"))
    omni = Omni("tiny-flux", STREAM_ALL, dtype="bfloat16")
    assert omni.pipeline.transformer.dtype == torch.bfloat16
    assert omni.generate("a cat").metadata["dtype"] == "bfloat16"


def test_video_written_as_gif_without_mp4(tmp_path: Path) -> None:
    frames = np.random.default_rng(0).integers(0, 256, (3, 8, 12, 3), dtype=np.uint8)
    result = GenerationResult(prompt="p", seed=0, kind="video", frames=frames, name="clip", fps=8)
    saved = result.save(tmp_path, video_format="gif")
    assert saved.media.name == "clip.gif"
    decoded = read_frames(saved.media)
    assert decoded.shape == (3, 8, 12, 3)
    with Image.open(saved.media) as gif:
        assert gif.info["duration"] in (120, 130)  # 125 ms, stored in centiseconds
    assert json.loads(saved.sidecar.read_text())["file"] == "clip.gif"


def test_names_with_dots_keep_their_tail(tmp_path: Path) -> None:
    frames = np.zeros((8, 8, 3), dtype=np.uint8)
    for name in ("fox.v1", "fox.v2"):
        saved = GenerationResult(prompt="p", seed=0, kind="image", frames=frames, name=name).save(tmp_path)
        assert (saved.media.name, saved.sidecar.name) == (f"{name}.png", f"{name}.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fox.v1.json", "fox.v1.png", "fox.v2.json", "fox.v2.png"]


@pytest.mark.skipif(not mp4_available(), reason="needs the video extra (imageio, imageio-ffmpeg)")
def test_video_written_as_mp4_with_the_video_extra(tmp_path: Path) -> None:
    import imageio.v2 as imageio

    frames = np.full((5, 32, 32, 3), 128, dtype=np.uint8)
    result = GenerationResult(prompt="p", seed=0, kind="video", frames=frames, name="clip")
    saved = result.save(tmp_path)
    assert saved.media.suffix == ".mp4"
    decoded = np.stack(imageio.mimread(saved.media))
    assert decoded.shape == (5, 32, 32, 3)
    assert np.abs(decoded.astype(int) - 128).max() <= 3


def test_pickled_checkpoints_are_not_loaded(tmp_path: Path) -> None:
    from tiny_models import tiny_flux_pipeline

    tiny_flux_pipeline().save_pretrained(tmp_path / "flux", safe_serialization=False)
    # The message names the components that hold only .bin files and how to go on.
    with pytest.raises(ModelLoadError, match=r"\['transformer', 'vae'\] hold only \.bin \(pickled\) weights"):
        Omni(str(tmp_path / "flux"), STREAM_ALL, progress=False)


def test_a_missing_folder_given_as_a_path_is_named(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        Omni(tmp_path / "absent", STREAM_ALL, progress=False)


def test_setup_shows_a_bar_per_streamed_component(capsys) -> None:
    """Long setups show progress: a bar per streamed component while its blocks are filled and
    page-locked; none when progress is off."""
    config = {"mode": "layer", "components": ["dit", "text_encoder"]}
    Omni("tiny-wan", config, device="cpu", progress=True).close()
    err = capsys.readouterr().err
    assert "transformer: filling and page-locking blocks" in err and "text_encoder: filling" in err
    Omni("tiny-wan", config, device="cpu", progress=False).close()
    assert "filling and page-locking" not in capsys.readouterr().err


def test_upcast_without_a_config_is_refused_before_anything_loads(monkeypatch):
    import omni_dist_offload.app.api as api

    monkeypatch.setattr(api, "load_and_place", lambda *a, **k: pytest.fail("loaded the model"))
    with pytest.raises(OffloadConfigError, match="upcast='block' .* with diffusion_offload_config=None nothing streams"):
        Omni("tiny-flux", None, upcast="block")


def test_context_parallel_is_checked_before_anything_loads():
    from omni_dist_offload.loading.parallel import ContextParallel, ContextParallelError

    assert ContextParallel.parse({"ulysses_degree": 1}) is None  # nothing to split
    assert ContextParallel.parse({"ulysses_degree": 2}).size == 2
    for bad, words in (({"ulysses": 2}, "keys"), ({"ulysses_degree": 0}, "positive"),
                       ({"ring_degree": True}, "positive")):
        with pytest.raises(ContextParallelError, match=words):
            ContextParallel.parse(bad)
    with pytest.raises(ContextParallelError, match="torchrun --nproc_per_node 2"):
        Omni("tiny-wan", context_parallel={"ulysses_degree": 2})  # one process: refused before loading


class _Loaded(Exception):
    """Raised by a stand-in for ``load_and_place``: the checks before loading passed."""


@pytest.fixture
def split_without_ranks(monkeypatch):
    """``Omni`` with ``context_parallel`` in one process, up to the load: the job's ranks pass
    their check, and loading raises :class:`_Loaded` (nothing is loaded)."""
    import omni_dist_offload.app.api as api

    monkeypatch.setattr(api, "check_ranks", lambda spec: None)

    def load(*args, **kwargs):
        raise _Loaded

    monkeypatch.setattr(api, "load_and_place", load)


def _pipeline_folder(root: Path, heads: dict[str, int], classes: dict[str, str] | None = None) -> Path:
    """A Wan pipeline folder's model_index.json and its DiTs' config.json files, no weights."""
    root.mkdir(parents=True, exist_ok=True)
    index = {"_class_name": "WanPipeline", "_diffusers_version": "0.42.1", "vae": ["diffusers", "AutoencoderKLWan"],
             "text_encoder": ["transformers", "UMT5EncoderModel"]}
    for name, count in heads.items():
        index[name] = ["diffusers", (classes or {}).get(name, "WanTransformer3DModel")]
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps({"_class_name": index[name][1],
                                                             "num_attention_heads": count, "num_layers": 40}))
    (root / "model_index.json").write_text(json.dumps(index))
    return root


def test_heads_the_ulysses_degree_does_not_divide_are_refused_before_loading(split_without_ranks):
    """A built-in's DiT (tiny-wan: 2 heads), read from its config without loading it: refused
    with the split's own message before anything loads (it was refused only once the pipeline
    was loaded, offloaded and page-locked); a degree that divides the heads goes on to load."""
    from omni_dist_offload.loading.parallel import ContextParallelError

    for model in ("tiny-wan", "tiny-flux"):
        with pytest.raises(ContextParallelError) as raised:
            Omni(model, {"mode": "layer", "components": ["dit"]}, context_parallel={"ulysses_degree": 3})
        assert str(raised.value).startswith("transformer (") and \
            "has 2 attention heads, which ulysses_degree 3 (--ulysses-degree on the command line) does not divide" \
            in str(raised.value)
        with pytest.raises(_Loaded):
            Omni(model, {"mode": "layer", "components": ["dit"]}, context_parallel={"ulysses_degree": 2})


def test_a_folders_dits_are_read_from_their_config_before_loading(split_without_ranks, tmp_path):
    """A folder's DiTs, each read from ``<component>/config.json``: the second of two with heads 2
    does not divide, refused by name; one passed in ``load_kwargs`` as a module is that module's;
    a DiT class without a context-parallel plan is named before loading too."""
    import tiny_models as tiny
    from omni_dist_offload.loading.parallel import ContextParallelError

    folder = _pipeline_folder(tmp_path / "wan", {"transformer": 40, "transformer_2": 5})
    with pytest.raises(ContextParallelError, match=r"^transformer_2 \(WanTransformer3DModel\) has 5 attention heads, "
                                                   "which ulysses_degree 2"):
        Omni(str(folder), context_parallel={"ulysses_degree": 2})
    with pytest.raises(_Loaded):  # the module passed in is what loads: its 2 heads split over 2
        Omni(str(folder), context_parallel={"ulysses_degree": 2},
             load_kwargs={"transformer_2": tiny.tiny_wan_transformer(num_layers=1)})
    with pytest.raises(_Loaded):  # 5 divides both
        Omni(str(folder), context_parallel={"ulysses_degree": 5})
    plain = _pipeline_folder(tmp_path / "sd3", {"transformer": 24}, {"transformer": "SD3Transformer2DModel"})
    with pytest.raises(ContextParallelError, match="SD3Transformer2DModel.*has no context-parallel plan"):
        Omni(str(plain), context_parallel={"ulysses_degree": 2})
    # What cannot be read is left to the split's check after loading: no config.json, no such class.
    (folder / "transformer_2" / "config.json").unlink()
    with pytest.raises(_Loaded):
        Omni(str(folder), context_parallel={"ulysses_degree": 2})


def test_a_cached_hub_snapshots_dits_are_read_without_asking_the_hub(split_without_ranks, tmp_path, monkeypatch):
    """A hub id whose snapshot is in the local cache: its DiTs' configs are read there; one not in
    the cache is left to the loader (nothing is downloaded to check it)."""
    import huggingface_hub
    from omni_dist_offload.loading.parallel import ContextParallelError

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for name in ("hf_hub_download", "snapshot_download"):
        monkeypatch.setattr(huggingface_hub, name, lambda *a, **k: pytest.fail("asked the Hub"))
    repo = tmp_path / "cache" / "models--org--odd-wan"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0123abcd")
    _pipeline_folder(repo / "snapshots" / "0123abcd", {"transformer": 3})
    cache = {"cache_dir": str(tmp_path / "cache")}
    with pytest.raises(ContextParallelError, match="has 3 attention heads, which ulysses_degree 2"):
        Omni("org/odd-wan", context_parallel={"ulysses_degree": 2}, load_kwargs=cache)
    with pytest.raises(_Loaded):
        Omni("org/not-cached", context_parallel={"ulysses_degree": 2}, load_kwargs=cache)


@pytest.mark.parametrize("cache", ["first-block:0.2", {"type": "first-block", "threshold": 0.1}])
@pytest.mark.parametrize("split", [{"ulysses_degree": 2}, {"ring_degree": 2}])
def test_first_block_cache_with_context_parallel_is_refused_before_anything_loads(monkeypatch, cache, split):
    """First Block Cache decides from the first block's output, which context parallelism splits
    across the ranks (a shape error on the first forward, or ranks that decide apart and hang):
    refused before the job's ranks are checked and before any model is built."""
    import omni_dist_offload.app.api as api
    from omni_dist_offload.loading.parallel import ContextParallelError

    monkeypatch.setattr(api, "load_and_place", lambda *a, **k: pytest.fail("loaded the model"))
    with pytest.raises(ContextParallelError) as raised:
        Omni("tiny-wan", None, cache=cache, context_parallel=split)
    message = str(raised.value)
    assert "\n" not in message
    for words in ("cache 'first-block' with context_parallel", "'taylorseer:N' or 'pyramid-attention:N'",
                  "drop context_parallel"):
        assert words in message, message
    # The caches that skip by step pass this check (here the job's ranks are what is refused).
    with pytest.raises(ContextParallelError, match="needs torch.distributed"):
        Omni("tiny-wan", None, cache="taylorseer:2", context_parallel=split)


@pytest.mark.parametrize("flags, named", [(["--ulysses-degree", "2"], "--ulysses-degree 2"),
                                          (["--ulysses-degree", "2", "--ring-degree", "2"],
                                           "--ulysses-degree 2 --ring-degree 2")])
def test_cli_refuses_first_block_cache_with_context_parallel_in_one_line(flags, named, tmp_path, monkeypatch,
                                                                         capsys):
    """``--cache first-block:...`` with ``--ulysses-degree``/``--ring-degree``: exit status 2 with
    one line naming both flags and the caches that run split, while the flags are checked (the
    command itself never runs)."""
    from omni_dist_offload.app import cli

    for command in ("generate", "inspect"):
        monkeypatch.setitem(cli._COMMAND_FUNCS, command, lambda plan: pytest.fail(f"ran {plan.command}"))
    for command in (["--output-dir", str(tmp_path / "out")], ["inspect"]):
        assert cli.main([*command, *flags, "--cache", "first-block:0.2"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1, err
        assert f"--cache first-block with {named}:" in err[0]
        assert "--cache taylorseer:N or pyramid-attention:N" in err[0]
        assert "drop --ulysses-degree/--ring-degree" in err[0]
    assert not (tmp_path / "out").exists()


def test_compile_with_upcast_per_layer_is_refused_before_anything_loads(monkeypatch, tmp_path, capsys):
    """The per-layer upcast swaps tensors inside each block, which a compiled block does not
    follow: refused before the model loads (the ring would refuse it only at the first forward),
    and in one line with exit status 2 from the CLI."""
    import omni_dist_offload.app.api as api
    from omni_dist_offload import OffloadConfigError
    from omni_dist_offload.app.cli import main as cli_main

    monkeypatch.setattr(api, "load_and_place", lambda *a, **k: pytest.fail("loaded the model"))
    with pytest.raises(OffloadConfigError, match=r"compile='regional' with the DiT's upcast \"layer\""):
        Omni("tiny-flux", None, compile=True, storage_dtype="float8_e4m3fn", upcast="layer")
    out = tmp_path / "out"
    assert cli_main(["generate", "--model", "tiny-flux", "--compile", "--storage-dtype", "float8_e4m3fn",
                     "--upcast", "layer", "--output-dir", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "upcast \"layer\"" in err[0] and not out.exists()


# -- generate's options: one output per call, checked numbers, strict sidecars --------------

@pytest.fixture(scope="module")
def wan() -> Omni:
    """One streamed tiny-wan shared by the option checks below (none of them closes it)."""
    omni = Omni("tiny-wan", STREAM_ALL, progress=False)
    yield omni
    omni.close()


@pytest.fixture(scope="module")
def wan_reference(wan: Omni) -> np.ndarray:
    return wan.generate("a cat", seed=1).frames


def _refused(omni: Omni, words: str, prompt=None, **kwargs) -> None:
    assert TopLevelGenerationOptionError is GenerationOptionError  # importable from the package, as README names it
    with pytest.raises(GenerationOptionError, match=words):
        omni.generate("a cat" if prompt is None else prompt, **{"seed": 1, **kwargs})


def test_one_output_per_call_refused_before_compute(wan, wan_reference, monkeypatch) -> None:
    """num_*_per_prompt above 1 or a list of prompts made N outputs, returned the first and recorded N."""
    calls = []
    monkeypatch.setattr(type(wan.pipeline), "encode_prompt", lambda *a, **k: calls.append(1))
    _refused(wan, "num_videos_per_prompt=2: Omni.generate makes, returns and records one output",
             num_videos_per_prompt=2)
    _refused(wan, "num_videos_per_prompt=True", num_videos_per_prompt=True)
    for prompt in (["a cat", "a dog"], ("a cat",), 7):
        _refused(wan, "prompt must be one string", prompt=prompt)
    assert calls == []
    monkeypatch.undo()
    assert np.array_equal(wan.generate("a cat", seed=1, num_videos_per_prompt=1).frames, wan_reference)


@pytest.mark.parametrize("kwargs, words", [
    (dict(num_inference_steps=0), "num_inference_steps=0 is not a positive integer"),
    (dict(num_inference_steps=2.5), "num_inference_steps=2.5 is not a positive integer"),
    (dict(num_inference_steps="2"), "num_inference_steps='2' is not a positive integer"),
    (dict(num_inference_steps=True), "num_inference_steps=True is not a positive integer"),
    (dict(height=-16), "height=-16 is not a positive integer"),
    (dict(width=0), "width=0 is not a positive integer"),
    (dict(num_frames=0), "num_frames=0 is not a positive integer"),
    (dict(max_sequence_length=0), "max_sequence_length=0 is not a positive integer"),
    (dict(guidance_scale="5"), "guidance_scale='5' is not a real number"),
    (dict(guidance_scale=True), "guidance_scale=True is not a real number"),
    (dict(negative_prompt=["a", "b"]), r"negative_prompt=\['a', 'b'\]: the prompt is one string, so the negative"),
    (dict(guidance_scale=np.float32("nan")), "guidance_scale=nan is not a finite number"),
    (dict(guidance_scale=np.array(float("inf"))), "guidance_scale=inf is not a finite number"),
    (dict(guidance_scale=torch.tensor(float("nan"))), "guidance_scale=nan is not a finite number"),
    (dict(seed=-1), "seed -1 is not one torch's generator takes: give an integer from 0"),
    (dict(fps=0), "fps=0 is not a positive integer"),
    (dict(fps=-5), "fps=-5 is not a positive integer"),
    (dict(fps=True), "fps=True is not a positive integer"),
    (dict(fps="8"), "fps='8' is not a positive integer"),
    (dict(num_inference_steps=torch.tensor(2.0)), r"num_inference_steps=tensor\(2\.\) is not a positive integer"),
    (dict(height=torch.tensor(True)), r"height=tensor\(True\) is not a positive integer"),
    (dict(seed=np.int64(-1)), r"seed np.int64\(-1\) is not one torch.s generator takes"),
])
def test_bad_numbers_raise_generation_option_error(wan, wan_reference, kwargs, words) -> None:
    _refused(wan, words, **kwargs)
    assert np.array_equal(wan.generate("a cat", seed=1).frames, wan_reference)


def test_numpy_and_tensor_numbers_are_taken_as_numbers(wan) -> None:
    expected = wan.generate("a cat", seed=1, guidance_scale=1.0, num_inference_steps=2)
    # 0-d arrays and tensors for integers, numpy integers for fps and seed, as the pipelines take them.
    for scale, steps, fps, seed in ((np.float32(1.0), np.int64(2), np.int64(8), np.uint64(1)),
                                    (torch.tensor(1.0), 2, 8, 1),
                                    (1.0, torch.tensor(2), torch.tensor(8), torch.tensor(1)),
                                    (1.0, np.array(2), np.array(8), np.array(1))):
        result = wan.generate("a cat", seed=seed, guidance_scale=scale, num_inference_steps=steps, fps=fps)
        assert np.array_equal(result.frames, expected.frames)
        assert result.metadata["guidance_scale"] == 1.0 and type(result.metadata["guidance_scale"]) is float
        assert result.metadata["fps"] == 8


def test_sidecar_is_strict_json(tmp_path: Path) -> None:
    frames = np.zeros((8, 8, 3), dtype=np.uint8)
    bad = GenerationResult(prompt="p", seed=0, kind="image", frames=frames, name="nan",
                           metadata={"pipeline_kwargs": {"true_cfg_scale": np.float32("nan")}})
    with pytest.raises(ValueError, match=r"metadata\['pipeline_kwargs'\]\['true_cfg_scale'\] = nan is not a finite"):
        bad.save(tmp_path)
    assert list(tmp_path.iterdir()) == []  # nothing written
    good = GenerationResult(prompt="p", seed=0, kind="image", frames=frames, name="ok", metadata={"g": 1.5})
    assert json.loads(good.save(tmp_path).sidecar.read_text(), parse_constant=pytest.fail)["g"] == 1.5


def test_metadata_after_remove_reports_no_offload() -> None:
    omni = Omni("tiny-flux", STREAM_ALL, progress=False)
    assert omni.generate("a dog").metadata["offload_config"]["components"] == ["dit", "text_encoder"]
    omni.handle.remove()
    meta = omni.generate("a dog").metadata
    assert (meta["offload_config"], meta["offload_summary"]) == (None, None)
    omni.close()


def test_single_lora_path_or_spec_is_taken_as_one(monkeypatch, tmp_path: Path) -> None:
    import omni_dist_offload.app.api as api
    from omni_dist_offload.loading.adapters import AdapterError, LoraSpec

    monkeypatch.setattr(api, "load_and_place", lambda *a, **k: pytest.fail("loaded the model"))
    for lora in (tmp_path / "missing.safetensors", LoraSpec(str(tmp_path / "missing.safetensors"))):
        with pytest.raises(AdapterError, match="missing.safetensors: no such file"):
            Omni("tiny-flux", None, lora=lora)


def test_no_progress_hides_the_loading_bars_of_a_folder(tmp_path: Path, capfd) -> None:
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging
    from tiny_models import tiny_wan_pipeline

    tiny_wan_pipeline().save_pretrained(tmp_path / "wan")
    capfd.readouterr()
    Omni(str(tmp_path / "wan"), None, progress=False).close()
    err = capfd.readouterr().err
    assert "Loading pipeline components" not in err and "Loading weights" not in err, err
    assert diffusers_logging.is_progress_bar_enabled() and transformers_logging.is_progress_bar_enabled()


@torch.no_grad()
def test_no_prompt_with_prompt_embeds_is_taken(wan, wan_reference) -> None:
    """The one-string rule leaves room for the pipeline's own way of passing a prompt encoded
    already: prompt None with prompt_embeds (and its negative) gives the same frames."""
    pe, npe = wan.pipeline.encode_prompt("a cat", do_classifier_free_guidance=True, device=wan.device,
                                         max_sequence_length=16)  # the built-in default
    out = wan.generate(None, seed=1, prompt_embeds=pe, negative_prompt_embeds=npe)
    assert np.array_equal(out.frames, wan_reference)
    # Embeddings of two prompts made both and returned the first: refused, as two prompts are.
    with pytest.raises(GenerationOptionError, match=r"prompt_embeds holds 2 prompts \(shape \(2, 16, "):
        wan.generate(None, seed=1, prompt_embeds=pe.repeat(2, 1, 1), negative_prompt_embeds=npe.repeat(2, 1, 1))


def test_a_generation_inside_a_step_callback_is_refused_and_the_next_is_right(wan, wan_reference) -> None:
    """The lock is reentrant (a callback may read summary()); a generate() from a step callback
    on the same Omni reset the scheduler the outer call was stepping (AssertionError in UniPC)."""
    def nested(pipe, step, timestep, kwargs):
        wan.generate("a dog", seed=2, num_inference_steps=1)
        return {}

    with pytest.raises(RuntimeError, match="called from inside a generation on the same Omni"):
        wan.generate("a cat", seed=1, callback_on_step_end=nested)
    assert np.array_equal(wan.generate("a cat", seed=1).frames, wan_reference)


def test_numpy_and_tensor_numbers_are_recorded_in_the_sidecar() -> None:
    """Taken by the pipeline (the README allows numpy and 0-d tensor numbers) but left out of
    metadata['pipeline_kwargs']: the sidecar could not reproduce the output."""
    with Omni("tiny-flux", progress=False) as flux:
        for value in (np.float32(2.0), torch.tensor(2.0), 2.0):
            kwargs = flux.generate("a cat", seed=1, negative_prompt="blurry", true_cfg_scale=value,
                                   num_inference_steps=1).metadata["pipeline_kwargs"]
            assert kwargs["true_cfg_scale"] == 2.0 and type(kwargs["true_cfg_scale"]) is float, kwargs


# -- what Omni(...) refuses before anything loads ------------------------------------------

@pytest.mark.parametrize("kwargs, error, words", [
    (dict(model=123), TypeError, r"model must be a built-in name \['tiny-wan', .*found int 123"),
    (dict(model=None), TypeError, "model must be a built-in name .*found NoneType None"),
    (dict(dtype=torch.int8), ValueError, r"dtype torch.int8 is not one a pipeline runs in: use one of \['bfloat16'"),
    (dict(dtype=torch.float8_e4m3fn), ValueError, "8-bit host storage is storage_dtype="),
    (dict(lora=5), TypeError, "lora must be a path, 'PATH:SCALE', .* found int 5"),
    (dict(lora=[5]), TypeError, "a LoRA is a path, 'PATH:SCALE', .* found int 5"),
    (dict(load_kwargs=5), TypeError, "load_kwargs must be a dict of from_pretrained's keyword arguments, found int"),
    (dict(load_kwargs={1: 2}), TypeError, r"load_kwargs keys are from_pretrained's keyword names \(strings\)"),
    (dict(cold_start="no"), TypeError, "cold_start must be True or False, found str 'no'"),
    (dict(progress="yes"), TypeError, "progress must be True or False, found str 'yes'"),
    (dict(device="mps"), OffloadConfigError, "device mps is not supported: use a CUDA device or 'cpu'"),
    (dict(device="cuda:100"), OffloadConfigError, "device cuda:100: .* use"),
    (dict(device="nowhere"), OffloadConfigError, "device 'nowhere' is not a device here"),
    (dict(load_kwargs={"variant": "fp16"}), ValueError,
     r"load_kwargs \['variant'\] go to from_pretrained, and the built-in 'tiny-flux' is built in code, not loaded"),
    (dict(load_kwargs={"dtype": torch.bfloat16}), ValueError, "load_kwargs sets 'dtype'"),
])
@pytest.mark.parametrize("config", [None, STREAM_ALL], ids=["resident", "streamed"])
def test_bad_constructor_arguments_are_refused_before_anything_loads(monkeypatch, kwargs, error, words,
                                                                     config) -> None:
    """Each named, not a torch error from deep in the load or the cast (or, for a device this host
    lacks, after the whole model was built resident); a truthy string is not a bool."""
    import omni_dist_offload.app.api as api

    monkeypatch.setattr(api, "load_and_place", lambda *a, **k: pytest.fail("loaded the model"))
    with pytest.raises(error, match=words) as raised:
        Omni(**{"model": "tiny-flux", "diffusion_offload_config": config, **kwargs})
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize("key", ["dtype", "torch_dtype"])
def test_a_dtype_in_load_kwargs_is_refused_before_a_folder_loads(monkeypatch, tmp_path: Path, key) -> None:
    """Omni passes its run dtype to from_pretrained: load_kwargs' own gave a raw TypeError
    ("multiple values for keyword argument") or a ModelLoadError whose advice did not fit."""
    import omni_dist_offload.app.api as api
    import omni_dist_offload.loading.pipelines as pipelines

    monkeypatch.setattr(pipelines, "load_pipeline", lambda *a, **k: pytest.fail("loaded the model"))
    monkeypatch.setattr(pipelines, "_prepare_cold_start", lambda *a, **k: pytest.fail("read the folder"))
    for config in (None, STREAM_ALL):
        with pytest.raises(ValueError, match=rf"load_kwargs sets '{key}', which the loader sets itself from the run "
                                             r"dtype: drop it and pass the dtype as Omni\(dtype=\.\.\.\)"):
            Omni(str(tmp_path), config, progress=False, load_kwargs={key: torch.bfloat16, "variant": "fp16"})
        with pytest.raises(ValueError, match=f"load_kwargs sets '{key}'"):  # and the loader alone
            pipelines.load_and_place(str(tmp_path), None, device=torch.device("cpu"), dtype=torch.float32,
                                     load_kwargs={key: torch.bfloat16})
    monkeypatch.setattr(api, "load_and_place", lambda *a, **k: pytest.fail("loaded the model"))
    with pytest.raises(ValueError, match=rf"load_kwargs sets '{key}'.*Omni\(dtype="):
        Omni("tiny-wan", None, load_kwargs={key: torch.bfloat16})  # a built-in took it and ran in float32
    assert pipelines.check_load_kwargs("tiny-wan", {}) == {} and pipelines.check_load_kwargs("x", None) == {}


def test_an_omni_is_not_copied_or_pickled(wan, wan_reference) -> None:
    """copy.copy shared the pipeline, handle and lock, and close() on the copy freed this one's
    offload; deepcopy and pickle failed on the lock. Refused, naming what to do, and the original
    goes on."""
    import copy
    import pickle

    for attempt in (copy.copy, copy.deepcopy, pickle.dumps):
        with pytest.raises(TypeError, match=r"an Omni cannot be copied \(copy.copy or copy.deepcopy\) or pickled: "
                                            ".*Build another Omni with the same arguments"):
            attempt(wan)
    assert np.array_equal(wan.generate("a cat", seed=1).frames, wan_reference)


def test_a_negative_prompt_is_one_prompt(wan, wan_reference, monkeypatch) -> None:
    """The prompt is one string, so the negative prompt is one too: Flux ran a list of two (twice
    the compute), dropped the second and recorded both; a number failed mid-run."""
    calls = []
    monkeypatch.setattr(type(wan.pipeline), "encode_prompt", lambda *a, **k: calls.append(1))
    for value in (["a", "b"], ("a", "b"), [], 5, [5], ["a", None]):
        _refused(wan, re.escape(f"negative_prompt={value!r}: the prompt is one string, so the negative prompt is "
                                "one too: give a string"), negative_prompt=value)
    assert calls == []
    monkeypatch.undo()
    one = wan.generate("a cat", seed=1, negative_prompt="blurry").frames
    assert np.array_equal(wan.generate("a cat", seed=1, negative_prompt=["blurry"]).frames, one)
    with Omni("tiny-flux", None, progress=False) as flux:
        with pytest.raises(GenerationOptionError, match=r"negative_prompt=\['a', 'b'\]"):
            flux.call_kwargs(negative_prompt=["a", "b"], true_cfg_scale=4.0)
        with pytest.raises(GenerationOptionError, match="negative_prompt_2=5"):
            flux.call_kwargs(negative_prompt="a", negative_prompt_2=5, true_cfg_scale=4.0)
        assert flux.call_kwargs(negative_prompt=["a"])["negative_prompt"] == ["a"]
