"""The shared transfer on CUDA: two ranks (one GPU each, or sharing the one GPU over gloo) page-
lock their mappings of one host copy and stream from it, running different work, bitwise equal
to the resident model."""

import pytest

from dist.test_shared_ranks import different_work
from ranks import run_ranks

pytestmark = pytest.mark.gpu


def test_two_ranks_stream_one_pinned_host_copy_on_cuda():
    for r in run_ranks(different_work, 2, device="cuda", timeout=300):
        assert r["equal"] and r["equal_after_remove"], r
        assert r["pinned"] and all(r["pinned"]), "every rank page-locks its own mapping"
        for row in r["summary"]:
            assert row["weight_transfer"] == "shared" and row["host_ranks"] == 2, row
            assert abs(row["host_bytes"] - row["shared_host_bytes"] / 2) <= 1
