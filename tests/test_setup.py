"""The README's commands set themselves up on the hosts people use, including a GPU container
whose `python3` is itself a virtual environment holding the host's torch and triton."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.skipif(sys.prefix == sys.base_prefix, reason="needs a python that is a venv")
def test_set_up_from_a_venv_python_uses_its_torch_and_installs_none(tmp_path):
    """This test's own python is a venv holding torch, like the H200 host's /opt/torch/.venv.
    Before the fix, the new .venv saw only the base interpreter's packages and set-up tried to
    install a second torch; QSA_TORCH names one that does not exist, so any attempt fails."""
    env = {**os.environ, "QSA_PYTHON": sys.executable, "QSA_VENV": str(tmp_path / "venv"),
           "QSA_TORCH": "torch==0.0.0", "QSA_TRITON": "triton==0.0.0"}
    script = ("source scripts/bootstrap.sh && "
              "python -c 'import torch, triton, qsa; print(torch.__file__)'")
    res = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "installing torch" not in res.stderr and "installing triton" not in res.stderr
    assert "is a virtual environment: its packages are used" in res.stderr
    assert Path(res.stdout.strip().splitlines()[-1]).resolve() == \
        Path(torch.__file__).resolve()


def test_the_triton_version_is_checked_not_pinned():
    """A pin would make pip swap a ROCm host's Triton (pytorch-triton-rocm) for PyPI's CUDA
    build; the kernels check the version they import instead."""
    import tomllib
    import warnings

    from qsa.kernels import TritonVersionError, check_triton_version

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if d.startswith("triton")]
    assert project["optional-dependencies"]["triton"] == ["triton>=3.6,<3.7"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_triton_version("3.6.0")
        check_triton_version("3.6.0+rocm7.0.0.git1234")
    with pytest.raises(TritonVersionError, match="need Triton 3.6.*qsa-workbench\\[triton\\]"):
        check_triton_version("3.5.1")
    with pytest.warns(UserWarning, match="tested and tuned with Triton 3.6"):
        check_triton_version("3.7.0")
    with pytest.raises(TritonVersionError, match="not a version"):
        check_triton_version("main")


def test_each_environment_file_installs_the_torch_of_its_platform():
    """CPU, CUDA and ROCm conda environments: each takes torch from its own wheel index, the
    CPU one adds Triton (a CPU torch brings none), and all install JupyterLab and the tests."""
    import yaml

    def pip_lines(name):
        env = yaml.safe_load((ROOT / name).read_text())
        return next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))

    expect = {"environment.yml": ("whl/cpu", "-e .[dev,lab,triton]"),
              "environment-cuda.yml": ("whl/cu130", "-e .[dev,lab]"),
              "environment-rocm.yml": ("whl/rocm", "-e .[dev,lab]")}
    for name, (index, install) in expect.items():
        lines = pip_lines(name)
        assert any(line.startswith("--extra-index-url") and index in line for line in lines), name
        assert install in lines and any(line.startswith("torch") for line in lines), name
        # An open bound would take PyPI's CUDA torch once PyPI has a newer one than the
        # vendor index: an exact version, which the index's build (+cu130, +rocm7.0) wins.
        (torch_line,) = [line for line in lines if line.startswith("torch")]
        assert re.fullmatch(r"torch==\d+\.\d+\.\d+", torch_line), (name, torch_line)


def _constraints() -> dict[str, str]:
    lines = (ROOT / "constraints.txt").read_text().splitlines()
    pins = [line.split("==") for line in lines if line and not line.startswith("#")]
    assert all(len(p) == 2 for p in pins), "constraints.txt holds NAME==VERSION lines only"
    return {canonicalize_name(n): v for n, v in pins}


def test_installs_use_the_constraints_and_pyproject_keeps_lower_bounds():
    """A fresh install takes the versions the suite passed with (constraints.txt, by pip -c in
    the set-up and in the wheelhouse), never torch's or Triton's (a GPU host's own builds),
    while pyproject.toml keeps ranges with a lower bound that every pin satisfies."""
    import tomllib

    bootstrap = (ROOT / "scripts" / "bootstrap.sh").read_text()
    assert '-c "$constraints"' in bootstrap and 'constraints="$root/constraints.txt"' in bootstrap
    assert '"$constraints" | sha256sum' in bootstrap  # a changed pin re-installs
    assert '-c "$root/constraints.txt"' in (ROOT / "scripts" / "wheelhouse.sh").read_text()
    pins = _constraints()
    assert not {"torch", "triton", "sympy", "networkx"} & set(pins)
    assert not [n for n in pins if n.startswith(("nvidia-", "pytorch-triton"))]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]
            + project["optional-dependencies"]["dev"]]
    for req in reqs:
        assert any(sp.operator == ">=" for sp in req.specifier), f"{req} has no lower bound"
        assert not any(sp.operator == "==" for sp in req.specifier), f"{req} is pinned"
        name = canonicalize_name(req.name)
        if name != "torch":
            assert name in pins and req.specifier.contains(pins[name]), (req, pins.get(name))
