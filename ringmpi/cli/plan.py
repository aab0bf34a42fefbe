"""The planner: per-rank memory, flops, bytes and predicted time of a ring, and a recommendation.

Cost model (design notes): per ring step a rank computes 4 Bq Bk D H flops (half on
average under a balanced causal mask) and sends 2 Bk Hkv D elements; with keys and
values of different widths (``--value-dim``), 2 Bq Bk (Dk + Dv) H flops and
Bk Hkv (Dk + Dv) elements, which leaves the condition below unchanged. The
exchange of step s + 1 runs while step s computes, so a step takes
max(compute, transfer) and the exchange hides when

    4 Bq Bk D H / rate >= 2 Bk Hkv D e / link + latency,   i.e.  Bq >= rate e Hkv / (2 H link)

(e: bytes per element, rate in flop/s, link in bytes/s). A call takes P steps
plus the fixed cost of agreeing on arguments and finalising. Rates come from
``--measure`` (the tile kernel and a ping-pong timed here) or are given.

    ringmpi plan --seq-len 1048576 --heads 32 --kv-heads 8 --head-dim 128 --ranks 64 --causal
    ringmpi plan --seq-len 65536 --heads 8 --head-dim 64 --ranks 8 --slices global_local:256:64
    mpiexec -n 2 python -m mpi4py -m ringmpi plan --seq-len 65536 --heads 8 --head-dim 64 --measure
"""

from __future__ import annotations

import argparse
import json
import os
import time
from types import SimpleNamespace
from typing import Optional

import numpy as np

from .. import cost
from ..spec import parse_window

__all__ = [
    "predict",
    "recommend",
    "measure_compute",
    "measure_link",
    "plan_mask",
    "parse_slices",
    "read_slices_file",
    "pick_layout",
    "main",
]

DEFAULT_GFLOPS = 100.0  # per rank, when neither measured nor given
DEFAULT_LINK_GBPS = 10.0
DEFAULT_LATENCY_S = 20e-6
OVERHEAD_S = 2e-3  # argument agreement, communicator creation, finalize


def _divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


def memory_per_rank(
    n_local: int, h: int, hkv: int, d: int, dtype: str, dv: Optional[int] = None
) -> int:
    """Bytes one rank needs for ``n_local`` tokens (the batch job's budget rule).

    ``dv``: the value width where it differs from the key width ``d``.
    """
    from ..job.resources import rank_bytes

    plan = SimpleNamespace(
        dtype=dtype,
        heads=h,
        kv_heads=hkv,
        head_dim=d,
        value_dim=dv or 0,
        mode="qkv",
        features=0,
    )
    return rank_bytes(plan, n_local, prefetch=False)


#: DeepSeek-V2/V3's multi-head latent attention widths: the latent c_kv, the shared rotary
#: key, the per-head key part from the latent, the per-head value
MLA_WIDTHS = {"latent": 512, "rope": 64, "nope": 128, "value": 128}


def mla_traffic(
    n: int, h: int, *, ranks: int, dtype: str = "float32", widths: Optional[dict] = None
) -> dict:
    """K/V bytes per ring step of multi-head latent attention with ``h`` heads, both forms.

    Unabsorbed: ``h`` K/V heads of keys nope + rope (192) and values ``value`` (128)
    wide. Absorbed: one latent K/V head of keys latent + rope (576) and values latent
    (512) wide. Per step a rank sends its block of n / ranks tokens
    (:func:`ringmpi.cost.kv_bytes`).

    Returns
    -------
    dict with the widths of each form, ``unabsorbed_bytes_per_step``,
    ``absorbed_bytes_per_step`` and their ``ratio``.
    """
    w = dict(MLA_WIDTHS, **(widths or {}))
    e = np.dtype(dtype).itemsize
    block = n / ranks
    dk_u, dv_u = w["nope"] + w["rope"], w["value"]
    dk_a, dv_a = w["latent"] + w["rope"], w["latent"]
    un = cost.kv_bytes(block, h, dk_u, e, dv=dv_u)
    ab = cost.kv_bytes(block, 1, dk_a, e, dv=dv_a)
    return {
        "heads": h,
        "unabsorbed": {"kv_heads": h, "dk": dk_u, "dv": dv_u},
        "absorbed": {"kv_heads": 1, "dk": dk_a, "dv": dv_a},
        "unabsorbed_bytes_per_step": un,
        "absorbed_bytes_per_step": ab,
        "ratio": un / ab,
    }


