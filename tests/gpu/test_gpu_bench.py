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
