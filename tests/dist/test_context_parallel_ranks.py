"""Context parallelism (diffusers' Ulysses) with streamed blocks, two and four ranks on gloo: the
streamed model split across ranks equals the resident model split the same way, bitwise, with
rank-local and allgather rings, in either order; ``Omni`` with a LoRA on a module the split
gathers and a step cache equals the unsplit pipeline, also once the LoRA is unloaded, loaded
again or fused after the split (a module put at a gathered path is hooked again); the errors
before anything changes (an attention backend that cannot split, a refusal from diffusers
part-way through the DiTs, sizes whose sequence the degree does not divide, the image's or the
text's, also without diffusers' assert as under ``python -O``); the process groups go when the
split does."""

from __future__ import annotations

import copy
import types
from unittest import mock

import numpy as np
import pytest
import torch
import torch.distributed as dist

import tiny_models as tiny
from omni_dist_offload import Omni, apply_offload
from omni_dist_offload.app import api
from omni_dist_offload.app.api import GenerationOptionError
from omni_dist_offload.loading.parallel import (
    ContextParallel,
    ContextParallelError,
    UnevenSplitError,
    disable_context_parallel,
    enable_context_parallel,
)
from ranks import Rank, run_ranks
from toys import ToyDiT

ULYSSES_2 = ContextParallel(ulysses_degree=2)


def _config(transfer: str) -> dict:
    return {"mode": "layer", "components": ["dit"], "collective_timeout_s": 30,
            "layer_options": {"dit": {"weight_transfer": transfer, "chunk_mib": 0.01}}}


def _three_heads():
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=3, attention_head_dim=8, in_channels=4,
                                 out_channels=4, text_dim=tiny.TINY_TEXT_DIM, freq_dim=8, ffn_dim=16, num_layers=1)


def _lora_on_proj_out(path: str) -> None:
    """A diffusers-format LoRA for tiny-wan's transformer on ``to_q`` and the root ``proj_out``,
    which Wan's context-parallel plan gathers (random A and B)."""
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    model = tiny.tiny_wan_transformer(num_layers=3)
    torch.manual_seed(0)
    model.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "proj_out"], init_lora_weights=False),
                      adapter_name="x")
    save_file({f"transformer.{k}": v.clone() for k, v in get_peft_model_state_dict(model, adapter_name="x").items()},
              path)