def predict(
    n: int,
    h: int,
    hkv: int,
    d: int,
    *,
    ranks: int,
    dtype: str = "float32",
    causal: bool = False,
    gflops: float = DEFAULT_GFLOPS,
    link_gbps: float = DEFAULT_LINK_GBPS,
    latency_s: float = DEFAULT_LATENCY_S,
    head_parallel: int = 1,
    dv: Optional[int] = None,
) -> dict:
    """Predicted per-rank cost of one ``ring_attention`` call.

    Parameters
    ----------
    n, h, hkv, d : int
        Sequence length, query heads, key/value heads, head dim (the key width Dk).
    dv : int, optional
        The value width Dv, default ``d`` (multi-head latent attention: 2 Bq Bk (Dk + Dv)
        flops per head and Bk Hkv (Dk + Dv) elements per step; the block that hides the
        exchange does not depend on the widths).
    ranks : int
        P (with ``head_parallel=U``: U x R ranks, the ring has R = P / U steps).
    gflops : float
        Achieved tile rate per rank, GFLOP/s.
    link_gbps : float
        Point-to-point bandwidth per rank, Gbit/s.

    Returns
    -------
    dict with memory_bytes, flops_per_step, bytes_per_step, compute_s_per_step,
    transfer_s_per_step, hidden (bool), step_s, time_s, and the minimum block
    (tokens per rank) that hides the exchange.
    """
    u = head_parallel
    ring = ranks // u
    e = np.dtype(dtype).itemsize
    block = n / ring  # tokens per ring position (the group's, under head parallelism)
    heads = h / u
    kvh = hkv / u if hkv >= u else 1
    frac = 0.5 if causal else 1.0
    flops_step = cost.flops(block * block * frac, d, heads, dv=dv)
    bytes_step = cost.kv_bytes(block, kvh, d, e, dv=dv)
    rate, link = gflops * 1e9, link_gbps * 1e9 / 8
    compute = flops_step / rate
    transfer = bytes_step / link + latency_s if ring > 1 else 0.0
    step = max(compute, transfer)
    total = compute + (ring - 1) * step + OVERHEAD_S
    need_block = rate * e * kvh / (2.0 * heads * frac * link)
    return {
        "ranks": ranks,
        "ring_size": ring,
        "head_parallel": u,
        "tokens_per_rank": n / ranks,
        "memory_bytes": memory_per_rank(int(np.ceil(n / ranks)), h, hkv, d, dtype, dv),
        "flops_per_step": flops_step,
        "bytes_per_step": bytes_step,
        "compute_s_per_step": compute,
        "transfer_s_per_step": transfer,
        "hidden": transfer <= compute,
        "min_block_to_hide": need_block,
        "step_s": step,
        "time_s": total,
    }


