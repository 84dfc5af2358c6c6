"""Config parsing: every mistake is an OffloadConfigError naming the key, value and allowed values."""

import json

import pytest

from omni_dist_offload import LayerOptions, OffloadConfig, OffloadConfigError, apply_offload
from toys import ToyDiT, assert_same, snapshot


def test_reference_shape_parses():
    raw = {"mode": "layer", "components": ["dit", "text_encoder"],
           "layer_options": {"dit": {"weight_transfer": "allgather"}}}
    cfg = OffloadConfig.parse(json.dumps(raw))
    assert cfg.components == ("dit", "text_encoder")
    assert cfg.options_for("dit").weight_transfer == "allgather"
    assert cfg.options_for("text_encoder").weight_transfer == "rank-local"
    assert cfg.pin_memory is True and cfg.pin_failure == "error"
    assert cfg.options_for("dit").gather == "auto"
    assert OffloadConfig.parse(cfg.to_dict()) == cfg
    assert OffloadConfig.parse(cfg) is cfg


def test_gather_choice_round_trips():
    for gather in ("auto", "copy-engine", "nccl"):
        cfg = OffloadConfig.parse({"mode": "layer", "components": ["dit"],
                                   "layer_options": {"dit": {"weight_transfer": "allgather", "gather": gather}}})
        assert cfg.options_for("dit").gather == gather
        assert cfg.to_dict()["layer_options"]["dit"]["gather"] == gather
        assert OffloadConfig.parse(cfg.to_dict()) == cfg


DIT_ONLY = {"mode": "layer", "components": ["dit"]}


