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
# The cache holds code that runs in this job: only a directory of this user that
# nobody else can write (made here with mkdir -m 700, which fails on an existing
# name, or checked when it exists). A CUPY_CACHE_DIR set by the user that fails the
# check stops the job; the default one falls back to a fresh mktemp -d directory.
private_cache() {  # private_cache DIR: 0 if DIR is (now) ours and mode 700
    local dir="$1" info
    mkdir -m 700 "$dir" 2>/dev/null && return 0
    [[ -d "$dir" && ! -L "$dir" ]] || return 1
    info="$(stat -c '%u %a' "$dir")" || return 1
    [[ "$info" == "$(id -u) 700" ]]
}
if [[ -n "${CUPY_CACHE_DIR:-}" ]]; then
    if ! private_cache "$CUPY_CACHE_DIR"; then
        echo "ringmpi: CUPY_CACHE_DIR=$CUPY_CACHE_DIR is not a directory of $(id -un) with" \
            "mode 700 (another user could plant kernels in it): fix it or unset it" >&2
        exit 2
    fi
else
    CUPY_CACHE_DIR="${TMPDIR:-/tmp}/cupy-cache-$(id -u)"
    if ! private_cache "$CUPY_CACHE_DIR"; then
        echo "ringmpi: $CUPY_CACHE_DIR is not this user's private directory: using a" \
            "fresh one for this job" >&2
        CUPY_CACHE_DIR="$(mktemp -d "${TMPDIR:-/tmp}/cupy-cache-XXXXXXXX")"
    fi
fi
export CUPY_CACHE_DIR
# python -m ... would import from the working directory first (a planted numpy/
# there would run in the job): Python >= 3.11 leaves it off sys.path with this.
export PYTHONSAFEPATH=1

# ARGS is one string from `qsub -v`: split it with shell quoting rules (shlex), but
# never evaluate it (no $(...), no globbing, no variable expansion).
: "${ARGS:?set ARGS, e.g. qsub -v ARGS=\"in.h5 -o out.h5\" jobs/pbs.sh}"
mapfile -d '' -t args < <("$PYTHON" -c \
    'import shlex, sys; sys.stdout.write("".join(a + "\0" for a in shlex.split(sys.argv[1])))' \
    "$ARGS")
set -- "${args[@]}"

echo "ringmpi: $nranks ranks, device ${DEVICE:-auto}"
exec "$MPIEXEC" -n "$nranks" "$PYTHON" -m mpi4py -m ringmpi run --device "${DEVICE:-auto}" "$@"
