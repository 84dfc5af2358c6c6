"""The benchmark's torchrun wrapper (launch/bench.sh) on two CPU ranks (gloo): allgather and
shared against rank-local, the ranks on different sizes at once (--stagger), one table from
rank 0."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _bench(tmp_path: Path, *flags: str) -> tuple[str, dict]:
    """launch/bench.sh on two gloo ranks, tiny Flux, rank-local, shared and allgather: rank 0's
    table and the JSON."""
    out_json = tmp_path / "bench.json"
    env = {**os.environ, "NGPU": "2", "OMNI_OFFLOAD_ALLOW_GLOO": "1",
           "TORCHRUN": f"{sys.executable} -m torch.distributed.run"}
    proc = subprocess.run(
        ["bash", str(REPO / "launch" / "bench.sh"), "--preset", "tiny-flux", "--variants", "rank-local", "shared",
         "allgather", "--warmup", "1", *flags, "--json", str(out_json)],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, json.loads(out_json.read_text())


@pytest.mark.skipif(sys.platform != "linux", reason="the launch script is bash")
def test_launch_script_runs_allgather_under_torchrun_rank_0_prints(tmp_path) -> None:
    stdout, data = _bench(tmp_path, "--px", "32", "48", "--stagger", "--repeats", "1")
    assert stdout.count(" allgather ") == 4  # one table, from rank 0: 2 sizes x 2 ranks
    assert data["meta"]["world_size"] == 2
    # --stagger: each rank ran each size, at the same time as the other rank ran the other.
    assert sorted({(r["shape"], r["rank"]) for r in data["results"]}) == [("32", 0), ("32", 1), ("48", 0), ("48", 1)]
    for shape in ("32", "48"):
        rows = {r["variant"]: r for r in data["results"] if r["shape"] == shape and r["rank"] == 0}
        assert all(r["bitwise_equal"] for r in rows.values())
        assert rows["allgather"]["weight_transfer"] == "allgather" and rows["shared"]["weight_transfer"] == "shared"
        assert rows["allgather"]["host_mib"] < rows["rank-local"]["host_mib"]  # each rank holds a shard
        assert rows["shared"]["host_mib"] < rows["rank-local"]["host_mib"]  # and its share of one copy
    # Each row is one rank's own: its timings_ms are the raw figures of its forward_ms.
    assert all(r["timings_ms_per_rank"] is None and r["forward_ms"] == statistics.median(r["timings_ms"])
               for r in data["results"])


@pytest.mark.skipif(sys.platform != "linux", reason="the launch script is bash")
def test_interleaved_variants_under_torchrun_pair_rounds_on_every_rank(tmp_path) -> None:
    # Every variant held at once on both ranks (allgather and shared collectives per forward,
    # in the same turning order on each), ratios paired by round; with --stagger each rank on
    # its own size, reporting its own rows.
    _, data = _bench(tmp_path, "--px", "32", "--interleave", "--repeats", "3")
    assert data["meta"]["interleave"] is True and data["meta"]["world_size"] == 2
    rows = {r["variant"]: r for r in data["results"]}
    assert list(rows) == ["resident", "rank-local", "shared", "allgather"]
    assert all(r["bitwise_equal"] and len(r["timings_ms"]) == 3 for r in rows.values())
    assert rows["allgather"]["weight_transfer"] == "allgather" and rows["shared"]["weight_transfer"] == "shared"
    assert rows["allgather"]["host_mib_ranks"][1] < rows["rank-local"]["host_mib_ranks"][1]
    # Every figure traces back to the raw timings in the same file: forward_ms is the slowest
    # rank's median, overhead the largest over ranks of the median per-round ratio to resident.
    resident = rows["resident"]["timings_ms_per_rank"]
    for row in rows.values():
        per_rank = row["timings_ms_per_rank"]
        assert len(per_rank) == 2 and all(len(t) == 3 for t in per_rank) and per_rank[0] == row["timings_ms"]
        assert row["forward_ms"] == max(statistics.median(t) for t in per_rank)
        assert row["overhead"] == pytest.approx(max(statistics.median(a / b for a, b in zip(t, r))
                                                    for t, r in zip(per_rank, resident)))
    assert "timings_ms_per_rank" in data["meta"]["figures"]["forward_ms"]
    _, data = _bench(tmp_path, "--px", "32", "48", "--stagger", "--interleave", "--repeats", "2")
    assert sorted({(r["shape"], r["rank"]) for r in data["results"]}) == [("32", 0), ("32", 1), ("48", 0), ("48", 1)]
    assert all(r["bitwise_equal"] and len(r["timings_ms"]) == 2 for r in data["results"])
