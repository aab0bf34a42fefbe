#!/usr/bin/env bash
# GPU check for a bare single-GPU node: no network, no package registry, an image with
# python3 + CuPy + numpy (torch optional) and an mpi4py wheel but no MPI library, pytest
# or pytest-mpi. What is missing travels with the checkout as wheels in .whl/ (ignored by
# git), made on any machine with network access (15 MB; mpich 13.3 MB, pygments 1.3 MB,
# pytest 0.4 MB, packaging 0.14 MB, pluggy, iniconfig, pytest-timeout, pytest-mpi):
#
#   pip download --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
#       --implementation cp -d .whl mpich pytest pytest-timeout pytest-mpi
#
# The one-line command for the node (the whole check, ~8 minutes at most, results in $OUT):
#
#   GPU_CHECK_OUT=$OUT timeout 540 bash jobs/gpu_check.sh
#
# and, within the same 15 minutes of GPU time, one rerun of what failed, e.g.
#
#   GPU_CHECK_OUT=$OUT GPU_CHECK_STAGES="tests1 staged" GPU_CHECK_BUDGET=200 timeout 260 bash jobs/gpu_check.sh
#
# (.whl/ must travel with the checkout: with the project's device tool, carry [".whl"].)
# Emulated without a GPU (a venv with numpy + mpi4py only, a loopback-only network
# namespace, the CuPy stand-in; every stage runs, results say nothing about CUDA):
#   ip netns add gc && ip netns exec gc ip link set lo up && ip netns exec gc env \
#     PYTHON=/tmp/node/bin/python PYTHONPATH=$PWD/tests/tools/fakecupy CUPY_STANDIN_KERNELS=1 \
#     RINGMPI_KERNEL_CACHE=0 bash jobs/gpu_check.sh; ip netns del gc
#
# Stages (every one under `timeout`; GPU_CHECK_BUDGET seconds in all, default 480, a
# global deadline shortens the later ones; GPU_CHECK_STAGES names a subset):
#   setup     pip install --no-index .whl/* --prefix into a private directory (--target would
#             drop mpich's lib/libmpi.so.12); MPI4PY_LIBMPI and PATH point at it
#   env       CuPy sees a GPU (else exit 2); mpi4py loads an MPI library (else exit 3);
#             ringmpi.gpu.info(); NVRTC and its builtins found (their folder on LD_LIBRARY_PATH)
#   compile   every forward and backward kernel compiles for this GPU (NVRTC, cached)
#   mods      the score modifiers first (tests/gpu/test_tile_device.py -k softcap, one process): softcap
#             and ALiBi in every forward configuration and in the backward kernels against
#             the numpy tile, and ring_attention_backward with them against the dense
#             float64 reference (the rerun of a failure: GPU_CHECK_STAGES=mods)
#   tests1    tests/gpu/test_tile_device.py on one process (tiles, every configuration, rings P=1)
#   ranks     mpiexec -n 2 gives COMM_WORLD size 2
#   staged    the MPI tests of tests/gpu/test_tile_device.py at P=2, staged ring (RINGMPI_CUDA_AWARE=0)
#   aware     the same, CUDA-aware (skipped when MPI does not report CUDA support)
#   bench     one table: TFLOP/s forward and backward beside torch SDPA, every configuration
# pytest runs with -v -rfEs --tb=short --timeout=120 (tests/gpu_runner.py without pytest).
# Results: $GPU_CHECK_OUT (else a new temporary folder): gpu_check.log (everything),
# one log per stage, junit XML per test stage, gpu_bench.json, summary.txt.
# Exit status: 0 every stage passed; 1 a stage failed or timed out; 2 no GPU (CuPy, driver
# or device missing); 3 no MPI (no libmpi for mpi4py, or no mpiexec); 4 setup impossible
# (no python3, an unwritable output folder).
#   Settings: PYTHON, MPIEXEC, GPU_CHECK_OUT, GPU_CHECK_BUDGET, GPU_CHECK_STAGES,
#   GPU_CHECK_WHEELS (default .whl), GPU_CHECK_CACHE (a kernel cache kept between runs),
#   GPU_CHECK_K (pytest -k expression for the test stages, e.g. to rerun one failure),
#   GPU_CHECK_BENCH_ARGS (default --configs).
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 4
PY=${PYTHON:-python3}
command -v "$PY" >/dev/null 2>&1 || { echo "gpu_check: no python ($PY)"; exit 4; }
OUT=${GPU_CHECK_OUT:-}
if [[ -z "$OUT" ]]; then
    OUT=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_out.XXXXXX") || exit 4
