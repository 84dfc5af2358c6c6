"""``state_dict()`` of an allgather component between forwards, two ranks on gloo: its streamed
tensors hold placeholders (the block exists whole on no rank), so user code that reads it is told
once per component, naming the component and saying to remove() on every rank first; nothing
raises, the keys and shapes are the model's, and remove() takes the notice off."""

from __future__ import annotations

import warnings

import torch

from omni_dist_offload import apply_offload
from ranks import Rank, run_ranks
from toys import ToyDiT

CONFIG = {"mode": "layer", "components": ["dit"], "collective_timeout_s": 20,
          "layer_options": {"dit": {"weight_transfer": "allgather", "chunk_mib": 0.01}}}


@torch.no_grad()
def read_state_dicts(rank: Rank) -> dict:
    model, reference = ToyDiT(3), ToyDiT(3)
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(0))
    handle = apply_offload(model, CONFIG, device=rank.device)
    transfer = handle.summary()[0]["weight_transfer"]
    equal = torch.equal(model(x), reference(x))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        state = model.state_dict()
        model.state_dict()
    told = [str(w.message) for w in record if "holds placeholders" in str(w.message)]
    shapes = {k: tuple(v.shape) for k, v in state.items()} == {k: tuple(v.shape) for k, v in reference.state_dict().items()}
    handle.remove()
    with warnings.catch_warnings(record=True) as after:
        warnings.simplefilter("always")
        values = all(torch.equal(v, reference.state_dict()[k]) for k, v in model.state_dict().items())
    return {"transfer": transfer, "equal": equal, "told": told, "shapes": shapes, "values": values,
            "after": [str(w.message) for w in after if "holds placeholders" in str(w.message)]}


def test_state_dict_of_an_allgather_component_warns_once_on_every_rank():
    for out in run_ranks(read_state_dicts, 2):
        assert out["transfer"] == "allgather" and out["equal"] and out["shapes"] and out["values"]
        (told,) = out["told"]
        assert told.startswith("transformer: state_dict() holds placeholders") and "sharded over the ranks" in told
        assert "handle.remove() first (on every rank" in told and not out["after"]
