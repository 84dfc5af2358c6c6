"""Every transformer class diffusers exports streams without a declaration: each is built at
tiny size (``tests/dit_recipes``), discovered, streamed, and compared bitwise with itself
resident, before and after ``remove()``. The classes come from diffusers itself, not from a
hand-kept list: a class added upstream fails here until it has a recipe (or a reason it has
none)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import types

import diffusers
import diffusers.models.transformers as transformers_pkg
import pytest
import torch
from diffusers import ModelMixin
from dit_recipes import RECIPES, SKIPPED
from torch import nn

from omni_dist_offload import OffloadConfig, apply_offload
from omni_dist_offload.plan import discover, module_bytes

CONFIG = {"mode": "layer", "components": ["dit"]}


def diffusers_transformer_classes() -> list[str]:
    """The model classes defined in ``diffusers.models.transformers`` and exported by diffusers."""
    names = set()
    for info in pkgutil.iter_modules(transformers_pkg.__path__):
        try:
            mod = importlib.import_module(f"{transformers_pkg.__name__}.{info.name}")
        except ImportError:  # an optional dependency this environment lacks
            continue
        for name, cls in vars(mod).items():
            if (inspect.isclass(cls) and issubclass(cls, ModelMixin) and cls.__module__ == mod.__name__
                    and hasattr(diffusers, name)):
                names.add(name)
    return sorted(names)


CLASSES = diffusers_transformer_classes()


#: Blocks a real model's streamed lists hold (its main stack), for the share at a realistic depth.
REALISTIC_BLOCKS = 20


def block_lists(model: nn.Module) -> dict[str, nn.ModuleList]:
    """The model's top-level ModuleLists whose entries are all of one class and hold weights
    (what a reader would call its blocks), by path."""
    found: dict[str, nn.ModuleList] = {}
    for path, lst in model.named_modules():
        if not isinstance(lst, nn.ModuleList) or not len(lst) or any(path.startswith(f"{p}.") for p in found):
            continue
        if len({type(b) for b in lst}) == 1 and module_bytes(lst[0]) > 0 and list(lst[0].children()):
            found[path] = lst
    return found


def realistic_share(model: nn.Module, streamed: list[nn.Module]) -> float:
    """The streamed share of the block bytes once the streamed lists hold ``REALISTIC_BLOCKS``
    blocks between them (tiny recipes have two per list, where a text refiner or a perceiver
    that a real model keeps at two weighs as much as the main stack)."""
    ids = {id(b) for b in streamed}
    kept = sum(module_bytes(b) for lst in block_lists(model).values() for b in lst if id(b) not in ids)
    moving = sum(module_bytes(b) for b in streamed) * REALISTIC_BLOCKS / max(1, len(streamed))
    return moving / (moving + kept)


def _tensors(out) -> list[torch.Tensor]:
    """Every tensor of a forward's output (a tensor, a tuple or list of them, possibly nested,
    an output object with ``sample``, or a transformers ``ModelOutput``), cloned."""
    if isinstance(out, torch.Tensor):
        return [out.clone()]
    if isinstance(out, (tuple, list)):
        return [t for item in out for t in _tensors(item)]
    if hasattr(out, "sample"):
        return _tensors(out.sample)
    if callable(getattr(out, "to_tuple", None)):  # a transformers ModelOutput
        return _tensors(out.to_tuple())
    return []


def assert_streams_bitwise(model: nn.Module, kwargs: dict, target, config: dict, attrs) -> None:
    """``model``'s outputs equal, resident, streamed (``apply_offload(target, config)``: two
    forwards, the second after the wrap to block 0) and after ``remove()``; the blocks run in
    the ring's order (a block run out of it warns "ran but was not prefetched": an error here)."""
    import warnings

    with torch.no_grad():
        ref = _tensors(model(**kwargs))
        handle = apply_offload(target, config, device="cpu")
        with warnings.catch_warnings():
            warnings.filterwarnings("error", ".* ran but was not prefetched", RuntimeWarning)
            outs = [_tensors(model(**kwargs)) for _ in range(2)]
        handle.remove()
        after = _tensors(model(**kwargs))
    assert ref and all(len(o) == len(ref) for o in (*outs, after))
    for got in (*outs, after):
        assert all(torch.equal(a, b) for a, b in zip(got, ref)), attrs


