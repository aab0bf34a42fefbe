"""Hostile input files (issue 22, items 4-7): each makes ``ringmpi run`` stop with one line.

``make(kind, dir)`` writes one crafted input (and whatever it points at) into ``dir``
and returns (input path, words the error line must contain). ``KINDS`` lists them.
Used by tests/job/input/test_files_hostile.py and by tests/security/run.sh (``--check``: run
every kind through the CLI, bounded in time and memory, and report).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np

S, H, D = 64, 2, 8
LIMIT_S, LIMIT_MIB = 10.0, 200


def _values(rng, shape):
    """Values shaped like activations: a nonzero mean per head and a small spread."""
    return (0.7 + 0.05 * rng.standard_normal(shape)).astype(np.float32)


def _secret(d: Path) -> Path:
    """A file the input points at (in the attacks: a file only root may read)."""
    p = d / "secret.h5"
    with h5py.File(p, "w") as f:
        for n in "qkv":
            f[n] = np.full((S, H, D), 42.0, np.float32)
    raw = d / "secret.bin"
    raw.write_bytes(np.full(S * H * D, 42.0, np.float32).tobytes())
    return p


def _good(f, rng, skip=()):
    for n in "qkv":
        if n not in skip:
            f[n] = _values(rng, (S, H, D))


def make(kind: str, d: Path) -> tuple[Path, list]:
    """Write the hostile input ``kind`` into ``d``; (its path, words expected in the error)."""
    d = Path(d)
    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    secret = _secret(d)
    p = d / f"{kind}.h5"
    if kind == "fifo":
        os.mkfifo(p)
        return p, ["not a regular file"]
    with h5py.File(p, "w") as f:
        if kind == "external_link":
            _good(f, rng, skip="q")
            f["q"] = h5py.ExternalLink(str(secret), "/q")
            want = ["external link", "secret.h5"]
        elif kind == "external_group":
            g = f.create_group("seq0")
            _good(g, rng)
            f["seq1"] = h5py.ExternalLink(str(secret), "/")
            want = ["external link", "'/seq1'"]
        elif kind == "external_storage":
            _good(f, rng, skip="k")
            f.create_dataset(
                "k", (S, H, D), "f4", external=[(str(d / "secret.bin"), 0, S * H * D * 4)]
            )
            want = ["external file", "secret.bin", "'/k'"]
        elif kind == "virtual":
            _good(f, rng, skip="v")
            lay = h5py.VirtualLayout((S, H, D), "f4")
            lay[:] = h5py.VirtualSource(str(secret), "v", shape=(S, H, D))
            f.create_virtual_dataset("v", lay)
            want = ["virtual dataset", "'/v'", "RINGMPI_ALLOW_VDS"]
        elif kind == "never_written":
            _good(f, rng, skip="q")
            f.create_dataset("q", (S, H, D), "f4")
            want = ["'/q'", "bytes written", "fill values"]
        elif kind == "custom_fill":
            _good(f, rng, skip="v")
            f.create_dataset("v", (S, H, D), "f4", fillvalue=0.5)
            want = ["'/v'", "bytes written"]
        elif kind == "half_written":
            _good(f, rng, skip="k")
            ds = f.create_dataset("k", (S, H, D), "f4", chunks=(8, H, D))
            ds[: S // 2] = _values(rng, (S // 2, H, D))
            want = ["'/k'", "chunks written", "fill values"]
        elif kind == "long_cu_seqlens":  # 2**27 offsets declared for 64 tokens, never read
            _good(f, rng)
            f.create_dataset("cu_seqlens", (1 << 27,), "i8", chunks=(1 << 16,), compression="gzip")
            want = ["cu_seqlens", "packed sequences"]
        elif kind == "cu_seqlens_bomb":  # a valid-looking, well-compressed, huge cu_seqlens
            _good(f, rng)
            cu = np.zeros(1 << 22, np.int64)
            cu[-1] = S
            f.create_dataset("cu_seqlens", data=cu, chunks=(1 << 18,), compression="gzip")
            want = ["cu_seqlens", "offsets for 64 tokens"]
        elif kind == "cu_seqlens_wrap":  # np.diff wraps: [0, 2**62, -2**63+1, 64]
            _good(f, rng)
            f["cu_seqlens"] = np.array([0, 1 << 62, -(1 << 63) + 1, S], np.int64)
            want = ["cu_seqlens", "offset beyond"]
        elif kind == "tiny_chunks":  # 65,536+ chunks of 4 bytes: memory far beyond the data
            n = 8200
            for name in "qkv":
                ds = f.create_dataset(name, (n, H, D), "f4", chunks=(1, 1, 1))
                if name == "q":
                    ds[...] = _values(rng, (n, H, D))
            want = ["'/q'", "chunks", "rechunk"]
        else:
            raise ValueError(f"unknown hostile input {kind!r}")
    return p, want


KINDS = (
    "fifo",
    "external_link",
    "external_group",
    "external_storage",
    "virtual",
    "never_written",
    "custom_fill",
    "half_written",
    "long_cu_seqlens",
    "cu_seqlens_bomb",
    "cu_seqlens_wrap",
    "tiny_chunks",
)


_MEASURE = (
    "import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
    "ru = resource.getrusage(resource.RUSAGE_CHILDREN); "
    "sys.stderr.write(f'\\nRSS_KIB={ru.ru_maxrss}\\n'); sys.exit(r.returncode)"
)


def run_cli(inp: Path, out: Path, env=None, ranks: int = 1) -> dict:
    """Run ``ringmpi run INP -o OUT`` (under mpiexec when ``ranks`` > 1); rc, stderr, s, MiB.

    A small wrapper process runs the job and reports the peak RSS of its children
    (the largest rank), so earlier runs of this process do not count.
    """
    py = sys.executable
    cmd = [py, "-m", "mpi4py", "-m", "ringmpi", "run", str(inp), "-o", str(out), "--quiet"]
    if ranks > 1:
        mpiexec = os.path.join(os.path.dirname(py), "mpiexec")
        cmd = [mpiexec, "-n", str(ranks), *cmd]
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [py, "-c", _MEASURE, *cmd],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    wall = time.monotonic() - t0
    lines = err.splitlines()
    kib = [int(x.split("=", 1)[1]) for x in lines if x.startswith("RSS_KIB=")]
    err = "\n".join(x for x in lines if not x.startswith("RSS_KIB="))
    return {"rc": proc.returncode, "err": err, "s": wall, "mib": (kib[0] if kib else 0) / 1024}


def check(kind: str, d: Path, env=None, ranks: int = 1) -> list:
    """Problems with how the job treats hostile input ``kind`` (empty when it fails closed)."""
    inp, want = make(kind, d / kind)
    out = d / kind / "out.h5"
    r = run_cli(inp, out, env=env, ranks=ranks)
    lines = [x for x in r["err"].splitlines() if x.strip()]
    bad = []
    if r["rc"] != 2:
        bad.append(f"exit {r['rc']}, not 2")
    if len(lines) != 1:
        bad.append(f"{len(lines)} lines on stderr: {lines[:4]}")
    elif not all(w in lines[0] for w in want):
        bad.append(f"line lacks {want}: {lines[0]}")
    if out.exists():
        bad.append("something is under the final name")
    if r["s"] > LIMIT_S:
        bad.append(f"took {r['s']:.1f} s")
    if r["mib"] > LIMIT_MIB:
        bad.append(f"peak RSS {r['mib']:.0f} MiB")
    return bad


if __name__ == "__main__":  # python tests/security/hostile.py DIR: every kind, one line each
    root = Path(sys.argv[1])
    failed = 0
    for k in KINDS:
        problems = check(k, root)
        print(f"hostile input {k:18s} {'FAIL: ' + '; '.join(problems) if problems else 'ok'}")
        failed += bool(problems)
    sys.exit(1 if failed else 0)
