"""The Python examples in README.md run as written under mpiexec and print small errors."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
MPIEXEC = Path(sys.executable).parent / "mpiexec"


def test_readme_has_examples():
    assert len(BLOCKS) >= 2


@pytest.mark.skipif(not MPIEXEC.exists(), reason="no mpiexec beside this Python")
@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(tmp_path, index):
    script = tmp_path / f"example{index}.py"
    script.write_text(BLOCKS[index])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [str(MPIEXEC), "-n", "2", sys.executable, "-m", "mpi4py", str(script)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    errs = [float(x) for x in re.findall(r"err\w*.*?([0-9.]+e-?[0-9]+)", res.stdout)]
    assert errs, res.stdout
    assert max(errs) < 1e-4, res.stdout
