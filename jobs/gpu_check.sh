#!/usr/bin/env bash
# GPU check for a bare single-GPU node: no network, no package registry, an image with
# python3 + CuPy + numpy (torch optional) and an mpi4py wheel but no MPI library, pytest
# or pytest-mpi. What is missing travels with the checkout as wheels in .whl/ (ignored by
# git), made on any machine with network access (15 MB; mpich 13.3 MB, pygments 1.3 MB,
# pytest 0.4 MB, packaging 0.14 MB, pluggy, iniconfig, pytest-timeout, pytest-mpi; the
# wheels are pure Python, mpich's is tagged py3-none, so they serve every Python 3):
#
#   pip download --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
#       --implementation cp -d .whl mpich pytest pytest-timeout pytest-mpi
#
# On Python 3.10 (and older) pytest also needs exceptiongroup and tomli (and exceptiongroup
# typing-extensions). pip download evaluates those markers with the Python that runs it,
# not --python-version, so a download on 3.11+ leaves them out: name them (70 kB):
#
#   pip download --only-binary=:all: -d .whl exceptiongroup tomli typing-extensions
#
# Check the carried wheels with a Python of the node's version (no GPU needed; the setup
# stage installs mpich alone, then the test tools, and says in one line what is missing):
#
#   PYTHON=python3.10 GPU_CHECK_STAGES=setup bash jobs/gpu_check.sh
#
# The one-line command for the node (the whole check, ~8 minutes at most, results in $OUT):
#
#   GPU_CHECK_OUT=$OUT GPU_CHECK_CACHE=out/gpu_kernel_cache timeout 540 bash jobs/gpu_check.sh
#
# and, within the same 15 minutes of GPU time, one rerun of what failed, e.g.
#
#   GPU_CHECK_OUT=$OUT GPU_CHECK_CACHE=out/gpu_kernel_cache GPU_CHECK_STAGES="tests1 staged" \
#       GPU_CHECK_BUDGET=200 timeout 260 bash jobs/gpu_check.sh
#
# The kernel cache (compiled cubins, checked by SHA-256 before loading) is kept between
# runs: by default under the output folder ($GPU_CHECK_OUT/kernel_cache); where $OUT is a
# new folder for each call (the project's device tool), name one kept between calls, as
# above (out/ is ignored by git and stays on a warm machine). The compile stage always
# runs first and reports its cache hits ("compile: 93 from the cache, 0 compiled"), so a
# rerun neither compiles in the test stages nor once per rank under mpiexec.
# (.whl/ must travel with the checkout: with the project's device tool, carry [".whl"].)
#
# FIRST THING TO MEASURE on a device (issue 39, item 9; planned, not built: it cannot be
# checked without one). The dK/dV backward grid is (ceil(Sk/64), Hkv, B): with one or two
# K/V heads and a short ring block (Hkv = 1, B = 1, Sk = 4096: 64 CTAs on 132 SMs) most of
# an H100/H200 idles. Measure first, on the warm machine after this check:
#   python -m ringmpi.gpu.bench --configs   (backward TFLOP/s beside the forward's)
# for H = 8, Hkv = 1 and 2, B = 1, Sk = 4096 and 16384; if the backward falls well
# below the forward at Hkv = 1, build the split. The plan: each dK/dV CTA loops over the
# (query head g, query block) pairs it sees, in order; cut that sequence into C
# contiguous runs, C = min(ceil(2 SMs / (ceil(Sk/64) Hkv B)), pairs), as a third grid
# factor (grid (ceil(Sk/64), Hkv, B C)); CTA c sums its run into an fp32 partial
# [C][B][Hkv][Sk][D] for dK and for dV, and a second kernel adds the partials in run
# order (c = 0, 1, ...) into the dK, dV accumulators as the flush does now. No atomics:
# the order of every sum is fixed, so the result is the same from run to run; it
# differs from the unsplit kernel only by where the runs' sums are grouped, inside the
# tolerance of tests/gpu/test_tile_device.py. How to check it keeps the order: run the
# split twice and require bitwise equal dK, dV; force C = 1 and require bitwise equal
# to the unsplit kernel; and give the stand-in (tests/tools/standin_kernels.py) the
# same runs (numpy tile per run, partials added in run order) so the plan and the
# launch are tested on the CPU like every other kernel.
#
# Emulated without a GPU (a system Python, not a venv, whose image holds numpy, mpi4py
# and NVRTC; a loopback-only network namespace): as is, every GPU stage says "NO GPU"
# and the others run; with the CuPy stand-in (PYTHONPATH=$PWD/tests/tools/fakecupy
# CUPY_STANDIN_KERNELS=1) every stage runs and says nothing about CUDA, except that
# the compile stage compiles the real kernels with NVRTC for the stand-in's sm_90
# (RINGMPI_KERNEL_CACHE=0 skips that: tests/gpu/test_gpu_check.py):
#   ip netns add gc && ip netns exec gc ip link set lo up && ip netns exec gc env \
#     PYTHON=/usr/bin/python3 PYTHONPATH=/tmp/image bash jobs/gpu_check.sh; ip netns del gc
#
# Stages (every one under `timeout`; GPU_CHECK_BUDGET seconds in all, default 480, a
# global deadline shortens the later ones; GPU_CHECK_STAGES names a subset of the test
# stages; setup, mpi, gpu and compile always run). A stage that cannot run says why and
# the next one still runs; the summary gives one verdict per stage: PASS, FAIL, SKIP
# (with the reason), NO GPU or NO MPI.
#   setup     mpich alone (pip install --no-index --no-deps --prefix, into a private
#             folder; --target would drop lib/libmpi.so.12), then pytest, pytest-timeout
#             and pytest-mpi from .whl; the site, scripts and data folders come from
#             sysconfig for that prefix (Debian's python3 uses P/local/...), else a search
#             of the prefix; MPI4PY_LIBMPI and PATH point at them. A missing dependency
#             is named in one line and the tests then run under tests/gpu_runner.py
#   mpi       mpi4py loads an MPI library, and an mpiexec is found (else NO MPI: only
#             ranks, staged and aware need it)
#   gpu       CuPy sees a GPU (else NO GPU for every stage that needs one); the compute
#             mode (nvidia-smi -q -d COMPUTE): in Exclusive_Process mode two ranks cannot
#             share a GPU, so staged and aware run one rank per GPU, or are skipped with
#             that reason on a one-GPU node; ringmpi.gpu.info(); NVRTC and its builtins
#   compile   every forward and backward kernel compiles for this GPU (NVRTC, cached)
#   mods      the score modifiers first (tests/gpu/test_tile_device.py -k softcap, one
#             process): softcap and ALiBi in every forward configuration and in the
#             backward kernels against the numpy tile, and ring_attention_backward with
#             them against the dense float64 reference
#   tests1    tests/gpu/test_tile_device.py on one process (tiles, every configuration, rings P=1)
#   ranks     mpiexec -n 2 gives COMM_WORLD size 2 (MPI only, no GPU)
#   staged    the MPI tests of tests/gpu/test_tile_device.py at P=2, staged ring (RINGMPI_CUDA_AWARE=0)
#   aware     the same, CUDA-aware (skipped when MPI does not report CUDA support)
#   bench     one table: TFLOP/s forward and backward beside torch SDPA, every configuration
# pytest runs with -v -rfEs --tb=short --timeout=120 (tests/gpu_runner.py without pytest).
# Results: $GPU_CHECK_OUT (else a new temporary folder): gpu_check.log (everything),
# one log per stage, junit XML per test stage (NAME.xml; NAME.rankR.xml, one per rank,
# under mpiexec), gpu_bench.json, summary.txt (the verdict table), kernel_cache/.
# Exit status: 0 no stage failed (a skip says why); 1 a stage failed or timed out; 2 no
# GPU (CuPy, driver or device missing); 3 no MPI (no libmpi for mpi4py, or no mpiexec);
# 4 setup impossible (no python3, an unwritable output folder).
#   Settings: PYTHON, MPIEXEC, GPU_CHECK_OUT, GPU_CHECK_BUDGET, GPU_CHECK_STAGES,
#   GPU_CHECK_WHEELS (default .whl), GPU_CHECK_CACHE (the kernel cache, kept between runs;
#   default $GPU_CHECK_OUT/kernel_cache), GPU_CHECK_K (pytest -k expression for the test
#   stages, e.g. to rerun one failure), GPU_CHECK_BENCH_ARGS (default --configs),
#   GPU_CHECK_SLOW (integer factor on every stage's limit, default 1: emulation on a
#   slow CPU).
set -uo pipefail