class _Wrapped(torch.nn.Module):
    """A layer put around another after the split, as a LoRA loaded then wraps it: its own part
    (nothing, but shaped by the input) is added to the inner layer's output."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) + 0 * x[..., :1]


def omni_with_lora_and_cache(lora: str) -> dict:
    """``Omni`` streaming the DiT, split over the two ranks, with a LoRA on ``proj_out`` (loaded
    after ``enable_parallelism`` it crashed: the gather stayed on its base layer) and a step
    cache, against the resident, unsplit ``Omni``; and without the LoRA, to see it counts. Then
    the LoRA unloaded after the split (peft puts ``proj_out``'s base layer back, which lost the
    gather), loaded again, and fused and unloaded, on both."""
    options = {"lora": [lora], "cache": "pyramid-attention:2", "progress": False}
    call = {"prompt": "a red fox", "seed": 0, "num_inference_steps": 4}
    with Omni("tiny-wan", None, cache=options["cache"], progress=False) as plain:
        no_lora = plain.generate(**call).frames
    with Omni("tiny-wan", None, **options) as whole, \
            Omni("tiny-wan", {"mode": "layer", "components": ["dit"]}, **options,
                 context_parallel={"ulysses_degree": 2}) as split:
        ref = whole.generate(**call).frames
        got = split.generate(**call)
        again = split.generate(**call).frames  # the cache is reset between generations
        split.pipeline.unload_lora_weights()
        unloaded = split.generate(**call).frames
        split.pipeline.load_lora_weights(lora, adapter_name="lora_0")
        reloaded = split.generate(**call).frames
        fused = []
        for omni in (whole, split):
            omni.pipeline.fuse_lora()
            omni.pipeline.unload_lora_weights()
            fused.append(omni.generate(**call).frames)
    return {"equal": np.array_equal(got.frames, ref) and np.array_equal(again, ref),
            "lora_counts": not np.array_equal(ref, no_lora),
            "after the split": {"unloaded": np.array_equal(unloaded, no_lora), "reloaded": np.array_equal(reloaded, ref),
                                "fused and unloaded": np.array_equal(*fused),
                                "fusing counts": not np.array_equal(fused[0], no_lora)},
            "meta": {k: got.metadata[k] for k in ("lora", "cache", "context_parallel")}}


@torch.no_grad()
def streamed_with_context_parallel(rank: Rank, lora: str) -> dict:
    """Per transfer and order: outputs of the streamed, split model against the resident,
    split one; the groups it reports; ``Omni`` with a LoRA and a cache; then the errors."""
    device = rank.device
    model = tiny.tiny_wan_transformer(num_layers=3).to(device)
    x = {k: v.to(device) if torch.is_tensor(v) else v for k, v in tiny.wan_transformer_inputs(model).items()}
    plain = model(**x)[0]
    resident = copy.deepcopy(model)
    groups = enable_context_parallel(resident, ULYSSES_2, device)
    ref = resident(**x)[0]
    out = {"groups": [groups.dp_rank, groups.dp_size, groups.cp_rank, groups.cp_size,
                      dist.get_process_group_ranks(groups.group)],
           "split_equals_whole": torch.equal(ref, plain)}
    # A module put at the gathered proj_out after the split: one wrapping it (a LoRA loaded
    # then), the one it wrapped put back (unload_lora_weights), wrapped again and undone before
    # any forward (its inner layer gathers no more).
    base = resident.proj_out
    resident.proj_out = _Wrapped(base)
    swapped = {"wrapped": torch.equal(resident(**x)[0], ref)}
    resident.proj_out = base
    swapped["put back"] = torch.equal(resident(**x)[0], ref)
    resident.proj_out = _Wrapped(base)
    disable_context_parallel(resident, groups)
    swapped["undone"] = torch.equal(resident(**x)[0], plain) and not resident._forward_pre_hooks
    out["swapped"] = swapped
    for transfer in ("rank-local", "allgather"):
        for order in ("offload first", "split first"):
            streamed = copy.deepcopy(model)
            if order == "split first":
                split = enable_context_parallel(streamed, ULYSSES_2, device)
            handle = apply_offload(types.SimpleNamespace(transformer=streamed), _config(transfer))
            if order == "offload first":
                split = enable_context_parallel(streamed, ULYSSES_2, device)
            equal = all(torch.equal(streamed(**x)[0], ref) for _ in range(2))
            row = handle.summary()[0]
            handle.remove()
            disable_context_parallel(streamed, split)
            out[f"{transfer}, {order}"] = {"equal": equal, "transfer": row["weight_transfer"],
                                           "whole_again": torch.equal(streamed(**x)[0], plain)}
    out["omni"] = omni_with_lora_and_cache(lora)
    errors = {}
    for name, target, spec in (("no plan", ToyDiT(2), ULYSSES_2),
                               ("world", tiny.tiny_wan_transformer(num_layers=1), ContextParallel(ulysses_degree=3)),
                               ("heads", _three_heads(), ULYSSES_2),
                               ("ring", tiny.tiny_wan_transformer(num_layers=1), ContextParallel(ring_degree=2))):
        try:
            enable_context_parallel(target, spec, device)
            errors[name] = None
        except ContextParallelError as exc:
            errors[name] = str(exc)
        errors[f"{name} untouched"] = getattr(target, "_parallel_config", None) is None
    out["errors"] = errors
    return out


def test_streamed_and_split_equals_resident_and_split(tmp_path):
    lora = str(tmp_path / "lora_proj_out.safetensors")
    _lora_on_proj_out(lora)
    for r in run_ranks(streamed_with_context_parallel, 2, args=(lora,)):
        assert r["split_equals_whole"]  # Ulysses on gloo changes no bit here: a strong reference
        assert r["groups"][:2] == [0, 1] and r["groups"][3] == 2 and r["groups"][4] == [0, 1]
        for transfer in ("rank-local", "allgather"):
            for order in ("offload first", "split first"):
                case = r[f"{transfer}, {order}"]
                assert case["equal"] and case["whole_again"], (transfer, order, case)
                assert case["transfer"] == transfer
        assert all(r["swapped"].values()), r["swapped"]
        omni = r["omni"]
        assert omni["equal"] and omni["lora_counts"], omni
        assert all(omni["after the split"].values()), omni
        assert omni["meta"] == {"lora": [{"path": lora, "scale": 1.0}],
                                "cache": {"type": "pyramid-attention", "spatial_attention_block_skip_range": 2},
                                "context_parallel": {"ulysses_degree": 2, "ring_degree": 1, "group": 0, "groups": 1}}
        errors = r["errors"]
        assert "ToyDiT" in errors["no plan"] and "_cp_plan" in errors["no plan"]
        assert "multiple of 3" in errors["world"] and "--ulysses-degree 3 --ring-degree 1" in errors["world"]
        assert "attention heads" in errors["heads"] and "--ulysses-degree" in errors["heads"]
        assert "log-sum-exp" in errors["ring"]
        assert all(errors[f"{name} untouched"] for name in ("no plan", "world", "heads", "ring"))


@torch.no_grad()
def data_and_context_parallel(rank: Rank) -> dict:
    """Four ranks: two groups of two, each splitting its own sample, with an allgather ring over
    the whole host (every rank runs the same calls: lockstep across the groups)."""
    model = tiny.tiny_wan_transformer(num_layers=3)
    groups = None
    reference = copy.deepcopy(model)
    ref_groups = enable_context_parallel(reference, ULYSSES_2, rank.device)
    x = tiny.wan_transformer_inputs(model, seed=ref_groups.dp_rank)  # one sample per group
    ref = reference(**x)[0]
    handle = apply_offload(types.SimpleNamespace(transformer=model), _config("allgather"))
    groups = enable_context_parallel(model, ULYSSES_2, rank.device)
    equal = all(torch.equal(model(**x)[0], ref) for _ in range(2))
    handle.remove()
    # The weight group may be the context-parallel group itself: then the groups need not keep
    # in step with each other (group 1 runs one forward more).
    handle = apply_offload(types.SimpleNamespace(transformer=model), _config("allgather"), process_group=groups.group)
    own_group = all(torch.equal(model(**x)[0], ref) for _ in range(1 + groups.dp_rank))
    weight_ranks = list(handle.rings[0].transfer.group.ranks)
    handle.remove()
    return {"equal": equal, "own_group": own_group, "weight_ranks": weight_ranks,
            "dp": [groups.dp_rank, groups.dp_size], "cp": dist.get_process_group_ranks(groups.group)}


@pytest.mark.parametrize("world", [4])
def test_two_groups_of_two(world):
    results = run_ranks(data_and_context_parallel, world)
    assert [r["dp"] for r in results] == [[0, 2], [0, 2], [1, 2], [1, 2]]
    assert [r["cp"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert all(r["equal"] and r["own_group"] for r in results)
    assert [r["weight_ranks"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]


# -- the benchmark, split ----------------------------------------------------------------------
def bench_split(rank: Rank, out: str) -> list:
    import contextlib
    import io

    from omni_dist_offload.tools import bench

    from torch.distributed import distributed_c10d

    split, alive = [], []
    enable = bench.enable_context_parallel

    def counted(model, *args):
        alive.append(len(distributed_c10d._world.pg_map))  # the groups alive as a case splits
        groups = enable(model, *args)
        split.append(groups.cp_size)
        return groups

    bench.enable_context_parallel = counted
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        # Two cases: each splits its own model, and lets its process groups go when done.
        rc = bench.main(["--preset", "tiny-wan", "--frames", "5", "9", "--height", "32", "--width", "32",
                         "--ulysses-degree", "2", "--variants", "rank-local", "allgather", "--warmup", "0",
                         "--repeats", "1", "--json", out])
    return [rc, printed.getvalue(), split, alive]


def test_bench_splits_resident_and_streamed_alike(tmp_path) -> None:
    """``bench --ulysses-degree 2``: the resident model and both streamed variants split over the
    two ranks; streamed equal to the split resident model, ratios to it, one table from rank 0."""
    import json

    out = tmp_path / "cp.json"
    (rc0, text0, split0, left0), (rc1, text1, split1, left1) = run_ranks(bench_split, 2, args=(str(out),),
                                                                        broken_group=True)
    assert (rc0, rc1) == (0, 0) and text1 == ""
    assert split0 == split1 == [2, 2]  # each case's model split over both ranks, once
    # The first case's process groups were destroyed before the second split its model.
    assert left0 == left1 and left0[0] == left0[1], (left0, left1)
    assert "context parallel: ulysses 2 x ring 1, 1 group(s)" in text0
    data = json.loads(out.read_text())
    assert data["meta"]["context_parallel"] == {"ulysses_degree": 2, "ring_degree": 1, "groups": 1}
    rows = {r["variant"]: r for r in data["results"]}
    assert set(rows) == {"resident", "rank-local", "allgather"}  # no peer under context parallelism
    assert all(r["bitwise_equal"] for r in rows.values())
    assert rows["allgather"]["weight_transfer"] == "allgather"
    assert rows["allgather"]["host_mib"] < rows["rank-local"]["host_mib"]
    for row in rows.values():  # each rank's memory beside rank 0's
        assert len(row["peak_device_mib_ranks"]) == 2 and row["host_mib_ranks"][0] == row["host_mib"]
    assert sum(rows["allgather"]["host_mib_ranks"]) < rows["rank-local"]["host_mib"] * 1.1  # one copy in shards


# -- refusals that change nothing, and the groups the split leaves behind -----------------------
def _group_count() -> int:
    """The process groups this rank belongs to (the default one included)."""
    return len(dist.distributed_c10d._world.pg_map)


def _untouched(model) -> bool:
    """No trace of a split: no config on the model or its processors, no split hooks."""
    processors = [m.processor for m in model.modules() if getattr(m, "processor", None) is not None]
    hooks = [name for m in model.modules() for name in getattr(getattr(m, "_diffusers_hook", None), "hooks", {})]
    return (model._parallel_config is None and all(getattr(p, "_parallel_config", None) is None for p in processors)
            and not any(name.startswith("cp_") for name in hooks))


@torch.no_grad()
def backend_refusals(rank: Rank) -> dict:
    """A DiT whose processors attend with a backend diffusers cannot split, refused untouched and
    split once set right; the same for a ring on torch's SDPA; Omni refusing a ring on the active
    backend before it loads; a refusal from diffusers on the second of two DiTs, which leaves
    both as they were and no process group behind."""
    out = {}
    model = tiny.tiny_wan_transformer(num_layers=1)
    x = tiny.wan_transformer_inputs(model)
    plain = model(**x)[0]
    for backend, spec in (("_native_math", ULYSSES_2), ("native", ContextParallel(ring_degree=2))):
        model.set_attention_backend(backend)
        try:
            enable_context_parallel(model, spec, rank.device)
            out[backend] = None
        except ContextParallelError as exc:
            out[backend] = str(exc)
        out[f"{backend} untouched"] = _untouched(model)
    model.set_attention_backend("native")
    split = enable_context_parallel(model, ULYSSES_2, rank.device)  # the fix the message names
    out["then splits"] = torch.equal(model(**x)[0], plain)
    disable_context_parallel(model, split)
    with mock.patch.object(api, "load_and_place", side_effect=AssertionError("loaded the model")):
        try:
            Omni("tiny-wan", None, context_parallel={"ring_degree": 2})
            out["omni ring"] = None
        except ContextParallelError as exc:
            out["omni ring"] = str(exc)
    # diffusers refuses the second DiT after the first is split: both go back as they were.
    first, second = tiny.tiny_wan_transformer(num_layers=1), tiny.tiny_wan_transformer(num_layers=1)
    pipeline = types.SimpleNamespace(transformer=first, transformer_2=second)
    before = _group_count()
    with mock.patch.object(second, "enable_parallelism", side_effect=RuntimeError("refused by diffusers")):
        try:
            enable_context_parallel(pipeline, ULYSSES_2, rank.device)
            out["rollback"] = None
        except RuntimeError as exc:
            out["rollback"] = str(exc)
    out["rollback untouched"] = _untouched(first) and _untouched(second) and torch.equal(first(**x)[0], plain)
    out["rollback groups"] = [before, _group_count()]
    return out


def test_backend_refusals_change_nothing():
    for r in run_ranks(backend_refusals, 2):
        math_error, ring_error = r["_native_math"], r["native"]
        for words in ("'_native_math'", "WanAttnProcessor", "set_attention_backend", "native"):
            assert words in math_error, math_error
        assert "log-sum-exp" in ring_error and "ulysses_degree" in ring_error, ring_error
        assert r["_native_math untouched"] and r["native untouched"] and r["then splits"]
        omni_ring = r["omni ring"]  # before loading: load_and_place was never called
        assert "active attention backend is 'native'" in omni_ring and "DIFFUSERS_ATTN_BACKEND" in omni_ring
        assert r["rollback"] == "refused by diffusers" and r["rollback untouched"]
        assert r["rollback groups"][0] == r["rollback groups"][1]


@torch.no_grad()
def split_cycles(rank: Rank) -> dict:
    """Split and undo two DiTs twice (a second undo does nothing), counting this rank's process
    groups; then a collective on the default group, which the mesh reuses and the undo keeps."""
    pipeline = types.SimpleNamespace(transformer=tiny.tiny_wan_transformer(num_layers=1),
                                     transformer_2=tiny.tiny_wan_transformer(num_layers=1))
    counts = [_group_count()]
    for _ in range(2):
        split = enable_context_parallel(pipeline, ULYSSES_2, rank.device)
        counts.append(_group_count())
        disable_context_parallel(pipeline, split)
        disable_context_parallel(pipeline, split)
        counts.append(_group_count())
    total = torch.ones(1)
    dist.all_reduce(total)
    return {"counts": counts, "world works": total.item() == dist.get_world_size()}


def test_undo_destroys_the_process_groups_the_split_made():
    for r in run_ranks(split_cycles, 2):
        counts = r["counts"]
        assert counts[1] > counts[0], counts  # the mesh's size-1 dimensions have groups of their own
        assert counts[0] == counts[2] == counts[4] and counts[1] == counts[3], counts
        assert r["world works"]


def _shard_without_assert(cls, tensor, dim, mesh):
    """diffusers' ``EquipartitionSharder.shard`` as ``python -O`` runs it: its check is an
    ``assert``, so an uneven length gives the ranks shards of different lengths."""
    return tensor.chunk(mesh.size(), dim=dim)[dist.get_rank(mesh.get_group())]


def _option_error(omni: Omni, **call) -> str | None:
    try:
        omni.generate(**call)
    except GenerationOptionError as exc:
        return str(exc)
    return None


@torch.no_grad()
def odd_sequence(rank: Rank) -> dict:
    """Sizes whose sequence two ranks do not split (9 tokens): a GenerationOptionError on every
    rank, also without diffusers' assert (``python -O``: the shards would differ and the ranks
    abort in the all-to-all), and the same Omni generates the unsplit pipeline's output after;
    its groups go on close. Flux's text (7 tokens): the error names the text and a
    max_sequence_length, which then generates. QwenImage splits the text's rotary embedding
    before the text itself: still the text's error."""
    from diffusers import QwenImageTransformer2DModel
    from diffusers.hooks.context_parallel import EquipartitionSharder

    call = {"prompt": "a red fox", "seed": 0, "num_inference_steps": 2}
    config = {"mode": "layer", "components": ["dit"], "collective_timeout_s": 30,
              "layer_options": {"dit": {"weight_transfer": "allgather"}}}
    with Omni("tiny-wan", None, progress=False) as whole:
        ref = whole.generate(**call).frames
    before = _group_count()
    with Omni("tiny-wan", config, progress=False, context_parallel={"ulysses_degree": 2}) as split:
        error = _option_error(split, **call, height=48, width=48, num_frames=1)
        with mock.patch.object(EquipartitionSharder, "shard", classmethod(_shard_without_assert)):
            optimized = _option_error(split, **call, height=48, width=48, num_frames=1)
        equal = np.array_equal(split.generate(**call).frames, ref)
    out = {"error": error, "-O": optimized, "equal": equal, "groups": [before, _group_count()]}
    with Omni("tiny-flux", config, progress=False, context_parallel={"ulysses_degree": 2}) as split:
        out["text"] = _option_error(split, **call, max_sequence_length=7)
        out["text fixed"] = split.generate(**call, max_sequence_length=6).frames.shape[0] > 0
    torch.manual_seed(0)
    qwen = QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=1,
                                       attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                       axes_dims_rope=(4, 6, 6))
    qwen_split = enable_context_parallel(qwen, ULYSSES_2, rank.device)
    try:
        qwen(hidden_states=torch.randn(1, 16, 16), encoder_hidden_states=torch.randn(1, 7, 32),
             encoder_hidden_states_mask=torch.ones(1, 7, dtype=torch.long), timestep=torch.tensor([0.5]),
             img_shapes=[(1, 4, 4)], return_dict=False)
        out["qwen text"] = None
    except UnevenSplitError as exc:
        out["qwen text"] = [exc.text, exc.tokens, str(exc)]
    disable_context_parallel(qwen, qwen_split)
    return out


