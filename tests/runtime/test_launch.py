"""Launch sanity (ringmpi.runtime.launch) and the PBS job script under a simulated PBS.

The environments below are what the launchers really set (Slurm 22.05's sbatch and
srun were read on a live one-node cluster, see tests/cluster/slurm.sh; hydra's from
the PyPI mpich's mpiexec). The end-to-end cases start ``ringmpi run`` in a
subprocess: a broken launch must exit 2 with one line and write nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from ringmpi.cli.make_data import make_data
from ringmpi.runtime.launch import LaunchError, check_launch, launch_problem, launcher_tasks

REPO = Path(__file__).resolve().parents[2]

# the batch script of `sbatch --ntasks=4`: allocation-level variables only
SBATCH = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_NPROCS": "4", "SLURM_PROCID": "0"}


def srun_step(n: int, rank: int, mpi: str = "none") -> dict:
    """One task of ``srun --ntasks=n --mpi=MPI`` inside that batch job."""
    env = dict(SBATCH, SLURM_NTASKS=str(n), SLURM_STEP_ID="0", SLURM_STEPID="0")
    env.update(SLURM_STEP_NUM_TASKS=str(n), SLURM_PROCID=str(rank), SLURM_STEP_NUM_NODES="1")
    if mpi == "pmi2":
        env.update(PMI_FD="11", PMI_JOBID="7.0", PMI_RANK=str(rank), PMI_SIZE=str(n))
    return env


def hydra(n: int, rank: int) -> dict:
    """One process of the PyPI mpich's ``mpiexec -n n`` on one host."""
    return {
        "PMI_RANK": str(rank),
        "PMI_SIZE": str(n),
        "PMI_FD": "9",
        "PMI_HOSTNAME": "vm",
        "MPI_LOCALNRANKS": str(n),
        "MPI_LOCALRANKID": str(rank),
    }


class FakeComm:
    def __init__(self, size: int):
        self.size = size

    def Get_size(self) -> int:
        return self.size


# -- the pure helper ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "env, size",
    [
        ({}, 1),  # plain python
        (SBATCH, 1),  # python in a 4-task batch script: one process, not four
        (srun_step(1, 0), 1),  # srun -n 1
        (srun_step(4, 2, "pmi2"), 4),  # srun --mpi=pmi2 that worked
        (hydra(3, 0), 3),  # mpiexec -n 3 that worked
        # hydra's mpiexec -n 1 inside a 2-task srun step: the inner launcher decides
        (dict(srun_step(2, 0), **hydra(1, 0)), 1),
        ({"OMPI_COMM_WORLD_SIZE": "1", "OMPI_COMM_WORLD_RANK": "0"}, 1),
        ({"PMIX_RANK": "0", "PMIX_NAMESPACE": "x"}, 1),
        ({"PBS_JOBID": "1.pbs", "PBS_NODEFILE": "/x", "PBS_NP": "4", "PBS_TASKNUM": "1"}, 1),
        ({"PMI_SIZE": "", "SLURM_STEP_NUM_TASKS": "many"}, 1),  # unreadable: no verdict
        (dict(srun_step(4, 1), RINGMPI_LAUNCH_CHECK="0"), 1),  # switched off
        # a rank whose launch is fine but whose env says fewer tasks: not ours to judge
        (srun_step(2, 1, "pmi2"), 4),
    ],
)
def test_good_launches_pass(env, size):
    assert launch_problem(env, size) is None
    check_launch(FakeComm(size), env)  # does not raise


def test_srun_without_pmi_names_cause_and_fix():
    for rank in (0, 1):
        msg = launch_problem(srun_step(2, rank), 1)
        assert msg is not None
        assert msg.startswith("srun started 2 tasks (SLURM_STEP_NUM_TASKS=2)")
        assert "MPI.COMM_WORLD has 1 rank" in msg and "same output" in msg
        assert "--mpi=pmi2" in msg and "build mpi4py against the site MPI" in msg
        assert "\n" not in msg
    with pytest.raises(LaunchError, match="srun started 2 tasks"):
        check_launch(FakeComm(1), srun_step(2, 1))


def test_srun_pmi2_with_a_library_that_ignores_it():
    # e.g. mpi4py on Open MPI under srun --mpi=pmi2: srun's PMI says 4, MPI says 1
    msg = launch_problem(srun_step(4, 0, "pmi2"), 1)
    assert msg.startswith("srun --mpi=pmi2 started 4 tasks (PMI_SIZE=4)")
    assert "--mpi=pmix for Open MPI" in msg


