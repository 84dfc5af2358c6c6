"""The benchmark on CUDA: the peer with streams, the floor from the measured link, the timeline
from CUDA events."""

from __future__ import annotations

import json

import pytest

from media import png_size
from omni_dist_offload.tools import bench


@pytest.mark.gpu
def test_gpu_run_peer_with_streams_floor_and_timeline(tmp_path, capsys) -> None:
    """On CUDA: the peer runs with use_stream=True, the floor uses the measured link, the
    timeline comes from CUDA events; every variant of this project is bitwise equal."""
    out_json = tmp_path / "gpu.json"
    argv = ["--preset", "tiny-flux", "--px", "64", "--warmup", "1", "--repeats", "3",
            "--json", str(out_json), "--png", str(tmp_path / "o.png"), "--timeline", str(tmp_path / "t.png")]
    assert bench.main(argv) == 0
    data = json.loads(out_json.read_text())
    rows = {r["variant"]: r for r in data["results"]}
    assert data["meta"]["peer"]["use_stream"] is True and rows["peer"]["note"] == ""
    assert data["meta"]["h2d_bytes_per_s"] > 1e9
    assert rows["rank-local"]["bitwise_equal"]
    assert rows["rank-local"]["floor_ms"] >= rows["resident"]["forward_ms"]
    assert all(r["peak_device_mib"] > 0 for r in data["results"])
    if "timeline" in data:
        assert png_size(tmp_path / "t.png")[0] > 100


@pytest.mark.gpu
def test_contention_times_each_mode_against_the_model_alone(tmp_path) -> None:
    from omni_dist_offload.tools import contention

    lines: list[str] = []
    path = tmp_path / "c.json"
    assert contention.main(["--preset", "tiny-flux", "--blocks", "3", "--px", "64", "--mib", "8", "--warmup", "1",
                            "--rounds", "3", "--json", str(path)], out=lines.append) == 0
    result = json.loads(path.read_text())
    assert [r["mode"] for r in result["rows"]] == list(contention.MODES)
    assert all(len(t) == 3 for t in result["timings_ms"].values())
    alone = result["rows"][0]
    assert alone["vs_alone"] == 1.0 and alone["copy_ms"] is None
    assert all(r["forward_ms"] > 0 and r["copy_ms"] > 0 for r in result["rows"][1:])
    assert [line.split()[0] for line in lines[0].splitlines()[2:]] == list(contention.MODES)
