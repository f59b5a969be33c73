"""The README's commands set themselves up on the hosts people use, including a GPU container
whose `python3` is itself a virtual environment holding the host's torch and triton."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.skipif(sys.prefix == sys.base_prefix, reason="needs a python that is a venv")
def test_set_up_from_a_venv_python_uses_its_torch_and_installs_none(tmp_path):
    """This test's own python is a venv holding torch, like the H200 host's /opt/torch/.venv.
    Before the fix, the new .venv saw only the base interpreter's packages and set-up tried to
    install a second torch; QSA_TORCH names one that does not exist, so any attempt fails."""
    env = {**os.environ, "QSA_PYTHON": sys.executable, "QSA_VENV": str(tmp_path / "venv"),
           "QSA_TORCH": "torch==0.0.0"}
    script = ("source scripts/bootstrap.sh && "
              "python -c 'import torch, triton, qsa; print(torch.__file__)'")
    res = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "installing torch" not in res.stderr
    assert "is a virtual environment: its packages are used" in res.stderr
    assert Path(res.stdout.strip().splitlines()[-1]).resolve() == \
        Path(torch.__file__).resolve()
