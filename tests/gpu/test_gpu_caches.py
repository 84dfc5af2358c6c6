"""Step caches on streamed models, CUDA: the ring does not bind a block a cache skips, so a
wrong skip decision would fail here (the block's parameters point at host memory), where on the
CPU it could not show. Each cache matches the cached resident model bitwise, and skipped blocks
are not copied."""

from __future__ import annotations

import pytest
import torch

from unit.test_caches import STEPS, cache_configs, cached_steps

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", list(cache_configs()))
def test_step_caches_on_cuda_match_the_cached_resident_model(name):
    ref = cached_steps(name, None, device="cuda")
    moves = []
    got = cached_steps(name, {"mode": "layer"}, device="cuda", moves=moves)
    assert [torch.equal(a, b) for a, b in zip(got, ref)] == [True] * STEPS
    if name in ("first-block", "mag", "layer-skip"):
        fills = moves[0].fills[:STEPS]
        assert sum(map(len, fills)) < 4 * STEPS, fills
