"""Kernel configurations of the CUDA tiles and the choice among them (no CuPy needed).

A configuration is one template instantiation with its launch shape and its
dynamic shared memory. Which ones may run depends on the storage type, the head
dim D and the device's opt-in shared-memory limit per block
(``sharedMemPerBlockOptin``: 232,448 B on sm_90, 166,912 B on sm_80/87,
101,376 B on sm_86/89/120). :func:`forward_candidates` lists the ones that fit,
fastest-expected first; the device tile then uses the first, or the one that
the autotuner (:mod:`ringmpi.gpu.tune`) measured fastest, or the one
``RINGMPI_GPU_CONFIG`` names.

Storage types are the kernel's names: ``half_t`` (fp16), ``bf16_t`` (bfloat16
bits), ``float``, ``double``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "Config",
    "MAX_D",
    "STORAGES",
    "forward_all",
    "forward_candidates",
    "forward_names",
    "select_forward",
    "backward_all",
    "select_backward",
    "backward_names",
    "NoConfigError",
    "fits",
]

MAX_D = 256
STORAGES = ("half_t", "bf16_t", "float", "double")
_MMA_HD = (32, 64, 96, 128)  # tensor-core head dims (D padded up to one of these)
_SIMT_DMAX = (64, 128, 256)


class NoConfigError(ValueError):
    """No kernel configuration fits the device's shared memory for this call."""


@dataclass(frozen=True)
class Config:
    """One kernel instantiation and how to launch it.

    Attributes
    ----------
    name : str
        Family name, the same for every head dim (what ``RINGMPI_GPU_CONFIG`` takes).
    expr : str
        NVRTC name expression of the template instantiation.
    bm, bn : int
        Query rows per CTA and keys per key block.
    threads : int
        Threads per CTA.
    smem : int
        Dynamic shared memory per CTA in bytes.
    static : int
        Static shared memory of the kernel (its ``__shared__`` arrays) in bytes, as
        ptxas reports it (tests/gpu/test_nvrtc.py checks every instantiation). A
        launch fits a device when ``smem + static`` is within its opt-in limit
        (:func:`fits`), and needs the opt-in when that is over 48 KiB.
    mma : bool
        Tensor-core kernel: rows must be 16-byte aligned (padded to ``ld``).
    packed : bool
        The query heads sharing a K/V head are packed into the rows of one CTA
        (row r of a CTA group is position r // G of head r % G) and the CTAs
        are launched heaviest causal block first (through an order array).
    """

    name: str
    expr: str
    bm: int
    bn: int
    threads: int
    smem: int
    mma: bool
    packed: bool = False
    static: int = 0

    @property
    def total(self) -> int:
        """Shared memory per CTA, dynamic and static, in bytes."""
        return self.smem + self.static


def fits(c: Config, smem_limit: int) -> bool:
    """Whether ``c`` fits a device whose opt-in limit per block is ``smem_limit`` bytes."""
    return c.total <= smem_limit


