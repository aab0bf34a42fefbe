"""Deterministic sample inputs in the ringmpi HDF5 schema (``ringmpi make-data``).

Values depend only on (seed, sequence, token block), never on the number of
shard files or the compression, so the same sequence split three ways or stored
compressed holds exactly the same numbers. Data are generated block by block:
any size can be written without holding a sequence in memory.
"""

from __future__ import annotations

import contextlib
import os
from typing import Optional

import numpy as np

from ..layout import split_sizes

__all__ = ["make_data", "shard_paths", "BLOCK"]

BLOCK = 4096  # tokens per generated block


def shard_paths(path: str, shards: int) -> list:
    """File names of ``shards`` shard files for ``path``: a.h5 -> a.part000.h5, ..."""
    if shards == 1:
        return [path]
    stem, ext = os.path.splitext(path)
    return [f"{stem}.part{j:03d}{ext or '.h5'}" for j in range(shards)]


#: ``values="realistic"``: (mean, spread) per dataset, the shape of a trained model's
#: activations (keys with a mean, positive values of small spread; see
#: ``ringmpi.testing.REALISTIC``); the others stay standard normal
VALUES = {"normal": {}, "realistic": {"k": (0.5, 1.0), "v": (1.0, 0.1)}}


def _block(
    seed: int, seq: int, blk: int, n: int, widths: dict, dtype, stream=None, values: str = "normal"
) -> dict:
    rng = np.random.default_rng([seed, seq, blk] + ([] if stream is None else [stream]))
    out = {}
    for k, w in widths.items():
        mean, spread = VALUES[values].get(k, (0.0, 1.0))
        x = rng.standard_normal((n, *w))
        out[k] = (x if (mean, spread) == (0.0, 1.0) else mean + spread * x).astype(dtype)
    return out