def assert_same_tensors(ref: nn.Module, got: nn.Module) -> None:
    """Every parameter and buffer of the two modules: same names, dtypes and bytes."""
    want, have = {**ref.state_dict(), **dict(ref.named_buffers())}, {**got.state_dict(), **dict(got.named_buffers())}
    assert set(want) == set(have)
    for key in want:
        assert want[key].dtype == have[key].dtype and torch.equal(want[key], have[key]), key


def assert_same_outputs(ref: nn.Module, got: nn.Module, kwargs: dict) -> None:
    with torch.no_grad():
        expected = _tensors(ref(**kwargs))
        outs = _tensors(got(**kwargs))
    assert expected and all(torch.equal(a, b) for a, b in zip(outs, expected))


def test_every_class_has_a_recipe_or_a_reason():
    missing = [c for c in CLASSES if c not in RECIPES and c not in SKIPPED]
    assert not missing, f"no tiny recipe for {missing}: add one to tests/dit_recipes (or a reason to SKIPPED)"
    assert len(CLASSES) > 60


@pytest.mark.parametrize("name", CLASSES)
def test_a_diffusers_transformer_streams_bitwise_equal(name):
    if name not in RECIPES:
        pytest.skip(SKIPPED.get(name, "no recipe"))
    model, kwargs = RECIPES[name](0)
    (comp,) = discover(model, OffloadConfig.parse(CONFIG))
    assert realistic_share(model, [b for _, b in comp.blocks]) >= 0.8, (comp.block_attrs, comp.source)
    assert_streams_bitwise(model, kwargs, model, CONFIG, comp.block_attrs)


def _uvit():  # aMUSEd's transformer
    model = diffusers.UVit2DModel(
        hidden_size=32, cond_embed_dim=16, micro_cond_encode_dim=4, micro_cond_embed_dim=20, encoder_hidden_size=16,
        vocab_size=40, codebook_size=32, in_channels=16, block_out_channels=16, num_res_blocks=3, block_num_heads=2,
        num_hidden_layers=2, num_attention_heads=4, intermediate_size=48, sample_size=4)
    return "transformer", model, dict(input_ids=torch.randint(0, 32, (1, 4, 4)), encoder_hidden_states=torch.randn(1, 3, 16),
                                      pooled_text_emb=torch.randn(1, 16), micro_conds=torch.randn(1, 5))


def _wuerstchen_prior():
    from diffusers.pipelines.deprecated.wuerstchen.modeling_wuerstchen_prior import WuerstchenPrior

    model = WuerstchenPrior(c_in=4, c=32, c_cond=16, c_r=8, depth=2, nhead=2, dropout=0.0)
    return "prior", model, dict(x=torch.randn(1, 4, 4, 4), r=torch.rand(1), c=torch.randn(1, 3, 16))


def _stable_cascade_prior():
    model = diffusers.StableCascadeUNet(
        in_channels=4, out_channels=4, timestep_ratio_embedding_dim=8, conditioning_dim=16, block_out_channels=(16, 16),
        num_attention_heads=(2, 2), down_num_layers_per_block=(1, 1), up_num_layers_per_block=(1, 1),
        clip_text_pooled_in_channels=8, clip_seq=2, clip_text_in_channels=8, self_attn=True, dropout=(0.0, 0.0))
    return "prior", model, dict(sample=torch.randn(1, 4, 8, 8), timestep_ratio=torch.rand(1),
                                clip_text_pooled=torch.randn(1, 1, 8), clip_text=torch.randn(1, 3, 8))


@pytest.mark.parametrize("recipe", [_uvit, _wuerstchen_prior, _stable_cascade_prior])
def test_u_net_shaped_models_under_dit_names_stream_in_order(recipe):
    """Models outside diffusers' transformers that pipelines hold under a DiT's name stream from
    the table, every block in the order the forward runs them."""
    torch.manual_seed(0)
    name, model, kwargs = recipe()
    model.eval()
    pipe = types.SimpleNamespace(**{name: model})
    (comp,) = discover(pipe, OffloadConfig.parse(CONFIG))
    assert comp.source == "built-in table", comp.source
    assert_streams_bitwise(model, kwargs, pipe, CONFIG, comp.block_attrs)


#: Classes whose blocks the scan alone must find, in execution order (several lists, nested
#: lists, lists walked together, lists indexed between blocks), as it would for a class that
#: is not in the table yet.
SCANNED = ["FluxTransformer2DModel", "HunyuanVideoTransformer3DModel", "LatteTransformer3DModel",
           "ConsisIDTransformer3DModel", "WanAnimateTransformer3DModel", "WanVACETransformer3DModel",
           "Kandinsky6Transformer3DModel", "Flux3Transformer2DModel"]


