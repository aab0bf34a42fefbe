"""``make stress``: faults, hostile input and soak checks of ringmpi, one line per check.

    python tests/stress.py            # full version (a few minutes on 2 cores)
    python tests/stress.py --quick    # reduced version, also run by tests/test_stress.py
    python tests/stress.py --only fuzz,soak

Every check launches ``mpiexec`` (the one beside sys.executable) in a subprocess
with a timeout, prints ``PASS`` or ``FAIL`` with its figure, and the script exits
1 if any check failed. Checks:

faults    an exception on each rank mid-ring (P = 2 and 4) through RINGMPI_TEST_FAULT, from
          the library under ``python -m mpi4py`` and from ``ringmpi run``; and one raised by
          the tile kernel while the step's transfers are in flight: non-zero exit within
          10 s, message naming the rank and the cause
kill      ``ringmpi run`` killed at half way by SIGTERM (to mpiexec) and by SIGKILL (to a
          rank), then ``--resume``: SHA-256 of the output and every part equal to an
          uninterrupted run; the final name polled every 20 ms never shows an incomplete file
disk      the output file system fills up, or turns read-only, mid-run: one clear error,
          nothing under the final name, every completion marker consistent
fuzz      truncated, bit-flipped, wrongly shaped and absurdly sized HDF5 inputs: a clear
          error or a result checked against ringmpi.reference; 0 crashes, 0 hangs; absurd
          declared sizes refused by the memory budget before reading
numerics  logits x 1e3, all-equal keys, a row with one visible key; check_finite=True
soak      consecutive ring_attention calls at P = 2: no live requests or communicators,
          RSS growth < 1%, bitwise identical results
oversub   P = 8 and 16 ranks on this machine against the reference
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import faults as F  # noqa: E402
import numpy as np

FAULT_LIMIT_S = 10.0
CHECKS = ("faults", "kill", "disk", "fuzz", "numerics", "soak", "oversub")


def _line(ok: bool, text: str) -> tuple:
    return bool(ok), text


def _first_error(res: F.Result) -> str:
    mine = [ln for ln in res.lines() if ln.startswith("ringmpi: error")]
    return (mine or res.lines() or ["(no message)"])[0]


# -- 1. faults ---------------------------------------------------------------------------


def check_faults(tmp: Path, quick: bool):
    """Inject a RuntimeError on each rank at the middle ring step, library and CLI."""
    from ringmpi.cli.make_data import make_data

    inp = make_data(str(tmp / "fault.h5"), seq_len=400, heads=2, kv_heads=1, head_dim=16)
    for p in (2, 4):
        step = p // 2
        for r in range(p):
            # backstop: should the launcher not tear the job down after the abort (seen
            # once under Open MPI 4.1 in ~200 runs, not reproduced since), the surviving
            # ranks' watchdog ends their ring wait after 5 s (exit 124) and the job with it
            env = {"RINGMPI_TEST_FAULT": f"{r}:{step}", "RINGMPI_WATCHDOG_S": "5"}
            want = f"injected fault on rank {r} at ring step {step}"
            lib = F.checks(p, "call", env=env, timeout=60)
            out = str(tmp / f"fault-{p}-{r}.h5")
            cli = F.run_cli(p, "run", *inp, "-o", out, "--quiet", env=env, timeout=60)
            for how, res in (("library", lib), ("ringmpi run", cli)):
                named = want in res.err
                if how == "ringmpi run":
                    named = named and f"ringmpi: error on rank {r}: RuntimeError" in res.err
                    named = named and not os.path.exists(out)
                ok = not res.hang and res.rc != 0 and res.secs < FAULT_LIMIT_S and named
                rc = "hang" if res.hang else f"exit {res.rc}"
                yield _line(
                    ok,
                    f"fault-injection P={p} rank={r} step={step} ({how}): {rc} in "
                    f"{res.secs:.1f} s, message {'names' if named else 'DOES NOT name'} "
                    f"rank {r} and the cause",
                )
        # a failure inside the tile kernel, after the step's 2 MiB exchange was posted
        r = p - 1
        res = F.checks(p, "tile-fault", r, step, env={"RINGMPI_WATCHDOG_S": "5"}, timeout=60)
        named = f"tile fault on rank {r} at ring step {step}" in res.err
        ok = not res.hang and res.rc != 0 and res.secs < FAULT_LIMIT_S and named
        rc = "hang" if res.hang else f"exit {res.rc}"
        yield _line(
            ok,
            f"fault-in-tile P={p} rank={r} step={step} (library, 2 MiB K/V transfers in "
            f"flight): {rc} in {res.secs:.1f} s, message {'names' if named else 'DOES NOT name'}"
            f" rank {r} and the cause",
        )


# The kill and disk checks inspect OUT.h5.parts/ (markers, part files): they ask
# for the part-file output also where h5py has MPI and the default is one file
# (tests/job/output/test_single_file.py kills and resumes the one-file output).
PARTS = ("--output-mode", "parts")


# -- 2. kill and resume --------------------------------------------------------------------


def _kill_input(tmp: Path, quick: bool) -> tuple:
    from ringmpi.cli.make_data import make_data

    nseq = 6 if quick else 8
    seq_len = 4096 if quick else 6144
    kw = dict(heads=4, kv_heads=2, head_dim=32)
    return make_data(str(tmp / "kill.h5"), seq_len=seq_len, sequences=nseq, **kw), nseq


def check_kill(tmp: Path, quick: bool):
    """SIGTERM to mpiexec / SIGKILL to one rank at half way, then --resume."""
    inp, nseq = _kill_input(tmp, quick)
    ref = tmp / "ref" / "out.h5"
    ref.parent.mkdir()
    res = F.run_cli(2, "run", *inp, "-o", str(ref), "--quiet", *PARTS, timeout=300)
    if res.rc != 0:
        yield _line(False, f"kill: uninterrupted run failed: {_first_error(res)}")
        return
    want = F.digests(str(ref))
    for sig in (signal.SIGTERM, signal.SIGKILL):
        name = signal.Signals(sig).name
        out = tmp / name / "out.h5"
        out.parent.mkdir()
        args = ["-m", "ringmpi", "run", *inp, "-o", str(out), "--quiet", "--device", "cpu", *PARTS]
        watch = F.Watch(str(out))
        watch.start()
        t0 = time.perf_counter()
        proc = F.start(2, args)
        pids = F.rank_pids(proc, 2)
        done_at_kill = F.wait_for_markers(str(out) + ".parts", nseq // 2, proc)
        t_kill = time.perf_counter()
        if sig == signal.SIGTERM:
            os.kill(proc.pid, sig)  # mpiexec forwards it to the ranks
            whom = "mpiexec"
        else:
            os.kill(max(pids), sig)  # one rank dies; mpiexec must tear the other down
            whom = "one rank"
        killed = F.finish(proc, t0, 120)
        down_s = time.perf_counter() - t_kill
        w1 = watch.stop()
        nmark, nparts, problems = F.markers_consistent(str(out) + ".parts")
        # resume, still watching: the final file may appear, but only complete
        watch = F.Watch(str(out), validate=True)
        watch.start()
        res = F.run_cli(2, "run", *inp, "-o", str(out), "--resume", *PARTS, timeout=300)
        w2 = watch.stop()
        got = F.digests(str(out)) if res.rc == 0 else {}
        skipped = f"({nmark} already done)" in res.out
        ok = (
            not killed.hang
            and killed.rc != 0
            and 0 < done_at_kill < nseq
            and w1.seen == 0
            and w2.incomplete == 0
            and not problems
            and res.rc == 0
            and skipped
            and got == want
        )
        detail = problems[0] if problems else f"{nmark} markers + {nparts} parts consistent"
        yield _line(
            ok,
            f"kill {name} to {whom} at {done_at_kill}/{nseq} sequences: job gone in "
            f"{down_s:.2f} s (exit {killed.rc}), nothing under the final name in "
            f"{w1.polls} polls (20 ms), {detail}; --resume redid {nseq - nmark}"
            f"{'' if skipped else ' (NOT SKIPPED)'}: SHA-256 of out.h5 + {len(got) - 1} "
            f"files of parts/ "
            f"{'identical to' if got == want else 'DIFFER from'} an uninterrupted run, "
            f"final file complete in {w2.seen - w2.incomplete} of the {w2.polls} polls that ran "
            f"with the resumed job ({w2.incomplete} incomplete)",
        )


# -- 3. disk full / unwritable ------------------------------------------------------------------


def _grow_input(path: Path) -> str:
    """Eight sequences, four short then four long: the part files grow mid-run."""
    import h5py

    rng = np.random.default_rng(9)
    with h5py.File(path, "w") as f:
        for i, n in enumerate([1024] * 4 + [4096] * 4):
            g = f.create_group(f"seq{i:03d}")
            g["q"] = rng.standard_normal((n, 4, 32)).astype("f4")
            g["k"] = rng.standard_normal((n, 2, 32)).astype("f4")
            g["v"] = rng.standard_normal((n, 2, 32)).astype("f4")
    return str(path)


def _disk_verdict(label: str, res: F.Result, out: Path, words: tuple, nseq: int) -> tuple:
    lines = res.lines()
    nmark, nparts, problems = F.markers_consistent(str(out) + ".parts")
    err = _first_error(res)
    clear = (
        res.rc == 2
        and len(lines) == 1
        and err.startswith("ringmpi: error: ")
        and "cannot write" in err
        and any(w in err for w in words)
    )
    ok = clear and not os.path.lexists(out) and not problems and 0 < nmark < nseq
    detail = problems[0] if problems else f"{nmark} markers consistent"
    rc = "hang" if res.hang else f"exit {res.rc}"
    return _line(
        ok,
        f"{label}: {rc} in {res.secs:.1f} s after {nmark}/{nseq} sequences, "
        f"nothing under the final name{'' if not os.path.lexists(out) else ' - FILE EXISTS'}, "
        f"{detail}; message: {err}",
    )


def check_disk(tmp: Path, quick: bool):
    """Output file system full mid-run; output file system turned read-only mid-run."""
    grow = _grow_input(tmp / "grow.h5")
    # full: a 3 MiB tmpfs holds the four short sequences' parts (~0.5 MiB each) but not
    # the long ones; without mount rights, RLIMIT_FSIZE of 600 KiB per file does the same
    mnt = tmp / "full"
    with F.limited_dir(str(mnt), 3 << 20) as mounted:
        out = mnt / "out.h5"
        lim = 0 if mounted else 600 << 10
        res = F.run_cli(2, "run", grow, "-o", str(out), "--quiet", *PARTS, timeout=120, fsize=lim)
        how = "tmpfs of 3 MiB" if mounted else "RLIMIT_FSIZE 600 KiB"
        words = ("No space left", "File too large", "Errno 28", "errno = 27", "errno = 28")
        yield _disk_verdict(f"disk-full ({how})", res, out, words, 8)
    # unwritable: remount the tmpfs read-only (or, without mount rights, put a plain file
    # where the parts directory was: root ignores permission bits) after two sequences
    inp, nseq = _kill_input(tmp, quick)
    mnt = tmp / "ro"
    with F.limited_dir(str(mnt), 256 << 20) as mounted:
        out = mnt / "out.h5"
        parts = str(out) + ".parts"
        t0 = time.perf_counter()
        args = ["-m", "ringmpi", "run", *inp, "-o", str(out), "--quiet", "--device", "cpu", *PARTS]
        proc = F.start(2, args)
        F.wait_for_markers(parts, 2, proc)
        if mounted:
            how = "tmpfs remounted read-only"
            while proc.poll() is None and not F.remount_ro(str(mnt)):
                time.sleep(0.005)  # EBUSY while a file is open for writing: retry
        else:
            how = "parts directory replaced by a file"
            os.rename(parts, parts + ".moved")
            Path(parts).write_text("not a directory\n")
        res = F.finish(proc, t0, 120)
        if not mounted:
            os.remove(parts)
            os.rename(parts + ".moved", parts)
        words = ("Read-only", "Not a directory", "Errno 30", "Errno 20")
        yield _disk_verdict(f"output unwritable mid-run ({how})", res, out, words, nseq)


# -- 4. hostile input --------------------------------------------------------------------------


def check_fuzz(tmp: Path, quick: bool):
    """Fuzzed HDF5 inputs at P = 2, each in a subprocess with a timeout."""
    count = 20 if quick else 200
    d = tmp / "fuzz"
    d.mkdir()
    tally = {k: 0 for k in ("clear", "abort", "ok", "wrong", "crash", "hang", "leftover")}
    budget = absurd = 0
    slowest = 0.0
    bad = []
    for i, (kind, what, files, extra) in enumerate(F.fuzz_cases(str(d), count)):
        out = d / f"out{i:03d}.h5"
        causal = i % 2 == 1
        res = F.run_cli(
            2,
            "run",
            *files,
            "-o",
            str(out),
            "--quiet",
            *extra,
            *(["--causal"] if causal else []),
            timeout=60,
        )
        cls = F.classify(res)
        slowest = max(slowest, res.secs)
        if cls == "ok":
            good, detail = F.verify_output(str(out), files, extra, causal)
            cls = "ok" if good else "wrong"
            if not good:
                bad.append(f"{what}: wrong result {detail}")
        elif os.path.lexists(out):
            tally["leftover"] += 1
            bad.append(f"{what}: file under the final name after an error")
        if cls in ("crash", "hang"):
            bad.append(f"{what}: {cls} rc={res.rc} {res.err[-300:]!r}")
        tally[cls] += 1
        if kind == "absurd":
            absurd += 1
            # refused before reading: by the budget, the shape cap, or (issue 22) as never
            # written / stored in too many tiny chunks
            words = ("over the budget", "absurd shape", "fill values", "rechunk")
            if cls == "clear" and any(w in res.err for w in words):
                budget += 1
            else:
                bad.append(f"{what}: not refused by the memory budget ({_first_error(res)})")
        for p in d.glob(f"out{i:03d}.h5*"):
            shutil.rmtree(p) if p.is_dir() else p.unlink()
        for p in files:
            if Path(p).name.startswith("fz"):
                Path(p).unlink()
        if extra[:1] == ["--weights"] and Path(extra[1]).name.startswith("fz"):
            Path(extra[1]).unlink()
    ok = not (tally["wrong"] or tally["crash"] or tally["hang"] or tally["leftover"])
    yield _line(
        ok,
        f"fuzz {count} hostile HDF5 inputs P=2: {tally['clear']} clear errors (exit 2), "
        f"{tally['abort']} rank aborts naming the rank (exit 1), {tally['ok']} results "
        f"matching ringmpi.reference, {tally['wrong']} wrong, {tally['crash']} crashes, "
        f"{tally['hang']} hangs; slowest {slowest:.1f} s"
        + (f"; first problem: {bad[0]}" if bad and not ok else ""),
    )
    yield _line(
        budget == absurd and absurd > 0,
        f"memory budget: {budget}/{absurd} absurd declared sizes (up to 2^43 tokens, or a "
        f"64K --max-memory) refused before reading with one clear line",
    )


# -- 5. numerics ------------------------------------------------------------------------------


def check_numerics(tmp: Path, quick: bool):
    """Large logits, equal keys, one visible key; and the check_finite policy."""
    for p in (2,) if quick else (2, 3, 4):
        res = F.checks(p, "numerics", timeout=180)
        if res.rc != 0:
            yield _line(False, f"numerics P={p}: exit {res.rc}: {res.err[-300:]}")
            continue
        r = res.json()
        yield _line(
            r["ok"],
            f"numerics P={p}: {r['cases']} cases (logits x1e3, all-equal keys, one visible "
            f"key; f32/f64; 3 layouts) finite, worst err/tol {r['worst_ratio']:.2f}, "
            f"one-key rows equal v[0] bit for bit" + (f"; {r['bad']}" if not r["ok"] else ""),
        )
    p = 2 if quick else 4
    res = F.checks(p, "finite", timeout=60)
    r = res.json() if res.rc == 0 else {"ok": False, "raised": 0, "ranks": p, "s": 0}
    yield _line(
        r["ok"],
        f"check_finite P={p}: NaN on rank {p - 1} -> ValueError naming NaN on "
        f"{r['raised']}/{r['ranks']} ranks in {r['s']:.2f} s (default: NaN propagates)",
    )


# -- 6. soak ----------------------------------------------------------------------------------


def check_soak(tmp: Path, quick: bool):
    """Consecutive calls at P = 2 (full: past MPICH's 2046 context ids)."""
    calls = 100 if quick else 2100
    res = F.checks(2, "soak", calls, timeout=600)
    if res.rc != 0:
        yield _line(False, f"soak {calls} calls P=2: exit {res.rc}: {res.err[-300:]}")
        return
    r = res.json()
    yield _line(
        r["ok"],
        f"soak {r['calls']} ring_attention calls P=2 in {r['s']:.1f} s: {r['live_requests']} "
        f"live MPI requests, {r['gc_request_growth']} more Request objects, "
        f"{r['unfreed_comms']} unfreed Cartesian comms of {r['rings_made']} made "
        f"({'past' if r['calls'] > 2046 else 'below'} the 2046 context ids a leak would "
        f"exhaust), {r['alive_rings']} Ring objects alive; RSS {r['rss0_mb']:.1f} -> "
        f"{r['rss1_mb']:.1f} MiB ({100 * r['rss_growth']:+.2f}%, limit 1%; "
        f"{100 * r['rss_trimmed_growth']:+.2f}% after malloc_trim); results "
        f"{'bitwise identical' if r['identical'] else 'DIFFER'} every call",
    )


# -- 7. oversubscription ----------------------------------------------------------------------


def check_oversub(tmp: Path, quick: bool):
    """P = 8 and 16 ranks on a 2-core machine."""
    for p, n in ((8, 203),) if quick else ((8, 1003), (16, 1003)):
        res = F.checks(p, "oversub", n, timeout=300)
        if res.rc != 0:
            rc = "hang" if res.hang else f"exit {res.rc}"
            yield _line(False, f"oversubscribed P={p} n={n}: {rc} {res.err[-300:]}")
            continue
        r = res.json()
        yield _line(
            r["ok"],
            f"oversubscribed P={p} on {os.cpu_count()} cores, n={n}: {r['cases']} cases "
            f"(3 layouts x causal x f32/f64) match the reference, worst err/tol "
            f"{r['worst_ratio']:.2f}, {r['wall_s']:.1f} s",
        )


def run_check(name: str, quick: bool, tmp_root: str | None = None) -> list:
    """Run one check in a fresh temporary directory; return its (ok, text) lines."""
    fn = globals()[f"check_{name}"]
    # kill and disk count finished sequences by their markers as the job goes: one
    # sequence per ring call there (batches of several: tests/job/test_resources_batches.py)
    saved = os.environ.get("RINGMPI_BATCH_TOKENS")
    if name in ("kill", "disk"):
        os.environ["RINGMPI_BATCH_TOKENS"] = "0"
    with tempfile.TemporaryDirectory(prefix=f"ringmpi-stress-{name}-", dir=tmp_root) as d:
        try:
            return list(fn(Path(d), quick))
        except Exception as e:  # noqa: BLE001 - a broken check is a failed check
            return [_line(False, f"{name}: the check itself failed: {type(e).__name__}: {e}")]
        finally:
            if saved is None:
                os.environ.pop("RINGMPI_BATCH_TOKENS", None)
            else:
                os.environ["RINGMPI_BATCH_TOKENS"] = saved


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="reduced version (as in make test)")
    ap.add_argument("--only", help=f"comma-separated subset of {','.join(CHECKS)}")
    a = ap.parse_args(argv)
    names = a.only.split(",") if a.only else list(CHECKS)
    t0 = time.perf_counter()
    failed = 0
    for name in names:
        for ok, text in run_check(name, a.quick):
            failed += not ok
            print(f"{'PASS' if ok else 'FAIL'} {text}", flush=True)
    mode = "quick" if a.quick else "full"
    print(f"stress ({mode}): {failed} failed, {time.perf_counter() - t0:.0f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
