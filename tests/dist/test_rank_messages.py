"""What a rank is told when the ranks do not line up, on three gloo ranks in one launch: a rank
outside the ``process_group`` it passed, ranks whose models have different numbers of blocks,
and (last: it breaks the group) a peer that dies while the shared host copy is filled, where
the surviving ranks' bare backend error carries a note and their models are as they were."""

from __future__ import annotations

import os
import time
from datetime import timedelta
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import omni_dist_offload.apply as apply_module
from omni_dist_offload import OffloadConfigError, apply_offload
from ranks import Rank, run_ranks, shared_copy_mappings
from toys import ToyDiT, assert_same, snapshot

TIMEOUT_S = 3


def _config(transfer: str) -> dict:
    return {"mode": "layer", "components": ["dit"], "collective_timeout_s": TIMEOUT_S,
            "layer_options": {"dit": {"weight_transfer": transfer}}}


def _refused(model: ToyDiT, config: dict, **kwargs) -> str:
    """The ``OffloadConfigError`` apply_offload raises; the model is left as it was."""
    before = snapshot(model)
    try:
        apply_offload(model, config, **kwargs)
    except OffloadConfigError as exc:
        assert_same(before, model)
        return str(exc)
    raise AssertionError(f"applied: {config}")


_mapped = shared_copy_mappings


def rank_messages(rank: Rank) -> dict:
    r = rank.rank
    out = {}

    # new_group([0, 1]) is collective: every rank makes it; rank 2 gets NON_GROUP_MEMBER. Only
    # rank 2 applies with it: it is refused before any exchange.
    pair = dist.new_group([0, 1])
    if r == 2:
        out["non_member"] = _refused(ToyDiT(3, dim=16), _config("allgather"), process_group=pair)

    # Rank 0 loads 4 blocks, ranks 1 and 2 load 5: every rank raises the same error.
    for transfer in ("allgather", "shared"):
        out[f"num_blocks_{transfer}"] = _refused(ToyDiT(4 if r == 0 else 5, dim=16), _config(transfer))

    # Last: rank 2 dies as the shared host copy is filled. Ranks 0 and 1 fail at the agreement
    # after the fill, with the backend's error and a note, and their models are as they were.
    model = ToyDiT(6, dim=16)
    x = torch.randn(2, 16)
    with torch.no_grad():
        ref = model(x)
    before = snapshot(model)
    # Rank 2 dies once ranks 0 and 1 have begun their fill too (past every earlier exchange).
    store = dist.distributed_c10d._get_default_store()
    real_fill = apply_module._fill_shared

    def fill(*args, **kwargs):
        if r == 2:
            store.wait(["filling 0", "filling 1"], timedelta(seconds=60))
            rank.report(out)
            os._exit(0)
        store.set(f"filling {r}", "1")
        return real_fill(*args, **kwargs)

    t0 = time.monotonic()
    with mock.patch.object(apply_module, "_fill_shared", fill):
        try:
            apply_offload(model, _config("shared"))
            out["peer_died"] = "applied"
        except Exception as exc:  # noqa: BLE001 - the backend's error, whatever its type
            out["peer_died"] = f"{type(exc).__name__}: {exc}"
            out["peer_died_notes"] = list(getattr(exc, "__notes__", []))
    out["peer_died_s"] = time.monotonic() - t0
    try:
        assert_same(before, model)
        out["peer_died_unchanged"] = True
    except AssertionError as exc:
        out["peer_died_unchanged"] = str(exc)
    out["peer_died_hooks"] = sum(len(b._forward_pre_hooks) + len(b._forward_hooks) for b in model.blocks)
    with torch.no_grad():
        out["peer_died_equal"] = torch.equal(model(x), ref)
    out["peer_died_mapped"] = _mapped()
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    """One launch for every test of the file."""
    return run_ranks(rank_messages, 3, broken_group=True, timeout=120)


def test_a_rank_outside_its_process_group_is_told_so(ranks):
    msg = ranks[2]["non_member"]
    assert msg.startswith("process_group is torch.distributed.GroupMember.NON_GROUP_MEMBER on rank 2: rank 2 is "
                          "not a member of the process_group it passed"), msg
    assert "Every rank must pass a group that contains it" in msg and "new_group([2]) on rank 2" in msg, msg
    assert "None on every rank" in msg and "found int" not in msg, msg


def test_ranks_with_different_numbers_of_blocks_are_told_the_counts(ranks):
    for transfer in ("allgather", "shared"):
        key = f"num_blocks_{transfer}"
        msg = ranks[0][key]
        assert all(r[key] == msg for r in ranks), [r[key] for r in ranks]  # the same error on every rank
        assert msg.startswith("rank 0 has 4 blocks in transformer, rank 1 has 5: every rank must load the same "
                              "model"), msg
        assert "blocks.4" not in msg, msg


def test_a_peer_dying_during_the_shared_fill_leaves_the_others_unchanged_with_a_note(ranks):
    for r in ranks[:2]:
        assert r["peer_died"].startswith(("RuntimeError", "DistBackendError", "DistError")), r["peer_died"]
        (note,) = r["peer_died_notes"]
        assert note.startswith("apply_offload could not agree with the other ranks that the setup of "
                               "transformer's shared host copy succeeded everywhere; this rank undid its setup "
                               "(the model is as it was)."), note
        assert "restart the job" in note, note
        assert r["peer_died_unchanged"] is True, r["peer_died_unchanged"]
        assert r["peer_died_hooks"] == 0 and r["peer_died_equal"] is True
        assert r["peer_died_mapped"] == []
        assert r["peer_died_s"] < 3 * TIMEOUT_S + 10, r["peer_died_s"]