def test_sizes_the_degree_does_not_divide_are_an_option_error():
    for r in run_ranks(odd_sequence, 2):
        for error in (r["error"], r["-O"]):
            for words in ("height=48, width=48, num_frames=1", "9 tokens", "over 2 ranks", "height=96",
                          "--ulysses-degree 2"):
                assert words in error, error
        assert r["equal"]
        assert r["groups"][0] == r["groups"][1]
        text = r["text"]
        for words in ("text embedding of the prompt has 7 tokens", "max_sequence_length=7", "max_sequence_length=6",
                      "height and width do not help"):
            assert words in text, text
        assert r["text fixed"]
        text, tokens, message = r["qwen text"]
        assert text and tokens == 7 and "'encoder_hidden_states'" in message, message


# -- the benchmark's and the CLI's refusals, before any model ---------------------------------
#: The review's reproducers: frames 1 at 48 px is 9 tokens (frames 5: 18), which two ranks do
#: not split; tiny-wan has 2 attention heads, which Ulysses over three ranks does not divide.
BENCH_UNEVEN = ["--preset", "tiny-wan", "--frames", "5", "1", "--height", "48", "--width", "48",
                "--ulysses-degree", "2", "--variants", "rank-local", "--warmup", "0", "--repeats", "1"]
BENCH_HEADS = ["--preset", "tiny-wan", "--frames", "5", "--height", "48", "--width", "48",
               "--ulysses-degree", "3", "--variants", "rank-local", "--warmup", "0", "--repeats", "1"]


