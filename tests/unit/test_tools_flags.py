"""The developer tools' command lines (``python -m omni_dist_offload.tools.<name>``): a bad flag
is one line on stderr (``prog: error: ...``) and exit status 2, found before any model is built
or process group started; output paths are checked (their folders created) before the run.
Every case here stops before a model exists: called in-process, each takes milliseconds. The
benchmark's own flags: test_bench.py; serve_stress's: test_serve_stress.py."""

from __future__ import annotations

import argparse
import copy
import json
import os
from pathlib import Path

import pytest
import torch

from omni_dist_offload.runtime.flags import (
    OneLineParser,
    UsageError,
    expand_home,
    non_negative_float,
    output_file,
    positive_float,
    user_path,
)
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


def test_user_path_expands_a_tilde_and_refuses_one_naming_no_user(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    assert user_path("~/out/x.json") == tmp_path / "out" / "x.json" and user_path("~") == tmp_path
    assert user_path("out/~x") == Path("out/~x")  # only a leading ~ is the home folder
    assert expand_home("~/l.safetensors:0.5") == f"{tmp_path}/l.safetensors:0.5"  # the text kept as given
    with pytest.raises(argparse.ArgumentTypeError, match=r"'~no-such-user-here' \(in '~no-such-user-here/x.json'\) "
                                                         "names no home folder known here"):
        user_path("~no-such-user-here/x.json")
    assert user_path("./~no-such-user-here/x.json") == Path("~no-such-user-here/x.json")  # the way to mean it


def test_a_type_path_flag_expands_a_tilde_in_every_one_line_parser(tmp_path, monkeypatch) -> None:
    """Flags declared ``type=Path`` (serve's --output-dir, these tools') get user_path from the
    parser: the shell leaves ``--json=~/x`` alone."""
    monkeypatch.setenv("HOME", str(tmp_path))
    parser = OneLineParser(prog="p")
    parser.add_argument("--out", type=Path)
    parser.add_subparsers(dest="command").add_parser("sub").add_argument("--out", type=Path)
    assert parser.parse_args(["--out=~/a"]).out == tmp_path / "a"
    assert parser.parse_args(["sub", "--out=~/b"]).out == tmp_path / "b"
    assert serve_stress.build_parser().parse_args(["--json=~/s.json"]).json == tmp_path / "s.json"
    assert startup.build_parser().parse_args(["write", "~/w"]).folder == tmp_path / "w"
    assert contention.build_parser().parse_args(["--json=~/c.json"]).json == tmp_path / "c.json"
    with pytest.raises(UsageError, match="argument --out: '~no-such-user-here' names no home folder"):
        parser.parse_args(["--out", "~no-such-user-here"])


def test_non_negative_float_refuses_what_would_turn_a_check_off() -> None:
    assert non_negative_float("0") == 0.0 and non_negative_float("2.5") == 2.5
    for text in ("nan", "inf", "-1", "x"):
        with pytest.raises(Exception, match=repr(text)):
            non_negative_float(text)


def test_positive_float_refuses_infinity() -> None:
    """Sizes and timeouts: infinity passed, then int(mib * 2**20) raised OverflowError mid-run."""
    assert positive_float("2.5") == 2.5
    for text in ("inf", "-inf", "1e400", "nan"):
        with pytest.raises(argparse.ArgumentTypeError, match=f"{text!r} is not a finite number"):
            positive_float(text)
    for text in ("0", "-1"):
        with pytest.raises(argparse.ArgumentTypeError, match=f"{text!r} is not above 0"):
            positive_float(text)


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


def test_trace_blocks_refused_outside_torchrun_leaves_no_json_folder(tmp_path, capsys) -> None:
    # Checked before the run (a file in the way is refused: above), made only once it starts.
    out = tmp_path / "new" / "blocks.json"
    assert trace_blocks.main(["--json", str(out)]) == 2
    assert not out.parent.exists()
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
    (hostfill, ["--gib", "inf"], "argument --gib: 'inf' is not a finite number"),
    (hostfill, ["--procs", "0"], "argument --procs: '0' is not a positive integer"),
    (contention, ["--modes", "spread"], "--modes must include alone"),
    (contention, ["--mib", "0"], "argument --mib: '0' is not above 0"),
    (contention, ["--mib", "inf"], "argument --mib: 'inf' is not a finite number"),
    (soak, ["--timeout-s", "inf"], "argument --timeout-s: 'inf' is not a finite number"),
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


@pytest.mark.parametrize("where", ["{file}", "{file}/x"])
def test_startup_write_onto_a_file_is_one_line_exit_2_before_anything_is_built(where, tmp_path, capsys,
                                                                              monkeypatch) -> None:
    def refuse(*_args, **_kwargs):
        raise AssertionError("a bad folder must be refused before anything is built")

    monkeypatch.setattr(startup, "write_folder", refuse)
    (tmp_path / "file").write_text("")
    folder = where.format(file=tmp_path / "file")
    assert startup.main(["write", folder, "--blocks", "1", "--preset", "tiny-wan"]) == 2
    line = one_line_error(capsys, "startup")
    assert f"folder '{folder}'" in line and "a file" in line and "give a folder" in line


@pytest.mark.parametrize("flag", ["--timeout", "--hold", "--probe-interval", "--p95-factor", "--rss-tolerance",
                                  "--settle"])
@pytest.mark.parametrize("value", ["inf", "nan"])
def test_serve_stress_refuses_a_number_that_is_not_finite_before_the_server_starts(flag, value, capsys,
                                                                                   monkeypatch) -> None:
    def refuse(*_args, **_kwargs):
        raise AssertionError("a bad flag must be refused before the server starts")

    monkeypatch.setattr(serve_stress, "run_stress", refuse)
    assert serve_stress.main([flag, value]) == 2
    assert f"argument {flag}: '{value}' is not a finite number" in one_line_error(capsys, "serve_stress")


def test_contention_help_says_its_whole_first_sentence(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        contention.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert info.value.code == 0
    assert "copies run beside it: the floor under which no residency plan brings a streamed forward, whatever it hides." in out


def test_startup_weights_digest_is_of_the_weights(tmp_path) -> None:
    a, b = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    b.load_state_dict(a.state_dict())
    # Same bytes at another offset: the same digest.
    b.weight.data = torch.empty(b.weight.numel() + 1)[1:].view_as(b.weight).copy_(a.weight)
    assert startup._weights_digest(a) == startup._weights_digest(b)
    with torch.no_grad():
        b.weight[0, 0] = torch.nextafter(b.weight[0, 0], torch.tensor(1.0))  # one bit
    assert startup._weights_digest(a) != startup._weights_digest(b)
    assert startup._weights_digest(a) != startup._weights_digest(copy.deepcopy(a).double())  # same values
    # A digest taken earlier (a streamed block's, while it ran) stands for that tensor's bytes.
    assert startup._weights_digest(b, {"weight": startup._tensor_digest(a.weight)}) == startup._weights_digest(a)


def test_startup_modes_give_equal_weights_digests_on_the_cpu(tmp_path, capsys) -> None:
    # fp32 on the CPU: the forward's digest may differ between cold and ordinary (the matmuls
    # depend on the tensors' alignment); the weights' must not.
    folder = tmp_path / "w"
    assert startup.main(["write", str(folder), "--blocks", "1", "--preset", "tiny-wan", "--dtype", "fp32"]) == 0
    capsys.readouterr()
    rows = {}
    for mode in ("cold", "ordinary", "peer"):
        assert startup.main(["load", str(folder), "--mode", mode, "--run-dtype", "fp32"]) == 0
        rows[mode] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len({r["weights_digest"] for r in rows.values()}) == 1
    assert all(len(r["digest"]) == 16 for r in rows.values())  # the forward's, as earlier rows have it


def test_trace_blocks_summarises_a_run_of_one_block() -> None:
    """--blocks 1: the per-block median past the first block had nothing to take (StatisticsError
    after the whole GPU run); a run whose blocks report no transfer time has no transfer median."""
    row = {"fwd": 5.0, "blocks_span": 4.0, "wait": 0.0, "compute": [4.0], "xfer": [None]}
    runs = {"resident_block_ms": [4.0], "resident_fwd": [5.0, 5.0], **{n: [row, row] for n in trace_blocks.CONFIGS}}
    line = trace_blocks._summarise(0, runs)
    assert line["resident_block_med"] == 4.0
    assert all(line[n]["block_compute_med"] == 4.0 and line[n]["xfer_med"] is None for n in trace_blocks.CONFIGS)
    # Two blocks: the first is left out, as before.
    row = {**row, "compute": [9.0, 4.0], "xfer": [1.0, 2.0]}
    line = trace_blocks._summarise(0, {**runs, "rank-local": [row]})
    assert line["rank-local"]["block_compute_med"] == 4.0 and line["rank-local"]["xfer_med"] == 1.5
