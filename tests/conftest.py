"""Shared by every test folder: ``unit/`` (one process), ``dist/`` (several ranks over gloo,
started by ranks.py) and ``gpu/`` (marked ``gpu``, skipped without CUDA).

Beside this file: ranks.py (the multi-rank launcher), toys.py and tiny_models.py (models),
faults.py (fault injection), media.py (decoding outputs), serving.py (a server to call)."""

import logging

import pytest
import torch

# One intra-op thread per test process. The suite runs in two workers on two cores (pytest-xdist);
# with torch's default of a thread per core each, the workers' OpenMP threads spin on cores the
# other worker needs, and the suite took 4:17 instead of 3:01 (measured on the 2-core CI-like
# machine). The models are tiny: a second thread buys nothing. Outputs compared in-process run
# with the same count; processes the tests start set OMP_NUM_THREADS themselves.
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _restore_library_logger():
    """The CLI and the server configure the library logger; leave it as the next test expects."""
    lib_logger = logging.getLogger("omni_dist_offload")
    handlers, level = list(lib_logger.handlers), lib_logger.level
    yield
    lib_logger.handlers[:] = handlers
    lib_logger.setLevel(level)


@pytest.fixture(scope="session")
def wan_folder(tmp_path_factory):
    """The tiny Wan pipeline saved as a folder: fp32, several safetensors shards and an index."""
    import tiny_models as tiny  # here, not at the top: the xdist controller runs no test

    folder = tmp_path_factory.mktemp("tiny-wan")
    tiny.tiny_wan_pipeline().save_pretrained(folder, max_shard_size="40KB")  # several shards + index
    return folder
