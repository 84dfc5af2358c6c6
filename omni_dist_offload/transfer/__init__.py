"""Weight transfers: how a block's bytes get from host memory into a device slot.

* :mod:`.protocol`: :class:`WeightTransfer`, what a ring needs of a transfer, and its streams;
* :mod:`.rank_local`: whole blocks per rank, copied over the rank's own link;
* :mod:`.shared`: the same from one host copy the ranks of a host share (``sharedmem.py``);
* :mod:`.allgather`: one shard per rank, rebuilt on the device by a collective all-gather;
* :mod:`.copy_engine`: the same, rebuilt by peer copies on the copy engines (no kernel);
* :mod:`.sharding`: how a block splits into per-rank shards;
* :mod:`.groups`: which ranks share weights (the weight group), or why none can;
* :mod:`.memops`: the CUDA driver's stream memory operations.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..hostmem import HostBuffer
from .allgather import AllGatherTransfer
from .copy_engine import CopyEngineGatherTransfer
from .groups import WeightGroup
from .protocol import TransferStreams, WeightTransfer
from .rank_local import RankLocalTransfer
from .sharding import ShardPlan

__all__ = [
    "AllGatherTransfer",
    "CopyEngineGatherTransfer",
    "RankLocalTransfer",
    "TransferStreams",
    "WeightTransfer",
    "gather_transfer",
]


def gather_transfer(gather: str, shards: Sequence[HostBuffer | None], plans: Sequence[ShardPlan],
                    group: WeightGroup, streams: TransferStreams, device: torch.device, timeout_s: float,
                    name: str = "allgather") -> AllGatherTransfer:
    """The allgather transfer for a resolved ``gather``: ``"copy-engine"``, or the collective
    (NCCL, or gloo on the CPU). Slots come later (``allocate_slots``)."""
    if gather == "copy-engine":
        return CopyEngineGatherTransfer(shards, plans, group, streams, device, timeout_s, name)
    return AllGatherTransfer(shards, plans, group, streams, device)
