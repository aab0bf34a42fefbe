#!/usr/bin/env bash
# Run ringmpi on this machine with mpiexec.
#
#   jobs/local.sh [-n RANKS] INPUT... -o OUTPUT [ringmpi run options]
#   jobs/local.sh -n 4 data/sample/sample.h5 -o data/sample/out.h5 --causal --verify
#
# With no arguments it makes the sample data (if missing) and runs it.
# Environment: NP (ranks, default 4), MPIEXEC (default: the one next to PYTHON,
# else mpiexec on PATH), PYTHON (default: .venv/bin/python, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."

np_ranks="${NP:-4}"
if [[ "${1:-}" == "-n" ]]; then
    np_ranks="$2"
    shift 2
fi

if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
if [[ -z "${MPIEXEC:-}" ]]; then
    MPIEXEC="$(dirname "$PYTHON")/mpiexec"
    [[ -x "$MPIEXEC" ]] || MPIEXEC=mpiexec
fi

# one BLAS/OpenMP thread per rank: the ranks share the cores
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-1}"
export MKL_NUM_THREADS="${MKL_NUM_THREADS:-1}"

if [[ $# -eq 0 ]]; then
    if [[ ! -f data/sample/sample.h5 ]]; then
        "$PYTHON" -m ringmpi make-data data/sample/sample.h5 --sequences 3
    fi
    set -- data/sample/sample.h5 -o data/sample/out.h5 --causal --verify
fi

# `python -m mpi4py` turns an uncaught exception on any rank into MPI_Abort
exec "$MPIEXEC" -n "$np_ranks" "$PYTHON" -m mpi4py -m ringmpi run "$@"
