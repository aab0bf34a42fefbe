"""The report of ``ringmpi bench``: derived columns, the printed table and the PNG plot.

:func:`ringmpi.bench.main` gathers the workers' runs into one document and hands it here.
"""

from __future__ import annotations

from typing import Optional

__all__ = ["summarize", "plot"]


def summarize(doc: dict) -> None:
    """Add fractions of matmul, scaling efficiency and torch ratios; print the table.

    Parameters
    ----------
    doc : dict
        ``workers`` (one per world size: ``p``, ``matmul_gflops_per_rank``, ``isa``),
        ``runs`` (one dict per case and world size; gets ``frac_matmul``,
        ``scaling_eff``, ``torch_gflops_per_thread``, ``vs_torch``, ``vs_plain``)
        and ``torch`` (the SDPA rows).
    """
    mm = {w["p"]: w["matmul_gflops_per_rank"] for w in doc["workers"]}
    key = lambda r: (r["n"], r["d"], r["causal"], r["pass_"], r.get("mod", "plain"))  # noqa: E731
    t1 = {key(r): r["time_s"] for r in doc["runs"] if r["p"] == 1}
    plain = {key(r)[:4] + (r["p"],): r["gflops_per_rank"] for r in doc["runs"]
             if r.get("mod", "plain") == "plain"}  # fmt: skip
    torch = {(key(t), t["threads"]): t["gflops_per_thread"] for t in doc["torch"]}
    for r in doc["runs"]:
        r["frac_matmul"] = r["gflops_per_rank"] / mm[r["p"]]
        r["scaling_eff"] = t1[key(r)] / (r["p"] * r["time_s"]) if key(r) in t1 else None
        tv = torch.get((key(r), r["p"]))
        r["torch_gflops_per_thread"] = tv
        r["vs_torch"] = r["gflops_per_rank"] / tv if tv else None
        pv = plain.get(key(r)[:4] + (r["p"],))
        r["vs_plain"] = r["gflops_per_rank"] / pv if pv else None
    hdr = (
        f"{'pass':>4} {'P':>2} {'N':>6} {'D':>4} {'causal':>6} {'mod':>7} {'time s':>8} "
        f"{'GF/s/rank':>9} {'xplain':>6} "
        f"{'xmatmul':>7} {'eff':>5} {'torch':>7} {'xtorch':>6} {'wait s':>7} {'MiB/rank':>8}"
    )
    isa = doc["workers"][0].get("isa") if doc["workers"] else None
    print(f"float32 matmul GFLOP/s per rank: {mm}   CPU kernel: {isa}")
    print(hdr)
    fmt = lambda x, f: "-" if x is None else format(x, f)  # noqa: E731
    for r in doc["runs"]:
        print(
            f"{r['pass_']:>4} {r['p']:>2} {r['n']:>6} {r['d']:>4} {str(r['causal']):>6} "
            f"{r.get('mod', 'plain'):>7} {r['time_s']:>8.3f} "
            f"{r['gflops_per_rank']:>9.1f} {fmt(r['vs_plain'], '>6.2f')} {r['frac_matmul']:>7.2f} "
            f"{fmt(r['scaling_eff'], '>5.2f')} {fmt(r['torch_gflops_per_thread'], '>7.1f')} "
            f"{fmt(r['vs_torch'], '>6.2f')} {r['wait_s']:>7.3f} {r['peak_mem_mib_per_rank']:>8.1f}"
        )


def plot(doc: dict, path: str) -> Optional[str]:
    """Bars of the plain forward GFLOP/s per rank (and torch SDPA, 1 thread) into PNG ``path``.

    Returns ``path``, or None when matplotlib is not importable.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    runs = [r for r in doc["runs"] if r.get("pass_", "fwd") == "fwd" and
            r.get("mod", "plain") == "plain"]  # the plain forward rows  # fmt: skip
    trs = [t for t in doc["torch"] if t.get("pass_", "fwd") == "fwd"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    labels = sorted({(r["n"], r["d"], r["causal"]) for r in runs})
    ps = sorted({r["p"] for r in runs})
    width = 0.8 / (len(ps) + 1)
    for i, p in enumerate(ps):
        ys = [
            next((r["gflops_per_rank"] for r in runs if r["p"] == p and
                  (r["n"], r["d"], r["causal"]) == lab), 0.0)
            for lab in labels
        ]  # fmt: skip
        ax.bar([j + i * width for j in range(len(labels))], ys, width, label=f"ringmpi P={p}")
    ty = [
        next((t["gflops_per_thread"] for t in trs if t["threads"] == 1 and
              (t["n"], t["d"], t["causal"]) == lab), 0.0)
        for lab in labels
    ]  # fmt: skip
    if any(ty):
        ax.bar([j + len(ps) * width for j in range(len(labels))], ty, width, label="torch SDPA 1t")
    for w in doc["workers"]:
        ax.axhline(w["matmul_gflops_per_rank"], ls="--", lw=0.8, color="gray")
    ax.set_xticks([j + width * len(ps) / 2 for j in range(len(labels))])
    ax.set_xticklabels([f"N={n}\nD={d}{' c' if c else ''}" for n, d, c in labels], fontsize=7)
    ax.set_ylabel("GFLOP/s per rank (dashed: fp32 matmul)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
