"""Test setup. Without a GPU, Triton kernels run under the interpreter: TRITON_INTERPRET must be
set before any kernel module is imported, which is why it is set here, at collection start."""

import os
import signal

import pytest


def _has_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


HAS_GPU = _has_gpu()
# Figures default to PNG; the tests read labels out of the SVG text, so they ask for every format
# (notebook and sweep subprocesses inherit it).
os.environ.setdefault("QSA_FIGURE_FORMATS", "png,svg,pdf")
if not HAS_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a GPU (run scripts/gpu_check.sh on a GPU host)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _python_sigint_handler():
    """Every test starts and ends with Python's own Ctrl-C handler. In the whole default lane
    on a fresh clone, something before the sweep tests left SIGINT ignored (the handler read
    SIG_IGN there; which test does it was not found), and the sweep's Ctrl-C test then saw no
    KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, signal.default_int_handler)
