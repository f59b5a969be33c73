"""Triton kernels, one family per module; block configs come from qsa/configs/tables.

Triton is not a pinned dependency of the package: CUDA torch wheels bring `triton`, ROCm ones
`pytorch-triton-rocm` (the same `triton` module under another distribution name), and a pin
would make pip replace a ROCm host's Triton with PyPI's CUDA build. The version is checked
here instead, when the kernels are first imported."""

from __future__ import annotations

import re
import warnings

TESTED_TRITON = (3, 6)  # the minor version the kernels are written, tested and tuned with


class TritonVersionError(ImportError):
    """The installed Triton is older than the kernels can use."""


def check_triton_version(version: str) -> None:
    """Refuse a Triton older than the tested minor version with what to install; warn on a
    newer one (kernels compile, but configs and numbers were tuned on the tested one)."""
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None:
        raise TritonVersionError(f"triton {version!r}: not a version this package can read")
    found = (int(m.group(1)), int(m.group(2)))
    want = ".".join(map(str, TESTED_TRITON))
    if found < TESTED_TRITON:
        raise TritonVersionError(
            f"triton {version}: the QSA kernels need Triton {want}. CPU or CUDA: pip install "
            f"'triton>={want},<{TESTED_TRITON[0]}.{TESTED_TRITON[1] + 1}' (or the extra "
            f"qsa-workbench[triton]); ROCm: the pytorch-triton-rocm that matches a ROCm torch "
            f"built with Triton {want}")
    if found != TESTED_TRITON:
        warnings.warn(f"triton {version}: the QSA kernels were tested and tuned with Triton "
                      f"{want}; configs and timings may differ", stacklevel=2)


def _check_installed() -> None:
    try:
        import triton
    except ImportError:
        raise TritonVersionError(
            "triton is not installed: CUDA and ROCm torch builds bring it; with a CPU torch "
            "install the extra qsa-workbench[triton]") from None
    check_triton_version(triton.__version__)


_check_installed()
