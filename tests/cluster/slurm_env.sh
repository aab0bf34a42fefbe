# shellcheck shell=bash
# A private one-node Slurm for tests: munged, slurmctld and slurmd started by us, as root,
# with every file (key, sockets, state, pid and log files) in one temporary folder.
# Source it, then:  slurm_install; slurm_up DIR; ... (SLURM_CONF is exported); slurm_down
# slurm_up registers nothing itself: the caller's EXIT trap must call slurm_down.

_slurm_pids=()

slurm_log() { printf '[slurm %(%T)T] %s\n' -1 "$*"; }

# Debian's slurm-wlm and munge, when missing (apt-get update once, then install).
# policy-rc.d / no systemd: the packages' own services do not start; we start ours.
slurm_install() {
    local need=()
    command -v slurmctld >/dev/null || need+=(slurmctld)
    command -v slurmd >/dev/null || need+=(slurmd)
    command -v sbatch >/dev/null || need+=(slurm-client)
    command -v munged >/dev/null || need+=(munge)
    ((${#need[@]})) || return 0
    slurm_log "installing ${need[*]} from Debian"
    export DEBIAN_FRONTEND=noninteractive
    timeout 300 apt-get -o DPkg::Lock::Timeout=240 update -qq
    timeout 600 apt-get -o DPkg::Lock::Timeout=240 install -y -qq --no-install-recommends \
        "${need[@]}" >/dev/null
}

_free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# slurm_up DIR: write the configuration under DIR, start the daemons, wait for the node.
slurm_up() {
    local d=$1 node cpus mem_mib t
    node=$(hostname -s)
    cpus=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
    # RealMemory a little under what the kernel reports (slurmd drains a node that has less)
    mem_mib=$(awk '/^MemTotal:/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)
    mkdir -p "$d/munge" "$d/state" "$d/spool" "$d/log"
    chmod 711 "$d/munge"
    head -c 1024 /dev/urandom >"$d/munge/munge.key"
    chmod 400 "$d/munge/munge.key"

    cat >"$d/slurm.conf" <<EOF
# written by tests/cluster/slurm_env.sh for one test run
ClusterName=ringmpitest
SlurmctldHost=${node}(127.0.0.1)
SlurmctldPort=$(_free_port)
SlurmdPort=$(_free_port)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$d/munge/munge.socket
StateSaveLocation=$d/state
SlurmdSpoolDir=$d/spool
SlurmctldPidFile=$d/slurmctld.pid
SlurmdPidFile=$d/slurmd.pid
SlurmctldLogFile=$d/log/slurmctld.log
SlurmdLogFile=$d/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
# no PMI unless the job asks (as at many sites): the launch check must catch it
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
ReturnToService=2
# job ids unique across runs of this private cluster: MPICH names its node-local shared
# memory after the PMI job id (/dev/shm/mpich_shm_<hash>_N); a cancelled job's segment
# stays, and a later run's job with the same id and step would attach to it and fail in
# MPI_Init (UCX: "failed to unpack address, invalid bandwidth 0.00")
FirstJobId=$((1000 + $(date +%s) % 60000000))
KillWait=5
MinJobAge=600
InactiveLimit=0
SlurmdTimeout=60
NodeName=${node} NodeAddr=127.0.0.1 CPUs=${cpus} RealMemory=${mem_mib} State=UNKNOWN
PartitionName=test Nodes=${node} Default=YES MaxTime=INFINITE State=UP
EOF
    export SLURM_CONF="$d/slurm.conf"

    munged -F -f --key-file="$d/munge/munge.key" --socket="$d/munge/munge.socket" \
        --pid-file="$d/munge/munged.pid" --log-file="$d/log/munged.log" \
        --seed-file="$d/munge/munged.seed" >>"$d/log/munged.out" 2>&1 &
    _slurm_pids+=($!)
    for ((t = 0; t < 100; t++)); do
        [[ -S "$d/munge/munge.socket" ]] && break
        sleep 0.1
    done
    munge -S "$d/munge/munge.socket" -n | unmunge -S "$d/munge/munge.socket" >/dev/null ||
        { slurm_log "munge does not work"; return 1; }

    slurmctld -D -i -f "$SLURM_CONF" >>"$d/log/slurmctld.out" 2>&1 &
    _slurm_pids+=($!)
    slurmd -D -f "$SLURM_CONF" -N "$node" >>"$d/log/slurmd.out" 2>&1 &
    _slurm_pids+=($!)

    # the node becomes idle once slurmd has registered (bounded)
    for ((t = 0; t < 120; t++)); do
        if [[ "$(sinfo -h -n "$node" -o %T 2>/dev/null)" == idle ]]; then
            export SLURM_NODE=$node
            return 0
        fi
        sleep 0.5
    done
    slurm_log "node $node not idle after 60 s: $(sinfo -h -N -o '%N %T %E' 2>&1)"
    tail -n 20 "$d"/log/*.log "$d"/log/*.out >&2 || true
    return 1
}

# Cancel our jobs, stop the daemons we started (TERM, then KILL after 10 s).
slurm_down() {
    local pid t
    if [[ -n "${SLURM_CONF:-}" ]] && ((${#_slurm_pids[@]})); then
        timeout 10 scancel --full --quiet --user=root 2>/dev/null || true
        sleep 1
    fi
    # slurmd, slurmctld, munged: the reverse of the start order
    for ((t = ${#_slurm_pids[@]} - 1; t >= 0; t--)); do
        pid=${_slurm_pids[t]}
        kill -TERM "$pid" 2>/dev/null || continue
        timeout 10 tail --pid="$pid" -f /dev/null || kill -KILL "$pid" 2>/dev/null || true
    done
    _slurm_pids=()
}