fi
mkdir -p "$OUT" && [[ -w "$OUT" ]] || { echo "gpu_check: cannot write to $OUT"; exit 4; }
OUT=$(cd "$OUT" && pwd)

BUDGET=${GPU_CHECK_BUDGET:-480}
STAGES=${GPU_CHECK_STAGES:-compile mods tests1 ranks staged aware bench}
WHEELS=${GPU_CHECK_WHEELS:-.whl}
START=$SECONDS
summary=()
failed=0
standin=0

# private working folder: the carried packages and (unless GPU_CHECK_CACHE) the kernel cache
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX") || exit 4
if [[ -n "${GPU_CHECK_CACHE:-}" ]]; then
    mkdir -p "$GPU_CHECK_CACHE" && chmod 700 "$GPU_CHECK_CACHE" || exit 4
    RINGMPI_CACHE_DIR=$GPU_CHECK_CACHE
else
    RINGMPI_CACHE_DIR=$WORK/cache
    mkdir -m 700 "$RINGMPI_CACHE_DIR" || exit 4
fi
export RINGMPI_CACHE_DIR
trap 'rm -rf "$WORK"' EXIT

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
# Open MPI refuses root and oversubscription unless told; MPICH ignores these
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1

wanted() { [[ " $STAGES " == *" $1 "* ]]; }

# run_stage NAME LIMIT CMD...: CMD under timeout min(LIMIT, time left), its output in
# $OUT/NAME.log too; records PASS/FAIL (exit status, or timed out)
run_stage() {
    local name=$1 limit=$2 left rc t0
    shift 2
    left=$((BUDGET - (SECONDS - START)))
    if ((left < 10)); then
        summary+=("FAIL  $name (no time left in the ${BUDGET}s budget)")
        failed=1
        return 1
    fi
    ((limit > left)) && limit=$left
    echo
    echo "=== $name (limit ${limit}s, $(date +%T)) ==="
    t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    rc=${PIPESTATUS[0]}
    if ((rc == 0)); then
        summary+=("PASS  $name ($((SECONDS - t0))s)")
    elif ((rc == 124 || rc == 137)); then
        local last
        last=$(grep -E '::test_|^(PASS|FAIL|SKIP) ' "$OUT/$name.log" | tail -1 | cut -c1-120)
        summary+=("FAIL  $name (timed out after ${limit}s${last:+; last: $last})")
        failed=1
    else
        summary+=("FAIL  $name (exit $rc, $((SECONDS - t0))s)")
        failed=1
    fi
    return "$rc"
}

skip_stage() {
    summary+=("SKIP  $1 ($2)")
    echo
    echo "=== $1: SKIPPED ($2) ==="
}

finish() {  # finish EXIT_STATUS: print and save the summary, then exit
    local status=$1
    {
        echo
        echo "=== gpu_check summary ($((SECONDS - START))s; results in $OUT) ==="
        ((standin)) && echo "EMULATION: CuPy is the ringmpi CPU stand-in; no CUDA code ran"
        printf '%s\n' "${summary[@]}"
        case $status in
            0) echo "gpu_check: PASS (every stage)" ;;
            2) echo "gpu_check: NO GPU (exit 2)" ;;
            3) echo "gpu_check: NO MPI (exit 3)" ;;
            *) echo "gpu_check: FAILED (exit $status)" ;;
        esac
    } | tee "$OUT/summary.txt"
    exit "$status"
}

