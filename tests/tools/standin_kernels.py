"""CPU implementations of ringmpi's CUDA kernels for the CuPy stand-in (tests only).

Each function receives a launch exactly as the GPU tiles make it (grid, block,
the argument tuple, dynamic shared memory), checks it against the kernel's
signature as parsed from kernels/*.cu (argument count, each argument's kind and
type for the instantiation's template arguments: :func:`check_signature`), then
the meaning of the arguments (shapes, dtypes, padded row stride ``ld``, grid,
the score modifiers' parameter block), checks the block plan it was given (a
skipped block pair hides every element, a pair run without a mask shows every
element), then does the kernel's arithmetic with the numpy tile
(:mod:`ringmpi.cpu.numpy_tile`) on the unpacked arguments. The CUDA code itself
does not run: these tests cover the Python side of the GPU path, never the
kernels (tests/gpu/test_tile_device.py does, on a GPU).
"""

from __future__ import annotations

import functools
import re

import numpy as np

__all__ = [
    "install",
    "configs_by_expr",
    "geometry",
    "signatures",
    "check_signature",
    "static_smem",
]

geometry: list = []  # (expression, D, ld) of every launch checked here, in order

LOG2E = 1.4426950408889634
_STORAGE = {"half_t": "float16", "bf16_t": "uint16", "float": "float32", "double": "float64"}
# the kernels' C types -> numpy: scalars by value, pointees of pointer parameters
_SCALAR = {"int": np.int32, "unsigned": np.uint32, "float": np.float32, "double": np.float64}
_POINTEE = {
    **{k: np.dtype(v) for k, v in _STORAGE.items()},
    "longlong": np.dtype(np.int64),
    "int": np.dtype(np.int32),
}
_KERNEL = re.compile(
    r"template\s*<([^>]*)>\s*__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?"
    r"(\w+)\s*\(([^)]*)\)\s*\{"
)


@functools.cache
def configs_by_expr() -> dict:
    """Name expression -> Config of every kernel configuration (ringmpi imported lazily)."""
    from ringmpi.gpu import configs

    out = {}
    for s in configs.STORAGES:
        for d in range(1, configs.MAX_D + 1):
            for c in configs.forward_all(s, d):
                out[c.expr] = c
            for lst in configs.backward_all(s, d):
                for c in lst:
                    out[c.expr] = c
    return out


def _targs(expr: str) -> list:
    return [a.strip() for a in expr[expr.index("<") + 1 : expr.rindex(">")].split(",")]


@functools.cache
def signatures() -> dict:
    """Kernel template -> (template parameter names, [(type, name), ...]), from kernels/*.cu.

    Parsed from the text the loader compiles (:func:`ringmpi.gpu.sources.source`); a
    type is written without spaces, ``const`` or ``__restrict__`` (``T*``, ``longlong*``,
    ``unsigned``).
    """
    from ringmpi.gpu import sources

    out = {}
    for f in (sources.FORWARD_FILE, sources.BACKWARD_FILES):
        for m in _KERNEL.finditer(sources.source(f)):
            tparams = [p.split()[-1] for p in m.group(1).split(",")]
            params = []
            for p in m.group(3).split(","):
                words = [w for w in p.split() if w not in ("const", "__restrict__")]
                params.append(("".join(words[:-1]), words[-1]))
            out[m.group(2)] = (tparams, params)
    return out


def _param_names(expr: str) -> list:
    """The parameter names of kernel ``expr`` in kernels/*.cu, in order."""
    return [name for _, name in signatures()[expr.split("<")[0].strip()][1]]


def _null(x) -> bool:
    return isinstance(x, np.uint64) and int(x) == 0