def recommend(
    n: int,
    h: int,
    hkv: int,
    d: int,
    *,
    ranks: Optional[int] = None,
    memory_per_rank_bytes: Optional[int] = None,
    sequences: int = 1,
    dv: Optional[int] = None,
    mask=None,
    **rates,
) -> dict:
    """Ring size, layout and head-parallel degree for ``sequences`` sequences on ``ranks``.

    The layout: with ``mask`` (a :class:`ringmpi.mask.Mask`), the one whose slowest
    rank has the fewest visible pairs on the chosen ring (:func:`pick_layout` over
    :func:`ringmpi.cost.imbalances`; the result also holds ``imbalance``); without,
    zigzag under causal, else contiguous.

    Among the ring sizes R dividing P whose per-rank memory fits, the one with the
    shortest predicted job (P/R rings each take one sequence at a time: many
    sequences favour small rings, which also have big blocks that hide the
    exchange; one long sequence favours one ring of P); ties go to the smaller
    ring. Head parallelism (U dividing H, and Hkv or U dividing the other) is
    suggested when it shortens a ring whose exchange is exposed. Without
    ``ranks``, the fewest ranks (a power of two) whose memory fits.
    """
    causal = rates.get("causal", False)
    dtype = rates.get("dtype", "float32")
    budget = memory_per_rank_bytes

    def fits(p: int) -> bool:
        return budget is None or memory_per_rank(-(-n // p), h, hkv, d, dtype, dv) <= budget

    if ranks is None:
        ranks = 1
        while not fits(ranks) and ranks < (1 << 20):
            ranks *= 2
    options = []
    for r in _divisors(ranks):
        if not fits(r):
            continue
        waves = -(-sequences // (ranks // r))
        for u in _divisors(r):
            if u > 1 and (h % u or (hkv % u and u % hkv)):
                continue
            pr = predict(n, h, hkv, d, ranks=r, head_parallel=u, dv=dv, **rates)
            options.append((waves * pr["time_s"], r, u, pr))
    if not options:  # nothing fits: the largest ring, and say so
        pr = predict(n, h, hkv, d, ranks=ranks, dv=dv, **rates)
        options.append((-(-sequences // 1) * pr["time_s"], ranks, 1, pr))
    job, r, u, best = min(options, key=lambda o: (round(o[0], 9), o[1], o[2]))
    got = {
        "ranks": ranks,
        "ring_size": r,
        "rings": ranks // r,
        "head_parallel": u,
        "layout": "zigzag" if causal else "contiguous",
        "fits": fits(r),
        "per_ring": best,
        "job_time_s": job,
    }
    if mask is not None:
        got["imbalance"] = cost.imbalances(mask, r)
        got["layout"] = pick_layout(got["imbalance"], got["layout"])
    return got


#: imbalances within this fraction of the lowest count as tied (the model counts pairs, not
#: time): the mask-free layouts, cheaper to compute, win a tie over balanced
LAYOUT_TIE = 0.01


def pick_layout(imbalance: dict, preferred: str = "zigzag") -> str:
    """The layout with the lowest work imbalance (slowest rank's visible pairs / mean).

    Those within :data:`LAYOUT_TIE` of the lowest are tied; a tie goes to ``preferred``,
    then zigzag, striped, contiguous, and balanced last.

    Parameters
    ----------
    imbalance : dict
        ``{layout: imbalance}``, :func:`ringmpi.cost.imbalances`.
    preferred : str
        The layout the mask's kind would get (zigzag for causal, contiguous for full).
    """
    best = min(imbalance.values())
    order = [preferred, "zigzag", "striped", "contiguous", "balanced", *imbalance]
    for lay in order:
        if lay in imbalance and imbalance[lay] <= best * (1 + LAYOUT_TIE):
            return lay
    raise AssertionError("unreachable: the lowest is in the dict")


def measure_compute(
    d: int,
    h: int = 4,
    hkv: int = 4,
    n_local: int = 2048,
    dtype="float32",
    causal: bool = False,
    repeat: int = 3,
) -> float:
    """Useful GFLOP/s of this machine's CPU tile on an (n_local x n_local) block (median)."""
    from .. import softmax
    from ..backend import select

    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, n_local, h, d)).astype(dtype)
    k = rng.standard_normal((1, n_local, hkv, d)).astype(dtype)
    be = select(q)
    qi = np.ascontiguousarray(np.moveaxis(q, 1, 2), dtype=be.tile_dtype(q.dtype))
    ki = np.ascontiguousarray(np.moveaxis(k, 1, 2), dtype=qi.dtype)
    pos = np.arange(n_local, dtype=np.int64)
    times = []
    for _ in range(repeat):
        acc, m, l = softmax.init_state(qi.shape, be.acc_dtype(q.dtype))
        t0 = time.perf_counter()
        be.forward_tile(qi, ki, ki, pos, pos, acc, m, l, scale=d**-0.5, causal=causal)
        times.append(time.perf_counter() - t0)
    # the rate of useful work: visible pairs only (a causal tile also computes the
    # masked half of its diagonal blocks), which is what predict() counts
    pairs = n_local * (n_local + 1) / 2 if causal else n_local * n_local
    return cost.flops(pairs, d, h) / float(np.median(times)) / 1e9


def measure_link(comm, nbytes: int = 8 << 20, repeat: int = 5) -> Optional[tuple]:
    """(Gbit/s, latency s) between ranks 0 and 1 by ping-pong; None with one rank."""
    from mpi4py import MPI

    if comm is None or comm.Get_size() < 2:
        return None
    rank = comm.Get_rank()
    out = []
    for size in (8, nbytes):
        buf = np.zeros(size, dtype=np.uint8)
        comm.Barrier()
        best = float("inf")
        for _ in range(repeat):
            t0 = MPI.Wtime()
            if rank == 0:
                comm.Send(buf, dest=1)
                comm.Recv(buf, source=1)
            elif rank == 1:
                comm.Recv(buf, source=0)
                comm.Send(buf, dest=0)
            best = min(best, (MPI.Wtime() - t0) / 2)
        out.append(comm.bcast(best, root=0))
    lat, t_big = out
    return nbytes * 8 / max(t_big - lat, 1e-9) / 1e9, lat


BUILDERS = {  # --slices NAME:ARGS -> the builder's arguments (issue 41)
    "global_local": "global_local:WINDOW[:GLOBAL_TOKENS] (WINDOW: W or L/R)",
    "prefix_lm": "prefix_lm:PREFIX",
    "shared_prefix": "shared_prefix:PROMPT:A1,A2,...",
    "block_sparse": "block_sparse:BLOCK[:DENSITY[:SEED]]",
}


def parse_slices(text: str, n: int, causal: bool = False):
    """``--slices NAME:ARGS``: the :class:`ringmpi.Slices` of a builder over ``n`` tokens.

    ``causal`` goes to the builders that take it (global_local, block_sparse).
    ValueError naming the accepted forms when ``text`` is not one of them, or when
    the mask does not cover exactly ``n`` tokens.
    """
    from .. import slices as sl

    name, _, rest = str(text).partition(":")
    args = rest.split(":") if rest else []
    forms = "; ".join(BUILDERS.values())
    try:
        if name == "global_local" and 1 <= len(args) <= 2:
            w = tuple(int(x) for x in args[0].split("/"))
            window = w[0] if len(w) == 1 else w
            g = int(args[1]) if len(args) > 1 else 0
            s = sl.global_local(n, window, g, causal=causal)
        elif name == "prefix_lm" and len(args) == 1:
            s = sl.prefix_lm(n, int(args[0]))
        elif name == "shared_prefix" and len(args) == 2:
            s = sl.shared_prefix(int(args[0]), [int(a) for a in args[1].split(",")])
            if int(args[0]) + sum(int(a) for a in args[1].split(",")) != n:
                raise ValueError(f"prompt and answers must add up to --seq-len {n}")
        elif name == "block_sparse" and 1 <= len(args) <= 3:
            density = float(args[1]) if len(args) > 1 else 0.25
            seed = int(args[2]) if len(args) > 2 else 0
            s = sl.block_sparse(n, int(args[0]), density=density, seed=seed, causal=causal)
        else:
            raise ValueError(f"not one of the forms {forms}")
    except ValueError as e:
        raise ValueError(f"--slices {text!r}: {e}") from None
    return s


def read_slices_file(text: str, n: int):
    """``--slices-file FILE[:GROUP]``: the :class:`ringmpi.Slices` of an input's ``slices``
    dataset (the batch job's format, checked as the job checks it) over ``n`` tokens.

    ValueError with the file's one-line problem.
    """
    from ..job.input import files as input_files
    from ..job.plan import InputError, fail
    from ..slices import Slices

    path, _, group = str(text).partition(":")
    try:
        f = input_files.open_input(path)
        try:
            node = f
            if group:
                if group not in f:
                    fail(path, f"no group '{group}'")
                node = f[group]
            if "slices" not in node:
                fail(path, f"no dataset 'slices' in {'/' + group}")
            t = input_files.guarded(
                path, input_files.read_slices, path, node, os.path.getsize(path)
            )
            input_files.check_slices(path, "", t, n, n)
        finally:
            f.close()
    except InputError as e:
        raise ValueError(f"--slices-file: {e}") from None
    return Slices(t)


def plan_mask(n: int, causal: bool = False, window=None, slices=None):
    """The :class:`ringmpi.mask.Mask` of self-attention over ``n`` tokens the planner rates."""
    from ..mask import mask_of
    from ..spec import AttentionSpec

    if slices is not None:
        causal = False  # the builder took it
    return mask_of(AttentionSpec(causal=causal, window=window, slices=slices), n, n)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ringmpi plan",
        description="Per-rank memory, flops, bytes per step and predicted time of ring "
        "attention; whether the exchange hides behind compute; a recommended ring size, "
        "layout and head-parallel degree.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  ringmpi plan --seq-len 1048576 --heads 32 --kv-heads 8 "
        "--head-dim 128 --ranks 64 --causal --link-gbps 100\n  mpiexec -n 2 python -m mpi4py "
        "-m ringmpi plan --seq-len 65536 --heads 8 --head-dim 64 --measure",
    )
    p.add_argument("--seq-len", type=int, required=True, help="tokens per sequence N")
    p.add_argument("--heads", type=int, required=True, help="query heads H")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default H)")
    p.add_argument("--head-dim", type=int, required=True, help="head dimension D (key width)")
    p.add_argument(
        "--value-dim", type=int, default=None, help="value width Dv (default D: Dk = Dv)"
    )
    p.add_argument(
        "--mla-heads",
        type=int,
        default=None,
        help="also print the K/V bytes per ring step of multi-head latent attention with "
        "this many heads, unabsorbed (H heads, Dk=192, Dv=128) and absorbed (one latent head, "
        "Dk=576, Dv=512), for this plan's ring",
    )
    p.add_argument(
        "--dtype", default="float32", choices=("float16", "bfloat16", "float32", "float64")
    )
    p.add_argument("--ranks", type=int, help="ranks available P")
    p.add_argument("--memory-per-rank", help="memory budget per rank, e.g. 16G")
    p.add_argument("--sequences", type=int, default=1, help="sequences in the job (default 1)")
    p.add_argument("--causal", action="store_true")
    p.add_argument(
        "--window",
        type=parse_window,
        help="sliding window LEFT[,RIGHT] (-1: unbounded), for the layouts' imbalance",
    )
    p.add_argument(
        "--slices",
        metavar="NAME:ARGS",
        help="a mask of slices by its builder, for the layouts' imbalance: "
        + "; ".join(BUILDERS.values())
        + " (--causal: the builder's causal variant)",
    )
    p.add_argument(
        "--slices-file",
        metavar="FILE[:GROUP]",
        help="a mask of slices from an input file's 'slices' dataset (the batch job's "
        "format; GROUP: the sequence's group), over --seq-len tokens",
    )
    p.add_argument("--gflops", type=float, help="tile rate per rank, GFLOP/s")
    p.add_argument("--link-gbps", type=float, help="link bandwidth per rank, Gbit/s")
    p.add_argument(
        "--measure",
        action="store_true",
        help="measure the tile rate here (and the link, under mpiexec with >= 2 ranks)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return p


def main(argv: Optional[list] = None) -> int:
    """``ringmpi plan``: print the prediction and the recommendation."""
    parser = _parser()
    args = parser.parse_args(argv)
    from ..job.resources import parse_size

    try:
        sl = None if args.slices is None else parse_slices(args.slices, args.seq_len, args.causal)
        if args.slices_file is not None:
            if sl is not None or args.causal:
                raise ValueError("--slices-file is the whole mask: leave out --slices, --causal")
            sl = read_slices_file(args.slices_file, args.seq_len)
        if sl is not None and args.window is not None:
            raise ValueError("--slices is the whole mask: leave out --window")
        mask = plan_mask(args.seq_len, args.causal, args.window, sl)
    except ValueError as e:
        parser.error(str(e))

    hkv = args.kv_heads or args.heads
    dt = "float16" if args.dtype == "bfloat16" else args.dtype
    gflops, link, lat, source = args.gflops, args.link_gbps, DEFAULT_LATENCY_S, "given"
    comm, ranks = None, args.ranks
    if args.measure:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        cdt = "float64" if dt == "float64" else "float32"
        gflops = gflops or measure_compute(args.head_dim, dtype=cdt, causal=args.causal)
        got = measure_link(comm)
        if got is not None and link is None:
            link, lat = got
        source = "measured"
        ranks = ranks or comm.Get_size()
    gflops = gflops or DEFAULT_GFLOPS
    link = link or DEFAULT_LINK_GBPS
    budget = parse_size(args.memory_per_rank) if args.memory_per_rank else None
    rates = dict(dtype=dt, causal=args.causal, gflops=gflops, link_gbps=link, latency_s=lat)
    rec = recommend(
        args.seq_len,
        args.heads,
        hkv,
        args.head_dim,
        ranks=ranks,
        memory_per_rank_bytes=budget,
        sequences=args.sequences,
        dv=args.value_dim,
        mask=mask,
        **rates,
    )
    mla = None
    if args.mla_heads:
        ring = rec["ring_size"] // rec["head_parallel"]
        mla = mla_traffic(args.seq_len, args.mla_heads, ranks=ring, dtype=dt)
    if comm is not None and comm.Get_rank() != 0:
        return 0
    imb = rec["imbalance"]
    if args.json:
        got = {"rates": rates, "recommendation": rec, "imbalance": imb}
        if mla is not None:
            got["mla"] = mla
        print(json.dumps(got, indent=1))
        return 0
    r = rec["per_ring"]
    widths = f"D={args.head_dim}"
    if args.value_dim and args.value_dim != args.head_dim:
        widths = f"Dk={args.head_dim} Dv={args.value_dim}"
    print(
        f"ringmpi plan: N={args.seq_len:,} H={args.heads} Hkv={hkv} {widths} "
        f"{args.dtype}{' causal' if args.causal else ''}"
    )
    print(
        f"  rates ({source}): {gflops:.1f} GFLOP/s per rank, link {link:.2f} Gbit/s, "
        f"latency {lat * 1e6:.1f} us"
    )
    print(
        f"  ring of {r['ring_size']} (x{r['head_parallel']} head-parallel): "
        f"{r['tokens_per_rank']:,.0f} tokens/rank, memory/rank "
        f"{r['memory_bytes'] / 2**30:.2f} GiB"
        f"{'' if rec['fits'] else ' (OVER the budget)'}"
    )
    print(
        f"  per step: {r['flops_per_step'] / 1e9:.2f} GFLOP, {r['bytes_per_step'] / 2**20:.2f} "
        f"MiB sent; compute {r['compute_s_per_step'] * 1e3:.2f} ms, transfer "
        f"{r['transfer_s_per_step'] * 1e3:.2f} ms -> exchange "
        f"{'hidden' if r['hidden'] else 'EXPOSED'} (needs >= {r['min_block_to_hide']:,.0f} "
        f"tokens per rank)"
    )
    print(f"  predicted: {r['step_s'] * 1e3:.2f} ms per step, {r['time_s']:.3f} s per call")
    what = "mask " + (args.slices or args.slices_file or ("causal" if args.causal else "full"))
    what += f" window {args.window}" if args.window is not None else ""
    print(
        f"  imbalance ({what}; slowest rank's visible pairs / mean, ring of "
        f"{rec['ring_size']}): " + ", ".join(f"{k} {v:.3f}" for k, v in imb.items())
    )
    print(
        f"  recommendation: {rec['rings']} ring(s) of {rec['ring_size']} on {rec['ranks']} "
        f"ranks, layout {rec['layout']} (lowest imbalance for this mask, "
        f"{imb[rec['layout']]:.3f}), head_parallel {rec['head_parallel']}; "
        f"{args.sequences} sequence(s) in ~{rec['job_time_s']:.2f} s"
    )
    if mla is not None:
        u, a = mla["unabsorbed"], mla["absorbed"]
        print(
            f"  MLA, H={mla['heads']}, K/V per ring step: unabsorbed ({u['kv_heads']} heads, "
            f"Dk={u['dk']} Dv={u['dv']}) {mla['unabsorbed_bytes_per_step'] / 2**20:.2f} MiB; "
            f"absorbed (1 latent head, Dk={a['dk']} Dv={a['dv']}) "
            f"{mla['absorbed_bytes_per_step'] / 2**20:.2f} MiB ({mla['ratio']:.1f}x less)"
        )
    return 0