main() {
    echo "gpu_check: $(date -u +%FT%TZ) on $(hostname); results in $OUT; stages: $STAGES"

    # --- setup: the carried wheels, installed with --prefix (keeps lib/libmpi.so.12) ------
    local prefix=$WORK/prefix site
    if compgen -G "$WHEELS/*.whl" >/dev/null; then
        run_stage setup 90 "$PY" -m pip install --no-index --no-warn-script-location \
            --disable-pip-version-check -q --find-links "$WHEELS" --prefix "$prefix" \
            "$WHEELS"/*.whl
        site=$("$PY" -c 'import sys, sysconfig
print(sysconfig.get_path("purelib", vars={"base": sys.argv[1], "platbase": sys.argv[1]}))' "$prefix")
        export PYTHONPATH="$PYTHONPATH:$site"
        export PATH="$prefix/bin:$PATH"
        if [[ -e "$prefix/lib/libmpi.so.12" && -z "${MPI4PY_LIBMPI:-}" ]]; then
            export MPI4PY_LIBMPI=$prefix/lib/libmpi.so.12
        fi
    else
        skip_stage setup "no wheels in $WHEELS: the image's own packages only"
    fi

    # --- env: GPU, MPI, ringmpi, NVRTC --------------------------------------------------
    echo
    echo "=== env ($(date +%T)) ==="
    timeout 60 "$PY" - <<'PYEOF' 2>&1 | tee "$OUT/env.log"
import sys

try:
    import cupy

    n = cupy.cuda.runtime.getDeviceCount()
except Exception as exc:
    print(f"gpu_check: no usable GPU: CuPy/CUDA unavailable ({type(exc).__name__}: {exc})")
    sys.exit(2)
if n < 1:
    print("gpu_check: no usable GPU: CuPy sees no CUDA device")
    sys.exit(2)
print(f"CuPy {cupy.__version__} from {cupy.__file__}: {n} device(s)")
if getattr(cupy, "STANDIN", False):
    print("EMULATION: this CuPy is the ringmpi CPU stand-in (tests/tools/fakecupy), not a GPU")
PYEOF
    local rc=${PIPESTATUS[0]}
    if ((rc != 0)); then
        summary+=("FAIL  env (no GPU: exit $rc)")
        finish 2
    fi
    grep -q '^EMULATION' "$OUT/env.log" && standin=1
    timeout 60 "$PY" - <<'PYEOF' 2>&1 | tee -a "$OUT/env.log"
import os
import sys

try:
    from mpi4py import MPI

    print(f"mpi4py: {MPI.Get_library_version().splitlines()[0]}")
except Exception as exc:
    lib = os.environ.get("MPI4PY_LIBMPI", "(MPI4PY_LIBMPI unset)")
    print(f"gpu_check: no MPI library for mpi4py ({type(exc).__name__}: {exc}); tried {lib}")
    sys.exit(3)
PYEOF
    rc=${PIPESTATUS[0]}
    if ((rc != 0)); then
        summary+=("FAIL  env (no MPI: exit $rc)")
        finish 3
    fi
    timeout 90 "$PY" - <<'PYEOF' 2>&1 | tee -a "$OUT/env.log"
import json
import traceback

try:
    import ringmpi.gpu as g

    print(json.dumps(g.info(), indent=1, default=str))
except Exception:
    traceback.print_exc()
    raise SystemExit(1)
try:
    from ringmpi.gpu import nvrtc

    ver = ".".join(map(str, nvrtc.version()))
    print(f"NVRTC {ver}: {nvrtc.find_library()}; builtins {nvrtc.BUILTINS or 'system loader'}")
    print("NVRTC_DIR=" + __import__("os").path.dirname(__import__("os").path.realpath(
        nvrtc.find_library())))  # fmt: skip
except Exception as exc:
    print(f"no standalone NVRTC ({type(exc).__name__}: {exc}): kernels compile through CuPy")
PYEOF
    rc=${PIPESTATUS[0]}
    if ((rc != 0)); then
        summary+=("FAIL  env (import ringmpi.gpu failed: exit $rc)")
        finish 1
    fi
    local nvdir
    nvdir=$(sed -n 's/^NVRTC_DIR=//p' "$OUT/env.log" | tail -1)
    if [[ -n "$nvdir" ]]; then  # CuPy's own NVRTC looks for the builtins by name too
        export LD_LIBRARY_PATH="$nvdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    fi
    summary+=("PASS  env (GPU, MPI, ringmpi.gpu)")
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || true

    # the tests: pytest when it imports, else the project's runner
    local tests mpitests
    if "$PY" -c "import pytest, pytest_timeout" 2>/dev/null; then
        tests=(-m pytest -v -rfEs --tb=short --timeout=120 -p no:cacheprovider)
        mpitests=("${tests[@]}")
        if "$PY" -c "import pytest_mpi" 2>/dev/null; then
            mpitests+=(--with-mpi)
        fi
        echo "tests run under pytest"
    else
        tests=(tests/gpu_runner.py --require-run)
        mpitests=("${tests[@]}")
        echo "pytest (with pytest-timeout) not found: tests run under tests/gpu_runner.py"
    fi
    local junit=()
    [[ ${tests[1]} == pytest ]] && junit=(--junitxml)
    if [[ -n "${GPU_CHECK_K:-}" ]]; then
        tests+=(-k "$GPU_CHECK_K")
        mpitests+=(-k "$GPU_CHECK_K")
    fi

    if wanted compile; then
        run_stage compile 150 "$PY" - <<'PYEOF'
import sys
import traceback

try:
    import cupy

    from ringmpi.gpu import backward, device, loader, tile
except Exception:
    traceback.print_exc()
    sys.exit(1)
dev = device.current()
print(f"device {device.name(dev)}, sm_{device.check_arch(dev)}, "
      f"{device.smem_optin(dev)} B shared memory per block (opt-in)")
bad = 0
for files, names in ((tile.KERNEL_FILE, tile.kernel_names()),
                     (backward.KERNEL_FILES, backward.kernel_names())):
    try:
        res = loader.precompile(files, names, dev)
    except Exception as exc:  # no standalone libnvrtc: CuPy compiles each kernel instead
        print(f"precompile unavailable ({type(exc).__name__}: {exc}); loading through CuPy")
        res = {}
    for n in names:
        try:
            loader.get_function(files, n, names)
        except Exception as exc:
            bad += 1
            print(f"FAILED {n}: {res.get(n, '')} {type(exc).__name__}: {exc}")
    how = {}
    for n in names:
        key = loader.last_path.get(n, "?").split(":")[0]
        how[key] = how.get(key, 0) + 1
    print(f"{files}: {len(names)} kernels loaded ({how})")
    for n in names:
        if loader.last_path.get(n, "").startswith("cupy:"):
            print(f"  {n}: {loader.last_path[n]}")
            break
cupy.cuda.Device().synchronize()
sys.exit(1 if bad else 0)
PYEOF
    fi
    if wanted mods; then  # before tests1, so a slow tests1 cannot crowd them out
        local modk=(-k softcap)
        [[ -n "${GPU_CHECK_K:-}" ]] && modk=()  # GPU_CHECK_K is already in tests
        run_stage mods 120 "$PY" "${tests[@]}" ${junit:+"${junit[0]}=$OUT/mods.xml"} \
            -m "not mpi" "${modk[@]}" tests/gpu/test_tile_device.py
    fi
    if wanted tests1; then
        run_stage tests1 200 "$PY" "${tests[@]}" ${junit:+"${junit[0]}=$OUT/tests1.xml"} \
            -m "not mpi" tests/gpu/test_tile_device.py
    fi

    local mpiexec=${MPIEXEC:-}
    if [[ -z "$mpiexec" ]]; then
        local pydir
        pydir=$(dirname "$("$PY" -c 'import sys; print(sys.executable)')")
        for c in "$(command -v mpiexec)" "$pydir/mpiexec" "$(command -v mpirun)"; do
            [[ -n "$c" && -x "$c" ]] && { mpiexec=$c; break; }
        done
    fi
    local two=(ranks staged aware) s
    if [[ -z "$mpiexec" ]]; then
        for s in "${two[@]}"; do wanted "$s" && summary+=("FAIL  $s (no mpiexec: not on PATH, not beside $PY)"); done
        finish 3
    fi
    echo "mpiexec: $mpiexec"
    local ranks_ok=1
    if wanted ranks || wanted staged || wanted aware; then
        run_stage ranks 45 "$mpiexec" -n 2 "$PY" -c '
from mpi4py import MPI
size = MPI.COMM_WORLD.Get_size()
assert size == 2, f"mpiexec -n 2 gave COMM_WORLD size {size}: mpi4py and mpiexec do not match"
print(f"rank {MPI.COMM_WORLD.Get_rank()} of {size}: {MPI.Get_library_version().splitlines()[0]}")
' || ranks_ok=0
    fi
    if ((ranks_ok)); then
        if wanted staged; then
            RINGMPI_CUDA_AWARE=0 run_stage staged 120 "$mpiexec" -n 2 "$PY" -m mpi4py \
                "${mpitests[@]}" ${junit:+"${junit[0]}=$OUT/staged.xml"} -m mpi tests/gpu/test_tile_device.py
        fi
        if wanted aware; then
            if timeout 60 "$PY" -c 'import sys; from ringmpi.gpu import cuda_aware; sys.exit(0 if cuda_aware() else 1)' 2>/dev/null; then
                RINGMPI_CUDA_AWARE=1 run_stage aware 120 "$mpiexec" -n 2 "$PY" -m mpi4py \
                    "${mpitests[@]}" ${junit:+"${junit[0]}=$OUT/aware.xml"} -m mpi tests/gpu/test_tile_device.py
            else
                skip_stage aware "this MPI does not report CUDA support"
            fi
        fi
    else
        for s in staged aware; do wanted "$s" && skip_stage "$s" "mpiexec -n 2 did not give two ranks"; done
    fi

    if wanted bench; then
        local bargs
        read -ra bargs <<<"${GPU_CHECK_BENCH_ARGS:---configs}"
        run_stage bench 150 "$PY" -m ringmpi.gpu.bench "${bargs[@]}" --json "$OUT/gpu_bench.json"
    fi
    finish "$failed"
}

main 2>&1 | tee "$OUT/gpu_check.log"
exit "${PIPESTATUS[0]}"
