"""Data-parallel generation in one process: job planning, padding, the launch script (with a
fake torchrun). Under a real torchrun on CPU (gloo): dist/test_launch_torchrun.py."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from omni_dist_offload import Omni
from omni_dist_offload.app.api import SamplingOptions
from omni_dist_offload.app.dp import plan_jobs, run_jobs
from omni_dist_offload.runtime.dist import DistContext, maybe_init_dist

REPO = Path(__file__).resolve().parents[2]
PROMPTS = ["a red fox", "a cat on a boat", "a dog in the rain", "a bird over the sea"]


def test_plan_jobs_waves_seeds_and_padding() -> None:
    prompts = ["p0", "p1", "p2", "p3", "p4"]
    per_rank = [plan_jobs(prompts, 10, rank, 2) for rank in range(2)]
    assert [[j.index for j in jobs] for jobs in per_rank] == [[0, 2, 4], [1, 3, 5]]
    assert [j.seed for j in per_rank[1]] == [11, 13, 10]
    assert [j.padding for j in per_rank[1]] == [False, False, True]
    assert per_rank[1][2].prompt == "p0"  # a repeat of a real prompt and its seed, same work
    real = sorted(j.index for jobs in per_rank for j in jobs if not j.padding)
    assert real == list(range(5))
    assert [len(plan_jobs(prompts, 0, r, 3)) for r in range(3)] == [2, 2, 2]
    assert [j.index for j in plan_jobs(prompts, 0, 0, 1)] == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="no prompts"):
        plan_jobs([], 0, 0, 1)


def test_padding_call_runs_and_its_output_is_discarded(tmp_path) -> None:
    omni = Omni("tiny-flux", {"mode": "layer", "components": ["dit"]}, progress=False)
    calls = []
    generate = omni.generate
    omni.generate = lambda prompt, **kw: calls.append(kw["name"]) or generate(prompt, **kw)
    ctx = DistContext(rank=1, world_size=2)  # no process group: the loop of rank 1 alone
    jobs = plan_jobs(PROMPTS[:3], 0, ctx.rank, ctx.world_size)
    report = run_jobs(omni, jobs, ctx, sampling=SamplingOptions(), output_dir=tmp_path)
    assert calls == ["00001", "00003"]  # the padding call ran, in lockstep with rank 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["00001.json", "00001.png"]
    assert report.written == [tmp_path / "00001.png"] and report.local_count == 1
    meta = json.loads((tmp_path / "00001.json").read_text())
    assert (meta["index"], meta["rank"], meta["world_size"], meta["seed"]) == (1, 1, 2, 1)


def test_maybe_init_dist_does_nothing_with_one_process(monkeypatch) -> None:
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    ctx = maybe_init_dist("cpu")
    assert ctx == DistContext() and ctx.backend is None
    assert not torch.distributed.is_initialized()


def _fake_launcher(tmp_path: Path) -> dict[str, str]:
    """A ``torchrun`` on PATH that prints its arguments and the variables the script sets."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "torchrun"
    fake.write_text('#!/usr/bin/env bash\necho "ARGS $*"\n'
                    'for v in NCCL_NVLS_ENABLE TORCH_SYMM_MEM_DISABLE_MULTICAST NVSHMEM_DISABLE_NVLS '
                    'LOG_RANK; do echo "$v=${!v-unset}"; done\n')
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in (
        "NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS", "LOG_RANK",
        "NGPU", "NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHRUN")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    return env


