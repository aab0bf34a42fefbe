#!/usr/bin/env bash
# The test suites on a site-like stack: Debian 12's Open MPI 4.1 with Debian's
# python3-mpi4py (3.1), python3-numpy (1.24, reference BLAS) and python3-h5py-mpi
# (3.7 on HDF5 1.10, parallel) in a venv made with --system-site-packages from
# Debian's /usr/bin/python3, numpy on Debian's OpenBLAS (libopenblas0-pthread,
# as sites have; SITE_BLAS=reference runs it on libblas3, the reference BLAS that
# python3-numpy alone pulls in). ringmpi goes in without dependencies; only the
# test tools come from PyPI. Runs the serial suite once and the multi-rank suite
# at each P of SITE_RANKS under Open MPI's mpiexec; exits non-zero on any failure.
#
#   bash tests/cluster/site_stack.sh            (or: make test-site)
#
# Environment:
#   SITE_VENV     the venv (default .site-venv in the checkout, ignored by git)
#   SITE_RANKS    world sizes of the multi-rank suite (default "2 3")
#   SITE_STAGES   which suites: any of "serial mpi blas" (default all; blas: the numpy
#                 tile's real-value tests under each OpenBLAS kernel the CPU runs)
#   SITE_TIMEOUT  seconds per suite (default 1800)
#   SITE_PYTEST   extra pytest arguments, e.g. "-x" or a test file
#   SITE_JOBS     pytest-xdist workers of the serial suite (default auto: one per core)
#   SITE_BLAS     openblas (default) or reference: the libblas.so.3 numpy loads
# Missing Debian packages are installed with apt-get (root, or sudo without a password).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT"
VENV=${SITE_VENV:-$ROOT/.site-venv}
RANKS=${SITE_RANKS:-2 3}
STAGES=${SITE_STAGES:-serial mpi blas}
TIMEOUT=${SITE_TIMEOUT:-1800}
read -r -a EXTRA <<<"${SITE_PYTEST:-}"
SYSPY=/usr/bin/python3
OMPI_EXEC=/usr/bin/mpiexec.openmpi
BLAS=${SITE_BLAS:-openblas}
PKGS=(openmpi-bin python3-mpi4py python3-numpy python3-h5py-mpi python3-venv libopenblas0-pthread)

log() { printf '[site] %s\n' "$*"; }
die() { printf '[site] error: %s\n' "$*" >&2; exit 1; }

# -- 1. Debian packages ----------------------------------------------------------------
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  command -v apt-get >/dev/null || die "not Debian/Ubuntu: install ${missing[*]} by hand"
  SUDO=()
  if [[ $(id -u) -ne 0 ]]; then
    sudo -n true 2>/dev/null || die "need root (or sudo) to install: ${missing[*]}"
    SUDO=(sudo -n)
  fi
  log "installing ${missing[*]}"
  "${SUDO[@]}" apt-get update -qq
  "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
    -o DPkg::Lock::Timeout=600 "${missing[@]}"
fi
[[ -x $OMPI_EXEC ]] || die "$OMPI_EXEC missing (openmpi-bin)"

# -- 2. the venv -------------------------------------------------------------------------
stamp=$VENV/.site-installed
if [[ ! -f $stamp || setup.cfg -nt $stamp || pyproject.toml -nt $stamp || $0 -nt $stamp ]]; then
  log "building $VENV from $SYSPY"
  [[ -x $VENV/bin/python ]] || "$SYSPY" -m venv --system-site-packages "$VENV"
  "$VENV/bin/python" -m pip install -q --no-deps -e .
  # test tools only; numpy, mpi4py and h5py must stay Debian's (checked below)
  "$VENV/bin/python" -m pip install -q pytest pytest-mpi pytest-timeout pytest-xdist psutil
  touch "$stamp"
fi
# the tests start `mpiexec` from beside sys.executable: make that Open MPI's
ln -sfn "$OMPI_EXEC" "$VENV/bin/mpiexec"

# -- 3. BLAS and Open MPI settings for the tests -------------------------------------------
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
# pick numpy's libblas.so.3 for this run only, whatever update-alternatives says
case $BLAS in
  openblas) blasdir=/usr/lib/x86_64-linux-gnu/openblas-pthread ;;
  reference) blasdir=/usr/lib/x86_64-linux-gnu/blas ;;
  *) die "SITE_BLAS must be openblas or reference, not '$BLAS'" ;;