def check_signature(expr: str, args) -> None:
    """LaunchError unless ``args`` fit the parameters of kernel ``expr`` in kernels/*.cu.

    One argument per parameter; a pointer parameter takes a device array of its pointee's
    dtype (after the template arguments are substituted), C-contiguous, or a null pointer
    (numpy.uint64(0)); a scalar takes the numpy scalar type of its C type exactly.
    """
    name = expr.split("<")[0].strip()
    sig = signatures().get(name)
    _need(sig is not None, expr, f"no __global__ {name} in kernels/*.cu")
    tparams, params = sig
    targs = _targs(expr)
    _need(len(targs) == len(tparams), expr, f"template arguments {targs} for {tparams}")
    sub = dict(zip(tparams, targs))
    _need(
        len(args) == len(params),
        expr,
        f"{len(args)} arguments for the {len(params)} parameters of {name}",
    )
    for (typ, pname), a in zip(params, args):
        base = typ.rstrip("*")
        base = sub.get(base, base)
        if typ.endswith("*"):
            if _null(a):
                continue
            _need(
                type(a).__module__.split(".")[0] == "cupy",
                expr,
                f"{pname} ({typ}) is not a device array or a null pointer",
            )
            want = _POINTEE.get(base)
            _need(want is not None, expr, f"{pname}: unknown pointee type {base}")
            _need(a._a.dtype == want, expr, f"{pname} has dtype {a._a.dtype}, kernel reads {base}")
            _need(a._a.flags.c_contiguous, expr, f"{pname} is not C-contiguous")
        else:
            want = _SCALAR.get(base)
            _need(want is not None, expr, f"{pname}: unknown scalar type {base}")
            _need(
                type(a) is want,
                expr,
                f"{pname} must be {want.__name__} ({base}), got {type(a).__name__}",
            )


class LaunchError(AssertionError):
    """A launch that the real kernel would misread."""


def _need(ok: bool, expr: str, what: str) -> None:
    if not ok:
        raise LaunchError(f"stand-in {expr}: {what}")


def _dev(x, expr: str, name: str, dtype, shape=None):
    """The numpy storage of device array argument ``name`` (checked)."""
    _need(type(x).__module__.split(".")[0] == "cupy", expr, f"{name} is not a device array")
    a = x._a
    _need(a.dtype == np.dtype(dtype), expr, f"{name} has dtype {a.dtype}, kernel reads {dtype}")
    _need(a.flags.c_contiguous, expr, f"{name} is not C-contiguous")
    if shape is not None:
        _need(a.shape == tuple(shape), expr, f"{name} has shape {a.shape}, expected {shape}")
    return a


def _int(x, expr: str, name: str) -> int:
    _need(isinstance(x, np.int32), expr, f"{name} must be numpy.int32, got {type(x).__name__}")
    return int(x)


def _rows_arg(lo, hi, expr: str, sq: int):
    """(lo, hi) host arrays, or None for the two null pointers."""
    if isinstance(lo, np.uint64) and isinstance(hi, np.uint64):
        _need(int(lo) == 0 and int(hi) == 0, expr, "row bounds: a non-null raw pointer")
        return None
    return (
        _dev(lo, expr, "row_lo", np.int64, (sq,)).copy(),
        _dev(hi, expr, "row_hi", np.int64, (sq,)).copy(),
    )


def _visible(q_pos, k_pos, rows, causal: bool) -> np.ndarray:
    if rows is not None:
        lo, hi = rows
        return (lo[:, None] <= k_pos[None, :]) & (k_pos[None, :] <= hi[:, None])
    if causal:
        return k_pos[None, :] <= q_pos[:, None]
    return np.ones((len(q_pos), len(k_pos)), dtype=bool)


