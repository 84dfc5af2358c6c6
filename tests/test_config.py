"""Config parsing: every mistake is an OffloadConfigError naming the key, value and allowed values."""

import json

import pytest

from omni_dist_offload import LayerOptions, OffloadConfig, OffloadConfigError


def test_reference_shape_parses():
    raw = {"mode": "layer", "components": ["dit", "text_encoder"],
           "layer_options": {"dit": {"weight_transfer": "allgather"}}}
    cfg = OffloadConfig.parse(json.dumps(raw))
    assert cfg.components == ("dit", "text_encoder")
    assert cfg.options_for("dit").weight_transfer == "allgather"
    assert cfg.options_for("text_encoder").weight_transfer == "rank-local"
    assert cfg.pin_memory is True
    assert OffloadConfig.parse(cfg.to_dict()) == cfg
    assert OffloadConfig.parse(cfg) is cfg


@pytest.mark.parametrize("raw, needles", [
    ('{"mode": "layer", "components": ["dit"]', ["not valid JSON"]),
    ("[1, 2]", ["JSON object"]),
    ({"components": ["dit"]}, ["'mode'", "missing"]),
    ({"mode": "block", "components": ["dit"]}, ["'mode'", "'block'", "['layer']"]),
    ({"mode": "layer", "components": []}, ["'components'", "empty"]),
    ({"mode": "layer", "components": "dit"}, ["'components'", "'dit'", "list"]),
    ({"mode": "layer", "components": ["dit", "dit"]}, ["repeats", "dit"]),
    ({"mode": "layer", "components": ["vae"]}, ["'vae'", "['dit', 'text_encoder']"]),
    ({"mode": "layer", "components": ["dit"], "extra": 1}, ["unknown key 'extra'"]),
    ({"mode": "layer", "components": ["dit"], "layer_options": {"text_encoder": {}}},
     ["'text_encoder'", "not in 'components'"]),
    ({"mode": "layer", "components": ["dit"], "layer_options": {"dit": {"weight_transfer": "nvlink"}}},
     ["'weight_transfer'", "'nvlink'", "['rank-local', 'allgather']"]),
    ({"mode": "layer", "components": ["dit"], "layer_options": {"dit": {"chunk": 1}}},
     ["unknown key 'chunk'", "layer_options.dit"]),
    ({"mode": "layer", "components": ["dit"], "layer_options": {"dit": "allgather"}},
     ["layer_options.dit", "'allgather'"]),
    ({"mode": "layer", "components": ["dit"], "layer_options": []}, ["'layer_options'"]),
    ({"mode": "layer", "components": ["dit"], "pin_memory": "yes"}, ["'pin_memory'", "'yes'"]),
])
def test_bad_configs_name_the_problem(raw, needles):
    with pytest.raises(OffloadConfigError) as info:
        OffloadConfig.parse(raw)
    for needle in needles:
        assert needle in str(info.value)


def test_error_is_a_value_error():
    assert issubclass(OffloadConfigError, ValueError)
    with pytest.raises(ValueError):
        LayerOptions(weight_transfer="x")