esac
[[ -e $blasdir/libblas.so.3 ]] || die "$blasdir/libblas.so.3 missing"
export LD_LIBRARY_PATH=$blasdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
# Open MPI hands the ranks a pty: keep pytest's summary free of colour codes
export PY_COLORS=0
if [[ $(id -u) -eq 0 ]]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
# --oversubscribe for every mpiexec the tests start (more ranks than cores)
export OMPI_MCA_rmaps_base_oversubscribe=1
# `mpiexec -q`: no launcher help banners after a rank exits non-zero or calls
# MPI_Abort, so stderr holds ringmpi's one line (what the tests check)
export OMPI_MCA_orte_execute_quiet=1
# SIGTERM to mpiexec: Open MPI sends SIGCONT, then SIGTERM only after this many
# seconds (default 1): the stress check that kills a job half way needs it at once
export OMPI_MCA_odls_base_sigkill_timeout=0
# the one-file output tests (tests/job/output/test_single_file.py) skip where h5py has no MPI; here
# it has (checked below), so a skip would hide a broken setup: make it a failure
export RINGMPI_REQUIRE_MPIO=1
# the CUDA compile check does not depend on the MPI/numpy/h5py stack and takes
# minutes: `make test` runs it; here it is skipped on purpose
export RINGMPI_SKIP_NVRTC=1

PY=$VENV/bin/python
# versions (h5py: Debian picks its MPI build only inside an Open MPI job)
"$OMPI_EXEC" -n 1 "$PY" - <<'EOF' || die "the venv does not see Debian's stack"
import os, sys

import h5py, mpi4py, numpy
from mpi4py import MPI

for mod in (numpy, mpi4py, h5py):
    if not mod.__file__.startswith("/usr/lib/python3/dist-packages/"):
        sys.exit(f"{mod.__name__} comes from {mod.__file__}, not Debian's python3-* package")
if not h5py.get_config().mpi:
    sys.exit("h5py has no MPI under mpiexec (python3-h5py-mpi missing?)")
blas = sorted({ln.split()[-1] for ln in open("/proc/self/maps") if "blas" in ln.lower()})
print(f"[site] python {sys.version.split()[0]} ({sys.executable})")
print(f"[site] numpy {numpy.__version__} (BLAS: {', '.join(blas) or '?'})")
print(f"[site] mpi4py {mpi4py.__version__}; {MPI.Get_library_version().splitlines()[0]}")
print(f"[site] h5py {h5py.__version__}, HDF5 {h5py.version.hdf5_version}, mpi={h5py.get_config().mpi}")
EOF
"$PY" -c "import pytest, pytest_mpi; print('[site] pytest', pytest.__version__)"

# -- 4. the suites -------------------------------------------------------------------------
failed=()
summary=()
run() {  # run NAME CMD...: one suite, timed; its last line goes to the summary
  local name=$1 t0 rc=0 out
  shift
  log "=== $name ==="
  out=$(mktemp)
  t0=$(date +%s)
  timeout "$TIMEOUT" "$@" 2>&1 | tee "$out" || rc=$?
  summary+=("$name: $(grep -aE ' (passed|failed|errors?|skipped)[ ,]' "$out" | tail -n 1) [rc $rc, $(($(date +%s) - t0)) s]")
  rm -f "$out"
  ((rc == 0)) || failed+=("$name")
}
for stage in $STAGES; do
  case $stage in
    serial) run "serial" "$PY" -m pytest -q -p no:cacheprovider -rfEs -n "${SITE_JOBS:-auto}" \
              "${EXTRA[@]}" tests ;;
    mpi)
      for p in $RANKS; do
        run "multi-rank P=$p" "$OMPI_EXEC" --oversubscribe -n "$p" "$PY" -m mpi4py \
          -m pytest -q -p no:cacheprovider -rfEs --with-mpi -m mpi "${EXTRA[@]}" tests
      done
      ;;
    blas)
      # the numpy tile's error against a dense float32 peer depends on the BLAS kernel's
      # summation order: run the real-value tests under each OpenBLAS kernel this CPU can
      # execute (CI once failed on one the default did not pick)
      flags=$(grep -m1 '^flags' /proc/cpuinfo || true)
      cores=()
      [[ $flags == *" avx2 "* ]] && cores+=(Haswell)
      [[ $flags == *" avx512f "* ]] && cores+=(SkylakeX)
      [[ $flags == *" avx512_bf16 "* ]] && cores+=(CooperLake)
      for c in "${cores[@]}"; do
        run "numpy tile on OpenBLAS $c" env OPENBLAS_CORETYPE="$c" "$PY" -m pytest -q \
          -p no:cacheprovider -rfEs -k numpy "${EXTRA[@]}" tests/test_attention_real_values.py
      done
      ;;
    *) die "unknown stage '$stage' (serial, mpi, blas)" ;;
  esac
done
log "--- summary ---"
for s in "${summary[@]}"; do log "$s"; done
if ((${#failed[@]})); then
  die "failed: ${failed[*]}"
fi
log "all passed"
