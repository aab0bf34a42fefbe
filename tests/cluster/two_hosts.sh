#!/usr/bin/env bash
# Ranks on two "hosts" over TCP: two network namespaces joined by a veth pair
# (10.200.0.1 and 10.200.0.2, addresses that exist only inside the namespaces), the
# PyPI MPICH's hydra starting one proxy per namespace, MPICH's libfabric TCP netmod
# on the veth (the default UCX netmod would use shared memory between the namespaces
# and nothing would cross the link).
#
#   tests/cluster/two_hosts.sh        (make test-cluster; needs root and `ip netns`)
#
# Stages, each under a timeout; a table at the end; exit 1 when any fails:
#   net        both namespaces up; a 16 MiB exchange between them crosses the veth
#   ring P=2   tests/test_attention_mpi.py (ring_attention vs the float64 reference), 1 rank/host
#   ring P=4   the same with 2 ranks per host
#   run        `ringmpi run --causal --verify` on sample data, P = 4
#   kill -9    SIGKILL to one rank on the second host mid-run: the job must end in 15 s
#   wrapper    the same rank behind a shell wrapper that exits 137 (an exit code, not a
#              signal, for mpiexec), with RINGMPI_WATCHDOG_S=5: ends in 15 s. Runs only
#              where `ringmpi.runtime.watchdog.ENV` exists (the watchdog); SKIP else
#              (FORCE_WRAPPER=1 runs it anyway: without a watchdog it fails, ends at 40 s)
#   overlap    link shaped to 100 Mbit/s (tc tbf, both directions): MPI wait share vs the
#              cost model's crossover, N = 2k..32k, causal and not (tests/cluster/overlap.py)
# Not root, or `ip netns add` refused: prints SKIP and exits 0.
# Environment: PYTHON (default .venv/bin/python), OVERLAP_N (the N list), ONLY (a subset of
# the stages after net, e.g. ONLY="run overlap"), RINGMPI_KEEP=1 (keep the work folder).
set -euo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
PY=${PYTHON:-$REPO/.venv/bin/python}
MPIEXEC=${MPIEXEC:-$(dirname "$PY")/mpiexec}
# the kill checks count finished sequences by their markers: one sequence per ring call
export RINGMPI_BATCH_TOKENS=0
OVERLAP_N=${OVERLAP_N:-1024 2048 4096 8192 16384 32768}
KILL_LIMIT=15
IF=rmpi0 # the veth's name inside both namespaces (FI_TCP_IFACE is one name for all ranks)
HOST_A=10.200.0.1
HOST_B=10.200.0.2

skip() {
    echo "SKIP tests/cluster/two_hosts.sh: $*"
    exit 0
}
[[ $(id -u) -eq 0 ]] || skip "needs root (network namespaces)"
command -v ip >/dev/null || skip "no 'ip' command (iproute2)"
[[ -x "$MPIEXEC" ]] || { echo "two_hosts.sh: no mpiexec at $MPIEXEC" >&2; exit 1; }

NS_A=ringmpiA$$
NS_B=ringmpiB$$
work=$(mktemp -d /tmp/ringmpi-2h.XXXXXX)
made_ns=()
log() { printf '[2hosts %(%T)T] %s\n' -1 "$*"; }

