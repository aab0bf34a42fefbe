"""The fused CPU tiles against a baseline revision: accuracy on real-shaped values and speed.

    python benchmarks/kernel_ab.py                       # accuracy table + speed, baseline HEAD
    python benchmarks/kernel_ab.py --baseline 78b76ac    # compare with the kernels of a revision
    python benchmarks/kernel_ab.py --accuracy --keys 4096 16384 65536 262144
    python benchmarks/kernel_ab.py --speed --n 8192 --d 64 --rounds 9
    python benchmarks/kernel_ab.py --mods --n 4096 --causal  # softcap / ALiBi cost, current
    python benchmarks/kernel_ab.py --packed --baseline main    # packed short causal sequences

Accuracy: queries standard normal, keys mean 0.5, values mean 1 and spread 0.1 (the shape
of real activations, where float32 rounding errors do not cancel as they do for zero-mean
normals). One head, D=32, 256 query rows against N keys (forward and dq), and N query rows
against 256 keys (dk, dv: their sums run over the queries). Each column is the largest
error against the dense float64 reference divided by that of a dense float32 computation
(``ringmpi.reference`` in float32, the yardstick of the tests' tolerance rule); the exit
status is 1 when a current kernel's ratio exceeds ``--limit`` (default 2).

Speed: both builds of each tile on the same arrays, interleaved A B B A for ``--rounds``
rounds in one process (so machine noise hits both alike); medians in GFLOP/s and the
ratio current / baseline.

Packed (``--packed``): batches of ``--tokens`` tokens of causal sequences of each length in
``--lens`` (per-row bounds lo = (pos // S) S, hi = pos, as a batch of many short sequences
is run) and one plain causal tile of ``--n`` tokens, H=``--heads``, Hkv=``--kv-heads``,
float32; both builds forward and backward alternated A B B A, best of ``--rounds``, in
GFLOP/s of 4 D H (forward) or 10 D H (backward) per visible pair.

Modifiers (``--mods``): the current tiles plain, with softcap (30), with ALiBi (standard
slopes) and with both, interleaved in one process, CPU time; GFLOP/s and the ratio to
plain (the same flops are counted, so the ratio is the modifier's cost).

The baseline's kernel sources come from ``git show REV:kernels/...`` into a private
temporary directory and are compiled through ``ringmpi.cpu.build`` (its cache, its flags).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from ringmpi import reference, softmax
from ringmpi.cpu import build, fused, fused_backward, numpy_tile
from ringmpi.cpu import isa as cpu_isa

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("cpu_tile.c", "cpu_backward.c")


def baseline_dir(rev: str, tmp: str) -> str:
    """Write the kernel sources of git revision ``rev`` (and its kernels/*.h) into ``tmp``."""
    headers = subprocess.run(
        ["git", "-C", str(ROOT), "ls-tree", "--name-only", f"{rev}:kernels"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    for name in (*SOURCES, *(h for h in headers if h.endswith(".h"))):
        text = subprocess.run(
            ["git", "-C", str(ROOT), "show", f"{rev}:kernels/{name}"],
            check=True,
            capture_output=True,
        ).stdout
        with open(
            os.open(os.path.join(tmp, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb"
        ) as f:
            f.write(text)
    return tmp


def kernels(isa: str, source_dir):
    """(forward Kernel, backward library) built for ``isa`` from ``source_dir`` (None: current)."""
    old = os.environ.get("RINGMPI_KERNEL_DIR")
    if source_dir is None:
        os.environ.pop("RINGMPI_KERNEL_DIR", None)
    else:
        os.environ["RINGMPI_KERNEL_DIR"] = source_dir
    try:
        fwd = fused.Kernel(build.build_library("cpu_tile.c", isa))
        bwd = fused_backward.open_library(build.build_library("cpu_backward.c", isa))
    finally:
        if old is None:
            os.environ.pop("RINGMPI_KERNEL_DIR", None)
        else:
            os.environ["RINGMPI_KERNEL_DIR"] = old
    return fwd, bwd


def real_shaped(rng, sq: int, sk: int, h: int = 1, d: int = 32):
    """q (1, H, Sq, D) standard normal; k mean 0.5; v mean 1, spread 0.1; dO mean 0.2 (float64)."""
    q = rng.standard_normal((1, h, sq, d))
    k = 0.5 + rng.standard_normal((1, h, sk, d))
    v = 1.0 + 0.1 * rng.standard_normal((1, h, sk, d))
    do = 0.2 + 0.1 * rng.standard_normal((1, h, sq, d))
    return q, k, v, do


def positions(sq: int, sk: int):
    """Queries are the last ``sq`` tokens when ``sq <= sk``, else all of them (non-causal)."""
    return np.arange(max(sk - sq, 0), max(sk - sq, 0) + sq, dtype=np.int64), np.arange(
        sk, dtype=np.int64
    )


def forward(tile, q, k, v, finalize):
    """out, lse of one non-causal tile call from an empty state (head-major arrays)."""
    b, h, sq, d = q.shape
    acc = np.zeros((b, h, sq, d), q.dtype)
    m = np.full((b, h, sq), -np.inf, q.dtype)
    l = np.zeros((b, h, sq), q.dtype)
    qp, kp = positions(sq, k.shape[2])
    tile(q, k, v, qp, kp, acc, m, l, scale=1 / np.sqrt(d), causal=False)
    return finalize(acc, m, l)


def gradients(fwd, bwd_lib, q, k, v, do):
    """dq, dk, dv through the fused forward (out, lse, delta as the ring backward forms them)."""
    out, lse = forward(fwd.forward_tile, q, k, v, fwd.finalize)
    delta = (do * out).sum(-1)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    qp, kp = positions(q.shape[2], k.shape[2])
    fused_backward.backward_tile_with(
        bwd_lib,
        q,
        k,
        v,
        do,
        lse,
        delta,
        qp,
        kp,
        dq,
        dk,
        dv,
        scale=1 / np.sqrt(q.shape[-1]),
        causal=False,
    )
    return dq, dk, dv


def seq_major(x):
    return np.moveaxis(x, 1, 2)


def err(a, ref) -> float:
    return float(np.abs(np.asarray(a, np.float64) - ref).max() / max(np.abs(ref).max(), 1e-300))


def accuracy(builds: dict, keys, limit: float, seed: int) -> bool:
    """Print the forward and backward tables; True when every current ratio is <= limit."""
    rng = np.random.default_rng(seed)
    names = list(builds)
    ok = True
    print("forward: max|out - ref| / dense float32's, 256 queries x N keys, D=32")
    print(f"{'keys':>8} " + " ".join(f"{n:>16}" for n in names) + f" {'numpy':>8} {'dense32':>9}")
    for n in keys:
        q, k, v, _ = real_shaped(rng, 256, n)
        ref = reference.attention(seq_major(q), seq_major(k), seq_major(v))[0]
        q32, k32, v32 = (x.astype(np.float32) for x in (q, k, v))
        e_d = err(reference.attention(*map(seq_major, (q32, k32, v32)), dtype=np.float32)[0], ref)
        cols = []
        for name, (fwd, _) in builds.items():
            r = err(seq_major(forward(fwd.forward_tile, q32, k32, v32, fwd.finalize)[0]), ref) / e_d
            ok &= name.startswith("base") or r <= limit
            cols.append(r)
        r_np = (
            err(
                seq_major(forward(numpy_tile.forward_tile, q32, k32, v32, softmax.finalize)[0]), ref
            )
            / e_d
        )
        print(f"{n:>8} " + " ".join(f"{c:>16.2f}" for c in cols) + f" {r_np:>8.2f} {e_d:>9.2e}")
        sys.stdout.flush()
    print("backward: max error / dense float32's for dq / dk / dv, D=32")
    print(f"{'Sq x Sk':>13} " + " ".join(f"{n:>16}" for n in names) + f" {'dense32 dq dk dv':>27}")
    for n in keys:
        for sq, sk in ((256, n), (n, 256)):
            q, k, v, do = real_shaped(rng, sq, sk)
            ref = reference.attention_backward(*map(seq_major, (do, q, k, v)))
            x32 = [x.astype(np.float32) for x in (q, k, v, do)]
            d32 = reference.attention_backward(
                *map(seq_major, (x32[3], x32[0], x32[1], x32[2])), dtype=np.float32
            )
            e_d = [err(a, r) for a, r in zip(d32, ref)]
            cols = []
            for name, (fwd, lib) in builds.items():
                g = gradients(fwd, lib, *x32)
                rs = [err(seq_major(a), r) / e for a, r, e in zip(g, ref, e_d)]
                ok &= name.startswith("base") or max(rs) <= limit
                cols.append("/".join(f"{x:.1f}" for x in rs))
            print(
                f"{f'{sq}x{sk}':>13} "
                + " ".join(f"{c:>16}" for c in cols)
                + "  "
                + " ".join(f"{e:.1e}" for e in e_d)
            )
            sys.stdout.flush()
    return ok


def speed(pairs: dict, n: int, d: int, heads: int, rounds: int, causal: bool) -> None:
    """Median GFLOP/s of the baseline and current tiles, timed interleaved."""
    rng = np.random.default_rng(1)
    q, k, v, do = (x.astype(np.float32) for x in real_shaped(rng, n, n, heads, d))
    pos = np.arange(n, dtype=np.int64)
    sc = 1 / np.sqrt(d)
    out, lse = forward(pairs["current"][0].forward_tile, q, k, v, pairs["current"][0].finalize)
    delta = (do * out).sum(-1)
    fl_f = 4.0 * heads * n * n * d / (2 if causal else 1)
    fl_b = 10.0 * heads * n * n * d / (2 if causal else 1)

    def run_fwd(kern):
        acc = np.zeros_like(q)
        m = np.full(q.shape[:-1], -np.inf, np.float32)
        l = np.zeros(q.shape[:-1], np.float32)
        t = time.process_time()
        kern.forward_tile(q, k, v, pos, pos, acc, m, l, scale=sc, causal=causal)
        return time.process_time() - t

    def run_bwd(lib):
        dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
        t = time.process_time()
        fused_backward.backward_tile_with(
            lib, q, k, v, do, lse, delta, pos, pos, dq, dk, dv, scale=sc, causal=causal
        )
        return time.process_time() - t

    times = {(p, w): [] for p in ("fwd", "bwd") for w in pairs}
    order = ["baseline", "current", "current", "baseline"]
    for _ in range(rounds):
        for w in order:
            times[("fwd", w)].append(run_fwd(pairs[w][0]))
        for w in order:
            times[("bwd", w)].append(run_bwd(pairs[w][1]))
    print(f"speed: N={n} D={d} H={heads} causal={causal}, {rounds} rounds x 2 runs each, medians")
    for p, fl in (("fwd", fl_f), ("bwd", fl_b)):
        g = {w: fl / np.median(times[(p, w)]) / 1e9 for w in pairs}
        ratio = g["current"] / g["baseline"]
        print(
            f"  {p}: baseline {g['baseline']:7.1f} GF/s  current {g['current']:7.1f} GF/s"
            f"  current/baseline {ratio:.3f}"
        )


def empty_state(q):
    """acc, m, l of no key yet for queries ``q`` (B, H, S, D)."""
    return (
        np.zeros_like(q),
        np.full(q.shape[:-1], -np.inf, q.dtype),
        np.zeros(q.shape[:-1], q.dtype),
    )


def packed(pairs: dict, lens, tokens: int, n: int, d: int, heads: int, kv_heads: int, rounds: int):
    """Best-of-rounds GFLOP/s of both builds on packed causal batches and one causal tile."""
    rng = np.random.default_rng(2)
    sc = 1 / np.sqrt(d)
    print(
        f"packed: {tokens} tokens a batch, D={d} H={heads} Hkv={kv_heads} float32, "
        f"best of {rounds} rounds x 2 runs each (thread CPU time)"
    )
    for s in (*lens, None):
        t = n if s is None else tokens // s * s
        pos = np.arange(t, dtype=np.int64)
        bounds = None if s is None else (pos // s * s, pos.copy())
        kw = dict(scale=sc, causal=True, bounds=bounds)
        pairs_vis = t * (t + 1) // 2 if s is None else (t // s) * s * (s + 1) // 2
        q = rng.standard_normal((1, heads, t, d)).astype(np.float32)
        k = (0.5 + rng.standard_normal((1, kv_heads, t, d))).astype(np.float32)
        v = (1.0 + 0.1 * rng.standard_normal((1, kv_heads, t, d))).astype(np.float32)
        do = (0.2 + 0.1 * rng.standard_normal((1, heads, t, d))).astype(np.float32)
        cur = pairs["current"][0]
        st = empty_state(q)
        cur.forward_tile(q, k, v, pos, pos, *st, **kw)
        out, lse = cur.finalize(*st)
        delta = (do * out).sum(-1)
        times = {(p, w): [] for p in ("fwd", "bwd") for w in pairs}
        for _ in range(rounds):
            for w in ("baseline", "current", "current", "baseline"):
                fwd, lib = pairs[w]
                st = empty_state(q)
                c = time.thread_time()
                fwd.forward_tile(q, k, v, pos, pos, *st, **kw)
                times[("fwd", w)].append(time.thread_time() - c)
                dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
                c = time.thread_time()
                fused_backward.backward_tile_with(
                    lib, q, k, v, do, lse, delta, pos, pos, dq, dk, dv, **kw
                )
                times[("bwd", w)].append(time.thread_time() - c)
        name = f"causal {t}" if s is None else f"packed S={s}"
        for p, per in (("fwd", 4.0), ("bwd", 10.0)):
            g = {w: per * d * heads * pairs_vis / min(times[(p, w)]) / 1e9 for w in pairs}
            ratio = g["current"] / g["baseline"]
            print(
                f"  {name:>16} {p}: baseline {g['baseline']:7.1f} GF/s  current "
                f"{g['current']:7.1f} GF/s  current/baseline {ratio:.3f}"
            )
        sys.stdout.flush()


def modifiers(kern, lib, n: int, d: int, heads: int, rounds: int, causal: bool) -> None:
    """Median GFLOP/s (CPU time) of the current tiles plain and with softcap / ALiBi."""
    from ringmpi.job.options import alibi_slopes

    rng = np.random.default_rng(1)
    q, k, v, do = (x.astype(np.float32) for x in real_shaped(rng, n, n, heads, d))
    pos = np.arange(n, dtype=np.int64)
    sc = 1 / np.sqrt(d)
    alibi = (np.asarray(alibi_slopes(heads)), pos)
    mods = {"plain": {}, "softcap": dict(softcap=30.0), "alibi": dict(alibi=alibi)}
    mods["both"] = dict(softcap=30.0, alibi=alibi)

    def state():
        return (
            np.zeros_like(q),
            np.full(q.shape[:-1], -np.inf, np.float32),
            np.zeros(q.shape[:-1], np.float32),
        )

    lses = {}
    for name, kw in mods.items():  # each variant's own lse and delta for its backward
        st = state()
        kern.forward_tile(q, k, v, pos, pos, *st, scale=sc, causal=causal, **kw)
        out, lse = kern.finalize(*st)
        lses[name] = (lse, (do * out).sum(-1))
    times = {(p, m): [] for p in ("fwd", "bwd") for m in mods}
    for _ in range(rounds):
        for name, kw in mods.items():
            st = state()
            t = time.process_time()
            kern.forward_tile(q, k, v, pos, pos, *st, scale=sc, causal=causal, **kw)
            times[("fwd", name)].append(time.process_time() - t)
            dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
            t = time.process_time()
            fused_backward.backward_tile_with(
                lib,
                q,
                k,
                v,
                do,
                *lses[name],
                pos,
                pos,
                dq,
                dk,
                dv,
                scale=sc,
                causal=causal,
                **kw,
            )
            times[("bwd", name)].append(time.process_time() - t)
    print(f"modifiers: N={n} D={d} H={heads} causal={causal}, {rounds} rounds, CPU time medians")
    for p, per in (("fwd", 4.0), ("bwd", 10.0)):
        fl = per * heads * n * n * d / (2 if causal else 1)
        g = {m: fl / np.median(times[(p, m)]) / 1e9 for m in mods}
        print(f"  {p}: " + "  ".join(f"{m} {g[m]:6.1f} GF/s ({g[m] / g['plain']:.2f}x)" for m in g))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", default="HEAD", help="git revision of the baseline kernels")
    ap.add_argument("--accuracy", action="store_true", help="only the accuracy tables")
    ap.add_argument("--speed", action="store_true", help="only the speed comparison")
    ap.add_argument("--mods", action="store_true", help="only the softcap / ALiBi cost")
    ap.add_argument("--keys", type=int, nargs="+", default=[4096, 16384, 65536, 262144])
    ap.add_argument(
        "--isa", nargs="+", default=None, help="ISA paths (default: every one the host runs)"
    )
    ap.add_argument("--limit", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--packed", action="store_true", help="only packed short sequences")
    ap.add_argument("--lens", type=int, nargs="+", default=[128, 256, 512, 1024, 2048])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--kv-heads", type=int, default=2)
    a = ap.parse_args(argv)
    both = not (a.accuracy or a.speed or a.mods or a.packed)
    isas = a.isa or cpu_isa.host_isas()
    if a.mods:
        print(f"ISA path {isas[0]}")
        modifiers(*kernels(isas[0], None), a.n, a.d, a.heads, a.rounds, a.causal)
        return 0
    with tempfile.TemporaryDirectory(prefix="ringmpi-ab-") as tmp:
        base = baseline_dir(a.baseline, tmp)
        ok = True
        if a.accuracy or both:
            builds = {}
            for isa in isas:
                builds[f"base-{isa}"] = kernels(isa, base)
                builds[f"cur-{isa}"] = kernels(isa, None)
            ok = accuracy(builds, a.keys, a.limit, a.seed)
        if a.speed or both:
            pairs = {"baseline": kernels(isas[0], base), "current": kernels(isas[0], None)}
            print(f"ISA path {isas[0]}")
            speed(pairs, a.n, a.d, a.heads, a.rounds, a.causal)
        if a.packed:
            pairs = {"baseline": kernels(isas[0], base), "current": kernels(isas[0], None)}
            print(f"ISA path {isas[0]}")
            packed(pairs, a.lens, a.tokens, a.n, a.d, a.heads, a.kv_heads, a.rounds)
    if not ok:
        print(f"FAILED: a current kernel's error exceeds {a.limit}x dense float32's")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
