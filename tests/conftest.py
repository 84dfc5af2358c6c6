import pytest
import torch


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
    import logging

    lib_logger = logging.getLogger("omni_dist_offload")
    handlers, level = list(lib_logger.handlers), lib_logger.level
    yield
    lib_logger.handlers[:] = handlers
    lib_logger.setLevel(level)
