#!/usr/bin/env bash
# PBS Pro / Torque job for ringmpi (mpiexec from the MPI that mpi4py was built with:
# MPIEXEC, else the one next to PYTHON, else mpiexec on PATH).
#
#   qsub -v ARGS="in.h5 -o out.h5 --causal" jobs/pbs.sh
#   qsub -l select=2:ncpus=32:mpiprocs=32 -v ARGS="'shards/*.h5' -o out.h5 --resume" jobs/pbs.sh
#   qsub -l select=2:ngpus=4:mpiprocs=4 -v ARGS="in.h5 -o out.h5",DEVICE=gpu jobs/pbs.sh
#
# The output must be on a file system every node sees.
#PBS -N ringmpi
#PBS -l select=1:ncpus=4:mpiprocs=4
#PBS -l walltime=01:00:00
#PBS -j oe
set -euo pipefail

cd "${PBS_O_WORKDIR:-.}"
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
# the mpiexec next to PYTHON (the venv's, from the PyPI mpich), else the one on PATH
if [[ -z "${MPIEXEC:-}" ]]; then
    MPIEXEC="$(dirname "$(command -v "$PYTHON")")/mpiexec"
    [[ -x "$MPIEXEC" ]] || MPIEXEC=mpiexec
fi
if ! command -v "$MPIEXEC" >/dev/null; then
    echo "pbs.sh: no mpiexec next to $PYTHON nor on PATH: 'module load' the MPI that" \
        "mpi4py was built with, or set MPIEXEC" >&2
    exit 1
fi

# ranks = lines of the node file (one per mpiproc)
nranks=1
if [[ -n "${PBS_NODEFILE:-}" && -r "${PBS_NODEFILE}" ]]; then
    nranks="$(wc -l < "$PBS_NODEFILE")"
fi

export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export OPENBLAS_NUM_THREADS="$OMP_NUM_THREADS"
export MKL_NUM_THREADS="$OMP_NUM_THREADS"
export CUPY_CACHE_DIR="${CUPY_CACHE_DIR:-${TMPDIR:-/tmp}/cupy-cache-${USER:-$(id -u)}}"
mkdir -p "$CUPY_CACHE_DIR"

# ARGS is one string from `qsub -v`; split it like a shell command line would.
eval "set -- ${ARGS:?set ARGS, e.g. qsub -v ARGS=\"in.h5 -o out.h5\" jobs/pbs.sh}"

echo "ringmpi: $nranks ranks, device ${DEVICE:-auto}"
exec "$MPIEXEC" -n "$nranks" "$PYTHON" -m mpi4py -m ringmpi run --device "${DEVICE:-auto}" "$@"
