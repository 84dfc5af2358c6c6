"""``omni-offload serve`` on two ranks started as torchrun starts them (gloo; forked, as in
tests/ranks.py): with one shared host copy of the
weights each rank takes the next request when free (any size, no padding); with allgather weights the ranks run
padded waves in lockstep; SIGTERM stops every rank either way. One rank: unit/test_serve.py."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from serving import IMAGES, Server, call, decode, metric, reference  # noqa: E402

ALLGATHER = ('{"mode":"layer","components":["dit","text_encoder"],'
             '"layer_options":{"dit":{"weight_transfer":"allgather"}}}')
SHARED = ('{"mode":"layer","components":["dit","text_encoder"],'
          '"layer_options":{"dit":{"weight_transfer":"shared"},"text_encoder":{"weight_transfer":"shared"}}}')


def test_free_ranks_take_mixed_sizes_as_they_come_then_stop_on_sigterm(tmp_path) -> None:
    # One host copy of the weights for both ranks (shared), each rank taking the next request.
    server = Server(tmp_path, "tiny-flux", "--diffusion-offload-config", SHARED, ranks=2)
    try:
        seeds, sizes = list(range(100, 108)), ["16x16", "32x16"] * 4
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda s, z: call(server.port, IMAGES, {"prompt": "a red fox", "seed": s,
                                                                             "size": z}), seeds, sizes))
        assert [status for status, _ in answers] == [200] * 8
        assert [(body["data"][0]["seed"], body["data"][0]["size"]) for _, body in answers] == list(zip(seeds, sizes))
        wants = {16: reference("tiny-flux", seeds[0::2]), 32: reference("tiny-flux", seeds[1::2], width=32, height=16)}
        for k, (_, body) in enumerate(answers):  # each its own seed's image, whichever rank ran it
            got, want = decode(body["data"][0]), wants[16 if k % 2 == 0 else 32][k // 2]
            assert np.array_equal(got, want), _unequal(body, got, want, server)
        text = call(server.port, "/metrics")[1]
        assert metric(text, "omni_serve_outputs_total", kind="image") == 8
        assert (metric(text, "omni_serve_lockstep"), metric(text, "omni_serve_ranks_serving")) == (0, 2)
        assert ", shared, " in server.output() and "not used" not in server.output()  # one host copy
        # Each slot is a wave of one, never padded.
        assert (metric(text, "omni_serve_waves_total"), metric(text, "omni_serve_padded_slots_total")) == (8, 0)
        out = server.output()
        assert "each taking the next request when free" in out and "wave of" not in out
        assert re.search(r"^\[rank1\] image req-\S+ done in", out, re.M)  # rank 1 generated
        assert re.search(r"^\[rank0\] image on rank 1 \(", out, re.M) and "image on rank 0 (" in out

        # SIGTERM to rank 0: it tells rank 1 over its link, and every rank exits 0.
        # (Running slots finishing and queued ones getting 503: unit/test_serve.py.)
        assert server.terminate(server.pids[0]) == 0, server.output()
        assert re.search(r"^\[rank0\] stopped$", server.output(), re.M)
        assert re.search(r"^\[rank1\] stopped$", server.output(), re.M)
    finally:
        server.kill()


def test_allgather_ranks_answer_in_padded_waves_then_stop_on_sigterm(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("OMNI_OFFLOAD_ALLOW_GLOO", "1")  # gloo gathers on the CPU
    server = Server(tmp_path, "tiny-flux", "--diffusion-offload-config", ALLGATHER, "--wave-wait", "0.5",
                    ranks=2)
    try:
        seeds = list(range(100, 104))
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda s: call(server.port, IMAGES, {"prompt": "a red fox", "seed": s}),
                                    seeds))
        assert [status for status, _ in answers] == [200] * 4, server.output()[-4000:]
        assert [body["data"][0]["seed"] for _, body in answers] == seeds
        for (_, body), want in zip(answers, reference("tiny-flux", seeds), strict=True):
            got = decode(body["data"][0])
            assert np.array_equal(got, want), _unequal(body, got, want, server)  # gathered: the same bytes
        text = call(server.port, "/metrics")[1]
        assert metric(text, "omni_serve_outputs_total", kind="image") == 4
        assert metric(text, "omni_serve_lockstep") == 1
        waves, padded = metric(text, "omni_serve_waves_total"), metric(text, "omni_serve_padded_slots_total")
        assert 2 * waves - padded == 4
        assert "in padded waves" in server.output() and "wave of 2 image(s) + 0 padding" in server.output()

        # A lone request starts padded after --wave-wait.
        assert call(server.port, IMAGES, {"prompt": "a cat", "seed": 1})[0] == 200
        assert "wave of 1 image(s) + 1 padding" in server.output()

        # SIGTERM to rank 0: it stops, sends the stop wave, and every rank exits 0.
        assert server.terminate(server.pids[0]) == 0, server.output()
        assert re.search(r"^\[rank0\] stopped$", server.output(), re.M)
        assert re.search(r"^\[rank1\] stopped$", server.output(), re.M)
    finally:
        server.kill()


def _unequal(body: dict, got: np.ndarray, want: np.ndarray, server: Server) -> str:
    """What a failed comparison needs to be read: how far apart, and what the ranks logged."""
    far = np.abs(got.astype(np.int16) - want.astype(np.int16))
    return (f"seed {body['data'][0]['seed']}: {np.count_nonzero(far)} of {far.size} values differ, by "
            f"{far.max()} at most; the server's log:\n{server.output()}")