def _write_family(
    node,
    widths,
    total,
    lo,
    hi,
    seed,
    gi,
    stream,
    dt,
    sequences,
    batch_axis,
    compression,
    values="normal",
) -> None:
    """Write tokens [lo, hi) of the datasets ``widths`` (all of length ``total``) into ``node``."""
    n = hi - lo
    lead = (sequences,) if batch_axis else ()
    dsets = {}
    for name, w in widths.items():
        kw = {}
        if compression == "gzip":
            chunk = (1,) * len(lead) + (max(1, min(n, 1024)), *w)
            kw = dict(chunks=chunk, compression="gzip", compression_opts=4)
            kw.update(shuffle=True, fletcher32=True)
        dsets[name] = node.create_dataset(name, shape=(*lead, n, *w), dtype=dt, **kw)
    if n == 0:
        return
    for b in range(sequences if batch_axis else 1):
        seq = b if batch_axis else gi
        # global blocks overlapping this shard's token range
        for blk in range(lo // BLOCK, (hi - 1) // BLOCK + 1):
            a, e = blk * BLOCK, min((blk + 1) * BLOCK, total)
            vals = _block(seed, seq, blk, e - a, widths, dt, stream, values)
            s0, s1 = max(a, lo), min(e, hi)
            for name, arr in vals.items():
                sel = (b,) if batch_axis else ()
                dsets[name][sel + (slice(s0 - lo, s1 - lo),)] = arr[s0 - a : s1 - a]


@contextlib.contextmanager
def _removed_on_error(tmp: str):
    """Remove the temporary file ``tmp`` when the block fails (a full disk): no .tmp left."""
    try:
        yield
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def make_data(
    path: str,
    seq_len: int = 4096,
    heads: int = 8,
    kv_heads: int = 2,
    head_dim: int = 64,
    sequences: int = 1,
    batch_axis: bool = False,
    shards: int = 1,
    compression: Optional[str] = None,
    dtype: str = "float32",
    features: int = 0,
    weights: Optional[str] = None,
    seed: int = 0,
    packed=None,
    kv_tokens: Optional[int] = None,
    bias: bool = False,
    values: str = "normal",
    value_dim: Optional[int] = None,
    slices=None,
) -> list:
    """Write sample input file(s) and return their paths (weights file last, if any).

    Parameters
    ----------
    path : str
        Output file; with ``shards > 1`` it becomes ``stem.partNNN.h5``.
    seq_len, heads, kv_heads, head_dim : int
        S, H, Hkv, D: q is (S, H, D), k and v (S, Hkv, D).
    sequences : int
        Number of sequences: one group per sequence (``seq000``, ...) unless
        ``batch_axis`` gives a leading axis (B, S, ...). One sequence is stored
        at the root.
    shards : int
        Split the sequence axis over this many files (near-equal sizes).
    compression : {None, "gzip"}
        gzip level 4 with the shuffle filter and fletcher32 checksums, chunked.
    features : int
        If > 0, write raw features x (S, F) instead of q/k/v, and a weights file
        (``weights`` or ``stem-weights.h5``) with wq (F, H*D), wk, wv (F, Hkv*D).
    packed : int or list of int, optional
        Packed sequences, written as ``cu_seqlens`` (in the first shard): a count N
        (N seeded random lengths summing to ``seq_len``, zeros possible) or the
        lengths themselves (their sum replaces ``seq_len``). Not with ``batch_axis``.
    kv_tokens : int, optional
        Cross-attention: k and v (``x_kv`` for features) get this many tokens, q
        ``seq_len``; each is split over the shards along its own axis. With
        ``packed``, ``cu_seqlens_k`` splits them in proportion to the q lengths.
    bias : bool
        With ``features``: also write projection biases bq (H*D,), bk and bv
        (Hkv*D,) (nonzero means, like a trained model's): q = x @ wq + bq.
    values : {"normal", "realistic"}
        q, k, v standard normal, or shaped like a trained model's activations
        (:data:`VALUES`: k mean 0.5, v mean 1 and spread 0.1), where float32
        rounding errors do not cancel as they do for zero-mean values.
    value_dim : int, optional
        Dv, the width of v (wv's columns per head with ``features``), default
        ``head_dim``: values of another width than the keys (multi-head latent
        attention, e.g. 192 / 128).
    slices : ringmpi.Slices, str or (n, 5) table, optional
        A mask of slices for every sequence, written as an int64 ``slices`` (n, 5)
        (in the first shard; issue 41): a :class:`ringmpi.Slices`, its table, or a
        builder ``NAME:ARGS`` as ``ringmpi plan --slices`` takes it, over ``seq_len``
        tokens (e.g. ``"global_local:64:8"``). Not with ``batch_axis`` or ``packed``.
    """
    import h5py

    if values not in VALUES:
        raise ValueError(f"values must be one of {', '.join(VALUES)}, not {values!r}")
    if bias and not features:
        raise ValueError("bias needs features > 0 (biases belong to the projection weights)")
    if heads % kv_heads:
        raise ValueError(f"heads={heads} must be a multiple of kv_heads={kv_heads}")
    dv = head_dim if value_dim is None else int(value_dim)
    if dv < 1:
        raise ValueError(f"value_dim must be >= 1, got {value_dim}")
    cu = cu_k = None
    if packed is not None:
        if batch_axis:
            raise ValueError("packed sequences (cu_seqlens) cannot be combined with a batch axis")
        if isinstance(packed, (list, tuple)):
            lengths = [int(x) for x in packed]
            if not lengths or min(lengths) < 0:
                raise ValueError(f"packed lengths must be >= 0, got {packed}")
            seq_len = int(sum(lengths))
        else:
            if int(packed) < 1:
                raise ValueError(f"packed count must be >= 1, got {packed}")
            cuts = np.random.default_rng([seed, 2 << 20]).integers(0, seq_len + 1, int(packed) - 1)
            lengths = np.diff(np.concatenate(([0], np.sort(cuts), [seq_len]))).tolist()
        cu = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
    table = None
    if slices is not None:
        from ..slices import Slices

        if batch_axis or packed is not None:
            raise ValueError(
                "slices (a mask per sequence) cannot be combined with a batch axis "
                "or packed sequences"
            )
        if isinstance(slices, str):
            from .plan import parse_slices

            slices = parse_slices(slices, seq_len)
        sl = Slices(slices)
        sl.check(seq_len, seq_len if kv_tokens is None else int(kv_tokens))
        table = sl.table()
    if seq_len < max(shards, 1):
        raise ValueError(f"seq_len={seq_len} is smaller than shards={shards}")
    if kv_tokens is not None:
        if kv_tokens < shards or kv_tokens < 1:
            raise ValueError(f"kv_tokens={kv_tokens} is smaller than shards={shards} (or 0)")
        if cu is not None:
            cu_k = (cu * int(kv_tokens) + seq_len // 2) // seq_len
    dt = np.dtype(dtype)
    if features:
        widths = {"x": (features,)}
        kv_widths = {"x_kv": (features,)}
    else:
        widths = {"q": (heads, head_dim), "k": (kv_heads, head_dim), "v": (kv_heads, dv)}
        kv_widths = {"k": widths.pop("k"), "v": widths.pop("v")} if kv_tokens is not None else {}
    # (datasets, tokens, random stream): self-attention keeps one stream for q, k, v
    families = [(widths, seq_len, None)]
    if kv_tokens is not None:
        families.append((kv_widths, int(kv_tokens), 1))
    paths = shard_paths(path, shards)
    groups = [""] if sequences == 1 and not batch_axis else None
    if groups is None:
        groups = [""] if batch_axis else [f"seq{i:03d}" for i in range(sequences)]
    for j, p in enumerate(paths):
        tmp = p + ".tmp"
        with _removed_on_error(tmp), h5py.File(tmp, "w") as f:
            for gi, g in enumerate(groups):
                node = f.require_group(g) if g else f
                if j == 0 and table is not None:
                    node.create_dataset("slices", data=table)
                if j == 0 and cu is not None:
                    node.create_dataset("cu_seqlens", data=cu)
                    if cu_k is not None:
                        node.create_dataset("cu_seqlens_k", data=cu_k)
                for fam, total, stream in families:
                    starts = np.concatenate(([0], np.cumsum(split_sizes(total, shards))))
                    lo, hi = int(starts[j]), int(starts[j + 1])
                    _write_family(
                        node,
                        fam,
                        total,
                        lo,
                        hi,
                        seed,
                        gi,
                        stream,
                        dt,
                        sequences,
                        batch_axis,
                        compression,
                        values,
                    )
        os.replace(tmp, p)
    if features:
        wpath = weights or os.path.splitext(path)[0] + "-weights.h5"
        rng = np.random.default_rng([seed, 1 << 20])
        with _removed_on_error(wpath + ".tmp"), h5py.File(wpath + ".tmp", "w") as f:
            f.attrs["num_heads"] = heads
            f.attrs["num_kv_heads"] = kv_heads
            for name, h, wd in (
                ("wq", heads, head_dim),
                ("wk", kv_heads, head_dim),
                ("wv", kv_heads, dv),
            ):
                w = rng.standard_normal((features, h * wd)) / np.sqrt(features)
                f.create_dataset(name, data=w.astype(dt))
            if bias:  # a stream of its own: the weights stay those of a file without biases
                brng = np.random.default_rng([seed, 1 << 20, 1])
                for name, h, wd in (
                    ("bq", heads, head_dim),
                    ("bk", kv_heads, head_dim),
                    ("bv", kv_heads, dv),
                ):
                    b = 0.3 + 0.5 * brng.standard_normal(h * wd)
                    f.create_dataset(name, data=b.astype(dt))
        os.replace(wpath + ".tmp", wpath)
        paths.append(wpath)
    return paths