def _check_plan(expr, env, vis, bm: int, bn: int, g: int) -> None:
    """A skipped block pair must hide every element, an unmasked one show every element."""
    sq, sk = vis.shape
    nqb, nkb = -(-g * sq // bm), -(-sk // bn)
    env = _dev(env, expr, "bounds (block plan)", np.int64, (4 * nqb + 2 * nkb,))
    lo_min, lo_max, hi_min, hi_max = env[: 4 * nqb].reshape(4, nqb)
    klo, khi = env[4 * nqb :].reshape(2, nkb)
    rows = vis[np.arange(g * sq) // g]  # packed row r is position r // g
    qs, ks = np.arange(0, g * sq, bm), np.arange(0, sk, bn)
    any_ = np.logical_or.reduceat(np.logical_or.reduceat(rows, qs, axis=0), ks, axis=1)
    all_ = np.logical_and.reduceat(np.logical_and.reduceat(rows, qs, axis=0), ks, axis=1)
    skip = (hi_max[:, None] < klo[None, :]) | (khi[None, :] < lo_min[:, None])
    full = (lo_max[:, None] <= klo[None, :]) & (khi[None, :] <= hi_min[:, None])
    _need(not (skip & any_).any(), expr, "the plan skips a block pair with visible keys")
    _need(not (full & ~all_ & ~skip).any(), expr, "the plan runs a partly hidden pair unmasked")


def _decode(a: np.ndarray, d: int, storage: str) -> np.ndarray:
    """Stored rows (padded to ld) -> the first d values in the tile's compute dtype."""
    a = a[..., :d]
    if storage == "bf16_t":
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float64 if storage == "double" else np.float32)


def _padding_zero(expr, d: int, **arrays) -> None:
    """Tensor-core kernels multiply the padded columns too: they must hold zeros."""
    for name, a in arrays.items():
        _need(not a[..., d:].view(np.uint8).any(), expr, f"{name}: padding columns not zero")


def _geometry(expr, kern, storage, args_i, q, k) -> tuple:
    """(h, hkv, sq, sk, d, ld) from the int arguments, checked against the arrays."""
    h, hkv, sq, sk, d, ld = (_int(x, expr, n) for x, n in zip(args_i, "H Hkv Sq Sk D ld".split()))
    _need(h > 0 and hkv > 0 and h % hkv == 0, expr, f"H={h} is not a multiple of Hkv={hkv}")
    t = [int(x) for x in _targs(expr)[1:] if x.isdigit()]
    if kern.mma:
        hd = t[0]
        _need(ld % 8 == 0 and d <= ld <= hd, expr, f"ld={ld} for D={d}, HD={hd} (16-byte rows)")
    else:
        _need(ld == d <= t[0], expr, f"ld={ld} != D={d} or D > DMAX={t[0]}")
    geometry.append((expr, d, ld))
    del geometry[:-1000]
    return h, hkv, sq, sk, d, ld


def _modifiers(expr, bits, mparam, mpos, h: int, sq: int) -> dict:
    """The numpy tile's modifier keywords from the kernel's last three arguments (checked).

    ``(mods, mparam, mpos)`` as kernels/attention_common.cuh reads them: the active
    slots' bits; their (H, NMODS) float64 parameters (null without modifiers); the rows'
    int64 positions, given exactly when an active modifier uses positions. Unpacked
    generically through :mod:`ringmpi.scoremods` (no modifier is named here).
    """
    from ringmpi import scoremods

    _need(isinstance(bits, np.uint32), expr, f"mods must be numpy.uint32, got {type(bits)}")
    bits = int(bits)
    if bits == 0:
        _need(_null(mparam), expr, "mparam: not a null pointer without modifiers")
        _need(_null(mpos), expr, "mpos: not a null pointer without modifiers")
        return {}
    known = sum(1 << m.slot for m in scoremods.MODS)
    _need(not bits & ~known, expr, f"mods {bits:#x} sets bits of no modifier ({known:#x})")
    params = _dev(mparam, expr, "mparam", np.float64, (h, scoremods.NMODS)).copy()
    block = scoremods.TileMods(bits, params, None)
    if any(m.positions for m in block.active()):
        qpos = _dev(mpos, expr, "mpos", np.int64, (sq,)).copy()
    else:
        _need(_null(mpos), expr, "mpos given, but no active modifier uses positions")
        qpos = None
    return scoremods.TileMods(bits, params, qpos).keywords()


def _forward(expr, grid, block, args, smem):
    kern = configs_by_expr()[expr]
    ta = _targs(expr)
    storage = ta[0]
    sdt = _STORAGE[storage]
    adt = np.float64 if storage == "double" else np.float32
    _need(block == (kern.threads,), expr, f"block {block}, kernel expects ({kern.threads},)")
    _need(smem == kern.smem, expr, f"shared memory {smem} B, the configuration needs {kern.smem}")
    check_signature(expr, args)
    *args, bits, mparam, mpos = args  # the score modifiers come last
    if kern.packed:
        q, k, v, acc, m, l, qp, kp, env, rlo, rhi, order, b_arg, *ints, scale, causal = args
        bsz = _int(b_arg, expr, "B")
    else:
        q, k, v, acc, m, l, qp, kp, env, rlo, rhi, *ints, scale, causal = args
        bsz = grid[2] if len(grid) == 3 else 1
    _need(len(ints) == 6, expr, f"{len(args)} arguments do not match the signature")
    qa = q._a
    _need(qa.ndim == 4, expr, "q is not (B, H, Sq, ld)")
    h, hkv, sq, sk, d, ld = _geometry(expr, kern, storage, ints, q, k)
    qa = _dev(q, expr, "q", sdt, (bsz, h, sq, ld))
    ka = _dev(k, expr, "k", sdt, (bsz, hkv, sk, ld))
    va = _dev(v, expr, "v", sdt, (bsz, hkv, sk, ld))
    acc_a = _dev(acc, expr, "acc", adt, (bsz, h, sq, d))
    m_a = _dev(m, expr, "m", adt, (bsz, h, sq))
    l_a = _dev(l, expr, "l", adt, (bsz, h, sq))
    q_pos = _dev(qp, expr, "q_pos", np.int64, (sq,))
    k_pos = _dev(kp, expr, "k_pos", np.int64, (sk,))
    rows = _rows_arg(rlo, rhi, expr, sq)
    causal = bool(_int(causal, expr, "causal"))
    _need(isinstance(scale, adt if not kern.mma else np.float32), expr, "scale has the wrong type")
    mod_kw = _modifiers(expr, bits, mparam, mpos, h, sq)
    g = h // hkv if kern.packed else 1
    nqb = -(-g * sq // kern.bm)
    if kern.packed:
        order = _dev(order, expr, "order", np.int32, (nqb,))
        _need(np.array_equal(np.sort(order), np.arange(nqb)), expr, "order is no permutation")
        _need(grid == (nqb * bsz * hkv,), expr, f"grid {grid}, expected ({nqb * bsz * hkv},)")
    else:
        _need(grid == (nqb, h, bsz), expr, f"grid {grid}, expected {(nqb, h, bsz)}")
    # the scale's unit is the parameter's name: natural (scale), or base 2 (scale_log2:
    # scores times log2(e), whose state the kernel would have to convert back)
    names = _param_names(expr)
    scale = float(scale)
    if names[names.index("causal") - 1] == "scale_log2":
        scale /= LOG2E
    _padding_zero(expr, d, q=qa, k=ka, v=va)
    _check_plan(expr, env, _visible(q_pos, k_pos, rows, causal), kern.bm, kern.bn, g)
    from ringmpi.cpu import numpy_tile

    numpy_tile.forward_tile(
        _decode(qa, d, storage),
        _decode(ka, d, storage),
        _decode(va, d, storage),
        q_pos,
        k_pos,
        acc_a,
        m_a,
        l_a,
        scale=scale,
        causal=causal,
        bounds=rows,
        **mod_kw,
    )


def _backward(expr, grid, block, args, smem):
    kern = configs_by_expr()[expr]
    storage = _targs(expr)[0]
    sdt = _STORAGE[storage]
    adt = np.float64 if storage == "double" else np.float32
    dkdv = "_dkdv_" in expr
    _need(block == (kern.threads,), expr, f"block {block}, kernel expects ({kern.threads},)")
    _need(smem == kern.smem, expr, f"shared memory {smem} B, the configuration needs {kern.smem}")
    check_signature(expr, args)
    *args, bits, mparam, mpos = args  # the score modifiers come last
    if dkdv:
        q, k, v, do, lse, delta, dk, dv, qp, kp, env, rlo, rhi, *ints, scale, causal = args
    else:
        q, k, v, do, lse, delta, dq, qp, kp, env, rlo, rhi, *ints, scale, causal = args
    _need(len(ints) == 6, expr, f"{len(args)} arguments do not match the signature")
    bsz = grid[2]
    h, hkv, sq, sk, d, ld = _geometry(expr, kern, storage, ints, q, k)
    qa = _dev(q, expr, "q", sdt, (bsz, h, sq, ld))
    ka = _dev(k, expr, "k", sdt, (bsz, hkv, sk, ld))
    va = _dev(v, expr, "v", sdt, (bsz, hkv, sk, ld))
    doa = _dev(do, expr, "dout", sdt, (bsz, h, sq, ld))
    lse_a = _dev(lse, expr, "lse", adt, (bsz, h, sq))
    delta_a = _dev(delta, expr, "delta", adt, (bsz, h, sq))
    q_pos = _dev(qp, expr, "q_pos", np.int64, (sq,))
    k_pos = _dev(kp, expr, "k_pos", np.int64, (sk,))
    rows = _rows_arg(rlo, rhi, expr, sq)
    causal = bool(_int(causal, expr, "causal"))
    _need(isinstance(scale, adt if not kern.mma else np.float32), expr, "scale has the wrong type")
    mod_kw = _modifiers(expr, bits, mparam, mpos, h, sq)
    if dkdv:
        dk_a = _dev(dk, expr, "dk", adt, (bsz, hkv, sk, d))
        dv_a = _dev(dv, expr, "dv", adt, (bsz, hkv, sk, d))
        dq_a = np.zeros((bsz, h, sq, d), dtype=adt)
        _need(grid == (-(-sk // kern.bn), hkv, bsz), expr, f"grid {grid}")
    else:
        dq_a = _dev(dq, expr, "dq", adt, (bsz, h, sq, d))
        dk_a = np.zeros((bsz, hkv, sk, d), dtype=adt)
        dv_a = np.zeros_like(dk_a)
        _need(grid == (-(-sq // kern.bm), h, bsz), expr, f"grid {grid}")
    _padding_zero(expr, d, q=qa, k=ka, v=va, dout=doa)
    _check_plan(expr, env, _visible(q_pos, k_pos, rows, causal), kern.bm, kern.bn, 1)
    dec = [_decode(x, d, storage) for x in (qa, ka, va, doa)]
    from ringmpi.cpu import numpy_tile

    numpy_tile.backward_tile(
        dec[0],
        dec[1],
        dec[2],
        dec[3],
        lse_a,
        delta_a,
        q_pos,
        k_pos,
        dq_a,
        dk_a,
        dv_a,
        scale=float(scale),
        causal=causal,
        bounds=rows,
        **mod_kw,
    )


def install(cupy) -> None:
    """Register the CPU implementations with the stand-in ``cupy`` module."""
    for name in ("attn_fwd_mma", "attn_fwd_mma2", "attn_fwd_simt"):
        cupy.register(name, _forward, static_smem)
    for name in ("attn_bwd_dkdv_mma", "attn_bwd_dq_mma", "attn_bwd_dkdv_simt", "attn_bwd_dq_simt"):
        cupy.register(name, _backward, static_smem)


def static_smem(expr: str) -> int:
    """Static shared memory of instantiation ``expr`` in bytes (the configuration's, which
    tests/gpu/test_nvrtc.py checks against ptxas for every instantiation)."""
    return configs_by_expr()[expr].static
