"""Batch scripts on a shared machine (issue 22, items 2 and 11): cache dirs and ARGS.

jobs/pbs.sh and jobs/slurm.sbatch run here with stub launchers (``MPIEXEC``, ``srun``)
that record their arguments and environment instead of starting ranks.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

STUB = """#!/bin/sh
out="$STUB_LOG"
{ printf 'CUPY_CACHE_DIR=%s\\n' "$CUPY_CACHE_DIR"; printf 'PYTHONSAFEPATH=%s\\n' \
"$PYTHONSAFEPATH"; for a in "$@"; do printf 'ARG=%s\\n' "$a"; done; } >> "$out"
"""


def _stub(tmp_path: Path, name: str) -> Path:
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    p = bindir / name
    p.write_text(STUB)
    p.chmod(0o755)
    return p


def _run(script: str, tmp_path: Path, **env) -> tuple[subprocess.CompletedProcess, list]:
    log = tmp_path / "stub.log"
    if log.exists():
        log.unlink()
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    full = {k: v for k, v in os.environ.items() if k != "CUPY_CACHE_DIR"}
    full.update(
        STUB_LOG=str(log),
        PYTHON=sys.executable,
        PBS_O_WORKDIR=str(work),
        SLURM_SUBMIT_DIR=str(work),
        TMPDIR=str(tmp_path / "tmp"),
        PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}",
    )
    (tmp_path / "tmp").mkdir(exist_ok=True)
    full.update(env)
    proc = subprocess.run(
        ["bash", str(ROOT / "jobs" / script), *full.pop("SCRIPT_ARGS", "").split()],
        env=full,
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = log.read_text().splitlines() if log.exists() else []
    return proc, lines


def test_pbs_args_are_split_not_evaluated(tmp_path):
    mpiexec = _stub(tmp_path, "mpiexec")
    pwned = tmp_path / "pwned"
    args = f"'shards/a b*.h5' -o out.h5 $(touch {pwned}) `touch {pwned}` $HOME"
    proc, lines = _run("pbs.sh", tmp_path, MPIEXEC=str(mpiexec), ARGS=args)
    assert proc.returncode == 0, proc.stderr
    assert not pwned.exists()
    got = [x[4:] for x in lines if x.startswith("ARG=")]
    i = got.index("run")
    assert got[i + 3 :] == [
        "shards/a b*.h5",
        "-o",
        "out.h5",
        "$(touch",
        f"{pwned})",
        "`touch",
        f"{pwned}`",
        "$HOME",
    ]
    assert "PYTHONSAFEPATH=1" in lines


@pytest.mark.parametrize("script", ["pbs.sh", "slurm.sbatch"])
def test_default_cupy_cache_is_private(tmp_path, script):
    _stub(tmp_path, "srun")
    mpiexec = _stub(tmp_path, "mpiexec")
    env = dict(MPIEXEC=str(mpiexec), ARGS="in.h5 -o out.h5", SCRIPT_ARGS="in.h5 -o out.h5")
    proc, lines = _run(script, tmp_path, **env)
    assert proc.returncode == 0, proc.stderr
    want = tmp_path / "tmp" / f"cupy-cache-{os.getuid()}"
    assert f"CUPY_CACHE_DIR={want}" in lines
    assert stat.S_IMODE(want.stat().st_mode) == 0o700
    # a directory under that name that others can write is not used: a fresh one is
    want.chmod(0o777)
    proc, lines = _run(script, tmp_path, **env)
    assert proc.returncode == 0, proc.stderr
    assert "using a fresh one" in proc.stderr
    used = [x.split("=", 1)[1] for x in lines if x.startswith("CUPY_CACHE_DIR=")]
    assert used and all(u != str(want) for u in used)
    assert stat.S_IMODE(Path(used[0]).stat().st_mode) == 0o700


@pytest.mark.parametrize("script", ["pbs.sh", "slurm.sbatch"])
def test_unsafe_user_cupy_cache_stops_the_job(tmp_path, script):
    _stub(tmp_path, "srun")
    mpiexec = _stub(tmp_path, "mpiexec")
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o775)
    proc, lines = _run(
        script,
        tmp_path,
        MPIEXEC=str(mpiexec),
        ARGS="in.h5 -o out.h5",
        SCRIPT_ARGS="in.h5 -o out.h5",
        CUPY_CACHE_DIR=str(shared),
    )
    assert proc.returncode == 2
    assert "is not a directory of" in proc.stderr and "mode 700" in proc.stderr
    assert lines == []  # nothing was launched
