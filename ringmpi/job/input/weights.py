"""The projection weights file of raw-feature inputs: wq, wk, wv, optional biases and sinks.

q = x @ wq + bq (the (in, out) convention), k and v alike; root attributes
``num_heads`` and ``num_kv_heads`` give the head split. :func:`read_weights`
checks the shapes without reading the data (the reader projects slab by slab).
"""

from __future__ import annotations

import os

import numpy as np

from ..plan import fail
from .files import dataset, open_input

__all__ = ["WEIGHT_NAMES", "BIAS_NAMES", "read_weights"]

WEIGHT_NAMES = ("wq", "wk", "wv")
BIAS_NAMES = ("bq", "bk", "bv")


def read_weights(path: str) -> dict:
    """Shapes of a weights file: wq (F, H*D), wk/wv (F, Hkv*D), optional bq (H*D,), bk/bv.

    The convention is (in, out): q = x @ wq + bq. A torch ``Linear.weight`` is
    (out, in): refused where the shapes tell (not for square matrices).
    """
    f = open_input(path)
    try:
        fsize = os.path.getsize(path)
        extra = sorted(set(f.keys()) - set(WEIGHT_NAMES) - set(BIAS_NAMES) - {"sinks"})
        if extra:
            use = "it reads wq, wk, wv, the optional biases bq, bk, bv and sinks"
            fail(path, f"holds '{extra[0]}', which the job does not use ({use}): remove it")
        w = {n: dataset(path, f, n, 2, fsize) for n in WEIGHT_NAMES}
        b = {n: dataset(path, f, n, 1, fsize) for n in BIAS_NAMES if n in f}
        if b and len(b) != 3:
            fail(path, f"has {', '.join(sorted(b))} but not all of bq, bk, bv (give all three)")
        try:
            h, hkv = int(f.attrs["num_heads"]), int(f.attrs["num_kv_heads"])
        except (KeyError, TypeError, ValueError):
            fail(path, "needs integer root attributes 'num_heads' and 'num_kv_heads'")
        fq, nq = w["wq"].shape
        fk, nk = w["wk"].shape
        cols = {w[n].shape[1] for n in WEIGHT_NAMES}
        torch = (len(cols) == 1 and fq != fk) or (b and b["bq"].shape[0] == fq != nq)
        if torch:  # (out, in) shapes: torch.nn.Linear.weight
            hint = "the job expects (in, out), q = x @ wq + bq: store weight.T"
            fail(
                path,
                f"wq {w['wq'].shape}, wk {w['wk'].shape} look like torch Linear "
                f"weights (out, in); {hint}",
            )
        nv = w["wv"].shape[1]  # the values may be narrower or wider than the keys (MLA)
        if w["wv"].shape[0] != fk or nv % max(hkv, 1) or nv < hkv:
            fail(path, f"wk has shape {w['wk'].shape} but wv has shape {w['wv'].shape}")
        if fq != fk:
            fail(path, f"wq has {fq} input features but wk and wv have {fk}")
        if h < 1 or hkv < 1 or nq % h or nk % hkv or nq // max(h, 1) != nk // max(hkv, 1):
            fail(path, f"wq {w['wq'].shape}, wk {w['wk'].shape} do not fit H={h}, Hkv={hkv}")
        if h % hkv:
            fail(path, f"num_heads={h} is not a multiple of num_kv_heads={hkv}")
        for n, width in (("bq", nq), ("bk", nk), ("bv", nv)):
            if n in b and b[n].shape != (width,):
                fail(
                    path, f"bias {n} has shape {b[n].shape}, expected ({width},) (w{n[1]} columns)"
                )
        sinks = None
        if "sinks" in f:  # per-head sink logits: small, read here once
            ds = dataset(path, f, "sinks", 1, fsize)
            sinks = np.asarray(ds[...], dtype=np.float64)
            if sinks.shape != (h,) or not np.isfinite(sinks).all():
                fail(path, f"sinks must hold num_heads={h} finite numbers, got shape {sinks.shape}")
            sinks = tuple(float(x) for x in sinks)
        return {
            "features": fq,
            "heads": h,
            "kv_heads": hkv,
            "head_dim": nq // h,
            "value_dim": nv // hkv,
            "sinks": sinks,
        }
    finally:
        f.close()
