"""Helpers of the stress checks: launch MPI jobs, kill them, fill disks, fuzz inputs.

Used by tests/stress.py (``make stress``) and tests/test_stress.py (``make test``).
Everything here runs in the launching (non-MPI) process; the in-job half lives
in tests/mpi_checks.py. ``python tests/faults.py verify OUT INPUT... [--causal]``
checks an output against ringmpi.reference in a separate process, so that a
damaged input can never take the checking process down with it.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

HERE = Path(__file__).resolve().parent
MPIEXEC = str(Path(sys.executable).parent / "mpiexec")
CHECKS = str(HERE / "mpi_checks.py")

__all__ = [
    "Result",
    "launch",
    "start",
    "finish",
    "run_cli",
    "checks",
    "rank_pids",
    "digests",
    "Watch",
    "wait_for_markers",
    "markers_consistent",
    "limited_dir",
    "fuzz_cases",
    "classify",
    "verify_output",
]


@dataclass
class Result:
    """What one launched job did."""

    rc: Optional[int]  # None: killed by us after the timeout (a hang)
    out: str
    err: str
    secs: float

    @property
    def hang(self) -> bool:
        return self.rc is None

    def lines(self) -> list:
        """Non-empty stderr lines."""
        return [ln for ln in self.err.splitlines() if ln.strip()]

    def json(self) -> dict:
        """The ``RESULT {...}`` line printed by tests/mpi_checks.py (rank 0)."""
        for ln in self.out.splitlines():
            if ln.startswith("RESULT "):
                return json.loads(ln[7:])
        raise AssertionError(f"no RESULT line (rc={self.rc}):\n{self.out}\n{self.err[-2000:]}")


def _env(extra: Optional[dict]) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    for k in ("RINGMPI_TEST_FAULT", "RINGMPI_TEST_KILL_AFTER"):
        env.pop(k, None)
    env.update(extra or {})
    return env


def start(p: int, args: list, env: Optional[dict] = None, fsize: int = 0) -> subprocess.Popen:
    """Start ``mpiexec -n p python -m mpi4py ARGS`` in its own process group.

    ``fsize`` > 0: each rank limits the size of the files it writes to that many
    bytes once MPI is up (see :func:`_fsize_main`)."""
    run = ["-m", "mpi4py"] if not fsize else [__file__, "fsize", str(fsize)]
    cmd = [MPIEXEC, "-n", str(p), sys.executable, *run, *args]
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(env),
        start_new_session=True,
    )


def finish(proc: subprocess.Popen, t0: float, timeout: float) -> Result:
    """Wait for a started job; on timeout kill its whole process group and report a hang."""
    try:
        out, err = proc.communicate(timeout=max(0.1, timeout - (time.perf_counter() - t0)))
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        rc = None
    return Result(rc, out, err, time.perf_counter() - t0)


def launch(p: int, args: list, env: Optional[dict] = None, timeout: float = 120, fsize: int = 0):
    """Run a job to the end (or the timeout); return a :class:`Result`."""
    t0 = time.perf_counter()
    return finish(start(p, args, env, fsize=fsize), t0, timeout)


def run_cli(p: int, *args: str, env=None, timeout: float = 120, fsize: int = 0) -> Result:
    """``ringmpi ARGS`` on ``p`` ranks (CPU device)."""
    extra = ["--device", "cpu"] if args and args[0] == "run" else []
    return launch(p, ["-m", "ringmpi", *args, *extra], env, timeout, fsize)


def checks(p: int, mode: str, *args, env=None, timeout: float = 300) -> Result:
    """tests/mpi_checks.py MODE ARGS on ``p`` ranks."""
    return launch(p, [CHECKS, mode, *map(str, args)], env, timeout)


def rank_pids(proc: subprocess.Popen, p: int, timeout: float = 20) -> list:
    """PIDs of the ``p`` Python ranks under an mpiexec we started (waits until all exist)."""
    import psutil

    end = time.time() + timeout
    while time.time() < end:
        try:
            kids = psutil.Process(proc.pid).children(recursive=True)
            ranks = [k for k in kids if k.name().startswith("python")]
        except psutil.Error:
            ranks = []
        if len(ranks) >= p:
            return [k.pid for k in ranks]
        time.sleep(0.02)
    raise AssertionError("the ranks did not start")


def digests(out: str) -> dict:
    """SHA-256 of the final output file and of every file in its parts directory."""
    files = [out, *sorted(glob.glob(out + ".parts/*"))]
    return {os.path.basename(f): hashlib.sha256(Path(f).read_bytes()).hexdigest() for f in files}


class Watch(threading.Thread):
    """Poll a path every ``interval`` seconds; count polls that find a file under it, and
    (``validate``) files there that do not open as a complete HDF5 output."""

    def __init__(self, path: str, interval: float = 0.02, validate: bool = False):
        super().__init__(daemon=True)
        self.path, self.interval, self.validate = path, interval, validate
        self.polls = self.seen = self.incomplete = 0
        self._halt = threading.Event()

    def _complete(self) -> bool:
        import h5py

        try:
            with h5py.File(self.path, "r", locking=False) as f:
                return "format" in f.attrs and len(f.keys()) > 0
        except Exception:  # noqa: BLE001 - whatever the failure, the file is not complete
            return False

    def run(self):
        while not self._halt.is_set():
            self.polls += 1
            if os.path.lexists(self.path):
                self.seen += 1
                if self.validate and not self._complete():
                    self.incomplete += 1
            time.sleep(self.interval)

    def stop(self) -> Watch:
        self._halt.set()
        self.join()
        return self


def wait_for_markers(parts: str, n: int, proc: subprocess.Popen, timeout: float = 120) -> int:
    """Wait until ``n`` sequences are marked done (or the job ends); return the count seen."""
    end = time.time() + timeout
    while time.time() < end and proc.poll() is None:
        k = len(glob.glob(os.path.join(parts, "s*.done")))
        if k >= n:
            return k
        time.sleep(0.01)
    return len(glob.glob(os.path.join(parts, "s*.done")))


def markers_consistent(parts: str) -> tuple:
    """(markers, parts under final names, problems): every marker's parts exist with its size
    and CRC32, and every part file under a final name opens as HDF5 with out, lse, pos."""
    import zlib

    import h5py

    problems, nparts = [], 0
    markers = sorted(glob.glob(os.path.join(parts, "s*.done")))
    for m in markers:
        info = json.loads(Path(m).read_text())
        for r, (size, crc) in enumerate(info["parts"]):
            p = m[: -len(".done")] + f".r{r:05d}.h5"
            if not os.path.exists(p) or os.path.getsize(p) != size:
                problems.append(f"{p}: missing or wrong size")
            elif zlib.crc32(Path(p).read_bytes()) != crc:
                problems.append(f"{p}: CRC differs from its marker")
    for p in sorted(glob.glob(os.path.join(parts, "s*.r*.h5"))):
        nparts += 1
        try:
            with h5py.File(p, "r") as f:
                _ = f["out"][...], f["lse"][...], f["pos"][...]
        except Exception as e:  # noqa: BLE001 - any failure is an incomplete file
            problems.append(f"{p}: incomplete file under a final name ({type(e).__name__})")
    return len(markers), nparts, problems


# -- full or unwritable file systems ---------------------------------------------------------


@contextlib.contextmanager
def limited_dir(path: str, size: int):
    """A tmpfs of ``size`` bytes mounted at ``path``; yields False where mounting is not allowed
    (not root, or a container without CAP_SYS_ADMIN): the caller then falls back."""
    os.makedirs(path, exist_ok=True)
    ok = False
    if os.geteuid() == 0 and shutil.which("mount") and not os.environ.get("STRESS_NO_MOUNT"):
        cmd = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path]
        r = subprocess.run(cmd, capture_output=True, timeout=20)
        ok = r.returncode == 0
    try:
        yield ok
    finally:
        if ok:
            subprocess.run(["umount", "-l", path], capture_output=True, timeout=20)


def remount_ro(path: str) -> bool:
    """Make the tmpfs at ``path`` read-only while files are open on it."""
    r = subprocess.run(["mount", "-o", "remount,ro", path], capture_output=True, timeout=20)
    return r.returncode == 0


def _fsize_main(argv: list) -> None:
    """``python faults.py fsize N ARGS``: ``python -m mpi4py ARGS`` writing files of <= N bytes.

    MPI is initialized first (MPICH's shared-memory segments are files larger than
    the limit); then RLIMIT_FSIZE makes any larger write fail with EFBIG, SIGXFSZ
    being ignored, as a full disk makes it fail with ENOSPC. Used where mounting a
    small tmpfs is not allowed."""
    from mpi4py import MPI  # noqa: F401 - MPI_Init before the limit
    from mpi4py.run import main as mpi4py_main

    n = int(argv[0])
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (n, n))
    sys.argv = ["mpi4py", *argv[1:]]
    mpi4py_main()


# -- hostile inputs --------------------------------------------------------------------------

FUZZ_GEOM = dict(heads=2, kv_heads=1, head_dim=8)
FUZZ_LEN = 300


def fuzz_bases(d: str) -> list:
    """Small valid inputs of every structure: (files to mutate, run arguments)."""
    from ringmpi.cli.make_data import make_data

    g = FUZZ_GEOM
    groups = make_data(f"{d}/groups.h5", seq_len=FUZZ_LEN, sequences=2, **g)
    gz = make_data(f"{d}/gzip.h5", seq_len=FUZZ_LEN, compression="gzip", **g)
    batch = make_data(f"{d}/batch.h5", seq_len=FUZZ_LEN, sequences=2, batch_axis=True, **g)
    shards = make_data(f"{d}/sh.h5", seq_len=FUZZ_LEN, shards=2, **g)
    x, w = make_data(f"{d}/feat.h5", seq_len=FUZZ_LEN, features=12, **g)
    return [
        (groups, []),
        (gz, []),
        (batch, []),
        (shards, []),
        ([x], ["--weights", w]),
        ([w], ["--features-input", x]),  # the weights file is the one mutated
    ]


def _bytes_case(rng, src: str, dst: str, kind: str) -> str:
    b = bytearray(Path(src).read_bytes())
    if kind == "truncate":
        b = b[: int(rng.integers(0, len(b)))]
        what = f"truncated to {len(b)} bytes"
    elif kind == "flip":
        k = int(rng.integers(1, 21))
        for _ in range(k):
            b[int(rng.integers(0, len(b)))] ^= 1 << int(rng.integers(0, 8))
        what = f"{k} bits flipped"
    elif kind == "flip-metadata":  # the first 4 KiB: superblock, object headers, B-trees
        k = int(rng.integers(1, 9))
        for _ in range(k):
            b[int(rng.integers(0, min(4096, len(b))))] ^= 1 << int(rng.integers(0, 8))
        what = f"{k} metadata bits flipped"
    else:  # "smash": 8 bytes of 0xff or random bytes (absurd sizes, offsets, counts)
        at = int(rng.integers(0, min(4096, len(b) - 8)))
        fill = b"\xff" * 8 if rng.random() < 0.5 else rng.bytes(8)
        b[at : at + 8] = fill
        what = f"8 bytes at offset {at} smashed"
    Path(dst).write_bytes(bytes(b))
    return what


def _shape_case(rng, dst: str) -> tuple:
    """A structurally wrong input written with h5py: (description, extra run arguments)."""
    import h5py

    n, h, hkv, dd = FUZZ_LEN, 2, 1, 8
    shapes = {"q": (n, h, dd), "k": (n, hkv, dd), "v": (n, hkv, dd)}
    dtypes = {"q": "f4", "k": "f4", "v": "f4"}
    kind = rng.choice(
        [
            "D mismatch",
            "H not multiple",
            "2-D q",
            "5-D q",
            "no token",
            "one token",
            "int dtype",
            "missing v",
            "q is a group",
            "k longer",
            "batch mismatch",
            "zero heads",
        ]
    )
    if kind == "D mismatch":
        shapes["k"] = shapes["v"] = (n, hkv, dd + 1)
    elif kind == "H not multiple":
        shapes["q"], shapes["k"], shapes["v"] = (n, 3, dd), (n, 2, dd), (n, 2, dd)
    elif kind == "2-D q":
        shapes["q"] = (n, h * dd)
    elif kind == "5-D q":
        shapes = {k: (1, 1) + s for k, s in shapes.items()}
    elif kind == "no token":
        shapes = {k: (0,) + s[1:] for k, s in shapes.items()}
    elif kind == "one token":
        shapes = {k: (1,) + s[1:] for k, s in shapes.items()}
    elif kind == "int dtype":
        dtypes["k"] = "i4"
    elif kind == "missing v":
        shapes.pop("v")
    elif kind == "k longer":
        shapes["k"] = shapes["v"] = (n + 7, hkv, dd)
    elif kind == "batch mismatch":
        shapes = {"q": (2, n, h, dd), "k": (3, n, hkv, dd), "v": (3, n, hkv, dd)}
    elif kind == "zero heads":
        shapes["k"] = shapes["v"] = (n, 0, dd)
    with h5py.File(dst, "w") as f:
        for name, s in shapes.items():
            if name == "q" and kind == "q is a group":
                f.create_group("q")
                continue
            f[name] = rng.standard_normal(s).astype(dtypes[name])
    return f"wrong shapes: {kind}", []


def _absurd_case(rng, dst: str) -> tuple:
    """Declared sizes far beyond memory, stored in a few KiB; or a tight --max-memory."""
    import h5py

    kind = int(rng.integers(0, 4))
    if kind == 3:  # a real, small input run under a budget it does not fit
        from ringmpi.cli.make_data import make_data

        make_data(dst, seq_len=FUZZ_LEN, **FUZZ_GEOM)
        return "real input, --max-memory 64K", ["--max-memory", "64K"]
    s = int(2 ** rng.integers(31, 44)) if kind < 2 else int(2 ** rng.integers(24, 30))
    h, d = (64, 128) if kind == 2 else (2, 8)
    with h5py.File(dst, "w") as f:
        for name, hh in (("q", h), ("k", 1), ("v", 1)):
            f.create_dataset(name, shape=(s, hh, d), dtype="f4", chunks=(1, hh, d))
    return f"declared S={s} H={h} D={d}, no data stored", []


def fuzz_cases(d: str, count: int, seed: int = 2024):
    """Yield ``count`` hostile inputs: (kind, description, input files, extra run arguments).

    Mix: 25% truncated, 25% random bit flips, 15% metadata bit flips, 10% smashed
    header bytes, 15% wrong dataset shapes, 10% absurd declared sizes.
    """
    rng = np.random.default_rng(seed)
    bases = fuzz_bases(d)
    plan = (
        ["truncate"] * 25
        + ["flip"] * 25
        + ["flip-metadata"] * 15
        + ["smash"] * 10
        + ["shape"] * 15
        + ["absurd"] * 10
    )
    kinds = [plan[(i * 100) // count % 100] for i in range(count)]
    rng.shuffle(kinds)
    for i, kind in enumerate(kinds):
        dst = f"{d}/fz{i:03d}.h5"
        if kind == "shape":
            what, extra = _shape_case(rng, dst)
            yield kind, what, [dst], extra
        elif kind == "absurd":
            what, extra = _absurd_case(rng, dst)
            yield kind, what, [dst], extra
        else:
            files, extra = bases[int(rng.integers(0, len(bases)))]
            j = int(rng.integers(0, len(files)))
            what = _bytes_case(rng, files[j], dst, kind)
            if extra[:1] == ["--features-input"]:
                yield kind, what + " (weights)", [extra[1]], ["--weights", dst]
            else:
                mutated = list(files)
                mutated[j] = dst
                yield kind, f"{what} ({os.path.basename(files[j])})", mutated, list(extra)


CRASH_WORDS = ("Traceback", "BAD TERMINATION", "Segmentation", "core dumped", "signal")


def classify(res: Result) -> str:
    """hang, crash, clear (one 'ringmpi: error' line, exit 2), abort (an unexpected exception
    on one rank: one 'ringmpi: error on rank' line, MPI_Abort, exit 1), or ok (exit 0)."""
    if res.hang:
        return "hang"
    lines = res.lines()
    if res.rc < 0 or res.rc >= 128 or any(w in res.err for w in CRASH_WORDS):
        return "crash"
    if res.rc == 0:
        return "ok"
    mine = [ln for ln in lines if ln.startswith("ringmpi: error")]
    rest = [ln for ln in lines if not ln.startswith(("ringmpi: error", "Abort("))]
    if res.rc == 2 and len(lines) == 1 and mine:
        return "clear"
    if res.rc == 1 and len(mine) == 1 and not rest:
        return "abort"
    return "crash"


def verify_output(out: str, inputs: list, extra: list, causal: bool, timeout: float = 120):
    """Check a run's output against ringmpi.reference in a separate process: (ok, detail)."""
    cmd = [sys.executable, __file__, "verify", out, *inputs, *extra]
    cmd += ["--causal"] if causal else []
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(None))
    except subprocess.TimeoutExpired:
        return False, "verify hung"
    if r.returncode != 0:
        return False, (r.stdout + r.stderr).strip().splitlines()[-1:]
    return True, r.stdout.strip()