# One rank of a multi-rank stage (mpiexec -n 2 bash jobs/gpu_check.sh --rank XML CMD...):
# its own junit file (XML with .rankR before .xml; none when XML is empty) and, where
# GPU_CHECK_RANK_GPUS lists GPUs (exclusive-process mode), a GPU of its own.
if [[ ${1:-} == --rank ]]; then
    rank=${PMI_RANK:-${OMPI_COMM_WORLD_RANK:-${PMIX_RANK:-${SLURM_PROCID:-0}}}}
    xml=$2
    shift 2
    if [[ -n ${GPU_CHECK_RANK_GPUS:-} ]]; then
        IFS=, read -ra gpus <<<"$GPU_CHECK_RANK_GPUS"
        export CUDA_VISIBLE_DEVICES=${gpus[rank % ${#gpus[@]}]}
    fi
    if [[ -n $xml ]]; then
        exec "$@" "--junitxml=${xml%.xml}.rank$rank.xml"
    fi
    exec "$@"
fi

SCRIPT=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")
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
SLOW=${GPU_CHECK_SLOW:-1}
[[ $SLOW =~ ^[1-9][0-9]*$ ]] || { echo "gpu_check: GPU_CHECK_SLOW=$SLOW is no positive integer"; exit 4; }
STAGES=${GPU_CHECK_STAGES:-mods tests1 ranks staged aware bench}
WHEELS=${GPU_CHECK_WHEELS:-.whl}
ALL_STAGES=(setup mpi gpu compile mods tests1 ranks staged aware bench)
START=$SECONDS
declare -A verdict=() reason=()
failed=0
standin=0
have_gpu=0
have_mpi=0

# the kernel cache: kept between runs (under the output folder unless named), private
CACHE=${GPU_CHECK_CACHE:-$OUT/kernel_cache}
if ! mkdir -p "$CACHE" || ! chmod 700 "$CACHE"; then
    echo "gpu_check: cannot make the kernel cache $CACHE"
    exit 4
fi
CACHE=$(cd "$CACHE" && pwd)
export RINGMPI_CACHE_DIR=$CACHE
# private working folder: the carried packages, removed at exit
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX") || exit 4
trap 'rm -rf "$WORK"' EXIT

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
# Open MPI refuses root and oversubscription unless told; MPICH ignores these
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1

wanted() { [[ " $STAGES " == *" $1 "* ]]; }

# record NAME VERDICT [WHY]: the stage's line of the summary (the first one given stays)
record() {
    [[ -n ${verdict[$1]:-} ]] && return 0
    verdict[$1]=$2
    reason[$1]=${3:-}
    [[ $2 == FAIL ]] && failed=1
    return 0
}

# not_run NAME VERDICT WHY: a stage that cannot run says why (the next one still runs)
not_run() {
    record "$1" "$2" "$3"
    echo
    echo "=== $1: $2 ($3) ==="
}

# run_stage NAME LIMIT CMD...: CMD under timeout min(LIMIT * SLOW, time left), its output
# in $OUT/NAME.log too; records PASS/FAIL (exit status, or timed out)
run_stage() {
    local name=$1 limit=$(($2 * SLOW)) left rc t0 note
    shift 2
    left=$((BUDGET - (SECONDS - START)))
    if ((left < 10)); then
        record "$name" FAIL "no time left in the ${BUDGET}s budget"
        return 1
    fi
    ((limit > left)) && limit=$left
    echo
    echo "=== $name (limit ${limit}s, $(date +%T)) ==="
    t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    rc=${PIPESTATUS[0]}
    note=$(sed -n 's/^gpu_check-note: //p' "$OUT/$name.log" | tail -1)
    if ((rc == 0)); then
        record "$name" PASS "$((SECONDS - t0))s${note:+; $note}"
    elif ((rc == 124 || rc == 137)); then
        local last
        last=$(grep -E '::test_|^(PASS|FAIL|SKIP) ' "$OUT/$name.log" | tail -1 | cut -c1-100)
        record "$name" FAIL "timed out after ${limit}s${last:+; last: $last}"
    else
        record "$name" FAIL "exit $rc, $((SECONDS - t0))s${note:+; $note}"
    fi
    return "$rc"
}

finish() {  # print and save the verdict table, then exit with the run's status
    local status=0 s
    if ((failed)); then
        status=1
    elif ((!have_gpu)); then
        status=2
    elif ((!have_mpi)); then
        status=3
    fi
    {
        echo
        echo "=== gpu_check summary ($((SECONDS - START))s; results in $OUT) ==="
        ((standin)) && echo "EMULATION: CuPy is the ringmpi CPU stand-in; no CUDA code ran"
        printf '%-8s %-7s %s\n' stage verdict why
        for s in "${ALL_STAGES[@]}"; do
            printf '%-8s %-7s %s\n' "$s" "${verdict[$s]:-SKIP}" "${reason[$s]:-not reached}"
        done
        case $status in
            0) echo "gpu_check: PASS (no stage failed; skips are in the table)" ;;
            2) echo "gpu_check: NO GPU (exit 2)" ;;
            3) echo "gpu_check: NO MPI (exit 3)" ;;
            *) echo "gpu_check: FAILED (exit $status)" ;;
        esac
    } | tee "$OUT/summary.txt"
    exit "$status"
}

