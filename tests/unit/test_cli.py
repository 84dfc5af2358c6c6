"""``omni-offload``: generate end to end on the built-in pipelines, inspect, and bad input."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from omni_dist_offload.app.cli import main
from media import read_frames

REPO = Path(__file__).resolve().parents[2]


def sidecar(path: Path) -> dict:
    return json.loads(path.with_suffix(".json").read_text())


def test_no_arguments_runs_tiny_wan_streaming_dit_and_text_encoder(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    assert main([]) == 0
    out = capsys.readouterr().out
    assert "generated 1 video in" in out and "videos/min" in out
    meta = json.loads((tmp_path / "outputs" / "00000.json").read_text())
    video = tmp_path / "outputs" / meta["file"]
    if video.suffix == ".mp4":  # the optional video extra is installed
        import imageio.v2 as imageio

        assert np.stack(imageio.mimread(video)).shape == (5, 32, 32, 3)
    else:
        assert video.name == "00000.gif" and read_frames(video).shape == (5, 32, 32, 3)
    assert meta["model"] == "tiny-wan" and meta["kind"] == "video"
    assert (meta["prompt"], meta["seed"]) == ("a red fox running through snow", 0)
    assert meta["offload_config"]["components"] == ["dit", "text_encoder"]
    assert {r["category"] for r in meta["offload_summary"]} == {"dit", "text_encoder"}
    assert meta["timings"]["setup_s"] > 0 and meta["timings"]["generation_s"] > 0


def test_generate_tiny_wan_with_sizes_and_prompts_file(tmp_path) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("# a comment\na red fox\n\na cat on a boat\n")
    out_dir = tmp_path / "out"
    rc = main(["generate", "--model", "tiny-wan", "--prompts-file", str(prompts), "--height", "48",
               "--width", "32", "--num-frames", "9", "--num-inference-steps", "2", "--seed", "7",
               "--output-dir", str(out_dir), "--video-format", "gif", "--fps", "8",
               "--diffusion-offload-config", '{"mode":"layer","components":["dit"]}'])
    assert rc == 0
    assert sorted(p.name for p in out_dir.iterdir()) == ["00000.gif", "00000.json", "00001.gif", "00001.json"]
    first, second = read_frames(out_dir / "00000.gif"), read_frames(out_dir / "00001.gif")
    assert first.shape == second.shape == (9, 48, 32, 3)
    assert not np.array_equal(first, second)
    meta = [sidecar(out_dir / f"0000{i}.gif") for i in range(2)]
    assert [(m["prompt"], m["seed"]) for m in meta] == [("a red fox", 7), ("a cat on a boat", 8)]
    assert (meta[0]["height"], meta[0]["width"], meta[0]["num_frames"], meta[0]["fps"]) == (48, 32, 9, 8)
    assert meta[0]["offload_config"]["components"] == ["dit"]


def test_generate_tiny_flux_images(tmp_path) -> None:
    out_dir = tmp_path / "out"
    rc = main(["--model", "tiny-flux", "--prompt", "a red fox", "--prompt", "a blue bird",
               "--seed", "3", "--output-dir", str(out_dir), "--no-progress"])
    assert rc == 0
    images = [read_frames(out_dir / f"0000{i}.png") for i in range(2)]
    assert images[0].shape == (1, 16, 16, 3) and not np.array_equal(images[0], images[1])
    meta = sidecar(out_dir / "00001.png")
    assert (meta["prompt"], meta["seed"], meta["kind"], meta["num_frames"]) == ("a blue bird", 4, "image", None)
    assert [r["component"] for r in meta["offload_summary"]] == ["transformer", "text_encoder", "text_encoder_2"]


def test_generate_from_a_local_folder(tmp_path) -> None:
    from tiny_models import tiny_wan_pipeline

    tiny_wan_pipeline().save_pretrained(tmp_path / "wan")
    rc = main(["--model", str(tmp_path / "wan"), "--height", "32", "--width", "32", "--num-frames", "5",
               "--num-inference-steps", "2", "--output-dir", str(tmp_path / "out"), "--video-format", "gif"])
    assert rc == 0
    assert read_frames(tmp_path / "out" / "00000.gif").shape == (5, 32, 32, 3)
    assert sidecar(tmp_path / "out" / "00000.gif")["pipeline_class"] == "WanPipeline"


def test_inspect_prints_the_plan_table(capsys) -> None:
    assert main(["inspect", "--model", "tiny-flux"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.startswith("component"))
    assert header.split() == ["component", "category", "class", "blocks", "resident", "streamed", "share", "host",
                              "slots", "on-device", "budget", "transfer", "stored", "found", "setup", "fallback"]
    rows = {line.split()[0]: line.split() for line in lines if line.split()[:1] in
            (["transformer"], ["text_encoder"], ["text_encoder_2"], ["vae"])}
    assert rows["transformer"][1:5] == ["dit", "FluxTransformer2DModel", "5", "0"]
    assert rows["transformer"][-5:-3] == ["rank-local", "-"] and rows["transformer"][-1] == "-"  # not stored in 8 bits
    assert rows["transformer"][-3] == "table" and rows["text_encoder_2"][-3] == "table"
    share = next(cell for cell in rows["transformer"] if cell.endswith("%"))  # bytes carry a unit: split
    assert int(share[:-1]) > 50
    assert re.fullmatch(r"\d+\.\d\ds@\d+\.\dGB/s", rows["transformer"][-2])  # fill+pin time, rate
    assert rows["vae"][-2] == "-"
    assert rows["text_encoder_2"][1:4] == ["text_encoder", "T5EncoderModel", "3"]
    assert rows["vae"][1:5] == ["resident", "AutoencoderKL", "0", "-"]
    assert any(line.startswith("weights on the device:") for line in lines)


def test_inspect_shows_the_plan_a_device_budget_makes(capsys) -> None:
    assert main(["inspect", "--model", "tiny-flux", "--device-budget", "700KiB", "--json"]) == 0
    rows = {r["component"]: r for r in json.loads(capsys.readouterr().out)}
    dit = rows["transformer"]
    assert dit["device_budget"] and dit["resident_blocks"] and dit["predicted_ratio"] == 1.0
    assert dit["kept_blocks"] == []  # as summary() names it: blocks keeping a part (a measured plan)
    budgets = [r["device_budget"] for r in rows.values() if r["device_budget"] is not None]
    assert len(budgets) == 3 and sum(budgets) <= 700 * 1024
    assert main(["inspect", "--model", "tiny-flux", "--device-budget", "1KiB"]) == 2
    assert "below the smallest budget that works here" in capsys.readouterr().err
    # The flag replaces a config's "auto" budget, and the activation_reserve that went with it.
    auto = '{"mode":"layer","components":["dit"],"device_budget":"auto","activation_reserve":"1GiB"}'
    assert main(["inspect", "--model", "tiny-flux", "--device-budget", "700KiB", "--json",
                 "--diffusion-offload-config", auto]) == 0, capsys.readouterr().err
    rows = {r["component"]: r for r in json.loads(capsys.readouterr().out)}
    assert 0 < rows["transformer"]["device_budget"] <= 700 * 1024


def test_inspect_json(capsys) -> None:
    assert main(["inspect", "--model", "tiny-wan", "--diffusion-offload-config",
                 '{"mode":"layer","components":["text_encoder"]}', "--json"]) == 0
    rows = {r["component"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["text_encoder"]["num_blocks"] == 3 and rows["text_encoder"]["weight_transfer"] == "rank-local"
    assert rows["text_encoder"]["block_bytes"] > 0 and rows["text_encoder"]["fallback_reason"] is None
    assert rows["transformer"]["category"] == "resident" and rows["transformer"]["block_bytes"] == 0


def test_inspect_on_device_bytes_are_what_stays_on_the_device(capsys) -> None:
    """``inspect --json``'s ``on_device_bytes`` counts the tensors outside the blocks as well as
    the kept blocks, so it is not named ``resident_bytes``, which summary() uses for the kept
    blocks alone."""
    def rows(*flags: str) -> dict:
        assert main(["inspect", "--model", "tiny-wan", "--json", *flags]) == 0
        return {r["component"]: r for r in json.loads(capsys.readouterr().out)}

    fp8 = ["--storage-dtype", "float8_e4m3fn"]
    streamed, streamed8 = rows(), rows(*fp8)
    kept, kept8 = rows("--device-budget", "300KiB"), rows("--device-budget", "300KiB", *fp8)
    assert all("resident_bytes" not in row for row in [*streamed.values(), *kept.values()])
    for c in ("transformer", "text_encoder"):
        outside = streamed[c]["on_device_bytes"]  # every block streams: the tensors outside them
        assert outside > 0
        assert streamed8[c]["on_device_bytes"] == outside  # whatever the blocks are stored in
        assert streamed[c]["streamed_share"] == streamed[c]["block_bytes"] / (outside + streamed[c]["block_bytes"])
        assert streamed8[c]["streamed_share"] == streamed8[c]["block_bytes"] / (outside + streamed8[c]["block_bytes"])
        # Every block kept: in the model's dtype, or as 8-bit images.
        assert kept[c]["num_blocks"] == kept8[c]["num_blocks"] == 0
        assert kept[c]["on_device_bytes"] == outside + streamed[c]["block_bytes"]
        assert kept8[c]["on_device_bytes"] == outside + streamed8[c]["block_bytes"]


BAD_INPUT = {
    "bad JSON": (["--diffusion-offload-config", "{mode: layer"], "not valid JSON"),
    "unknown component": (["--diffusion-offload-config", '{"mode":"layer","components":["vae"]}'],
                          "'vae'"),
    "unknown key": (["--diffusion-offload-config", '{"mode":"layer","stream":true}'], "'stream'"),
    "zero steps": (["--num-inference-steps", "0"], "--num-inference-steps: '0' is not a positive integer"),
    "unknown flag": (["--frames", "5"], "unrecognized arguments: --frames"),
    "missing prompts file": (["--prompts-file", "nope.txt"], "--prompts-file 'nope.txt' cannot be read"),
    "missing folder": (["--model", "./no-such-model"], "--model './no-such-model': no such folder"),
    "bad dtype": (["--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8'"),
    "inspect flag": (["inspect", "--seed", "1"], "unrecognized arguments: --seed"),
    "missing lora": (["--lora", "nope.safetensors:0.5"], "--lora nope.safetensors: no such file or folder"),
    "unknown cache": (["--cache", "warp:2"], "unknown step cache 'warp'"),
    "bad cache value": (["--cache", "first-block:high"], "--cache first-block:high: threshold is a number"),
    "bad cache option": (["--cache", '{"type": "first-block", "thresh": 0.1}'], "unexpected keyword argument 'thresh'"),
    "zero cache interval": (["--cache", "taylorseer:0"], "--cache taylorseer:0: cache_interval is an integer, 1 or more"),
    "nan cache threshold": (["--cache", "first-block:nan"], "threshold is a number, finite and 0 or more"),
    "nan lora scale": (["--lora", "a.safetensors:nan"], "a LoRA scale is a finite number; found 'nan'"),
    "nan guidance": (["--guidance-scale", "nan"], "argument --guidance-scale: 'nan' is not a finite number"),
    "inf guidance": (["--guidance-scale", "inf"], "argument --guidance-scale: 'inf' is not a finite number"),
    "seed past torch's": (["--seed", str(2**64 - 2), "--prompt", "a", "--prompt", "b", "--prompt", "c"],
                          f"--seed {2**64 - 2}: prompt k uses seed + k, up to {2**64} here"),
}


@pytest.mark.parametrize("case", BAD_INPUT)
def test_bad_input_exits_2_with_one_line(case, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    argv, expected = BAD_INPUT[case]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0] and "error:" in lines[0], captured.err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv, expected", [
    (["--model", "tiny-flux", "--num-frames", "5"], "'num_frames' is not an option of FluxPipeline"),
    # The pipeline's own check_inputs refuses it.
    (["--height", "17"], "WanPipeline (tiny-wan) refused the options in its input check: `height` and `width` "
                         "have to be divisible by 16 but are 17 and 32. Change the option it names."),
], ids=["not an option", "refused by the pipeline"])
def test_option_the_pipeline_does_not_take_exits_2_before_generating(argv, expected, tmp_path, capsys) -> None:
    out_dir = tmp_path / "out"
    assert main([*argv, "--output-dir", str(out_dir), "--no-progress"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and expected in errors[0]
    assert not out_dir.exists()


def test_an_output_dir_below_a_file_is_refused_before_loading(tmp_path, capsys) -> None:
    (tmp_path / "a_file").write_text("x")
    assert main(["--output-dir", str(tmp_path / "a_file" / "out" / "more")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"is below {str(tmp_path / 'a_file')!r}, a file: give a folder." in err
    assert [p.name for p in tmp_path.iterdir()] == ["a_file"]


def test_a_prompts_file_with_a_byte_order_mark(tmp_path) -> None:
    from omni_dist_offload.app.cli import _validate, build_parser

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("# my prompts\na red fox\n", encoding="utf-8-sig")  # as Notepad saves it
    plan = _validate(build_parser().parse_args(["generate", "--prompts-file", str(prompts)]))
    assert plan.prompts == ["a red fox"]
    # Two such files joined (cat a.txt b.txt): the second's mark starts a line; as one before, it
    # made a comment and a blank line into prompts, shifting every later prompt's seed.
    prompts.write_bytes("\ufeffa red fox\n".encode() + "\ufeff# batch B\na cat\n\ufeff\n".encode())
    plan = _validate(build_parser().parse_args(["generate", "--prompts-file", str(prompts)]))
    assert plan.prompts == ["a red fox", "a cat"]


def test_the_last_seed_may_be_the_largest_torch_takes(monkeypatch) -> None:
    from omni_dist_offload.app.cli import UsageError, _validate, build_parser

    def plan(seed: int):
        return _validate(build_parser().parse_args(["generate", "--seed", str(seed), "--prompt", "a", "--prompt", "b"]))

    assert plan(2**64 - 2).seed == 2**64 - 2
    monkeypatch.setenv("WORLD_SIZE", "4")  # a padded wave repeats the prompts' own seeds
    assert plan(2**64 - 2).seed == 2**64 - 2
    with pytest.raises(UsageError, match=f"give --seed {2**64 - 2} or less"):
        plan(2**64 - 1)


def _entry_point(argv: list[str]) -> int:
    """``python -m omni_dist_offload ARGV`` in a forked process."""
    from omni_dist_offload.__main__ import run

    sys.argv = ["omni-offload", *argv]
    return run()


def test_process_exit_status_and_stderr(tmp_path) -> None:
    # Forked from the tests' preloaded server (tests/ranks.py): the process is the entry point's
    # own, without seconds of imports.
    from ranks import start_forked

    work, log = tmp_path / "work", tmp_path / "output.log"
    work.mkdir()
    proc = start_forked(_entry_point, (["generate", "--diffusion-offload-config", "[1, 2]"],),
                        env=dict(os.environ), log=log, cwd=work)
    assert proc.wait(timeout=120) == 2
    assert log.read_text().strip().splitlines() == [
        "omni-offload generate: error: --diffusion-offload-config: offload config must be a JSON "
        "object or dict, found list. (see omni-offload generate --help)"
    ]
    assert list(work.iterdir()) == []


def test_tracing_prints_the_offload_summary_line(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("OMNI_OFFLOAD_TRACE", "1")
    assert main(["generate", "--output-dir", str(tmp_path), "--no-progress"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("offload trace, last forward, exposed wait: transformer ")
    assert "text_encoder" in last and "%" in last


@pytest.mark.parametrize("flags, expected", [([], None), (["--compile"], "regional"),
                                             (["--compile", "model"], "model")])
def test_compile_flag(flags, expected):
    from omni_dist_offload.app.cli import _validate, build_parser

    plan = _validate(build_parser().parse_args(["generate", "--prompt", "a fox", *flags]))
    assert plan.compile == expected


def test_every_built_in_is_named_in_model_help_and_in_the_missing_folder_error(monkeypatch, tmp_path,
                                                                                capsys) -> None:
    """``--model``'s help and the missing-folder error list the built-ins from BUILTIN_MODELS
    (they named two of three)."""
    from omni_dist_offload.app.cli import build_parser
    from omni_dist_offload.models import BUILTIN_MODELS

    monkeypatch.chdir(tmp_path)
    assert main(["--model", "./no-such-model"]) == 2
    error = capsys.readouterr().err
    for command in ("generate", "inspect", "serve"):
        with pytest.raises(SystemExit):
            build_parser().parse_args([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert f"built-in name ({', '.join(BUILTIN_MODELS)})" in text, command
    assert f"a built-in name ({', '.join(BUILTIN_MODELS)})" in error


def test_serve_offers_no_context_parallel_degrees(capsys) -> None:
    """serve runs each request on one rank (or a wave of ranks): it takes no
    --ulysses-degree/--ring-degree, which it offered in --help only to refuse them."""
    from omni_dist_offload.app.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = capsys.readouterr().out
    assert "--ulysses-degree" not in text and "--ring-degree" not in text
    for flag in ("--ulysses-degree", "--ring-degree"):
        assert main(["serve", "--model", "tiny-flux", flag, "2"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"unrecognized arguments: {flag} 2" in err[0], err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--help"])
    assert "--ulysses-degree" in capsys.readouterr().out  # generate and inspect split


def test_a_bad_compile_mode_exits_2(capsys):
    assert main(["generate", "--prompt", "a fox", "--compile", "fast"]) == 2
    assert "--compile: invalid choice: 'fast'" in capsys.readouterr().err


def test_the_entry_point_imports_no_torch_before_it_decides_how_to_start() -> None:
    # serve restarts on the C allocator (omni_dist_offload/__main__.py); that must come before
    # the seconds of importing torch and diffusers, or every start pays them twice.
    code = "import sys, omni_dist_offload.__main__; print(sorted({'torch', 'diffusers'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("body, code, err", [("return 3", 3, ""), ("raise SystemExit(2)", 2, ""),
                                             ("raise ValueError('bad')", 1, "ValueError: bad")])
def test_an_entry_point_exits_with_main_status_and_skips_the_final_collection(body, code, err) -> None:
    # [Note: exit without the final collection]: the collector is frozen before the exit, and
    # atexit handlers still run after it.
    script = ("import atexit, gc\nfrom omni_dist_offload.runtime.proc import exit_with\n"
              "atexit.register(lambda: print('frozen' if gc.get_freeze_count() else 'collected'))\n"
              f"def main():\n    {body}\nexit_with(main)\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout.strip()) == (code, "frozen"), proc.stderr
    assert err in proc.stderr


def test_every_entry_point_exits_through_exit_with() -> None:
    blocks = {}
    for path in [*sorted((REPO / "omni_dist_offload").rglob("*.py")), REPO / "launch" / "generate.py"]:
        source = path.read_text()
        if 'if __name__ == "__main__":' in source:
            blocks[path.relative_to(REPO).as_posix()] = source.rsplit('if __name__ == "__main__":', 1)[1]
    assert "launch/generate.py" in blocks and "omni_dist_offload/tools/bench.py" in blocks
    for path, block in blocks.items():
        assert "exit_with(" in block or "run()" in block, f"{path} exits without exit_with: {block.strip()}"
    assert "skip_final_collection()" in (REPO / "omni_dist_offload" / "__main__.py").read_text()


# -- output folders that cannot be written, prompts files, re-runs into one folder -------------
UNWRITABLE = {
    # os.access says yes to all of these (for root, everywhere); the write itself fails.
    "below /proc": ("/proc/nowhere/out", "cannot be created: '/proc', the folder it would be made in, is not writable"),
    "below /sys": ("/sys/omni_out", "cannot be created: '/sys', the folder it would be made in, is not writable"),
    "an existing folder of /proc": ("/proc/self", "--output-dir '/proc/self' is not writable"),
}


@pytest.mark.skipif(not Path("/proc/self").is_dir() or not Path("/sys").is_dir(), reason="needs Linux /proc and /sys")
@pytest.mark.parametrize("case", UNWRITABLE)
def test_an_output_dir_that_cannot_be_written_is_refused_before_loading(case, monkeypatch, capsys) -> None:
    from omni_dist_offload.app import cli

    def refuse(*_args, **_kwargs):
        raise AssertionError("an unwritable --output-dir must be refused before the model is built")

    monkeypatch.setattr(cli, "_load", refuse)
    output_dir, expected = UNWRITABLE[case]
    assert main(["--model", "tiny-flux", "--output-dir", output_dir, "--no-progress"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert captured.out == "" and len(lines) == 1, captured.err
    assert lines[0].startswith("omni-offload generate: error: --output-dir ") and expected in lines[0]
    assert "give a folder you can write to" in lines[0]


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_an_output_dir_without_write_permission_is_refused_and_nothing_is_left(tmp_path, capsys) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        for output_dir, expected in [(locked, "is not writable"), (locked / "sub" / "out", "cannot be created")]:
            assert main(["--output-dir", str(output_dir)]) == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and expected in err and "(Permission denied)" in err
        assert list(locked.iterdir()) == []
    finally:
        locked.chmod(0o700)


def test_the_output_dir_check_writes_nothing_it_leaves_behind(tmp_path) -> None:
    from omni_dist_offload.runtime.flags import output_dir_check

    output_dir_check("--output-dir", tmp_path / "new" / "out")  # missing: the file written to try is in tmp_path
    output_dir_check("--output-dir", tmp_path)  # existing
    assert list(tmp_path.iterdir()) == []  # nor is the folder created: a refused run leaves nothing


@pytest.mark.parametrize("char", ["\u2028", "\u2029", "\x85", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e"],
                         ids=lambda c: f"U+{ord(c):04X}")
def test_a_prompts_file_splits_only_at_line_feeds(char, tmp_path) -> None:
    from omni_dist_offload.app.cli import _validate, build_parser

    prompts = tmp_path / "prompts.txt"
    # 3 lines, as wc -l and editors count them; Windows line ends on the first.
    prompts.write_bytes(f"a red fox\r\na cat{char}sitting on a mat\na dog\n".encode())
    plan = _validate(build_parser().parse_args(["generate", "--prompts-file", str(prompts), "--seed", "5"]))
    assert plan.prompts == ["a red fox", f"a cat{char}sitting on a mat", "a dog"]  # prompt 2 keeps seed 7


@pytest.mark.parametrize("text", ["a red fox\ra cat\r", "a red fox\r\na cat\rsitting\n"])
def test_a_prompts_file_with_classic_mac_line_ends_is_refused(text, tmp_path) -> None:
    """A carriage return alone made the whole file one prompt (fewer outputs, later seeds off)."""
    from omni_dist_offload.app.cli import _validate, build_parser
    from omni_dist_offload.runtime.flags import UsageError

    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes(text.encode())
    line = 1 if text.startswith("a red fox\ra") else 2
    with pytest.raises(UsageError, match=rf"line {line} holds a carriage return that ends no line"):
        _validate(build_parser().parse_args(["generate", "--prompts-file", str(prompts)]))


def test_a_rerun_into_the_same_folder_leaves_every_media_file_its_sidecar(tmp_path, capsys) -> None:
    out_dir = tmp_path / "out"
    assert main(["--model", "tiny-wan", "--prompt", "a", "--prompt", "b", "--prompt", "c", "--video-format", "gif",
                 "--num-inference-steps", "1", "--no-progress", "--output-dir", str(out_dir)]) == 0
    assert "already holds outputs" not in capsys.readouterr().err
    (out_dir / "notes.txt").write_text("mine")  # not of the runner's naming: never touched
    (out_dir / "00000.gif.bak").write_text("mine")
    assert main(["--model", "tiny-flux", "--prompt", "x", "--no-progress", "--output-dir", str(out_dir)]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "already holds outputs" in line]
    assert warnings == [f"--output-dir {out_dir} already holds outputs of an earlier run: 1 (00000) will be "
                        "replaced (with its media in any other format); 2 (00001 to 00002) past this run's "
                        "1 prompt(s) will stay as they are"]
    names = sorted(p.name for p in out_dir.iterdir())
    assert names == ["00000.gif.bak", "00000.json", "00000.png", "00001.gif", "00001.json", "00002.gif",
                     "00002.json", "notes.txt"]
    described = {sidecar(out_dir / f"0000{k}.x")["file"] for k in range(3)}
    assert described == {"00000.png", "00001.gif", "00002.gif"}
    assert sidecar(out_dir / "00000.x")["model"] == "tiny-flux"


@pytest.mark.skipif(not Path("/proc/self").is_dir() or not Path("/sys").is_dir(), reason="needs Linux /proc and /sys")
@pytest.mark.parametrize("flag, path, reason", [("--json", "/proc/bench.json", "its folder '/proc' is not writable"),
                                                ("--png", "/sys/bench.png", "its folder '/sys' is not writable")])
def test_bench_refuses_an_output_file_in_a_folder_that_cannot_be_written(flag, path, reason, monkeypatch,
                                                                         capsys) -> None:
    from omni_dist_offload.tools import bench

    def refuse(*_args, **_kwargs):
        raise AssertionError("an unwritable output file must be refused before the run")

    monkeypatch.setattr(bench, "maybe_init_dist", refuse)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert main(["bench", flag, path]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"omni-offload bench: error: {flag} {path!r}: {reason} (")


def test_an_output_file_check_leaves_no_file_behind(tmp_path) -> None:
    from omni_dist_offload.runtime.flags import output_file

    target = tmp_path / "sub" / "bench.json"
    assert output_file("--json", target) == target
    assert [p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")] == ["sub"]  # the folder, as before
    target.write_text("kept")
    assert output_file("--json", target) == target and target.read_text() == "kept"  # opened, not written


# -- a save that is interrupted or runs out of disk -------------------------------------------
def _result(kind: str, value: int):
    from omni_dist_offload.app.outputs import GenerationResult

    shape = (8, 8, 3) if kind == "image" else (3, 8, 8, 3)
    return GenerationResult(prompt=f"run {value}", seed=value, kind=kind, frames=np.full(shape, value, np.uint8),
                            name="00000", metadata={"run": value})


def _half_then(error: BaseException):
    """A media writer that writes part of the file, then fails (Ctrl-C, a full disk)."""
    def write(path, *_args):
        Path(path).write_bytes(b"\x89PNG\r\n\x1a\n half")
        raise error

    return write


INTERRUPTIONS = {
    "Ctrl-C in the media": ("media", KeyboardInterrupt()),
    "full disk in the media": ("media", OSError(28, "No space left on device")),
    "full disk in the sidecar": ("sidecar", OSError(28, "No space left on device")),
}


@pytest.mark.parametrize("case", INTERRUPTIONS)
def test_an_interrupted_save_leaves_the_earlier_output_whole(case, tmp_path, monkeypatch) -> None:
    """Written in place, media and sidecar were emptied at once: a 0-byte 00000.png beside the
    earlier run's 00000.json, the good output gone."""
    from omni_dist_offload.app import outputs

    saved = _result("image", 1).save(tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert sorted(before) == ["00000.json", "00000.png"] and all(before.values())
    where, error = INTERRUPTIONS[case]
    if where == "media":
        monkeypatch.setattr(outputs, "_write_png", _half_then(error))
    else:
        write_text = Path.write_text

        def failing(path, *args, **kwargs):
            if path.name.endswith(".json"):
                path.write_bytes(b'{"run": ')
                raise error
            return write_text(path, *args, **kwargs)

        monkeypatch.setattr(Path, "write_text", failing)
    expected = KeyboardInterrupt if isinstance(error, KeyboardInterrupt) else outputs.OutputWriteError
    with pytest.raises(expected) as info:
        _result("image", 2).save(tmp_path, replace=True)
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # no part left behind either
    assert read_frames(saved.media).max() == 1 and sidecar(saved.media) == {"run": 1, "file": "00000.png"}
    if expected is outputs.OutputWriteError:
        target = saved.media if where == "media" else saved.sidecar
        assert str(info.value).startswith(f"cannot write {str(target)!r} (No space left on device); an earlier "
                                          "output of that name is left as it was: free some space there")
        assert info.value.errno == 28 and isinstance(info.value, OSError)
    # Written again with nothing in the way: the new pair replaces the old one whole.
    _result("image", 3).save(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["00000.json", "00000.png"]
    assert read_frames(saved.media).max() == 3 and sidecar(saved.media)["run"] == 3


def test_a_video_save_writes_its_format_under_the_temporary_name(tmp_path) -> None:
    # Pillow (and ffmpeg) pick the format by the suffix: the temporary name keeps it last.
    result = _result("video", 4)
    result.frames = result.frames * np.arange(1, 4, dtype=np.uint8)[:, None, None, None]  # GIF merges equal frames
    saved = result.save(tmp_path, video_format="gif")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["00000.gif", "00000.json"]
    assert read_frames(saved.media).shape == (3, 8, 8, 3)


def test_a_full_disk_during_generate_is_one_line_exit_1(tmp_path, monkeypatch, capsys) -> None:
    from omni_dist_offload.app import outputs

    out_dir = tmp_path / "out"
    monkeypatch.setattr(outputs, "_write_png", _half_then(OSError(28, "No space left on device")))
    assert main(["--model", "tiny-flux", "--prompt", "a", "--num-inference-steps", "1", "--no-progress",
                 "--output-dir", str(out_dir)]) == 1
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert errors == [f"omni-offload generate: error: cannot write {str(out_dir / '00000.png')!r} (No space left on "
                      "device); an earlier output of that name is left as it was: free some space there, or write "
                      "to another folder."], err
    assert "Traceback" not in err and list(out_dir.iterdir()) == []


def test_ctrl_c_during_generate_is_one_line_exit_130(tmp_path, monkeypatch, capsys) -> None:
    """A Ctrl-C printed a KeyboardInterrupt traceback."""
    from omni_dist_offload.app import outputs

    def interrupt(path, frame):
        raise KeyboardInterrupt

    monkeypatch.setattr(outputs, "_write_png", interrupt)
    assert main(["--model", "tiny-flux", "--prompt", "a", "--num-inference-steps", "1", "--no-progress",
                 "--output-dir", str(tmp_path / "out")]) == 130
    err = capsys.readouterr().err
    assert "omni-offload generate: interrupted" in err and "Traceback" not in err, err


# -- ~ in path flags ---------------------------------------------------------------------------
@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """HOME in tmp_path, run from another folder there: a literal ~ would be a ./~ folder."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    return tmp_path / "home"


@pytest.mark.parametrize("command", ["generate", "inspect", "serve"])
@pytest.mark.parametrize("form", ["--{flag}=~/{path}", "--{flag} ~/{path}"])
def test_every_path_flag_expands_a_tilde_as_it_is_parsed(command, form, home) -> None:
    """The shell expands neither --output-dir=~/x nor a quoted '~/x': generate made a literal
    ./~/renders folder and found no ~/p.txt."""
    from omni_dist_offload.app.cli import build_parser

    flags = {"lora": ("l.safetensors:0.5", "lora", [f"{home}/l.safetensors:0.5"])}
    if command == "generate":
        flags.update({"output-dir": ("renders", "output_dir", home / "renders"),
                      "prompts-file": ("p.txt", "prompts_file", home / "p.txt")})
    if command == "serve":
        flags["output-dir"] = ("served", "output_dir", home / "served")
    argv = [command]
    for flag, (path, _, _) in flags.items():
        argv += form.format(flag=flag, path=path).split(" ")
    ns = build_parser().parse_args(argv)
    for _, dest, expected in flags.values():
        assert getattr(ns, dest) == expected


def test_a_generate_run_reads_and_checks_the_expanded_paths(home) -> None:
    from omni_dist_offload.app.cli import _validate, build_parser

    (home / "p.txt").write_text("a red fox\n")
    plan = _validate(build_parser().parse_args(["generate", "--prompts-file=~/p.txt", "--output-dir=~/renders"]))
    assert plan.prompts == ["a red fox"] and plan.output_dir == home / "renders"
    assert list(Path.cwd().iterdir()) == []  # no ./~ folder


def test_a_tilde_naming_no_user_is_refused_in_one_line(home, capsys) -> None:
    assert main(["generate", "--output-dir=~no-such-user-here/renders"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("omni-offload generate: error: argument --output-dir: "
                                                   "'~no-such-user-here' (in '~no-such-user-here/renders') names "
                                                   "no home folder known here"), lines
    assert list(Path.cwd().iterdir()) == []


def test_a_folder_named_like_a_built_in_does_not_change_what_the_ranks_compare(tmp_path, monkeypatch) -> None:
    # The loader loads the built-in whatever folder of that name is in the working directory, so
    # the ranks compare the built-in's name (a host with such a folder used to be refused).
    from omni_dist_offload.app.cli import _validate, build_parser, run_setup

    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny-flux").mkdir()
    plan = _validate(build_parser().parse_args(["generate", "--model", "tiny-flux", "--prompt", "a"]))
    assert run_setup(plan)["--model"] == "tiny-flux"