def _verify_main(argv: list) -> int:
    """Whole-sequence reference of each sequence (small inputs only) vs the output file."""
    import argparse

    import h5py

    from ringmpi import reference
    from ringmpi.job.input.reader import Reader
    from ringmpi.job.input.scan import scan
    from ringmpi.testing import dense

    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("inputs", nargs="+")
    ap.add_argument("--weights")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--max-memory")
    a = ap.parse_args(argv)
    plan = scan(a.inputs, a.weights)
    rd = Reader(plan, 0, 1, "contiguous")
    worst = 0.0
    with h5py.File(a.out, "r") as f:
        for s in plan.sequences:
            q, k, v = rd.read(s)
            ref, ref_lse = reference.attention(q, k, v, causal=a.causal)
            node = f[s.group] if s.group else f
            sel = (s.batch,) if s.batch is not None else ()
            o, lse = node["out"][sel], node["lse"][sel]
            if q.dtype == np.float64:
                tol = 1e-12 * max(1.0, float(np.abs(ref).max()))
                ltol = 1e-12 * max(1.0, float(np.abs(ref_lse).max()))
            else:
                do, dl = dense(q, k, v, a.causal)
                tol = 2 * float(np.abs(do - ref).max()) + 1e-6
                ltol = 2 * float(np.abs(dl - ref_lse).max()) + 1e-6
            err = float(np.abs(o - ref).max())
            lerr = float(np.abs(lse - ref_lse).max())
            if not (err <= tol and lerr <= ltol):
                print(f"{s.name}: out err {err:.3g} > tol {tol:.3g} or lse {lerr:.3g} > {ltol:.3g}")
                return 1
            worst = max(worst, err / tol, lerr / ltol)
    print(f"worst err/tol {worst:.3f}")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["verify"]:
        sys.exit(_verify_main(sys.argv[2:]))
    if sys.argv[1:2] == ["fsize"]:
        sys.exit(_fsize_main(sys.argv[2:]))
    sys.exit("usage: python tests/faults.py verify OUT INPUT... [--weights W] [--causal]")