def bench_refused(rank: Rank, argv: list, late_shape: list | None) -> dict:
    """``bench.main(argv)`` on this rank: its exit status, what it printed, and how many models it
    built. ``late_shape``: the second case runs its forward at this shape instead (a split the
    flags did not foresee, refused by the split itself at the first forward)."""
    import contextlib
    import io

    from omni_dist_offload.tools import bench

    built, cases = [], []
    build, inputs = bench.build_model, bench.case_inputs

    def counted(*args, **kwargs):
        built.append(1)
        return build(*args, **kwargs)

    def shaped(preset, model, shape, device, *args, **kwargs):
        if device.type != "meta":  # a case's run (the check before the run looks on the meta device)
            cases.append(shape)
            if late_shape is not None and len(cases) == 2:
                shape = tuple(late_shape)
        return inputs(preset, model, shape, device, *args, **kwargs)

    bench.build_model, bench.case_inputs = counted, shaped
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = bench.main(argv)
    return {"rc": rc, "out": out.getvalue(), "err": err.getvalue(), "built": len(built)}


@pytest.mark.parametrize("world, argv, words", [
    (2, BENCH_UNEVEN, ("--frames 1 --height 48 --width 48", "9 tokens", "2 does not divide", "--ulysses-degree",
                       "--ring-degree", "e.g. --height 64")),
    (3, BENCH_HEADS, ("--ulysses-degree 3", "2 attention heads", "--ring-degree", "1 or 2")),
], ids=["uneven tokens", "heads"])
def test_bench_refuses_what_the_split_cannot_run_before_any_model(world, argv, words, tmp_path) -> None:
    """``bench --ulysses-degree N`` with a shape whose token count N does not divide, or a
    preset whose heads N does not divide: exit 2 on every rank, one line from rank 0 naming the
    flags, before any model is built (each rank used to print a traceback and exit 1 at the
    first forward, losing the cases measured before)."""
    out = tmp_path / "out" / "x.json"
    for rank, r in enumerate(run_ranks(bench_refused, world, args=([*argv, "--json", str(out)], None))):
        assert r["rc"] == 2 and r["built"] == 0 and r["out"] == "", r
        if rank:
            assert r["err"] == "", r
            continue
        lines = r["err"].strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("omni-offload bench: error: "), r["err"]
        assert "Traceback" not in r["err"]
        for word in words:
            assert word in lines[0], lines[0]
    assert not out.parent.exists()  # refused before the run: nothing written