# Each case: the problem (key, value) and the fix (allowed values, an example, what to do).
@pytest.mark.parametrize("raw, needles", [
    ('{"mode": "layer", "components": ["dit"]', ["not valid JSON", "pass an object such as"]),
    ('{"mode": "layer", "components": ["dit"], "mode": "layer"}', ["'mode' twice", "keep one"]),
    ("[1, 2]", ["must be a JSON object or dict", "found list"]),
    (None, ["must be a JSON object or dict", "found NoneType"]),
    ({"components": ["dit"]}, ["'mode'", "missing", '"mode": "layer"']),
    ({"mode": "block", "components": ["dit"]}, ["'mode'", "'block'", "['layer']"]),
    ({"mode": 1, "components": ["dit"]}, ["'mode'", "value 1", "['layer']"]),
    ({"mode": "layer", "components": []}, ["'components'", "empty", "list at least one of"]),
    ({"mode": "layer", "components": "dit"}, ["'components'", "'dit'", "list", "['dit', 'text_encoder']"]),
    ({"mode": "layer", "components": None}, ["'components'", "None", "['dit', 'text_encoder']"]),
    ({"mode": "layer", "components": ["dit", "dit"]}, ["repeats", "dit", "list each component once"]),
    ({"mode": "layer", "components": ["vae"]}, ["'vae'", "['dit', 'text_encoder']"]),
    ({"mode": "layer", "components": [3]}, ["value 3", "['dit', 'text_encoder']"]),
    ({"mode": "layer", "components": ["dit"], "extra": 1}, ["unknown key 'extra'", "allowed keys are"]),
    ({"mode": "layer", "pin_memroy": False}, ["unknown key 'pin_memroy'", "did you mean 'pin_memory'"]),
    ({"mode": "layer", "components": ["dit"], "layer_options": {"text_encoder": {}}},
     ["'text_encoder'", "not in 'components'", "add it to 'components' or drop its options"]),
    ({"mode": "layer", "components": ["dit", "text_encoder"], "layer_options": {"text_encoder_2": {}}},
     ["'text_encoder_2'", "keyed by category", "use 'text_encoder'"]),
    ({"mode": "layer", "components": ["dit"], "layer_options": {"transformer": {}}},
     ["'transformer'", "keyed by category", "use 'dit'"]),
    ({"mode": "layer", "storage_dtype": "float8_e4m3fn"},
     ["unknown key 'storage_dtype' in config", "put it under layer_options", '{"dit": {"storage_dtype": ...}}']),
    ({"mode": "layer", "components": ["dit"], "layer_options": {"dit": {"device_budget": "1GiB"}}},
     ["unknown key 'device_budget' in layer_options.dit", "put it at the top level"]),
    ("cfg.json", ["not valid JSON", "looks like a file path", "$(cat FILE)"]),
    ({"mode": "layer", "components": ["dit"], "layer_options": {"dit": {"weight_transfer": "nvlink"}}},
     ["layer_options.dit", "'weight_transfer'", "'nvlink'", "['rank-local', 'shared', 'allgather']"]),
    ({"mode": "layer", "components": ["dit"], "layer_options": {"dit": {"weight_transfer": None}}},
     ["'weight_transfer'", "None", "['rank-local', 'shared', 'allgather']"]),
    ({"mode": "layer", "components": ["dit"], "layer_options": {"dit": {"chunk": 1}}},
     ["unknown key 'chunk'", "layer_options.dit", "did you mean 'chunk_mib'"]),
    ({"mode": "layer", "components": ["dit"], "layer_options": {"dit": {"chunk_mib": 0}}},
     ["layer_options.dit", "'chunk_mib'", "found 0", "use e.g. 64"]),
    ({"mode": "layer", "components": ["dit"], "layer_options": {"dit": {"chunk_mib": "64"}}},
     ["'chunk_mib'", "found '64'", "use e.g. 64"]),
    ('{"mode": "layer", "layer_options": {"dit": {"chunk_mib": Infinity}}}', ["'chunk_mib'", "found inf"]),
    ({"mode": "layer", "layer_options": {"dit": {"chunk_mib": 1e303}}}, ["'chunk_mib'", "up to 1048576", "found 1e+303"]),
    ({"mode": "layer", "device_budget": "1.5"}, ["'device_budget'", "'1.5'", "a byte count is a whole number"]),
    ({"mode": "layer", "components": ["dit"], "layer_options": {"dit": {"gather": "nvlink"}}},
     ["layer_options.dit", "'gather'", "'nvlink'", "['auto', 'copy-engine', 'nccl']"]),
    ({"mode": "layer", "components": ["dit"], "layer_options": {"dit": {"gathr": "nccl"}}},
     ["unknown key 'gathr'", "did you mean 'gather'"]),
    ({"mode": "layer", "components": ["dit"], "layer_options": {"dit": "allgather"}},
     ["layer_options.dit", "'allgather'", '{"weight_transfer": "rank-local"}']),
    ({"mode": "layer", "components": ["dit"], "layer_options": []}, ["'layer_options'", "keyed by component"]),
    ({"mode": "layer", "components": ["dit"], "pin_memory": "yes"}, ["'pin_memory'", "'yes'", "true or false"]),
    ({"mode": "layer", "pin_failure": "warn"}, ["'pin_failure'", "'warn'", "['error', 'pageable']"]),
    ({"mode": "layer", "collective_timeout_s": -1}, ["'collective_timeout_s'", "found -1", "use e.g. 600"]),
    ({"mode": "layer", "collective_timeout_s": True}, ["'collective_timeout_s'", "found True"]),
    ('{"mode": "layer", "collective_timeout_s": NaN}', ["'collective_timeout_s'", "found nan"]),
    # Past torch.distributed's and datetime.timedelta's range: refused here, not in dist.new_group.
    ({"mode": "layer", "collective_timeout_s": 1e14},
     ["'collective_timeout_s'", "found 100000000000000.0", "up to 1000000000", "use e.g. 600"]),
    ({"mode": "layer", "collective_timeout_s": 86399999999999.0},  # timedelta.max.total_seconds()
     ["'collective_timeout_s'", "found 86399999999999.0", "up to 1000000000"]),
    # Ints too large for a float: an OffloadConfigError, not an OverflowError.
    ({"mode": "layer", "collective_timeout_s": 10**400},
     ["'collective_timeout_s'", "found 10000000000", "(401 characters)", "up to 1000000000"]),
    ({"mode": "layer", "layer_options": {"dit": {"chunk_mib": 10**400}}},
     ["layer_options.dit key 'chunk_mib'", "found 10000000000", "up to 1048576", "use e.g. 64"]),
    ({"mode": "layer", "layer_options": {"dit": {"chunk_mib": True}}},
     ["layer_options.dit key 'chunk_mib'", "found True", "use e.g. 64"]),
    (b'\xff{"mode": "layer"}', ["not UTF-8 JSON", "b'\\xff' at offset 0", "pass the JSON text"]),
])
def test_bad_configs_name_the_problem_and_change_nothing(raw, needles):
    with pytest.raises(OffloadConfigError) as info:
        OffloadConfig.parse(raw)
    for needle in needles:
        assert needle in str(info.value)
    model = ToyDiT(2)
    before = snapshot(model)
    with pytest.raises(OffloadConfigError) as again:
        apply_offload(model, raw)
    assert str(again.value) == str(info.value)
    assert_same(before, model)


