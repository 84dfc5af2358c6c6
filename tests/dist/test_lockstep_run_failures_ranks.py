"""Lockstep runs (allgather, context parallel) where one rank fails: the others learn why from
the store and stop in one line naming it, instead of a gloo traceback (or, on NCCL, a wait for
the process group's timeout) and, on other hosts, waves generated after the job had failed."""

from __future__ import annotations

import contextlib
import io
import time
import types
from pathlib import Path

import torch
import torch.distributed as dist

from omni_dist_offload.app import dp
from omni_dist_offload.app.api import SamplingOptions
from omni_dist_offload.app.cli import main
from omni_dist_offload.runtime.dist import DistContext
from ranks import Rank, run_ranks

ALLGATHER = '{"mode":"layer","components":["dit"],"layer_options":{"dit":{"weight_transfer":"allgather"}}}'


def lockstep_cli_last_wave_fails(rank: Rank, out_dir: str) -> list:
    """tiny-flux, allgather, four prompts on two ranks (two waves): rank 1 cannot write its
    last-wave output (a folder in the way), so rank 0 runs both waves and reaches the end."""
    Path(out_dir, "00003.png").mkdir(parents=True, exist_ok=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            rc = main(["generate", "--model", "tiny-flux", "--num-inference-steps", "2", "--no-progress",
                       "--diffusion-offload-config", ALLGATHER, "--output-dir", out_dir,
                       *[flag for p in "abcd" for flag in ("--prompt", p)]])
    finally:
        torch.set_num_threads(threads)
    return [rc, stderr.getvalue()]


def test_lockstep_end_names_the_rank_that_failed_not_a_gloo_traceback(tmp_path) -> None:
    """Rank 0 ended the run in a bare all_reduce (dp._reduce_totals) that rank 1 never reached:
    a gloo 'Connection closed by peer' traceback (on NCCL, a wait for the group's timeout). Now
    the end goes through the store, and rank 0 names rank 1 and why it stopped, in one line."""
    out_dir = tmp_path / "out"
    (rc0, err0), (rc1, err1) = run_ranks(lockstep_cli_last_wave_fails, 2, args=(str(out_dir),),
                                         broken_group=True, timeout=120)
    assert rc1 == 1 and "cannot write" in err1 and "00003.png' (Is a directory)" in err1, err1
    assert rc0 == 1, err0
    lines = [line for line in err0.splitlines() if "error:" in line]
    assert len(lines) == 1, err0
    assert "rank 1 stopped on an error (OutputWriteError: cannot write" in lines[0], err0
    assert "in lockstep with it, ran its waves and stops at the end" in lines[0], err0
    assert "Traceback" not in err0 and "Connection closed" not in err0, err0
    assert sorted(p.name for p in out_dir.glob("*.png") if p.is_file()) == ["00000.png", "00001.png", "00002.png"]


def two_hosts_one_rank_fails(rank: Rank, out_dir: str) -> dict:
    """Four ranks on two hosts of two, each host's ranks gathering together (as allgather does),
    twelve prompts in three waves. Rank 3 fails in wave 1 (its output cannot be written). Rank 2
    is then in a collective with it; host 0's ranks finish wave 1 only after rank 3 has told
    the store, and must not run waves 2 and 3."""
    ctx = DistContext(rank=rank.rank, world_size=rank.world, local_rank=rank.local_rank, backend="gloo")
    hosts = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    mine = hosts[rank.rank // 2]
    marker = Path(out_dir, "rank3-failed")
    ran: list[str] = []

    class Gen:
        pipeline = types.SimpleNamespace(__call__=lambda prompt: None)

        def generate(self, prompt: str, *, name: str, **kwargs):
            if rank.rank == 3:
                marker.touch()
                raise OSError(f"simulated: cannot write {name}.png")
            dist.all_reduce(torch.ones(1), group=mine)  # the block gathers of this wave
            if rank.rank < 2:  # host 0 ends its wave once rank 3 has failed (and told the store)
                deadline = time.monotonic() + 30
                while not marker.exists() and time.monotonic() < deadline:
                    time.sleep(0.05)
                time.sleep(0.5)
            ran.append(name)
            saved = types.SimpleNamespace(media=Path(out_dir, name))
            return types.SimpleNamespace(kind="image", metadata={"timings": {}}, save=lambda *a, **k: saved)

    jobs = dp.plan_jobs([str(k) for k in range(12)], 0, rank.rank, rank.world)
    try:
        dp.run_jobs(Gen(), jobs, ctx, sampling=SamplingOptions(), output_dir=Path(out_dir))
    except BaseException as exc:  # noqa: BLE001 - the type is checked
        return {"error": type(exc).__name__, "message": str(exc), "ran": ran}
    return {"error": None, "ran": ran}


def test_other_hosts_stop_between_waves_and_a_broken_collective_names_the_rank(tmp_path) -> None:
    """Host 0 went on with waves 2 and 3 after rank 3 (host 1) had failed, then failed in the
    final all_reduce; rank 2 ended in a raw gloo error. Now host 0 stops before wave 2 and rank 2
    names rank 3, each in one PeerStopped line."""
    results = run_ranks(two_hosts_one_rank_fails, 4, local_world=2, args=(str(tmp_path),), broken_group=True,
                        timeout=90)
    r0, r1, r2, r3 = results
    assert r3 == {"error": "OSError", "message": "simulated: cannot write 00003.png", "ran": []}, r3
    for r in (r0, r1):
        assert r["error"] == "PeerStopped", results
        assert r["message"].startswith("rank 3 stopped on an error (OSError: simulated: cannot write 00003.png); "
                                       "this rank, in lockstep with it, stops before wave 2/3."), r
        assert len(r["ran"]) == 1, r  # wave 1 only
    assert r2["error"] == "PeerStopped" and r2["ran"] == [], r2
    assert r2["message"].startswith("rank 3 stopped on an error (OSError: simulated: cannot write 00003.png); "
                                    "this rank, in lockstep with it, stops: their collective failed in wave 1/3."), r2
