"""Launch sanity: did the launcher's tasks form one MPI communicator?

When a launcher starts P processes but the MPI library under mpi4py cannot talk
to that launcher (``srun`` without a PMI plugin the library speaks, Open MPI's
``mpirun`` with an MPICH-built mpi4py, ...), every process initializes as a
singleton: P independent jobs, each "rank 0 of 1", all writing the same output.
:func:`check_launch` compares what the environment says about the launch with
the size of ``COMM_WORLD`` and stops before any file is touched.

How the task count is read (innermost launcher first, the first one present wins):

====================  ==========================================================
variable              set by
====================  ==========================================================
OMPI_COMM_WORLD_SIZE  Open MPI's mpirun / prterun, for every process it starts
PMI_SIZE              PMI-1/PMI-2 process managers: MPICH and Intel MPI hydra
                      mpiexec, ``srun --mpi=pmi2``, Cray PMI
MV2_COMM_WORLD_SIZE   MVAPICH's mpirun_rsh
JSM_NAMESPACE_SIZE    IBM jsrun (LSF)
FLUX_JOB_SIZE         ``flux run``
SLURM_STEP_NUM_TASKS  ``srun``, for every task of a job step, whatever ``--mpi``
                      is. Read only together with SLURM_STEP_ID, i.e. inside a
                      step. SLURM_NTASKS is never read: in a batch script it is
                      the allocation's task count, while the script itself (and
                      a plain ``python`` in it) is one process.
MPI_LOCALNRANKS       hydra: processes on this node (a lower bound)
====================  ==========================================================

Innermost first matters: hydra's or Open MPI's mpiexec inside a Slurm
allocation starts its daemons with ``srun`` (one task per node), so the ranks
inherit a SLURM_STEP_NUM_TASKS that counts daemons, not ranks; the MPI
launcher's own variable is the right one there.

A rank variable above 0 while COMM_WORLD has one process is also a broken
launch, whatever the sizes say: PMIX_RANK (``srun --mpi=pmix``, prterun), PMI_RANK,
OMPI_COMM_WORLD_RANK, PALS_RANKID (HPE PALS mpiexec under PBS Pro), ALPS_APP_PE
(Cray aprun), FLUX_TASK_RANK, JSM_NAMESPACE_RANK, MV2_COMM_WORLD_RANK, and
SLURM_PROCID inside a step.

PBS itself (PBS_NODEFILE, PBS_NP, PBS_NCPUS, PBS_TASKNUM) only describes the
allocation or the job script, never how many processes a command was started
as, so it is not read: under PBS the mpiexec's variables above decide.

``RINGMPI_LAUNCH_CHECK=0`` turns the check off (for deliberately independent
single-process copies in one multi-task step, each with its own output).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import NamedTuple, Optional

__all__ = ["LaunchError", "Launch", "launcher_tasks", "launch_problem", "check_launch"]

EXIT_LAUNCH = 2

# (variable, launcher in words, kind); kind picks the fix in the message
_SIZE_VARS = (
    ("OMPI_COMM_WORLD_SIZE", "Open MPI's mpirun", "mpiexec"),
    ("PMI_SIZE", "a PMI process manager (hydra mpiexec or srun --mpi=pmi2)", "mpiexec"),
    ("MV2_COMM_WORLD_SIZE", "MVAPICH's mpirun_rsh", "mpiexec"),
    ("JSM_NAMESPACE_SIZE", "jsrun", "mpiexec"),
    ("FLUX_JOB_SIZE", "flux run", "mpiexec"),
    ("SLURM_STEP_NUM_TASKS", "srun", "srun"),
    ("MPI_LOCALNRANKS", "hydra's mpiexec", "mpiexec"),
)
_RANK_VARS = (
    ("OMPI_COMM_WORLD_RANK", "Open MPI's mpirun", "mpiexec"),
    ("PMI_RANK", "a PMI process manager", "mpiexec"),
    ("PMIX_RANK", "a PMIx launcher (srun --mpi=pmix or prterun)", "mpiexec"),
    ("PALS_RANKID", "HPE PALS mpiexec", "mpiexec"),
    ("ALPS_APP_PE", "Cray aprun", "mpiexec"),
    ("MV2_COMM_WORLD_RANK", "MVAPICH's mpirun_rsh", "mpiexec"),
    ("JSM_NAMESPACE_RANK", "jsrun", "mpiexec"),
    ("FLUX_TASK_RANK", "flux run", "mpiexec"),
    ("SLURM_PROCID", "srun", "srun"),
)
_SLURM_STEP_ONLY = ("SLURM_STEP_NUM_TASKS", "SLURM_PROCID")

_FIX = {
    "srun": "srun --mpi=pmi2 for MPICH or Intel MPI (the PyPI mpich), --mpi=pmix for Open MPI "
    "(see 'srun --mpi=list'; jobs/slurm.sbatch reads RINGMPI_SRUN_MPI), or build mpi4py "
    "against the site MPI",
    "mpiexec": "use the mpiexec of the MPI that mpi4py was built with ('ringmpi info' names "
    "it; with the PyPI mpich: .venv/bin/mpiexec), or build mpi4py against this launcher's MPI",
}


class LaunchError(RuntimeError):
    """The launcher started several tasks but MPI sees only this one."""


class Launch(NamedTuple):
    """What the environment says about how this process was launched."""

    tasks: Optional[int]  # task count announced by the launcher (None: no size variable)
    rank: Optional[int]  # this task's rank in the launcher's numbering (None: none set)
    tasks_var: str  # the variable tasks came from ("" when none)
    rank_var: str  # the variable rank came from ("" when none)
    launcher: str  # the launcher in words (of tasks_var, else of rank_var)
    kind: str  # "srun" or "mpiexec": which fix applies ("" when no launcher)


def _int(env: Mapping[str, str], name: str) -> Optional[int]:
    if name in _SLURM_STEP_ONLY and "SLURM_STEP_ID" not in env:
        return None
    val = env.get(name, "").strip()
    return int(val) if val.isdigit() else None


def _first(env: Mapping[str, str], table) -> tuple:
    for var, who, kind in table:
        n = _int(env, var)
        if n is not None:
            return n, var, who, kind
    return None, "", "", ""


def launcher_tasks(env: Mapping[str, str]) -> Launch:
    """Read the task count and rank the launcher put in the environment.

    Parameters
    ----------
    env : Mapping[str, str]
        The process environment (``os.environ`` or a fake for tests).

    Returns
    -------
    Launch
        ``tasks`` and ``rank`` from the innermost launcher that set them (None
        where none did), their variables, the launcher and which fix applies.
    """
    tasks, tvar, twho, tkind = _first(env, _SIZE_VARS)
    rank, rvar, rwho, rkind = _first(env, _RANK_VARS)
    if tvar == "PMI_SIZE" and tasks == _int(env, "SLURM_STEP_NUM_TASKS"):
        # srun's own PMI-2 server (srun --mpi=pmi2), not an mpiexec inside the step
        twho, tkind = "srun --mpi=pmi2", "srun"
    if tvar:
        return Launch(tasks, rank, tvar, rvar, twho, tkind)
    return Launch(None, rank, "", rvar, rwho, rkind)


def launch_problem(env: Mapping[str, str], world_size: int) -> Optional[str]:
    """The one-line error for a launch whose tasks did not form one communicator, else None.

    Parameters
    ----------
    env : Mapping[str, str]
        The process environment.
    world_size : int
        ``MPI.COMM_WORLD.Get_size()`` of this process.

    Returns
    -------
    str or None
        None when the launch looks right (or the check is off); otherwise the message.
    """
    if env.get("RINGMPI_LAUNCH_CHECK", "1").strip() == "0" or world_size != 1:
        return None
    la = launcher_tasks(env)
    if la.tasks is not None and la.tasks > 1:
        seen = f"{la.launcher} started {la.tasks} tasks ({la.tasks_var}={la.tasks})"
        kind = la.kind
    elif la.rank is not None and la.rank > 0:
        _, _, who, kind = _first(env, _RANK_VARS)
        seen = f"{who} started this task as rank {la.rank} ({la.rank_var}={la.rank})"
    else:
        return None
    return (
        f"{seen} but MPI.COMM_WORLD has 1 rank: the MPI library under mpi4py did not "
        f"connect to the launcher, so each task would run the whole job alone on the same "
        f"output. Fix: {_FIX[kind]}."
    )


def settings_problem(env: Mapping[str, str]) -> Optional[str]:
    """The one-line error for an invalid safety setting (checked before any file), else None."""
    from . import watchdog

    saved = os.environ.get(watchdog.ENV)
    try:
        if watchdog.ENV in env:
            os.environ[watchdog.ENV] = env[watchdog.ENV]
        watchdog.limit()
    except ValueError as e:
        return str(e)
    finally:
        if saved is None:
            os.environ.pop(watchdog.ENV, None)
        else:
            os.environ[watchdog.ENV] = saved
    return path_problem()


def path_problem() -> Optional[str]:
    """The error for a working directory others can write that Python searches first, else None.

    ``python -m ringmpi`` (and ``python -m mpi4py -m ringmpi``) puts the working
    directory first on ``sys.path``: in a shared job directory another user could
    plant a module (``numpy/``) that the job imports. Python >= 3.11 leaves it off
    with ``-P`` or ``PYTHONSAFEPATH=1``; where it is searched and others can write
    it, the job stops.
    """
    if getattr(sys.flags, "safe_path", False):
        return None
    try:
        cwd = os.getcwd()
        st = os.stat(cwd)
    except OSError:
        return None
    searched = any(p in ("", cwd) for p in sys.path[:1])
    if not searched:
        return None
    if st.st_uid == os.geteuid() and not st.st_mode & 0o022:
        return None
    return (
        f"the working directory {cwd} is first on Python's module path and other users can "
        "write it (a planted module would run in this job): run python -P, set "
        "PYTHONSAFEPATH=1, or start the job from a private directory"
    )


def check_launch(comm=None, env: Optional[Mapping[str, str]] = None, *, exit: bool = False):
    """Stop when the launcher started several tasks but ``comm`` has one rank.

    Call it before touching any file. Costs nothing when the launch is right.

    Parameters
    ----------
    comm : mpi4py.MPI.Comm, optional
        The job's world communicator (default ``MPI.COMM_WORLD``).
    env : Mapping[str, str], optional
        The environment to read (default ``os.environ``).
    exit : bool
        Command-line use: instead of raising, the task that the launcher
        numbered 0 (or every task, where none is numbered) prints
        ``ringmpi: error: ...`` on stderr, MPI is finalized, and the process
        exits with status 2, so one line is printed however many tasks run.

    Raises
    ------
    LaunchError
        The launch is broken (``exit=False``).
    """
    if comm is None:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
    env = os.environ if env is None else env
    msg = settings_problem(env) or launch_problem(env, comm.Get_size())
    if msg is None:
        return
    if not exit:
        raise LaunchError(msg)
    rank = launcher_tasks(env).rank
    if not rank:  # 0 or unknown
        sys.stderr.write(f"ringmpi: error: {msg}\n")
        sys.stderr.flush()
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        # a singleton: finalizing is local, and keeps `python -m mpi4py` from
        # turning the exit into an MPI_Abort with its own noise
        mpi.Finalize()
    sys.exit(EXIT_LAUNCH)