def test_a_split_refused_mid_run_keeps_the_cases_measured(tmp_path) -> None:
    """A context-parallel refusal the flags could not foresee (here the second case's forward at
    another size than asked): exit 2 on every rank, one line, no traceback, and the case measured
    before it written to --json, marked as stopped."""
    import json

    out = tmp_path / "x.json"
    argv = [*BENCH_UNEVEN[:4], "13", *BENCH_UNEVEN[5:], "--json", str(out)]  # --frames 5 13: both split
    results = run_ranks(bench_refused, 2, args=(argv, [1, 48, 48]))
    errors = []
    for rank, r in enumerate(results):
        assert r["rc"] == 2 and r["built"] == 2, r
        assert "Traceback" not in r["err"], r["err"]  # its other lines: the library's warnings as the cases ran
        errors.append([line for line in r["err"].splitlines() if "error" in line])
    assert len(errors[0]) == 1 and errors[1] == [], errors
    line = errors[0][0]
    for words in ("omni-offload bench: error: tiny-wan 4b 13x48x48: ", "9 tokens", f"case measured before it is in {out}"):
        assert words in line, line
    assert "resident" in results[0]["out"]  # the first case's table
    data = json.loads(out.read_text())
    assert {r["shape"] for r in data["results"]} == {"5x48x48"}
    assert [r["variant"] for r in data["results"]] == ["resident", "rank-local"]
    stopped = data["meta"]["stopped"]
    assert stopped["case"] == "tiny-wan 4b 13x48x48" and "9 tokens" in stopped["error"]


