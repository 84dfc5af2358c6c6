"""Context parallelism and the attention backend, in one process: what the active backend cannot
split (a ring on torch's SDPA, a backend diffusers' context parallelism does not support, as
``DIFFUSERS_ATTN_BACKEND`` sets it) is refused before any model loads, by ``Omni`` and by the CLI
in one line with exit status 2. The loaded model's own processors are checked on two ranks
(``tests/dist/test_context_parallel_ranks.py``)."""

from __future__ import annotations

import pytest
from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

from omni_dist_offload import Omni
from omni_dist_offload.app import api, cli
from omni_dist_offload.loading.parallel import ContextParallelError

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
    from omni_dist_offload.loading.parallel import ContextParallel, check_attention_backend

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