# shellcheck disable=SC2329 # called by the EXIT trap
cleanup() {
    local ns pids
    for ns in "${made_ns[@]}"; do
        # whatever we started in our namespaces, then the namespaces (and the veth with them)
        mapfile -t pids < <(ip netns pids "$ns" 2>/dev/null || true)
        ((${#pids[@]})) && kill -KILL "${pids[@]}" 2>/dev/null || true
    done
    for ns in "${made_ns[@]}"; do ip netns del "$ns" 2>/dev/null || true; done
    if [[ -n "${RINGMPI_KEEP:-}" ]]; then echo "kept $work"; else rm -rf "$work"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# -- results table ---------------------------------------------------------------------------
results=()
failed=0
stage_t0=$SECONDS
stage_begin() {
    stage_t0=$SECONDS
    log "--- $1"
}
record() { # record NAME PASS|FAIL|SKIP DETAIL...
    local s=$((SECONDS - stage_t0))
    [[ $2 == FAIL ]] && failed=1
    results+=("$(printf '%-4s %-9s %4d s  %s' "$2" "$1" "$s" "${*:3}")")
    log "$2 $1 ($s s): ${*:3}"
}
want() { [[ -z "${ONLY:-}" || " $ONLY " == *" $1 "* ]]; }
count_done() {
    local f=()
    shopt -s nullglob
    f=("$1".parts/s*.done)
    shopt -u nullglob
    echo "${#f[@]}"
}

# -- the two hosts ---------------------------------------------------------------------------
stage_begin net
ip netns add "$NS_A" 2>/dev/null || skip "'ip netns add' refused (no CAP_SYS_ADMIN here)"
made_ns+=("$NS_A")
ip netns add "$NS_B"
made_ns+=("$NS_B")
ip link add "vA$$" type veth peer name "vB$$"
ip link set "vA$$" netns "$NS_A"
ip link set "vB$$" netns "$NS_B"
ip -n "$NS_A" link set "vA$$" name "$IF"
ip -n "$NS_B" link set "vB$$" name "$IF"
ip -n "$NS_A" addr add "$HOST_A/24" dev "$IF"
ip -n "$NS_B" addr add "$HOST_B/24" dev "$IF"
for ns in "$NS_A" "$NS_B"; do
    ip -n "$ns" link set lo up
    ip -n "$ns" link set "$IF" up
done

# hydra's "ssh": [options] HOST COMMAND... -> the command in that host's namespace
cat >"$work/hostexec.sh" <<EOF
#!/usr/bin/env bash
while [[ "\${1:-}" == -* ]]; do shift; done
case "\$1" in
    $HOST_A) ns=$NS_A ;;
    $HOST_B) ns=$NS_B ;;
    *) echo "hostexec: unknown host \$1" >&2; exit 255 ;;
esac
shift
exec ip netns exec "\$ns" bash -c "\$*"
EOF
chmod +x "$work/hostexec.sh"

# mpi_cmd NRANKS_PER_HOST NRANKS: the launcher prefix (run it with a command appended)
mpi_cmd() {
    echo ip netns exec "$NS_A" env OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 \
        MPIR_CVAR_CH4_NETMOD=ofi FI_PROVIDER=tcp FI_TCP_IFACE="$IF" \
        "$MPIEXEC" -launcher ssh -launcher-exec "$work/hostexec.sh" -iface "$IF" \
        -hosts "$HOST_A:$1,$HOST_B:$1" -n "$2"
}
rx_bytes() { ip -n "$1" -s link show "$IF" | awk '/RX:/ {getline; print $1}'; }

rx0=$(rx_bytes "$NS_B")
rc=0
# shellcheck disable=SC2046 # mpi_cmd's words are meant to split
timeout -k 5 120 $(mpi_cmd 1 2) "$PY" -c '
import os
import numpy as np
from mpi4py import MPI
c = MPI.COMM_WORLD
a = np.full(4 << 20, c.rank + 1, np.float32)
b = np.empty_like(a)
c.Sendrecv(a, (c.rank + 1) % c.size, recvbuf=b, source=(c.rank - 1) % c.size)
assert b[0] == (c.rank - 1) % c.size + 1 and b[-1] == b[0]
ns = c.allgather(os.readlink("/proc/self/ns/net"))
assert len(set(ns)) == 2, ns
' >"$work/net.log" 2>&1 || rc=$?
crossed=$(($(rx_bytes "$NS_B") - rx0))
if [[ $rc -eq 0 && $crossed -ge $((16 << 20)) ]]; then
    record net PASS "2 namespaces, veth $HOST_A <-> $HOST_B, MPICH ofi/tcp:" \
        "16 MiB exchange, $((crossed >> 20)) MiB received on host B's veth"
else
    record net FAIL "exchange exit $rc, $crossed bytes on the veth"
    tail -n 20 "$work/net.log"
    printf '%s\n' "${results[@]}"
    exit 1
fi

# -- ring_attention against the reference -----------------------------------------------------
for per_host in 1 2; do
    np=$((2 * per_host))
    want ring || continue
    stage_begin "ring P=$np"
    rc=0
    # shellcheck disable=SC2046
    timeout -k 5 400 $(mpi_cmd "$per_host" "$np") "$PY" -m mpi4py -m pytest -q \
        -p no:cacheprovider --with-mpi -m mpi tests/test_attention_mpi.py >"$work/ring$np.log" 2>&1 ||
        rc=$?
    summary=$(grep -E '^[0-9]+ passed|failed|error' "$work/ring$np.log" | head -n 1 |
        sed 's/ *\[ *[0-9]*%\]$//' || true)
    if [[ $rc -eq 0 && "$summary" == *passed* && "$summary" != *failed* ]]; then
        record "ring P=$np" PASS "tests/test_attention_mpi.py, $per_host rank(s) per host: $summary"
    else
        record "ring P=$np" FAIL "exit $rc: ${summary:-no summary}"
        tail -n 30 "$work/ring$np.log"
    fi
done

# -- the batch job ------------------------------------------------------------------------------
mkdir -p "$work/data" "$work/run"
"$PY" -m ringmpi make-data "$work/data/sample.h5" --sequences 3 >/dev/null
"$PY" -m ringmpi make-data "$work/data/long.h5" --sequences 8 --seq-len 8192 \
    --heads 4 --kv-heads 2 --head-dim 64 >/dev/null
if want run; then
    stage_begin run
    rc=0
    # shellcheck disable=SC2046
    timeout -k 5 300 $(mpi_cmd 2 4) "$PY" -m mpi4py -m ringmpi run "$work/data/sample.h5" \
        -o "$work/run/out.h5" --causal --verify --device cpu >"$work/run.log" 2>&1 || rc=$?
    if [[ $rc -eq 0 ]] && grep -q "ringmpi verify: PASSED" "$work/run.log"; then
        record run PASS "ringmpi run --causal --verify, P=4 on 2 hosts, 3 x 4096 tokens:" \
            "$(grep -m 1 -o '[0-9.]* s | [0-9,]* tokens/s' "$work/run.log"), verify PASSED"
    else
        record run FAIL "exit $rc"
        tail -n 20 "$work/run.log"
    fi
fi

# -- kill one rank on host B mid-run ---------------------------------------------------------------
# kill_test NAME WRAPPER(0/1) [env...]: start ringmpi run on P=4, wait for the first finished
# sequence, SIGKILL rank 3's python (on host B), time until mpiexec has returned.
kill_test() {
    local name=$1 wrapped=$2 out=$work/$1/out.h5 jpid victim t_kill down rc=0 left n
    shift 2
    mkdir -p "$work/$name"
    local pre=()
    ((wrapped)) && pre=("$work/rankwrap.sh")
    # shellcheck disable=SC2046
    env "$@" timeout -k 5 120 $(mpi_cmd 2 4) "${pre[@]}" "$PY" -m mpi4py -m ringmpi run \
        "$work/data/long.h5" -o "$out" --causal --quiet --device cpu >"$work/$name.log" 2>&1 &
    jpid=$!
    for ((n = 0; n < 600; n++)); do # 60 s at most
        [[ $(count_done "$out") -ge 1 ]] && break
        kill -0 "$jpid" 2>/dev/null || break
        sleep 0.1
    done
    victim=""
    if ((wrapped)); then
        victim=$(cat "$work/pid.3" 2>/dev/null || true)
    else # the python rank of host B with the highest pid
        for n in $(ip netns pids "$NS_B"); do
            [[ "$(head -z -n 1 "/proc/$n/cmdline" 2>/dev/null | tr -d '\0')" == *python* ]] &&
                victim=$n
        done
    fi
    if [[ -z "$victim" ]] || ! kill -0 "$jpid" 2>/dev/null; then
        wait "$jpid" || rc=$?
        record "$name" FAIL "the job did not get to a finished sequence (exit $rc)"
        tail -n 20 "$work/$name.log"
        return
    fi
    t_kill=$EPOCHREALTIME
    kill -KILL "$victim"
    for ((n = 0; n < 400; n++)); do # 40 s at most, then we end it ourselves
        kill -0 "$jpid" 2>/dev/null || break
        sleep 0.1
    done
    down=$(awk -v a="$t_kill" -v b="$EPOCHREALTIME" 'BEGIN {printf "%.1f", b - a}')
    if kill -0 "$jpid" 2>/dev/null; then
        kill -TERM "$jpid"
        wait "$jpid" || true
        down=">40"
        rc=hang
    else
        wait "$jpid" || rc=$?
    fi
    sleep 0.5
    left=$(cat <(ip netns pids "$NS_A") <(ip netns pids "$NS_B") | wc -l)
    local what
    what="SIGKILL to a rank on host B after $(count_done "$out")/8 sequences:"
    what+=" job ended in $down s (mpiexec exit $rc), $left processes left,"
    what+=" final file $([[ -e $out ]] && echo PRESENT || echo absent)"
    local msg
    msg=$(grep -m 1 -E 'ringmpi: error|watchdog' "$work/$name.log" | cut -c1-160 || true)
    [[ -n "$msg" ]] && what+="; first error line: $msg"
    if [[ $rc != hang && $rc -ne 0 && $left -eq 0 && ! -e $out ]] &&
        awk -v d="$down" -v l="$KILL_LIMIT" 'BEGIN {exit !(d <= l)}'; then
        record "$name" PASS "$what"
    else
        record "$name" FAIL "$what"
        tail -n 15 "$work/$name.log"
    fi
}

if want kill; then
    stage_begin "kill -9"
    kill_test kill-9 0
fi

want kill && stage_begin wrapper
cat >"$work/rankwrap.sh" <<EOF
#!/usr/bin/env bash
# a site's rank wrapper: runs the rank as a child and exits with its status (137 after
# SIGKILL), so mpiexec sees an exit code, not a signal
"\$@" &
child=\$!
echo "\$child" >"$work/pid.\${PMI_RANK:-x}"
wait "\$child"
EOF
chmod +x "$work/rankwrap.sh"
if ! want kill; then
    :
elif [[ -n "${FORCE_WRAPPER:-}" ]] ||
    "$PY" -c "import ringmpi.runtime.watchdog as w; w.ENV" 2>/dev/null; then
    kill_test wrapper 1 RINGMPI_WATCHDOG_S=5
else
    record wrapper SKIP "needs the ring watchdog (ringmpi.runtime.watchdog.ENV not there):" \
        "without it the surviving ranks wait in MPI until an outer timeout"
fi

# -- overlap on a 100 Mbit/s link --------------------------------------------------------------
want overlap && stage_begin overlap
shaped=1
# tbf: 100 Mbit/s; the bucket holds 32 KB ("kb" is kilobytes in tc), small beside the
# messages (>= 256 KiB), so nearly all of every message moves at the shaped rate
for ns in "$NS_A" "$NS_B"; do
    want overlap || break
    ip netns exec "$ns" tc qdisc add dev "$IF" root tbf rate 100mbit burst 32kb latency 100ms ||
        shaped=0
done
if ! want overlap; then
    :
elif ((shaped)); then
    rc=0
    # shellcheck disable=SC2046,SC2086 # OVERLAP_N is a list of numbers
    timeout -k 5 900 $(mpi_cmd 1 2) "$PY" -m mpi4py tests/cluster/overlap.py --n $OVERLAP_N \
        --heads 4 --kv-heads 1 --dim 64 --repeat 3 --link "tbf 100M" >"$work/overlap.log" 2>&1 ||
        rc=$?
    grep -v '^RESULT ' "$work/overlap.log" | sed 's/^/    /'
    if [[ $rc -eq 0 ]]; then
        record overlap PASS "wait share vs predicted crossover as tabled above (P=2, 1 rank/host)"
    else
        record overlap FAIL "exit $rc (a row off the model, or the run failed; table above)"
    fi
    for ns in "$NS_A" "$NS_B"; do ip netns exec "$ns" tc qdisc del dev "$IF" root || true; done
else
    record overlap FAIL "tc could not add a tbf qdisc on the veth"
fi

echo
echo "Two hosts over TCP (network namespaces, PyPI MPICH, ofi/tcp):"
printf '  %s\n' "${results[@]}"
exit "$failed"