@pytest.mark.parametrize("name", SCANNED)
def test_the_scan_alone_finds_every_list_in_execution_order(name, monkeypatch):
    import warnings

    from omni_dist_offload import plan

    monkeypatch.setattr(plan, "DIT_BLOCK_ATTRS", {})
    monkeypatch.setattr(plan, "DIT_BLOCK_ALTERNATIVES", {})
    model, kwargs = RECIPES[name](0)
    (comp,) = discover(model, OffloadConfig.parse(CONFIG))
    assert comp.source == "scan"
    with torch.no_grad(), warnings.catch_warnings():
        ref = _tensors(model(**kwargs))
        handle = apply_offload(model, CONFIG)
        # A block run out of the ring's order warns ("ran but was not prefetched"): an error here.
        warnings.simplefilter("error", RuntimeWarning)
        outs = [_tensors(model(**kwargs)) for _ in range(3)]
        handle.remove()
    for got in outs:
        assert all(torch.equal(a, b) for a, b in zip(got, ref)), comp.block_attrs


@pytest.mark.parametrize("name", CLASSES)
def test_a_diffusers_transformer_cold_starts_bitwise_equal(name, tmp_path):
    """Saved with ``save_pretrained``, cold-started (blocks read from the safetensors file into
    host buffers, the rest built on the meta device and read), it equals ``from_pretrained`` +
    ``apply_offload``: every tensor, and the forward."""
    if name not in RECIPES:
        pytest.skip(SKIPPED.get(name, "no recipe"))
    model, kwargs = _saved(name, tmp_path)
    # disable_mmap: tensors left inside the memory-mapped file sit at unaligned addresses, where
    # CPU GEMMs round differently; a cold start's are fresh, aligned allocations (as on a GPU).
    ref = getattr(diffusers, name).from_pretrained(tmp_path / "transformer", torch_dtype=torch.float32,
                                                   disable_mmap=True).eval()
    ref_handle = apply_offload(ref, CONFIG, device="cpu")
    got, handle = _cold_started(tmp_path, torch.float32)
    assert_same_tensors(ref, got)
    # An attention processor the recipe set (configs do not save it), on both.
    procs = {n: type(m.processor) for n, m in model.named_modules() if callable(getattr(m, "set_processor", None))}
    for module in (ref, got):
        for n, m in module.named_modules():
            if n in procs and type(m.processor) is not procs[n]:
                m.set_processor(procs[n]())
    assert_same_outputs(ref, got, kwargs)
    handle.remove()
    ref_handle.remove()


@pytest.mark.parametrize("name", ["PriorTransformer", "WanAnimateTransformer3DModel"])
def test_buffers_the_constructor_computes_take_the_run_dtype_in_a_cold_start(name, tmp_path):
    """diffusers builds a model under the run dtype as the default dtype, so buffers computed
    in it (an attention mask, blur kernels) are bf16 in a bf16 run; so does the cold start."""
    _saved(name, tmp_path)
    ref = getattr(diffusers, name).from_pretrained(tmp_path / "transformer", torch_dtype=torch.bfloat16).eval()
    assert any(b.dtype == torch.bfloat16 for n, b in ref.named_buffers() if n not in ref.state_dict())
    got, handle = _cold_started(tmp_path, torch.bfloat16)
    assert torch.get_default_dtype() == torch.float32
    handle.remove()
    assert_same_tensors(ref, got)


def _saved(name: str, folder) -> tuple[nn.Module, dict]:
    """The recipe's model saved as a one-component pipeline folder; the model and its inputs."""
    import json

    model, kwargs = RECIPES[name](0)
    model.save_pretrained(folder / "transformer", safe_serialization=True)
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "DiffusionPipeline",
                                                         "transformer": ["diffusers", name]}))
    return model, kwargs


def _cold_started(folder, dtype: torch.dtype):
    """The folder's transformer cold-started at ``dtype`` and offloaded: the model and its handle."""
    from omni_dist_offload.loading.coldstart import prepare_cold_start

    cold = prepare_cold_start(folder, CONFIG, device=torch.device("cpu"), dtype=dtype)
    try:
        got = cold.components["transformer"].eval()
        handle = apply_offload(got, CONFIG, device="cpu", block_sources=cold.sources)
    finally:
        cold.close()
    return got, handle

