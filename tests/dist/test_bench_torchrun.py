"""The benchmark on two CPU ranks (gloo), forked as torchrun starts them: allgather and shared
against rank-local, the ranks on different sizes at once (--stagger), one table from rank 0."""

from __future__ import annotations

import json
import statistics

import pytest


def _staggered_on_rank(rank, argv: list[str]) -> tuple[int, str]:
    """bench.main on one rank, with what it printed."""
    import contextlib
    import io

    from omni_dist_offload.tools import bench

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = bench.main(argv)
    return rc, out.getvalue()


def test_staggered_sizes_run_allgather_and_shared_and_rank_0_prints(tmp_path) -> None:
    # --stagger with --interleave: every variant held at once on both ranks, each rank on its own
    # size, the allgather and shared collectives per forward in the same turning order on each.
    # (The passes without --interleave run the same collectives one variant at a time.) The
    # ranks are forked as torchrun starts them (tests/ranks.py); launch/bench.sh's command line
    # is checked in tests/unit/test_launch.py, the real torchrun by test_launch_torchrun.py.
    from ranks import run_ranks

    out_json = tmp_path / "bench.json"
    argv = ["--preset", "tiny-flux", "--variants", "rank-local", "shared", "allgather", "--warmup", "1",
            "--px", "32", "48", "--stagger", "--interleave", "--repeats", "1", "--json", str(out_json)]
    (rc0, stdout), (rc1, quiet) = run_ranks(_staggered_on_rank, 2, args=(argv,), timeout=120)
    assert (rc0, rc1) == (0, 0), stdout
    assert stdout.count(" allgather ") == 4 and " allgather " not in quiet  # one table, from rank 0: 2 sizes x 2 ranks
    data = json.loads(out_json.read_text())
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


def _bench_on_rank(rank, argv: list[str]) -> int:
    from omni_dist_offload.tools import bench

    return bench.main(argv)


def test_interleaved_variants_on_two_ranks_pair_rounds_on_every_rank(tmp_path) -> None:
    # Every variant held at once on both ranks, ratios paired by round (--stagger with
    # --interleave, under the launch script: the test above). The ranks are forked as torchrun
    # starts them (tests/ranks.py).
    from ranks import run_ranks

    out_json = tmp_path / "bench.json"
    argv = ["--preset", "tiny-flux", "--variants", "rank-local", "shared", "allgather", "--warmup", "1",
            "--px", "32", "--interleave", "--repeats", "3", "--json", str(out_json)]
    assert run_ranks(_bench_on_rank, 2, args=(argv,), timeout=120) == [0, 0]
    data = json.loads(out_json.read_text())
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


def _bench_with_rank_1_off(rank, out_json: str) -> int:
    """The bench on two ranks, rank 1's rank-local output nudged after the model ran."""
    import torch
    from faults import nudged_outputs

    from omni_dist_offload.tools import bench

    if rank.rank == 1:
        bench._apply_ours = nudged_outputs(bench._apply_ours)
    with torch.no_grad():
        return bench.main(["--preset", "tiny-wan", "--frames", "5", "--height", "32", "--width", "32", "--warmup",
                           "1", "--repeats", "1", "--variants", "rank-local", "--json", out_json])


def test_a_rank_whose_output_differs_makes_the_row_not_equal(tmp_path) -> None:
    """Rank 0's table and JSON said 'equal' when only rank 1's output differed (its exit status
    alone said otherwise)."""
    from ranks import run_ranks

    out_json = tmp_path / "bench.json"
    assert run_ranks(_bench_with_rank_1_off, 2, args=(str(out_json),), timeout=120) == [1, 1]
    rows = {r["variant"]: r for r in json.loads(out_json.read_text())["results"]}
    assert rows["rank-local"]["bitwise_equal"] is False
    assert rows["rank-local"]["bitwise_equal_ranks"] == [True, False]
    assert rows["resident"]["bitwise_equal"] is True
