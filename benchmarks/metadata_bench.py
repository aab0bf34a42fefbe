"""Per-sequence metadata costs of the batch job on a file of many groups, beside plain h5py.

    python benchmarks/metadata_bench.py [--sequences 2000] [--json FILE]

On a seeded file of N tiny groups (q, k, v each), in one run:

* ``scan``: the job's plan scan of the file (:func:`ringmpi.job.input.files.scan_file`:
  the link walk, every dataset's dtype, shape, storage and trust checks), per group;
* ``h5py peer``: a plain h5py loop over the same groups reading each dataset's
  shape and dtype (no checks): what any reader of the file pays;
* ``vds``: the part-file output's virtual-dataset file for N sequences over 2
  ranks (:func:`ringmpi.job.output.layout.write_vds`), per sequence;
* ``h5py vds peer``: h5py's own ``create_virtual_dataset`` for the same mappings
  (one VirtualSource per rank's run), per sequence.

Ratios below 1 mean ringmpi's step costs less than the plain h5py one. Timings
are the best of ``--repeat`` runs (the machine may be shared).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from types import SimpleNamespace

import numpy as np


def write_groups(path: str, n: int, length: int = 16) -> None:
    """N groups ``seq00000``.. with q (L, 4, 8), k and v (L, 2, 8), float32, seeded."""
    import h5py

    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        for i in range(n):
            g = f.create_group(f"seq{i:05d}")
            g["q"] = rng.standard_normal((length, 4, 8), dtype=np.float32)
            g["k"] = 0.5 + rng.standard_normal((length, 2, 8), dtype=np.float32)
            g["v"] = 1.0 + rng.standard_normal((length, 2, 8), dtype=np.float32)


def peer_scan(path: str) -> int:
    """Shapes and dtypes of every group's q, k, v with plain h5py (the peer)."""
    import h5py

    seen = 0
    with h5py.File(path, "r") as f:
        for name in f:
            g = f[name]
            for d in ("q", "k", "v"):
                ds = g[d]
                seen += len(ds.shape) + (ds.dtype.kind == "f")
    return seen


def _plan(n: int, length: int):
    seqs = [
        SimpleNamespace(
            name=f"seq{i:05d}",
            group=f"seq{i:05d}",
            length=length,
            length_k=length,
            cu_seqlens=None,
            cu_seqlens_k=None,
        )
        for i in range(n)
    ]
    return SimpleNamespace(
        sequences=seqs, heads=4, head_dim=64, dtype="float32", structure="groups"
    )


def peer_vds(path: str, plan, parts: str) -> None:
    """The same virtual datasets through h5py's high-level VirtualLayout (the peer)."""
    import h5py

    from ringmpi.job.output.layout import part_name
    from ringmpi.layout import local_runs, positions

    rel = os.path.basename(parts)
    with h5py.File(path, "w") as f:
        for i, s in enumerate(plan.sequences):
            g = f.create_group(s.group)
            for name, shape in (("out", (s.length, 4, 64)), ("lse", (4, s.length))):
                lay = h5py.VirtualLayout(shape, "f4")
                for r in range(2):
                    pos = positions(s.length, r, 2, "zigzag")
                    src_shape = (len(pos), 4, 64) if name == "out" else (4, len(pos))
                    src = h5py.VirtualSource(f"{rel}/{part_name(i, r)}", name, shape=src_shape)
                    for g0, cnt, step, o in local_runs(pos):
                        sel = slice(g0, g0 + cnt * step, step)
                        if name == "out":
                            lay[sel] = src[o : o + cnt]
                        else:
                            lay[:, sel] = src[:, o : o + cnt]
                g.create_virtual_dataset(name, lay, fillvalue=np.nan)


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def measure(n: int, repeat: int, folder: str) -> dict:
    """Seconds per group/sequence of each step, and the ratios."""
    from ringmpi.job.input.files import scan_file
    from ringmpi.job.output.layout import write_vds

    inp = os.path.join(folder, "groups.h5")
    write_groups(inp, n)
    scan = best(lambda: scan_file(inp, None), repeat) / n
    peer = best(lambda: peer_scan(inp), repeat) / n
    plan = _plan(n, 256)
    out = os.path.join(folder, "out.h5")
    parts = out + ".parts"
    os.mkdir(parts)
    where = {i: (i,) for i in range(n)}
    vds = best(lambda: write_vds(out, plan, {}, parts, 2, "zigzag", where), repeat) / n
    vpeer = best(lambda: peer_vds(os.path.join(folder, "peer.h5"), plan, parts), repeat) / n
    return {
        "sequences": n,
        "scan_ms": scan * 1e3,
        "h5py_scan_ms": peer * 1e3,
        "scan_ratio": scan / peer,
        "vds_ms": vds * 1e3,
        "h5py_vds_ms": vpeer * 1e3,
        "vds_ratio": vds / vpeer,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sequences", type=int, default=2000, help="groups in the file (2000)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per step; the best counts")
    ap.add_argument("--json", default=None, metavar="FILE", help="write the numbers as JSON")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ringmpi-meta-") as d:
        r = measure(a.sequences, a.repeat, d)
    print(f"{r['sequences']} sequences (ms per group / sequence, best of {a.repeat}):")
    print(
        f"  plan scan      {r['scan_ms']:7.3f}   h5py peer {r['h5py_scan_ms']:7.3f}   "
        f"ratio {r['scan_ratio']:.2f}"
    )
    print(
        f"  vds index      {r['vds_ms']:7.3f}   h5py peer {r['h5py_vds_ms']:7.3f}   "
        f"ratio {r['vds_ratio']:.2f}"
    )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