def test_layer_options_objects_are_checked_too():
    with pytest.raises(OffloadConfigError, match="must be LayerOptions, found dict: build the config with"):
        OffloadConfig(components=("dit",), layer_options={"dit": {"weight_transfer": "allgather"}})
    with pytest.raises(OffloadConfigError, match="'chunk_mib' must be a positive number"):
        LayerOptions(chunk_mib=float("inf"))


def test_a_checked_config_keeps_its_own_options_and_takes_numpy_integers():
    opts = {"dit": LayerOptions(weight_transfer="allgather")}
    config = OffloadConfig(layer_options=opts)
    opts["text_encoder"] = LayerOptions()  # the caller's dict, reused for another config
    assert list(config.layer_options) == ["dit"] and OffloadConfig.parse(config.to_dict()) == config
    np = pytest.importorskip("numpy")
    config = OffloadConfig.parse({"mode": "layer", "device_budget": np.int64(1 << 30),
                                  "layer_options": {"dit": {"resident_blocks": np.int64(2)}}})
    assert config.device_budget == 1 << 30 and type(config.device_budget) is int
    assert type(config.options_for("dit").resident_blocks) is int
    config = OffloadConfig.parse({"mode": "layer", "layer_options": {"dit": {"resident_blocks": [np.int32(3), 1]}}})
    assert config.options_for("dit").resident_blocks == (1, 3)
    assert all(type(i) is int for i in config.options_for("dit").resident_blocks)
    json.dumps(config.to_dict())


def test_error_is_a_value_error():
    assert issubclass(OffloadConfigError, ValueError)
    with pytest.raises(ValueError):
        LayerOptions(weight_transfer="x")


def test_seconds_and_mib_take_any_real_number_as_a_plain_one():
    np = pytest.importorskip("numpy")
    from datetime import timedelta
    from fractions import Fraction
    for timeout, chunk in ((np.float32(30.0), np.float32(8.0)), (np.float16(2.5), np.int64(16)),
                           (Fraction(3, 2), Fraction(1, 4)), (np.int32(600), np.float64(0.5))):
        config = OffloadConfig.parse({"mode": "layer", "collective_timeout_s": timeout,
                                      "layer_options": {"dit": {"chunk_mib": chunk}}})
        assert config.collective_timeout_s == float(timeout)
        assert type(config.collective_timeout_s) in (int, float)
        assert config.options_for("dit").chunk_mib == float(chunk)
        assert type(config.options_for("dit").chunk_mib) in (int, float)
        assert OffloadConfig.parse(json.loads(json.dumps(config.to_dict()))) == config
    assert type(OffloadConfig.parse({"mode": "layer", "collective_timeout_s": np.int64(60)}).collective_timeout_s) is int
    # The largest timeout is one torch.distributed and datetime.timedelta can take.
    config = OffloadConfig.parse({"mode": "layer", "collective_timeout_s": 10**9})
    assert timedelta(seconds=config.collective_timeout_s).total_seconds() == 10**9
    with pytest.raises(OffloadConfigError, match="'collective_timeout_s' must be a positive number"):
        OffloadConfig.parse({"mode": "layer", "collective_timeout_s": np.float32("inf")})
    with pytest.raises(OffloadConfigError, match="'collective_timeout_s' must be a positive number"):
        OffloadConfig.parse({"mode": "layer", "collective_timeout_s": np.bool_(True)})