@pytest.mark.parametrize(
    "env, head",
    [
        (hydra(2, 1), "a PMI process manager (hydra mpiexec or srun --mpi=pmi2) started 2 tasks"),
        ({"OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_RANK": "0"}, "Open MPI's mpirun started 3"),
        ({"MV2_COMM_WORLD_SIZE": "2"}, "MVAPICH's mpirun_rsh started 2 tasks"),
        ({"FLUX_JOB_SIZE": "8", "FLUX_TASK_RANK": "0"}, "flux run started 8 tasks"),
        ({"JSM_NAMESPACE_SIZE": "6"}, "jsrun started 6 tasks"),
        ({"MPI_LOCALNRANKS": "2"}, "hydra's mpiexec started 2 tasks"),
        # no size variable, but a rank above 0 cannot be a singleton
        ({"PMIX_RANK": "3"}, "a PMIx launcher (srun --mpi=pmix or prterun) started this task"),
        ({"PALS_RANKID": "1"}, "HPE PALS mpiexec started this task as rank 1 (PALS_RANKID=1)"),
    ],
)
def test_mpiexec_kind_launchers(env, head):
    msg = launch_problem(env, 1)
    assert msg is not None and msg.startswith(head), msg
    assert "use the mpiexec of the MPI that mpi4py was built with" in msg


def test_innermost_launcher_wins():
    la = launcher_tasks(dict(srun_step(2, 1), **hydra(4, 3)))
    assert (la.tasks, la.rank, la.tasks_var, la.rank_var) == (4, 3, "PMI_SIZE", "PMI_RANK")
    la = launcher_tasks(SBATCH)  # SLURM_NTASKS / SLURM_PROCID outside a step: never read
    assert (la.tasks, la.rank, la.tasks_var) == (None, None, "")


# -- ringmpi run, end to end ---------------------------------------------------------------


def _clean_env(extra: dict) -> dict:
    """This process's environment without any launcher variable, plus ``extra``."""
    drop = ("SLURM_", "PMI_", "PMIX_", "OMPI_", "MPI_LOCAL", "PALS_", "FLUX_", "JSM_", "MV2_")
    keep = ("OMPI_ALLOW_RUN_AS_ROOT", "OMPI_MCA_")  # Open MPI settings, not a launcher's
    env = {k: v for k, v in os.environ.items() if k.startswith(keep) or not k.startswith(drop)}
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


def _run(args, extra: dict, timeout: float = 120):
    cmd = [sys.executable, "-m", "mpi4py", "-m", "ringmpi", "run", *args]
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env=_clean_env(extra)
    )


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("launch")
    (path,) = make_data(str(d / "in.h5"), seq_len=96, heads=2, kv_heads=1, head_dim=8)
    return d, path


@pytest.mark.parametrize("rank", [0, 1])
def test_run_refuses_a_broken_launch_and_writes_nothing(tiny, rank):
    d, inp = tiny
    out = d / f"broken{rank}" / "out.h5"
    out.parent.mkdir()
    r = _run([inp, "-o", str(out), "--device", "cpu"], srun_step(2, rank))
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    if rank == 0:  # one line in the job log, from the task srun numbered 0
        assert len(lines) == 1 and lines[0].startswith("ringmpi: error: srun started 2 tasks")
    else:
        assert lines == []
    assert list(out.parent.iterdir()) == []


def test_run_in_a_batch_script_is_not_refused(tiny):
    d, inp = tiny
    out = d / "batch" / "out.h5"
    out.parent.mkdir()
    r = _run([inp, "-o", str(out), "--device", "cpu", "--quiet"], SBATCH)
    assert r.returncode == 0, r.stderr
    with h5py.File(out, "r") as f:
        assert np.isfinite(f["out"][...]).all()


# -- jobs/pbs.sh under a simulated PBS ------------------------------------------------------


def test_pbs_script_finds_the_venv_mpiexec(tiny, tmp_path):
    """PBS runs the script from a spool copy with PBS_O_WORKDIR, PBS_NODEFILE (one line
    per mpiproc) and PBS_JOBID set, and a PATH without the venv."""
    d, inp = tiny
    venv_bin = Path(sys.executable).parent
    if not (venv_bin / "mpiexec").exists():
        pytest.skip("no mpiexec next to this python (the PyPI mpich is not installed)")
    host = subprocess.run(["hostname"], capture_output=True, text=True).stdout.strip()
    nodefile = tmp_path / "nodes"
    nodefile.write_text(f"{host}\n{host}\n")
    spool = tmp_path / "spool.SC"  # PBS copies the script away, as Slurm does
    spool.write_text((REPO / "jobs" / "pbs.sh").read_text())
    out = tmp_path / "out" / "out.h5"
    out.parent.mkdir()
    path = ":".join(p for p in os.environ.get("PATH", "").split(":") if Path(p) != venv_bin)
    env = _clean_env(
        {
            "PATH": path or "/usr/bin:/bin",
            "PBS_O_WORKDIR": str(REPO),
            "PBS_NODEFILE": str(nodefile),
            "PBS_JOBID": "1234.pbs-server",
            "PBS_JOBNAME": "ringmpi",
            "PBS_ENVIRONMENT": "PBS_BATCH",
            "ARGS": f"'{inp}' -o '{out}' --causal --verify",
            "DEVICE": "cpu",
        }
    )
    if not (REPO / ".venv" / "bin" / "python").exists():
        env["PYTHON"] = sys.executable  # else the script's default: .venv of PBS_O_WORKDIR
    r = subprocess.run(
        ["bash", str(spool)], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ringmpi: 2 ranks" in r.stdout
    assert ", 2 ranks," in r.stdout and "ringmpi verify: PASSED" in r.stdout, r.stdout
    assert out.exists()