@torch.no_grad()
def splits_predicted(rank: Rank, cases: list) -> list:
    """For each (preset, text tokens, shape): what the benchmark's check before the run says of
    the case's split over the job's ranks, and what the split itself raises at the first forward
    of the real model."""
    import dataclasses

    from omni_dist_offload.models import PRESETS, build_model, case_inputs
    from omni_dist_offload.tools import bench

    spec = ContextParallel(ulysses_degree=rank.world)
    out = []
    for name, text_tokens, shape in cases:
        preset = dataclasses.replace(PRESETS[name], text_tokens=text_tokens)
        predicted = bench._uneven_split(preset, tuple(shape), spec.size)
        model = build_model(preset, 1, rank.device, torch.float32)
        split = enable_context_parallel(model, spec, rank.device)
        try:
            model(**case_inputs(preset, model, tuple(shape), rank.device, torch.float32))
            real = None
        except UnevenSplitError as exc:
            real = [exc.tokens, exc.text]
        disable_context_parallel(model, split)
        out.append([None if predicted is None else [predicted.tokens, predicted.text], real])
    return out


def test_the_benchmarks_check_predicts_the_splits_refusal() -> None:
    """The token counts the benchmark checks before building anything (the DiT's forward on the
    meta device, hooked where diffusers' plan splits) are those the real split refuses, for video
    and image presets, the image's tokens and the text's."""
    cases = [("tiny-wan", 16, [5, 48, 48]), ("tiny-wan", 16, [1, 48, 48]), ("tiny-wan", 16, [9, 32, 48]),
             ("tiny-wan", 16, [13, 48, 80]), ("tiny-wan", 16, [1, 32, 32]), ("tiny-flux", 16, [48]),
             ("tiny-flux", 16, [64]), ("tiny-flux", 7, [64]), ("tiny-flux", 7, [48]), ("tiny-wan", 7, [1, 48, 48])]
    results = run_ranks(splits_predicted, 2, args=(cases,))
    assert results[0] == results[1]
    for case, (predicted, real) in zip(cases, results[0]):
        assert predicted == real, (case, predicted, real)
    # Both kinds happened: even cases pass, the image's and the text's tokens are refused.
    reals = [real for _, real in results[0]]
    assert None in reals and [9, False] in reals and [7, True] in reals