# setup_stage: the carried wheels, installed with --prefix into $WORK/prefix
setup_stage() {
    local prefix=$WORK/prefix mpich ver paths log=$OUT/setup.log why=() k v lib
    : >"$log"
    echo
    echo "=== setup ($(date +%T)) ==="
    if ! compgen -G "$WHEELS/*.whl" >/dev/null; then
        not_run setup SKIP "no wheels in $WHEELS: the image's own packages only"
        return 0
    fi
    ver=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    if ! "$PY" -m pip --version >>"$log" 2>&1; then
        not_run setup FAIL "Python $ver ($PY) has no pip: the carried wheels cannot be installed"
        return 0
    fi
    local pip=("$PY" -m pip install --no-index --no-warn-script-location
        --disable-pip-version-check -q --prefix "$prefix")
    mpich=$(compgen -G "$WHEELS/mpich-*.whl" | sort -V | tail -1)
    if [[ -z "$mpich" ]]; then
        why+=("no mpich wheel in $WHEELS")
    elif ! timeout $((90 * SLOW)) "${pip[@]}" --no-deps "$mpich" >>"$log" 2>&1; then
        why+=("mpich did not install (setup.log)")
    fi
    if ! timeout $((90 * SLOW)) "${pip[@]}" --find-links "$WHEELS" pytest pytest-timeout \
        pytest-mpi >>"$log" 2>&1; then
        # pip names the first missing one; pytest's markers need these three below 3.11
        local missing need
        missing=$(sed -n 's/.*No matching distribution found for \([A-Za-z0-9_.-]*\).*/\1/p' "$log")
        if "$PY" -c 'import sys; sys.exit(sys.version_info >= (3, 11))'; then
            missing+=$'\nexceptiongroup\ntomli\ntyping-extensions'
        fi
        need=$(sort -u <<<"$missing" | xargs)
        why+=("pytest not installed on Python $ver (setup.log): carry ${need:-its dependencies}: pip download --only-binary=:all: -d $WHEELS ${need:-...}; the tests run under tests/gpu_runner.py")
        echo "gpu_check: ${why[-1]}"
    fi
    # where this Python's pip put them: the scheme sysconfig gives for this prefix
    # (Debian's python3: P/local/lib/python3.X/dist-packages, P/local/bin, P/local)
    paths=$("$PY" - "$prefix" <<'PYEOF'
import sys
import sysconfig

v = {"base": sys.argv[1], "platbase": sys.argv[1]}
for k in ("purelib", "platlib", "scripts", "data"):
    print(k, sysconfig.get_path(k, vars=v))
PYEOF
    )
    echo "$paths" >>"$log"
    declare -A at=()
    while read -r k v; do at[$k]=$v; done <<<"$paths"
    export PYTHONPATH="$PYTHONPATH:${at[purelib]}"
    [[ ${at[platlib]} != "${at[purelib]}" ]] && export PYTHONPATH="$PYTHONPATH:${at[platlib]}"
    export PATH="${at[scripts]}:$PATH"
    if [[ -n "$mpich" && -z "${MPI4PY_LIBMPI:-}" ]]; then
        lib=${at[data]}/lib/libmpi.so.12
        if [[ ! -e "$lib" ]]; then  # another scheme: search the prefix
            lib=$(find "$prefix" -name libmpi.so.12 -print -quit 2>/dev/null)
            [[ -n "$lib" ]] && PATH="$(dirname "$(dirname "$lib")")/bin:$PATH"
        fi
        if [[ -n "$lib" && -e "$lib" ]]; then
            export MPI4PY_LIBMPI=$lib
            echo "MPI4PY_LIBMPI=$lib"
        else
            why+=("no libmpi.so.12 under the prefix")
        fi
    fi
    if ((${#why[@]})); then
        local all
        all=$(printf '%s; ' "${why[@]}")
        record setup FAIL "${all%; }"
    else
        record setup PASS "Python $ver; mpich, pytest, pytest-timeout, pytest-mpi"
    fi
    echo "setup: ${verdict[setup]} ${reason[setup]}"
}

# mpi_stage: mpi4py loads an MPI library; an mpiexec is found (sets have_mpi, mpiexec)
mpiexec=""
mpi_stage() {
    echo
    echo "=== mpi ($(date +%T)) ==="
    local out rc c pydir
    out=$(timeout $((60 * SLOW)) "$PY" - 2>&1 <<'PYEOF'
import os
import sys

try:
    from mpi4py import MPI

    print(f"mpi4py {sys.modules['mpi4py'].__version__}: {MPI.Get_library_version().splitlines()[0]}")
    with open("/proc/self/maps") as f:  # the library mpi4py loaded: its mpiexec matches it
        libs = sorted({ln.split()[-1] for ln in f if "/libmpi" in ln and ".so" in ln})
    for lib in libs:
        print(f"LIBMPI={os.path.realpath(lib)}")
except Exception as exc:
    lib = os.environ.get("MPI4PY_LIBMPI", "MPI4PY_LIBMPI unset")
    print(f"no MPI library for mpi4py ({type(exc).__name__}: {exc}; {lib})")
    sys.exit(3)
PYEOF
    )
    rc=$?
    echo "$out" | tee "$OUT/mpi.log"
    if ((rc != 0)); then
        not_run mpi "NO MPI" "$(tail -1 <<<"$out" | cut -c1-160)"
        return 0
    fi
    # mpiexec: MPIEXEC, else the one beside the library mpi4py loaded (../bin), beside
    # $PY, on PATH
    mpiexec=${MPIEXEC:-}
    if [[ -z "$mpiexec" ]]; then
        local libdir
        libdir=$(dirname "$(sed -n 's/^LIBMPI=//p' <<<"$out" | head -1)")
        pydir=$(dirname "$("$PY" -c 'import sys; print(sys.executable)')")
        for c in "$(dirname "$libdir")/bin/mpiexec" "$pydir/mpiexec" "$(command -v mpiexec)" \
            "$(command -v mpirun)"; do
            [[ -n "$c" && -x "$c" ]] && { mpiexec=$c; break; }
        done
    fi
    if [[ -z "$mpiexec" ]]; then
        not_run mpi "NO MPI" "no mpiexec: not beside libmpi or $PY, not on PATH"
        return 0
    fi
    echo "mpiexec: $mpiexec" | tee -a "$OUT/mpi.log"
    have_mpi=1
    record mpi PASS "$(head -1 <<<"$out" | cut -c1-60); $mpiexec"
}

# gpu_stage: CuPy and a device, the compute mode, ringmpi.gpu, NVRTC (sets have_gpu)
rank_gpus=""
ranks_cannot=""
gpu_stage() {
    echo
    echo "=== gpu ($(date +%T)) ==="
    local rc n modes
    timeout $((60 * SLOW)) "$PY" - <<'PYEOF' 2>&1 | tee "$OUT/gpu.log"
import sys

try:
    import cupy

    n = cupy.cuda.runtime.getDeviceCount()
except Exception as exc:
    print(f"no usable GPU: CuPy/CUDA unavailable ({type(exc).__name__}: {exc})")
    sys.exit(2)
if n < 1:
    print("no usable GPU: CuPy sees no CUDA device")
    sys.exit(2)
print(f"CuPy {cupy.__version__} from {cupy.__file__}: {n} device(s)")
print(f"DEVICES={n}")
if getattr(cupy, "STANDIN", False):
    print("EMULATION: this CuPy is the ringmpi CPU stand-in (tests/tools/fakecupy), not a GPU")
PYEOF
    rc=${PIPESTATUS[0]}
    if ((rc != 0)); then
        not_run gpu "NO GPU" "$(tail -1 "$OUT/gpu.log" | cut -c1-160)"
        return 0
    fi
    have_gpu=1
    grep -q '^EMULATION' "$OUT/gpu.log" && standin=1
    n=$(sed -n 's/^DEVICES=//p' "$OUT/gpu.log")
    # the compute mode: two ranks on one GPU fail in Exclusive_Process mode
    if command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a "$OUT/gpu.log"
        modes=$(nvidia-smi -q -d COMPUTE 2>/dev/null |
            sed -n 's/^[[:space:]]*Compute Mode[[:space:]]*:[[:space:]]*//p' | sort -u | tr '\n' ' ')
        echo "compute mode: ${modes:-unknown}" | tee -a "$OUT/gpu.log"
        if [[ $modes == *Exclusive* ]]; then
            if ((n >= 2)); then
                local ids=() i
                if [[ -n ${CUDA_VISIBLE_DEVICES:-} ]]; then
                    IFS=, read -ra ids <<<"$CUDA_VISIBLE_DEVICES"
                else
                    for ((i = 0; i < n; i++)); do ids+=("$i"); done
                fi
                rank_gpus=$(IFS=,; echo "${ids[*]}")
                echo "compute mode ${modes% }: the multi-rank stages run one rank per GPU ($rank_gpus)"
            else
                ranks_cannot="GPU compute mode ${modes% } with 1 GPU: two ranks cannot share it (nvidia-smi -c DEFAULT, as root)"
                echo "$ranks_cannot"
            fi
        fi
    else
        echo "compute mode: unknown (no nvidia-smi)" | tee -a "$OUT/gpu.log"
    fi
    timeout $((90 * SLOW)) "$PY" - <<'PYEOF' 2>&1 | tee -a "$OUT/gpu.log"
import json
import os
import traceback

try:
    import ringmpi.gpu as g

    print(json.dumps(g.info(), indent=1, default=str))
except Exception as exc:
    traceback.print_exc()
    print(f"import ringmpi.gpu failed: {type(exc).__name__}: {exc}")
    raise SystemExit(1)
try:
    from ringmpi.gpu import nvrtc

    ver = ".".join(map(str, nvrtc.version()))
    print(f"NVRTC {ver}: {nvrtc.find_library()}; builtins {nvrtc.BUILTINS or 'system loader'}")
    print("NVRTC_DIR=" + os.path.dirname(os.path.realpath(nvrtc.find_library())))
except Exception as exc:
    print(f"no standalone NVRTC ({type(exc).__name__}: {exc}): kernels compile through CuPy")
PYEOF
    rc=${PIPESTATUS[0]}
    if ((rc != 0)); then
        record gpu FAIL "$(tail -1 "$OUT/gpu.log" | cut -c1-160)"
        return 0
    fi
    local nvdir
    nvdir=$(sed -n 's/^NVRTC_DIR=//p' "$OUT/gpu.log" | tail -1)
    if [[ -n "$nvdir" ]]; then  # CuPy's own NVRTC looks for the builtins by name too
        export LD_LIBRARY_PATH="$nvdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    fi
    record gpu PASS "$n device(s); compute mode ${modes:-unknown}"
}

main() {
    echo "gpu_check: $(date -u +%FT%TZ) on $(hostname); results in $OUT; stages: $STAGES"
    echo "kernel cache: $CACHE"
    setup_stage
    mpi_stage
    gpu_stage

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
    local junit=0 jx
    [[ ${tests[1]} == pytest ]] && junit=1
    if [[ -n "${GPU_CHECK_K:-}" ]]; then
        tests+=(-k "$GPU_CHECK_K")
        mpitests+=(-k "$GPU_CHECK_K")
    fi
    local nogpu="needs a GPU; the gpu stage found none"

    # compile first, always (cheap when the cache is warm): no test compiles after it
    if ((have_gpu)); then
        run_stage compile 150 "$PY" - <<'PYEOF'
import os
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
print(f"kernel cache: {loader.cache_dir()}")
bad = 0
count = {"cache": 0, "compiled": 0, "failed": 0}
for files, names in ((tile.KERNEL_FILE, tile.kernel_names()),
                     (backward.KERNEL_FILES, backward.kernel_names())):
    res = {}
    if os.environ.get("RINGMPI_KERNEL_CACHE", "1") == "0":
        print("precompile off (RINGMPI_KERNEL_CACHE=0): loading through CuPy")
    else:
        try:
            res = loader.precompile(files, names, dev)
        except Exception as exc:  # no standalone libnvrtc: CuPy compiles each kernel instead
            print(f"precompile unavailable ({type(exc).__name__}: {exc}); loading through CuPy")
    for n in names:
        how = res.get(n, "")
        count[how if how in count else "failed"] += bool(how)
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
note = (f"compile: {count['cache']} from the cache, {count['compiled']} compiled, "
        f"{count['failed']} failed")
print(note)
print(f"gpu_check-note: {note}")
sys.exit(1 if bad else 0)
PYEOF
    else
        not_run compile "NO GPU" "$nogpu"
    fi

    local s
    for s in mods tests1; do
        if ! wanted "$s"; then
            not_run "$s" SKIP "not in GPU_CHECK_STAGES"
        elif ((!have_gpu)); then
            not_run "$s" "NO GPU" "$nogpu"
        else
            jx=()  # its junit file (none under tests/gpu_runner.py)
            ((junit)) && jx=("--junitxml=$OUT/$s.xml")
            if [[ $s == mods ]]; then  # before tests1, so a slow tests1 cannot crowd them out
                local modk=(-k softcap)
                [[ -n "${GPU_CHECK_K:-}" ]] && modk=()  # GPU_CHECK_K is already in tests
                run_stage mods 120 "$PY" "${tests[@]}" "${jx[@]}" \
                    -m "not mpi" "${modk[@]}" tests/gpu/test_tile_device.py
            else
                run_stage tests1 200 "$PY" "${tests[@]}" "${jx[@]}" \
                    -m "not mpi" tests/gpu/test_tile_device.py
            fi
        fi
    done

    # the multi-rank stages: each rank writes its own junit file (--rank)
    local ranks_ok=0 nompi="needs MPI; the mpi stage found none"
    if ! wanted ranks && ! wanted staged && ! wanted aware; then
        not_run ranks SKIP "not in GPU_CHECK_STAGES"
    elif ((!have_mpi)); then
        not_run ranks "NO MPI" "$nompi"
    else
        run_stage ranks 45 "$mpiexec" -n 2 "$PY" -c '
from mpi4py import MPI
size = MPI.COMM_WORLD.Get_size()
assert size == 2, f"mpiexec -n 2 gave COMM_WORLD size {size}: mpi4py and mpiexec do not match"
print(f"rank {MPI.COMM_WORLD.Get_rank()} of {size}: {MPI.Get_library_version().splitlines()[0]}")
' && ranks_ok=1
    fi
    local rankxml
    export GPU_CHECK_RANK_GPUS=$rank_gpus
    for s in staged aware; do
        rankxml=""
        ((junit)) && rankxml=$OUT/$s.xml
        if ! wanted "$s"; then
            not_run "$s" SKIP "not in GPU_CHECK_STAGES"
        elif ((!have_gpu)); then
            not_run "$s" "NO GPU" "$nogpu"
        elif ((!have_mpi)); then
            not_run "$s" "NO MPI" "$nompi"
        elif ((!ranks_ok)); then
            not_run "$s" SKIP "mpiexec -n 2 did not give two ranks (ranks stage)"
        elif [[ -n $ranks_cannot ]]; then
            not_run "$s" SKIP "$ranks_cannot"
        elif [[ $s == staged ]]; then
            RINGMPI_CUDA_AWARE=0 run_stage staged 120 "$mpiexec" -n 2 bash "$SCRIPT" --rank \
                "$rankxml" "$PY" -m mpi4py "${mpitests[@]}" -m mpi tests/gpu/test_tile_device.py
        elif timeout $((60 * SLOW)) "$PY" -c 'import sys; from ringmpi.gpu import cuda_aware; sys.exit(0 if cuda_aware() else 1)' 2>/dev/null; then
            RINGMPI_CUDA_AWARE=1 run_stage aware 120 "$mpiexec" -n 2 bash "$SCRIPT" --rank \
                "$rankxml" "$PY" -m mpi4py "${mpitests[@]}" -m mpi tests/gpu/test_tile_device.py
        else
            not_run aware SKIP "this MPI does not report CUDA support"
        fi
    done

    if ! wanted bench; then
        not_run bench SKIP "not in GPU_CHECK_STAGES"
    elif ((!have_gpu)); then
        not_run bench "NO GPU" "$nogpu"
    else
        local bargs
        read -ra bargs <<<"${GPU_CHECK_BENCH_ARGS:---configs}"
        run_stage bench 150 "$PY" -m ringmpi.gpu.bench "${bargs[@]}" --json "$OUT/gpu_bench.json"
    fi
    finish
}

main 2>&1 | tee "$OUT/gpu_check.log"
exit "${PIPESTATUS[0]}"
