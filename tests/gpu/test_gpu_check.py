"""jobs/gpu_check.sh on the CuPy stand-in (NOT a GPU): verdicts, junit per rank, compute mode.

Each test runs the script with this Python and its mpiexec, the stand-in as CuPy
(tests/tools/fakecupy with its kernels), no carried wheels, no precompile
(RINGMPI_KERNEL_CACHE=0) and a -k expression that keeps each test stage to one
test. What they check is the script's own logic (issue 39): every stage gets one
verdict, a stage that cannot run says why and the next one still runs, each rank
of a multi-rank stage writes its own junit file, and a GPU in exclusive-process
mode gets one rank per GPU or a skip with the reason.
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "jobs" / "gpu_check.sh"
STAGES = ["setup", "mpi", "gpu", "compile", "mods", "tests1", "ranks", "staged", "aware", "bench"]
QUICK = "exchange_and_overlap"  # one quick multi-rank test of tests/gpu/test_tile_device.py

pytestmark = pytest.mark.skipif(
    not (Path(sys.executable).parent / "mpiexec").exists(),
    reason="no mpiexec beside this Python (the mpich extra)",
)


def run_check(tmp_path: Path, standin: bool = True, **env) -> tuple:
    """(exit status, {stage: (verdict, why)}, output folder) of one run of the script."""
    out = tmp_path / "out"
    e = {k: v for k, v in os.environ.items() if not k.startswith(("GPU_CHECK_", "CUPY_"))}
    e.update(
        PYTHON=sys.executable,
        PYTHONPATH=str(ROOT / "tests" / "tools" / "fakecupy") if standin else "",
        CUPY_STANDIN_KERNELS="1",
        RINGMPI_KERNEL_CACHE="0",
        GPU_CHECK_OUT=str(out),
        GPU_CHECK_WHEELS=str(tmp_path / "no-wheels"),
        GPU_CHECK_SLOW="4",
        GPU_CHECK_BUDGET="1200",
    )
    e.update(env)
    proc = subprocess.run(
        ["bash", str(SCRIPT)], env=e, capture_output=True, text=True, timeout=1500, check=False
    )
    table = (out / "summary.txt").read_text()
    rows = {}
    for line in table.splitlines():
        m = re.match(r"^(\w+)\s+(PASS|FAIL|SKIP|NO GPU|NO MPI)\s+(.*)$", line)
        if m:
            rows[m.group(1)] = (m.group(2), m.group(3))
    assert list(rows) == STAGES, f"one verdict per stage expected:\n{table}\n{proc.stdout[-3000:]}"
    return proc.returncode, rows, out


@pytest.mark.timeout(1500)
def test_each_rank_writes_its_own_junit_file(tmp_path):
    rc, rows, out = run_check(tmp_path, GPU_CHECK_STAGES="staged", GPU_CHECK_K=QUICK)
    assert rows["staged"][0] == "PASS" and rows["ranks"][0] == "PASS", rows
    assert rows["compile"][0] == "PASS" and rows["setup"][0] == "SKIP", rows
    for s in ("mods", "tests1", "aware", "bench"):
        assert rows[s] == ("SKIP", "not in GPU_CHECK_STAGES"), rows
    assert rc == 0, rows
    assert not (out / "staged.xml").exists()  # no file written by two ranks at once
    for r in (0, 1):
        suite = ET.parse(out / f"staged.rank{r}.xml").getroot()
        cases = [c.get("name") for c in suite.iter("testcase")]
        assert cases == ["test_gpu_ring_exchange_and_overlap"], (r, cases)


def fake_nvidia_smi(tmp_path: Path, mode: str) -> str:
    """A folder with an nvidia-smi that reports compute mode ``mode``; PATH with it first."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tool = bin_dir / "nvidia-smi"
    tool.write_text(
        "#!/bin/sh\n"
        'case "$*" in *COMPUTE*) printf "GPU 00000000:00:05.0\\n'
        f'    Compute Mode                          : {mode}\\n" ;; esac\n'
    )
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    return f"{bin_dir}:{os.environ['PATH']}"


@pytest.mark.timeout(1500)
def test_exclusive_process_mode_on_one_gpu_skips_the_rank_stages_with_the_reason(tmp_path):
    path = fake_nvidia_smi(tmp_path, "Exclusive_Process")
    rc, rows, out = run_check(
        tmp_path, GPU_CHECK_STAGES="staged aware", GPU_CHECK_K=QUICK, PATH=path
    )
    for s in ("staged", "aware"):
        verdict, why = rows[s]
        assert verdict == "SKIP" and "Exclusive_Process" in why and "1 GPU" in why, rows
    assert rows["ranks"][0] == "PASS" and rows["gpu"][0] == "PASS", rows  # MPI alone still runs
    assert "Exclusive_Process" in rows["gpu"][1]
    assert rc == 0, rows


@pytest.mark.timeout(1500)
def test_exclusive_process_mode_runs_one_rank_per_gpu(tmp_path):
    path = fake_nvidia_smi(tmp_path, "Exclusive_Process")
    rc, rows, out = run_check(
        tmp_path, GPU_CHECK_STAGES="staged", GPU_CHECK_K=QUICK, PATH=path, CUPY_STANDIN_DEVICES="2"
    )
    assert rows["staged"][0] == "PASS", rows
    assert "one rank per GPU (0,1)" in (out / "gpu_check.log").read_text()
    assert rc == 0, rows


@pytest.mark.timeout(600)
def test_no_gpu_reaches_every_stage(tmp_path):
    """Without CuPy: each GPU stage says NO GPU, the MPI stages still run; exit 2."""
    import importlib.util

    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("CuPy is installed here: the no-GPU path needs a Python without it")
    rc, rows, _ = run_check(tmp_path, standin=False, GPU_CHECK_K=QUICK)
    for s in ("gpu", "compile", "mods", "tests1", "staged", "aware", "bench"):
        assert rows[s][0] == "NO GPU", rows
    assert rows["mpi"][0] == "PASS" and rows["ranks"][0] == "PASS", rows
    assert rc == 2, rows