def cli_heads_refused(rank: Rank, out_dir: str) -> dict:
    """``omni-offload generate --ulysses-degree 3`` on tiny-wan (2 heads): its exit status, its
    output, and whether the pipeline was loaded."""
    import contextlib
    import io

    from omni_dist_offload.app import cli

    loaded = []
    load = api.load_and_place

    def counted(*args, **kwargs):
        loaded.append(1)
        return load(*args, **kwargs)

    api.load_and_place = counted
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = cli.main(["generate", "--model", "tiny-wan", "--ulysses-degree", "3", "--diffusion-offload-config",
                       '{"mode":"layer","components":["dit"]}', "--prompt", "a fox", "--num-inference-steps", "1",
                       "--output-dir", out_dir])
    return {"rc": rc, "err": err.getvalue(), "loaded": len(loaded)}


def test_generate_refuses_heads_the_degree_does_not_divide_before_loading(tmp_path) -> None:
    """The DiT's heads are read from its config before anything loads: the refusal (exit 2, the
    same message as the split's own check) comes before the pipeline is loaded and offloaded."""
    for r in run_ranks(cli_heads_refused, 3, args=(str(tmp_path / "out"),)):
        assert r["rc"] == 2 and r["loaded"] == 0, r
        assert "offloading" not in r["err"] and "Traceback" not in r["err"], r["err"]
        assert "has 2 attention heads, which ulysses_degree 3" in r["err"], r["err"]
