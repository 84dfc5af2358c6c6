"""``omni-offload serve`` on two ranks under torchrun (gloo): concurrent requests in waves,
padding, and SIGTERM stopping every rank. One rank: unit/test_serve.py."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from serving import IMAGES, Server, call, decode, metric, reference  # noqa: E402


def test_two_ranks_answer_8_concurrent_requests_then_stop_on_sigterm(tmp_path) -> None:
    server = Server(tmp_path, "tiny-flux", "--wave-wait", "0.5", ranks=2)
    try:
        seeds = list(range(100, 108))
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda s: call(server.port, IMAGES, {"prompt": "a red fox", "seed": s}),
                                    seeds))
        assert [status for status, _ in answers] == [200] * 8
        assert len({body["id"] for _, body in answers}) == 8
        assert [body["data"][0]["seed"] for _, body in answers] == seeds
        for (_, body), want in zip(answers, reference("tiny-flux", seeds), strict=True):
            assert np.array_equal(decode(body["data"][0]), want)  # each its own seed's image
        text = call(server.port, "/metrics")[1]
        assert metric(text, "omni_serve_outputs_total", kind="image") == 8
        assert metric(text, "omni_serve_world_size") == 2
        waves, padded = metric(text, "omni_serve_waves_total"), metric(text, "omni_serve_padded_slots_total")
        assert 2 * waves - padded == 8
        assert "[rank1]" in server.output() and "wave of 2 image(s) + 0 padding" in server.output()

        # A lone request starts padded after --wave-wait.
        assert call(server.port, IMAGES, {"prompt": "a cat", "seed": 1})[0] == 200
        assert "wave of 1 image(s) + 1 padding" in server.output()

        # SIGTERM to rank 0: it stops, sends the stop wave, and every rank (and torchrun) exits 0.
        assert server.terminate(_rank0_pid(server.proc.pid)) == 0, server.output()
        assert re.search(r"^\[rank0\] stopped$", server.output(), re.M)
        assert re.search(r"^\[rank1\] stopped$", server.output(), re.M)
    finally:
        server.kill()


def _rank0_pid(launcher: int) -> int:
    children = Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split()
    for pid in children:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if b"RANK=0" in env:
            return int(pid)
    raise AssertionError(f"no rank 0 among {children}")
