"""Context parallelism with streamed blocks on two GPUs (NCCL): the worker of the gloo test."""

import pytest
import torch

from dist.test_context_parallel_ranks import streamed_with_context_parallel
from ranks import run_ranks

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_streamed_and_split_equals_resident_and_split_on_gpus():
    for r in run_ranks(streamed_with_context_parallel, 2, device="cuda", timeout=300):
        for transfer in ("rank-local", "allgather"):
            for order in ("offload first", "split first"):
                case = r[f"{transfer}, {order}"]
                assert case["equal"] and case["whole_again"], (transfer, order, case)
