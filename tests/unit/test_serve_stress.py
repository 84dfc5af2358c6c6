"""``python -m omni_dist_offload.tools.serve_stress`` at tiny numbers: it starts a real server,
drives both phases and stops it; the figures it writes must add up to what it sent."""

from __future__ import annotations

import json
import socket

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from omni_dist_offload.tools.serve_stress import main


def test_serve_stress_both_phases_pass_and_add_up(tmp_path, capsys) -> None:
    out = tmp_path / "figures.json"
    # The latency check compares two samples of a few tens of milliseconds; on a shared CI host
    # that comparison is noise, so it is loosened here (the figures are still checked below).
    rc = main(["--requests", "12", "--in-flight", "4", "--stalled", "30", "--hold", "1.0", "--settle", "0.5",
               "--probe-interval", "0.1", "--p95-factor", "100", "--json", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert printed.splitlines()[-1].startswith("serve_stress PASS: ")

    figures = json.loads(out.read_text())
    assert figures["passed"] and figures["failures"] == [] and figures["server_exit"] == 0
    # `python -m omni_dist_offload serve` restarted itself on the C allocator (__main__.py).
    assert figures["server_allocator"] == "malloc"
    load = figures["load"]
    assert load["codes"] == {"200": 12} and load["wrong_seed"] == 0
    assert load["requests_200_delta"] == 12 and load["image_outputs_delta"] == 12
    assert 0 < load["p50_ms"] <= load["p95_ms"] <= load["p99_ms"]
    assert load["rss_early_mib"] > 0 and load["rss_end_mib"] > 0

    abuse = figures["abuse"]
    assert abuse["stalled_connected"] == 30 and abuse["stalled_failed"] == 0
    assert sum(abuse["stalled_replies"].values()) == 30
    assert abuse["unloaded_codes"] == {"200": 20}
    assert abuse["probes"] >= 1 and abuse["probe_codes"] == {"200": abuse["probes"]}
    assert abuse["held_s"] >= 1.0
    assert abuse["rss_before_mib"] > 0 and abuse["rss_peak_mib"] > 0 and abuse["rss_after_mib"] > 0
    assert abuse["log_bytes_after"] >= abuse["log_bytes_before"] > 0


@pytest.mark.parametrize("argv, says", [
    (["--url", "http://127.0.0.1:1", "--ranks", "2"], "--ranks says how many ranks"),
    (["--sizes", "64x64,64"], "'64' is not a size"),
    (["--url", "http://example.com:80"], "--url 'http://example.com:80': give http://127.0.0.1:PORT"),
    (["--url", "http://127.0.0.1"], "--url 'http://127.0.0.1': give http://127.0.0.1:PORT"),
    (["--url", "http://127.0.0.1:99999"], "--url 'http://127.0.0.1:99999': give http://127.0.0.1:PORT"),
    (["--pid", "1"], "--pid and --log describe a server given with --url"),
])
def test_serve_stress_refuses_ranks_with_url_and_sizes_it_cannot_read(argv, says, capsys) -> None:
    assert main(argv) == 2  # before any server is started or called
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("python -m omni_dist_offload.tools.serve_stress: error: ")
    assert says in err[0]


def test_serve_stress_fails_in_one_line_when_the_server_is_not_there(tmp_path, capsys) -> None:
    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "new" / "figures.json"  # its folder is made before the run
    assert main(["--url", f"http://127.0.0.1:{port}", "--phase", "load", "--json", str(out)]) == 1
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed == [f"serve_stress FAIL: cannot reach the server at http://127.0.0.1:{port} (GET /health: "
                       "Connection refused); is it running?"]
    assert json.loads(out.read_text())["passed"] is False