def _static(*nbytes: int) -> int:
    """Static shared memory of a kernel's ``__shared__`` variables of ``nbytes`` each: ptxas
    places each at a 16-byte boundary (a RingMods<float> of 8 B takes 16)."""
    return sum(-(-n // 16) * 16 for n in nbytes)


def _acc(storage: str) -> str:
    return "double" if storage == "double" else "float"


def _pad(d: int, dims: tuple) -> int:
    return next(x for x in dims if d <= x)


# ---------------------------------------------------------------------------
# forward
# ---------------------------------------------------------------------------
def _mma64(storage: str, hd: int) -> Config:
    # 4 warps x 16 query rows, 64-key blocks; Q + double-buffered K and V, 16-bit
    smem = (64 + 4 * 64) * (hd + 8) * 2
    static = _static(64 * 8, 64 * 8, 64 * 8, 8)  # rlo_s, rhi_s, qa_s[64]; md
    return Config(
        "m64n64", f"attn_fwd_mma<{storage}, {hd}>", 64, 64, 128, smem, True, static=static
    )


def _mma128(storage: str, hd: int, bn: int) -> Config:
    # 4 warps x 32 query rows (GQA heads packed), bn-key blocks, all fragments via ldmatrix
    smem = (128 + 4 * bn) * (hd + 8) * 2
    expr = f"attn_fwd_mma2<{storage}, {hd}, {bn}>"
    # rlo_s, rhi_s, qa_s, md_s (RingMods<float>), m_in, m_st: [128] each
    static = _static(128 * 8, 128 * 8, 128 * 8, 128 * 8, 128 * 4, 128 * 4)
    return Config(f"m128n{bn}", expr, 128, bn, 128, smem, True, packed=True, static=static)


# key blocks of the 128-row kernel per head dim: HD 96 and 128 with 64-key blocks spill
# registers (HD 96 did once the per-row mask bounds came in: 254 -> 255 registers + spills)
_MMA128_BN = {32: (64, 32), 64: (64, 32), 96: (32,), 128: (32,)}


# CUDA-core kernel: (BM, BN) per (acc, DMAX), largest first; smaller ones exist
# for devices with 99 KB of shared memory per block (sm_86/89/120)
_SIMT_TILES = {
    ("float", 64): ((64, 64), (32, 32)),
    ("float", 128): ((64, 64), (32, 32)),
    ("float", 256): ((32, 32), (32, 16), (16, 16)),
    ("double", 64): ((32, 32), (16, 16)),
    ("double", 128): ((32, 32), (32, 16), (16, 16)),
    ("double", 256): ((16, 16),),
}


def _simt(storage: str, dmax: int, bm: int, bn: int) -> Config:
    acc = _acc(storage)
    size = 8 if acc == "double" else 4
    smem = ((bm + 2 * bn) * (dmax + 1) + bm * (bn + 1)) * size
    expr = f"attn_fwd_simt<{storage}, {acc}, {dmax}, {bm}, {bn}>"
    return Config(f"simt{bm}x{bn}", expr, bm, bn, 256, smem, False, static=_static(2 * size))


def forward_all(storage: str, d: int) -> list:
    """Every forward configuration for (storage, D), whatever the device; preferred first."""
    if storage not in STORAGES:
        raise TypeError(f"GPU tile: unsupported storage type {storage}")
    if not 1 <= d <= MAX_D:
        raise ValueError(f"GPU tile: head dim D={d} outside 1..{MAX_D}")
    if storage in ("half_t", "bf16_t") and d <= _MMA_HD[-1]:
        hd = _pad(d, _MMA_HD)
        return [_mma128(storage, hd, bn) for bn in _MMA128_BN[hd]] + [_mma64(storage, hd)]
    dmax = _pad(d, _SIMT_DMAX)
    return [_simt(storage, dmax, bm, bn) for bm, bn in _SIMT_TILES[(_acc(storage), dmax)]]


def forward_candidates(storage: str, d: int, smem_limit: int) -> list:
    """The forward configurations for (storage, D) that fit ``smem_limit`` bytes per block."""
    return [c for c in forward_all(storage, d) if fits(c, smem_limit)]


def select_forward(storage: str, d: int, smem_limit: int, name: str = "") -> Config:
    """The configuration to run: the one named ``name`` if given, else the preferred one.

    Raises
    ------
    NoConfigError
        If nothing fits ``smem_limit``, or ``name`` is not a valid fitting configuration.
    """
    fits = forward_candidates(storage, d, smem_limit)
    if name:
        for c in fits:
            if c.name == name:
                return c
        valid = ", ".join(c.name for c in fits) or "none"
        raise NoConfigError(
            f"GPU tile: configuration {name!r} is not available for {storage} D={d} with "
            f"{smem_limit} B of shared memory per block; valid: {valid}"
        )
    if not fits:
        need = min(c.total for c in forward_all(storage, d))
        raise NoConfigError(
            f"GPU tile: no {storage} D={d} configuration fits {smem_limit} B of shared memory "
            f"per block (the smallest needs {need} B)"
        )
    return fits[0]


def forward_names() -> tuple:
    """Every forward template instantiation (NVRTC name expressions), without duplicates."""
    names: dict = {}
    for s in STORAGES:
        for d in sorted(set(_MMA_HD) | set(_SIMT_DMAX)):
            for c in forward_all(s, d):
                names[c.expr] = None
    return tuple(names)


# ---------------------------------------------------------------------------
# backward: a dK/dV kernel (one CTA per key block) and a dQ kernel (one CTA per
# query block); each is the first of its list that fits the device
# ---------------------------------------------------------------------------
def _bwd_mma(storage: str, hd: int) -> tuple:
    bm = 64 if hd <= 64 else 32  # query rows per dK/dV iteration (registers: 16 x bm S^T, dP^T)
    # K, V; double-buffered Q, dO; per query row (two stages): lo, hi (8 B each), lse, delta
    smem = (2 * 64 + 4 * bm) * (hd + 8) * 2 + 2 * bm * 24
    dkdv = [Config("mma", f"attn_bwd_dkdv_mma<{storage}, {hd}, {bm}>", bm, 64, 128, smem, True)]
    dq = []
    for bn in (64, 32):
        smem = (2 * 64 + 4 * bn) * (hd + 8) * 2
        expr = f"attn_bwd_dq_mma<{storage}, {hd}, {bn}>"
        dq.append(Config(f"mma_n{bn}", expr, 64, bn, 128, smem, True, static=_static(8)))  # md
    return dkdv, dq


_BWD_SIMT_TILES = {
    ("float", 64): ((32, 32), (16, 16)),
    ("float", 128): ((32, 32), (16, 16)),
    ("float", 256): ((32, 32), (16, 16)),
    ("double", 64): ((32, 32), (16, 16)),
    ("double", 128): ((32, 32), (16, 16)),
    ("double", 256): ((16, 16),),
}


def _bwd_simt(storage: str, dmax: int) -> tuple:
    acc = _acc(storage)
    size = 8 if acc == "double" else 4
    dkdv, dq = [], []
    for bm, bn in _BWD_SIMT_TILES[(acc, dmax)]:
        tmpl = f"<{storage}, {acc}, {dmax}, {bm}, {bn}>"
        smem = bm * 16 + ((2 * bn + 2 * bm) * (dmax + 1) + 2 * bn * (bm + 1) + 2 * bm) * size
        expr = "attn_bwd_dkdv_simt" + tmpl
        dkdv.append(
            Config(f"simt{bm}x{bn}", expr, bm, bn, 256, smem, False, static=_static(2 * size))
        )
        smem = ((2 * bm + 2 * bn) * (dmax + 1) + bm * (bn + 1)) * size
        expr = "attn_bwd_dq_simt" + tmpl
        dq.append(
            Config(f"simt{bm}x{bn}", expr, bm, bn, 256, smem, False, static=_static(2 * size))
        )
    return dkdv, dq


def backward_all(storage: str, d: int) -> tuple:
    """(dK/dV configurations, dQ configurations) for (storage, D), preferred first."""
    if storage not in STORAGES:
        raise TypeError(f"GPU backward tile: unsupported storage type {storage}")
    if not 1 <= d <= MAX_D:
        raise ValueError(f"GPU backward tile: head dim D={d} outside 1..{MAX_D}")
    if storage in ("half_t", "bf16_t") and d <= _MMA_HD[-1]:
        return _bwd_mma(storage, _pad(d, _MMA_HD))
    return _bwd_simt(storage, _pad(d, _SIMT_DMAX))


def select_backward(storage: str, d: int, smem_limit: int) -> tuple:
    """(dK/dV, dQ) configurations: the first of each list that fits ``smem_limit`` bytes.

    Raises
    ------
    NoConfigError
        If no configuration of either kernel fits.
    """
    out = []
    for what, lst in zip(("dK/dV", "dQ"), backward_all(storage, d)):
        ok = [c for c in lst if fits(c, smem_limit)]
        if not ok:
            raise NoConfigError(
                f"GPU backward tile: no {storage} D={d} {what} configuration fits {smem_limit} B "
                f"of shared memory per block (the smallest needs {min(c.total for c in lst)} B)"
            )
        out.append(ok[0])
    return tuple(out)


def backward_names() -> tuple:
    """Every backward template instantiation (NVRTC name expressions), without duplicates."""
    names: dict = {}
    for s in STORAGES:
        for d in sorted(set(_MMA_HD) | set(_SIMT_DMAX)):
            for lst in backward_all(s, d):
                for c in lst:
                    names[c.expr] = None
    return tuple(names)
