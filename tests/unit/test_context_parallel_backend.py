"""Context parallelism and the attention backend, in one process: what the active backend cannot
split (a ring on torch's SDPA, a backend diffusers' context parallelism does not support, as
``DIFFUSERS_ATTN_BACKEND`` sets it) is refused before any model loads, by ``Omni`` and by the CLI
in one line with exit status 2. The loaded model's own processors are checked on two ranks
(``tests/dist/test_context_parallel_ranks.py``). A job without torch.distributed is told what
it lacks; a text length the group does not divide is told apart from the image's."""

from __future__ import annotations

import inspect
import types

import pytest
from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

from omni_dist_offload import Omni
from omni_dist_offload.app import api, cli
from omni_dist_offload.loading.parallel import ContextParallel, ContextParallelError, UnevenSplitError, check_ranks

CASES = [  # (active backend, flags, words the refusal holds)
    ("native", ["--ring-degree", "2"], ("active attention backend is 'native'", "log-sum-exp",
                                        "--ulysses-degree")),
    ("_native_math", ["--ulysses-degree", "2"], ("active attention backend is '_native_math'",
                                                 "context parallelism needs a backend that splits")),
]


@pytest.fixture
def active_backend(monkeypatch):
    """Sets diffusers' active backend for the test, as ``DIFFUSERS_ATTN_BACKEND`` does at import."""
    return lambda name: monkeypatch.setattr(_AttentionBackendRegistry, "_active_backend", AttentionBackendName(name))


@pytest.mark.parametrize("backend, flags, words", CASES)
def test_cli_refuses_a_backend_that_cannot_split_before_loading(backend, flags, words, active_backend, monkeypatch,
                                                                tmp_path, capsys):
    active_backend(backend)
    for command in ("generate", "inspect"):
        monkeypatch.setitem(cli._COMMAND_FUNCS, command, lambda plan: pytest.fail(f"ran {plan.command}"))
    assert cli.main(["--output-dir", str(tmp_path / "out"), *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    for expected in (*words, "DIFFUSERS_ATTN_BACKEND=name", "set_attention_backend"):
        assert expected in err[0], err[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("backend, flags, words", CASES)
def test_omni_refuses_a_backend_that_cannot_split_before_loading(backend, flags, words, active_backend,
                                                                 monkeypatch):
    active_backend(backend)
    monkeypatch.setattr(api, "check_ranks", lambda spec: None)  # as if under torchrun with enough ranks
    monkeypatch.setattr(api, "load_and_place", lambda *a, **k: pytest.fail("loaded the model"))
    split = {"ring_degree": 2} if "--ring-degree" in flags else {"ulysses_degree": 2}
    with pytest.raises(ContextParallelError) as raised:
        Omni("tiny-wan", None, context_parallel=split)
    for expected in words:
        assert expected in str(raised.value)


def test_a_backend_that_splits_passes(active_backend, monkeypatch):
    """``native`` splits with Ulysses; ``flash`` returns the log-sum-exp a ring needs."""
    from omni_dist_offload.loading.parallel import check_attention_backend

    for backend, spec in (("native", ContextParallel(ulysses_degree=2)), ("flash", ContextParallel(ring_degree=2))):
        active_backend(backend)
        check_attention_backend(spec)


@pytest.mark.parametrize("backend, flags, words", CASES)
def test_bench_refuses_a_backend_that_cannot_split_before_any_model(backend, flags, words, active_backend,
                                                                    monkeypatch, capsys):
    from omni_dist_offload.tools import bench

    active_backend(backend)
    monkeypatch.setattr(bench, "build_model", lambda *a, **k: pytest.fail("built a model"))
    assert bench.main(["--preset", "tiny-wan", "--frames", "5", "--height", "32", "--width", "32", *flags]) == 2
    err = capsys.readouterr().err
    for expected in words:
        assert expected in err, err


@pytest.mark.parametrize("world, words", [
    ("4", ("one of the job's 4 ranks (WORLD_SIZE=4), has not initialised", "init_process_group() before Omni",
           "torch.cuda.set_device", "the CLI does")),
    (None, ("the job has 1: start it with torchrun --nproc_per_node 2", "NGPU=2", "init_process_group()")),
])
def test_a_job_without_torch_distributed_is_told_what_it_lacks(world, words, monkeypatch):
    """Under torchrun without ``init_process_group`` (the documented snippet lacked it) the job
    has its ranks: the call is missing, not torchrun. Alone, the job has one rank."""
    if world is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world)
    with pytest.raises(ContextParallelError) as raised:
        check_ranks(ContextParallel(ulysses_degree=2))
    message = str(raised.value)
    for expected in ("needs torch.distributed", "ulysses_degree 2 x ring_degree 1",
                     "--ulysses-degree 2 --ring-degree 1", *words):
        assert expected in message, message


@pytest.mark.parametrize("call, words", [
    # QwenImage pads no prompt: 7 tokens under the default max_sequence_length are the prompt's own.
    ({"negative_prompt": "blurry"}, ("text embedding of the prompt (or of negative_prompt, encoded apart) has 7",
                                     "the prompt's own length: QwenImagePipeline pads no prompt",
                                     "change the prompt", "cut it with a max_sequence_length 2 divides")),
    ({"max_sequence_length": 7}, ("text embedding of the prompt has 7 tokens (max_sequence_length=7",
                                  "max_sequence_length=6")),
])
def test_a_text_length_the_group_does_not_divide_names_the_text(call, words):
    from diffusers import QwenImagePipeline

    omni = object.__new__(api.Omni)  # only what the message reads
    omni.pipeline = object.__new__(QwenImagePipeline)
    omni._signature = inspect.signature(QwenImagePipeline.__call__)
    omni.parallel = types.SimpleNamespace(spec=ContextParallel(ulysses_degree=2))
    error = omni._unsplittable(call, UnevenSplitError("transformer", "QwenImageTransformer2DModel", "",
                                                      "encoder_hidden_states", 7, 2))
    message = str(error)
    assert isinstance(error, api.GenerationOptionError) and "height=" not in message, message
    for expected in (*words, "QwenImageTransformer2DModel splits the text sequence", "--ulysses-degree 2"):
        assert expected in message, message
