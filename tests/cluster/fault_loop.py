"""Loop one fault-injection job and count hangs, with a snapshot of every hung process.

    python tests/cluster/fault_loop.py [--runs N] [--ranks P] [--rank R] [--step S]
                                       [--limit SECONDS] [--mode call|cli]

Runs ``mpiexec -n P python -m mpi4py tests/mpi_checks.py call`` (``--mode call``,
the stress check's "library" case) or ``ringmpi run`` (``--mode cli``) with
RINGMPI_TEST_FAULT=R:S, N times, each bounded by ``--limit`` seconds. A run that
passes the limit counts as a hang: before it is killed, every process of its
session (mpiexec, orted, the ranks) is listed with its state, kernel wait channel
and the signals it catches/blocks/has pending (from /proc), which is what tells
an abort that Open MPI did not deliver from a rank that ignored it. Prints one
line per run and a summary; exits 1 if any run hung or did not fail cleanly.
Uses the mpiexec beside sys.executable (under tests/cluster/site_stack.sh: Open MPI's).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import faults as F  # noqa: E402


def _status(pid: int) -> dict:
    out = {}
    try:
        for ln in Path(f"/proc/{pid}/status").read_text().splitlines():
            k, _, v = ln.partition(":")
            if k in ("State", "SigPnd", "ShdPnd", "SigBlk", "SigCgt", "SigIgn"):
                out[k] = v.strip()
        out["wchan"] = Path(f"/proc/{pid}/wchan").read_text().strip()
        out["cmd"] = Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")[:100]
    except OSError as e:
        out["error"] = str(e)
    return out


def _sigs(mask: str) -> str:
    """Names of the signals in a /proc hex mask (only the interesting ones)."""
    bits = int(mask, 16)
    names = [
        s.name
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGCONT)
        if bits >> (s.value - 1) & 1
    ]
    return "+".join(names) or "-"


def snapshot(proc: subprocess.Popen) -> list:
    """One line per process of the job's session (it was started with a new session)."""
    import psutil

    lines = []
    try:
        procs = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.Error:
        return ["  (job already gone)"]
    for p in procs:
        s = _status(p.pid)
        if "error" in s:
            lines.append(f"  {p.pid}: {s['error']}")
            continue
        lines.append(
            f"  {p.pid} {s['State']:<14} wchan={s['wchan']:<24} caught={_sigs(s['SigCgt'])} "
            f"blocked={_sigs(s['SigBlk'])} pending={_sigs(s['SigPnd'])}/{_sigs(s['ShdPnd'])} "
            f"| {s['cmd']}"
        )
    return lines


def orphans() -> list:
    """PIDs of ranks of our jobs still alive after their job ended (their mpiexec gone)."""
    import psutil

    time.sleep(0.2)
    left = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if F.CHECKS in cmd and "mpiexec" not in cmd:
            try:
                parent = p.parent()
            except psutil.Error:
                continue
            if parent is None or "mpiexec" not in " ".join(parent.cmdline()):
                left.append(p.pid)
    return left


def one(args, tmp: str, k: int) -> tuple:
    env = {"RINGMPI_TEST_FAULT": f"{args.rank}:{args.step}"}
    if args.watchdog:
        env["RINGMPI_WATCHDOG_S"] = str(args.watchdog)
    if args.mode == "call":
        cmd = [F.CHECKS, "call"]
    else:
        from ringmpi.cli.make_data import make_data

        inp = os.path.join(tmp, "in.h5")
        if not os.path.exists(inp):
            make_data(inp, seq_len=400, heads=2, kv_heads=1, head_dim=16)
        out = os.path.join(tmp, f"out{k}.h5")
        cmd = ["-m", "ringmpi", "run", inp, "-o", out, "--quiet", "--device", "cpu"]
    t0 = time.perf_counter()
    proc = F.start(args.ranks, cmd, env=env)
    try:
        out, err = proc.communicate(timeout=args.limit)
        return proc.returncode, time.perf_counter() - t0, err, []
    except subprocess.TimeoutExpired:
        snap = snapshot(proc)
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return None, time.perf_counter() - t0, err, snap


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rank", type=int, default=1)
    ap.add_argument("--step", type=int, default=1)
    ap.add_argument("--limit", type=float, default=30.0)
    ap.add_argument("--watchdog", type=float, default=0, help="RINGMPI_WATCHDOG_S for the job")
    ap.add_argument("--mode", choices=("call", "cli"), default="call")
    args = ap.parse_args()
    hangs = bad = orphaned = 0
    times = []
    want = f"injected fault on rank {args.rank} at ring step {args.step}"
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.runs):
            rc, secs, err, snap = one(args, tmp, k)
            times.append(secs)
            if rc is None:
                hangs += 1
                print(f"run {k}: HANG after {secs:.1f} s; processes at the limit:", flush=True)
                print("\n".join(snap))
                print("  stderr tail: " + " | ".join(err.strip().splitlines()[-6:]), flush=True)
                continue
            ok = rc != 0 and want in err
            bad += not ok
            print(
                f"run {k}: exit {rc} in {secs:.1f} s{'' if ok else ' (NO clear message)'}",
                flush=True,
            )
            if rc != 1:  # a signal or an odd status: what the launcher said
                print("  stderr tail: " + " | ".join(err.strip().splitlines()[-4:]), flush=True)
            left = orphans()
            if left:
                orphaned += 1
                print(f"  ORPHANS after the job ended: {left}", flush=True)
    times.sort()
    print(
        f"SUMMARY mode={args.mode} P={args.ranks} fault={args.rank}:{args.step}: {args.runs} runs, "
        f"{hangs} hangs, {bad} unclear; seconds min {times[0]:.1f} median "
        f"{times[len(times) // 2]:.1f} max {times[-1]:.1f}",
        flush=True,
    )
    return int(hangs > 0 or bad > 0 or orphaned > 0)


if __name__ == "__main__":
    sys.exit(main())
