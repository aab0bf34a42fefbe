#!/usr/bin/env bash
# GPU check for a single-GPU machine without internet: GPU tests at 1 and 2 ranks
# (two ranks share the GPU), then the forward benchmark (bf16/fp16, D = 64 and 128,
# N = 4096 and 16384, causal and not; beside torch SDPA when torch imports).
# Needs python3 with cupy, mpi4py and pytest; torch, pytest-mpi and h5py are optional.
# ringmpi is used from this checkout through PYTHONPATH (nothing is installed).
# Finishes in under 8 minutes: every stage has its own timeout.
#   usage: bash jobs/gpu_check.sh          (PYTHON=... to pick the interpreter)
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=1
# Open MPI refuses root and oversubscription unless told; MPICH ignores these
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1
failed=()

stage() {
    echo
    echo "=== $1 ($(date +%T)) ==="
}

stage "environment"
"$PY" - <<'PYEOF' || failed+=("environment")
import json
import ringmpi.gpu as g
print(json.dumps(g.info(), indent=1, default=str))
PYEOF
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || true

stage "NVRTC compile check (registers and spills)"
timeout 120 "$PY" -m ringmpi.gpu.nvrtc sm_90 || echo "(no standalone libnvrtc here; CuPy compiles at run time)"

stage "GPU tests, one process"
timeout 240 "$PY" -m pytest -q -p no:cacheprovider -rs tests/test_gpu.py || failed+=("tests P=1")

stage "GPU tests, two ranks on one GPU"
MPIEXEC=$(command -v mpiexec || command -v mpirun || true)
mpi_flag=()
if "$PY" -c "import pytest_mpi" 2>/dev/null; then
    mpi_flag=(--with-mpi)
fi
if [[ -n "$MPIEXEC" ]]; then
    timeout 150 "$MPIEXEC" -n 2 "$PY" -m mpi4py -m pytest -q -p no:cacheprovider -rs \
        "${mpi_flag[@]}" -m mpi tests/test_gpu.py || failed+=("tests P=2")
else
    echo "no mpiexec on PATH: two-rank tests NOT run"
    failed+=("tests P=2 (no mpiexec)")
fi

stage "forward benchmark"
timeout 180 "$PY" -m ringmpi.gpu.bench --json gpu_bench.json || failed+=("benchmark")

echo
if ((${#failed[@]})); then
    echo "gpu_check: FAILED: ${failed[*]}"
    exit 1
fi
echo "gpu_check: all stages passed"