def test_generate_sh_sets_multicast_off_and_forwards(tmp_path) -> None:
    env = _fake_launcher(tmp_path)
    script = REPO / "launch" / "generate.sh"
    proc = subprocess.run(["bash", str(script), "--prompt", "a cat"], env={**env, "NGPU": "3"},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == f"ARGS --nproc_per_node 3 --standalone {script.parent}/generate.py --prompt a cat"
    assert lines[1:] == ["NCCL_NVLS_ENABLE=0", "TORCH_SYMM_MEM_DISABLE_MULTICAST=1",
                         "NVSHMEM_DISABLE_NVLS=1", "LOG_RANK=0"]

    multi = {**env, "NGPU": "8", "LOG_RANK": "0,8", "NNODES": "2", "NODE_RANK": "1",
             "MASTER_ADDR": "10.0.0.1"}
    proc = subprocess.run(["bash", str(script)], env=multi, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == (
        f"ARGS --nproc_per_node 8 --nnodes 2 --node-rank 1 --master-addr 10.0.0.1 --master-port 29500 "
        f"{script.parent}/generate.py")
    assert "LOG_RANK=0,8" in proc.stdout

    del multi["NODE_RANK"]
    proc = subprocess.run(["bash", str(script)], env=multi, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "NODE_RANK" in proc.stderr and "ARGS" not in proc.stdout


SCRIPTS = ["generate.sh", "bench.sh", "serve.sh"]


def _launch(tmp_path: Path, script: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REPO / "launch" / script), "--prompt", "a cat"],
                          env={**_fake_launcher(tmp_path), **env}, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("value", ["abc", "2.5", "-3", "0", "08", " 2"])
@pytest.mark.parametrize("script", SCRIPTS)
def test_a_launch_script_refuses_an_ngpu_that_is_not_a_positive_integer(script, value, tmp_path) -> None:
    proc = _launch(tmp_path, script, NGPU=value)
    assert proc.returncode == 2 and "ARGS" not in proc.stdout  # torchrun never started
    assert proc.stderr.splitlines() == [
        f"{script}: error: NGPU='{value}' is not a positive integer: give the number of processes on this host, "
        "e.g. NGPU=2."]


@pytest.mark.parametrize("value", ["auto", "gpu", "cpu", "xpu"])
@pytest.mark.parametrize("script", SCRIPTS)
def test_a_launch_script_passes_torchruns_own_ngpu_names_on(script, value, tmp_path) -> None:
    proc = _launch(tmp_path, script, NGPU=value)
    assert proc.returncode == 0, proc.stderr
    assert f"--nproc_per_node {value} " in proc.stdout.splitlines()[0]


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_launch_script_without_gpus_still_starts_one_process(script, tmp_path) -> None:
    proc = _launch(tmp_path, script, CUDA_VISIBLE_DEVICES="")  # no GPU visible: NGPU unset is 1
    assert proc.returncode == 0, proc.stderr
    assert "--nproc_per_node 1 " in proc.stdout.splitlines()[0]


@pytest.mark.parametrize("env, expected", [
    ({"NNODES": "x"}, "NNODES='x' is not a positive integer: give the number of hosts, e.g. NNODES=2."),
    ({"NNODES": "0"}, "NNODES='0' is not a positive integer"),
    ({"NNODES": "-2"}, "NNODES='-2' is not a positive integer"),
    ({"NNODES": "1.5"}, "NNODES='1.5' is not a positive integer"),
    ({"NNODES": "2", "NODE_RANK": "2"}, "NODE_RANK='2' is not a host of NNODES=2: set NODE_RANK (0..1) on each host."),
    ({"NNODES": "2", "NODE_RANK": "x"}, "NODE_RANK='x' is not a host of NNODES=2"),
    ({"NNODES": "2", "NODE_RANK": "-1"}, "NODE_RANK='-1' is not a host of NNODES=2"),
    ({"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": ""}, "MASTER_ADDR is not set: set it on each host"),
    ({"NNODES": "2", "NODE_RANK": "99999999999999999999"}, "NODE_RANK='99999999999999999999' is not a host of NNODES=2"),
    ({"NNODES": "12", "NODE_RANK": "12"}, "NODE_RANK='12' is not a host of NNODES=12"),
    ({"NNODES": "12", "NODE_RANK": "9"}, None),
    ({"NNODES": "99999999999999999999", "NODE_RANK": "99999999999999999998"}, None),
    ({"NODE_RANK": "1"}, "NODE_RANK='1' with NNODES=1: set NNODES to the number of hosts on every host"),
    ({"NNODES": "1", "NODE_RANK": "7"}, "NODE_RANK='7' with NNODES=1"),
    ({"NNODES": "1", "NODE_RANK": "0"}, None),
], ids=["NNODES=x", "NNODES=0", "NNODES=-2", "NNODES=1.5", "NODE_RANK=2", "NODE_RANK=x", "NODE_RANK=-1",
        "no-MASTER_ADDR", "NODE_RANK-20-digits", "NODE_RANK=NNODES-2-digits", "NODE_RANK-fewer-digits",
        "NNODES-20-digits", "NODE_RANK-without-NNODES", "NODE_RANK-with-NNODES=1", "NODE_RANK=0-one-host"])
def test_generate_sh_refuses_a_bad_host_count_instead_of_running_on_one_host(env, expected, tmp_path) -> None:
    proc = _launch(tmp_path, "generate.sh", **{"NGPU": "2", "MASTER_ADDR": "10.0.0.1", **env})
    if expected is None:  # a host of the job: torchrun starts
        assert proc.returncode == 0 and not proc.stderr, proc.stderr
        rendezvous = "--standalone" if env.get("NNODES", "1") == "1" else f"--node-rank {env['NODE_RANK']} "
        assert rendezvous in proc.stdout.splitlines()[0], proc.stdout
        return
    assert proc.returncode == 2 and "ARGS" not in proc.stdout  # not a --standalone run either
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"generate.sh: error: {expected}"), proc.stderr


def test_saving_with_replace_removes_only_the_same_output_in_the_other_formats(tmp_path) -> None:
    from omni_dist_offload.app.outputs import GenerationResult

    mine = ["00000.gif.bak", "x00000.gif", "000000.gif", "00001.gif", "00000.txt", "notes.json"]
    for name in ["00000.gif", "00000.mp4", *mine]:
        (tmp_path / name).write_text("old")
    (tmp_path / "00000.webp").mkdir()  # not a format this library writes
    result = GenerationResult(prompt="p", seed=0, kind="image", frames=np.zeros((4, 4, 3), np.uint8), name="00000")
    result.save(tmp_path)  # the default keeps them: a caller may save one result in two formats
    assert (tmp_path / "00000.gif").exists() and (tmp_path / "00000.mp4").exists()
    saved = result.save(tmp_path, replace=True)
    assert saved.media == tmp_path / "00000.png"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["00000.png", "00000.json", "00000.webp", *mine])


def test_the_earlier_outputs_warning_comes_once_per_host(tmp_path, caplog) -> None:
    from omni_dist_offload.app.dp import _warn_earlier_outputs

    for name in ["00000.png", "00000.json", "00003.gif", "100000.json", "0007.png", "000008.png", "00009.webp"]:
        (tmp_path / name).write_text("")
    with caplog.at_level("WARNING", logger="omni_dist_offload"):
        _warn_earlier_outputs(tmp_path, 2, DistContext(rank=1, world_size=2, local_rank=1))  # the host's other rank
        assert caplog.records == []
        _warn_earlier_outputs(tmp_path / "missing", 2, DistContext())
        assert caplog.records == []
        _warn_earlier_outputs(tmp_path, 4, DistContext(rank=8, world_size=16, local_rank=0))  # a host's first rank
    assert [r.getMessage() for r in caplog.records] == [
        f"--output-dir {tmp_path} already holds outputs of an earlier run: 2 (00000 to 00003) will be replaced "
        "(with its media in any other format); 1 (100000) past this run's 4 prompt(s) will stay as they are"]
