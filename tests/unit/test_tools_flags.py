"""The developer tools' command lines (``python -m omni_dist_offload.tools.<name>``): a bad flag
is one line on stderr (``prog: error: ...``) and exit status 2, found before any model is built
or process group started; output paths are checked (their folders created) before the run.
Every case here stops before a model exists: called in-process, each takes milliseconds. The
benchmark's own flags: test_bench.py; serve_stress's: test_serve_stress.py."""

from __future__ import annotations

import os

import pytest
import torch

from omni_dist_offload.runtime.flags import UsageError, non_negative_float, output_file
from omni_dist_offload.tools import contention, hostfill, serve_stress, soak, startup, trace_blocks


@pytest.fixture(autouse=True)
def _one_process(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def nothing_built(monkeypatch):
    """Fail the test if a tool gets as far as building a model or starting a process group."""
    def refuse(*_args, **_kwargs):
        raise AssertionError("a bad flag must be refused before anything is built")

    for module in (soak, startup, trace_blocks):
        monkeypatch.setattr(module, "maybe_init_dist", refuse)
    monkeypatch.setattr(soak, "build_model", refuse)
    monkeypatch.setattr(contention, "build_model", refuse)


def one_line_error(capsys, prog: str) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1, err
    assert err[0].startswith(f"python -m omni_dist_offload.tools.{prog}: error: "), err[0]
    return err[0]


# -- output paths ----------------------------------------------------------------------------
def test_output_file_creates_missing_folders_and_names_flag_path_and_reason(tmp_path) -> None:
    target = tmp_path / "out" / "deeper" / "bench.json"
    assert output_file("--json", target) == target
    assert target.parent.is_dir() and not target.exists()  # the folder is made, the file is not
    output_file("--json", target)  # again: nothing to do

    (tmp_path / "a-file").write_text("")
    with pytest.raises(UsageError) as info:
        output_file("--png", tmp_path / "a-file" / "x.png")
    assert str(info.value).startswith(f"--png '{tmp_path / 'a-file' / 'x.png'}': cannot create its folder")
    assert "is a file" in str(info.value)
    with pytest.raises(UsageError, match="is a folder: give a file path"):
        output_file("--json", tmp_path)


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_output_file_refuses_a_folder_it_cannot_write(tmp_path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(UsageError, match="is not writable"):
        output_file("--json", locked / "x.json")
    with pytest.raises(UsageError, match="cannot create its folder"):
        output_file("--json", locked / "sub" / "x.json")


def test_non_negative_float_refuses_what_would_turn_a_check_off() -> None:
    assert non_negative_float("0") == 0.0 and non_negative_float("2.5") == 2.5
    for text in ("nan", "inf", "-1", "x"):
        with pytest.raises(Exception, match=repr(text)):
            non_negative_float(text)


@pytest.mark.parametrize("tool, argv, flag", [
    (contention, ["--json", "{file}/x.json"], "--json"),
    (serve_stress, ["--json", "{file}/x.json"], "--json"),
    (trace_blocks, ["--json", "{file}/x.json"], "--json"),
    (startup, ["load", "{folder}", "--mode", "cold", "--json", "{file}/x.jsonl"], "--json"),
], ids=["contention", "serve_stress", "trace_blocks", "startup"])
def test_an_output_path_that_cannot_be_written_exits_2_before_the_run(tool, argv, flag, tmp_path, capsys,
                                                                      nothing_built, monkeypatch) -> None:
    if tool is contention:  # past its CUDA check, to its output check
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    (tmp_path / "file").write_text("")
    argv = [a.format(file=tmp_path / "file", folder=tmp_path) for a in argv]
    assert tool.main(argv) == 2
    line = one_line_error(capsys, tool.__name__.rsplit(".", 1)[1])
    assert f"{flag} '{tmp_path / 'file'}/x.json" in line and "is a file" in line


def test_trace_blocks_creates_its_json_folder_before_refusing_a_run_outside_torchrun(tmp_path, capsys) -> None:
    out = tmp_path / "new" / "blocks.json"
    assert trace_blocks.main(["--json", str(out)]) == 2
    assert out.parent.is_dir()
    assert "run it under torchrun with one process per GPU" in one_line_error(capsys, "trace_blocks")


# -- one line, exit 2 ------------------------------------------------------------------------
@pytest.mark.parametrize("tool, argv, says", [
    (soak, ["--shapes", "5x32", "9x48x64"], "shape 5x32 does not fit tiny-wan, a video model: give FxHxW"),
    (soak, ["--model", "tiny-flux", "--shapes", "64", "5x32x32"], "shape 5x32x32 does not fit tiny-flux, an image"),
    (soak, ["--shapes", "0x32x32", "9x48x64"], "each above 0"),
    (soak, ["--chunk-mib", "-1"], "argument --chunk-mib: '-1' is not above 0"),
    (soak, ["--chunk-mib", "0"], "argument --chunk-mib: '0' is not above 0"),
    (soak, ["--rss-tolerance-mib", "nan"], "argument --rss-tolerance-mib: 'nan' is not a finite number"),
    (soak, ["--allocated-tolerance-mib", "-1"], "argument --allocated-tolerance-mib: '-1' is negative"),
    (soak, ["--device", "bogus"], "argument --device: 'bogus' is not a device: use cuda, cuda:N or cpu"),
    (soak, ["--device", "meta"], "argument --device: 'meta' is not supported"),
    (soak, ["--forwards", "0"], "argument --forwards: '0' is not a positive integer"),
    (soak, ["--forwards", "3"], "more forwards than warm-up ones"),
    (hostfill, ["--gib", "-1"], "argument --gib: '-1' is not above 0"),
    (hostfill, ["--gib", "inf"], "--gib inf is more than 90% of"),
    (hostfill, ["--procs", "0"], "argument --procs: '0' is not a positive integer"),
    (contention, ["--modes", "spread"], "--modes must include alone"),
    (contention, ["--mib", "0"], "argument --mib: '0' is not above 0"),
    (startup, ["load", "/nonexistent", "--mode", "cold"], "'/nonexistent': no such folder"),
    (startup, ["load", "/tmp"], "the following arguments are required: --mode"),
    (startup, ["write", "/tmp/x", "--blocks", "0"], "argument --blocks: '0' is not a positive integer"),
    (startup, [], "the following arguments are required: command"),
    (trace_blocks, ["--preset", "tiny-flux"], "argument --preset: invalid choice: 'tiny-flux'"),
])
def test_a_bad_flag_is_one_line_and_exit_2_before_anything_is_built(tool, argv, says, capsys, nothing_built) -> None:
    assert tool.main(argv) == 2
    assert says in one_line_error(capsys, tool.__name__.rsplit(".", 1)[1])
    assert capsys.readouterr().out == ""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the host has a CUDA device")
def test_soak_and_contention_say_when_cuda_is_asked_for_but_absent(capsys, nothing_built) -> None:
    assert soak.main(["--device", "cuda"]) == 2
    assert "'cuda': no CUDA device is visible; use --device cpu" in one_line_error(capsys, "soak")
    assert contention.main(["--preset", "tiny-flux", "--blocks", "2"]) == 2
    assert "no CUDA device is visible" in one_line_error(capsys, "contention")


def test_startup_reports_a_folder_that_does_not_load_in_one_line_exit_1(tmp_path, capsys) -> None:
    # A folder, but no pipeline in it: a load failure (exit 1, as omni-offload generate reports a
    # model that cannot load), not a traceback.
    assert startup.main(["load", str(tmp_path), "--mode", "cold"]) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("python -m omni_dist_offload.tools.startup load: error: ")
    assert "model_index.json" in err[0]


def test_help_still_prints_the_whole_usage(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        soak.main(["--help"])
    assert info.value.code == 0 and "--shapes" in capsys.readouterr().out
