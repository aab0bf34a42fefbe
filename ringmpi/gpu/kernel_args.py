"""Kernel arguments shared by the GPU forward and backward tiles.

Dtypes (storage kind, tile and accumulation dtypes, bfloat16 bit patterns),
device copies of position arrays, score-modifier parameters and block plans
(cached by content), the per-row bounds and their null-pointer stand-ins, the
score modifiers' kernel arguments, 16-byte padded rows and the state checks.
CuPy is imported lazily: importing this module needs neither CuPy nor a GPU.
"""

from __future__ import annotations

import functools
from typing import Optional

import numpy as np

from . import configs, plan

__all__ = [
    "NULL",
    "dtype_name",
    "storage",
    "tile_dtype",
    "acc_dtype",
    "to_bf16_bits",
    "from_bf16_bits",
    "device_pos",
    "device_plan",
    "checked_rows",
    "device_rows",
    "padded_rows",
    "check_state",
    "modifier_args",
    "clear_caches",
]

# a null device pointer for the kernels' optional row_lo / row_hi arguments
NULL = np.uint64(0)
_NO_MODS = (np.uint32(0), NULL, NULL)  # the modifier arguments of a call without any


def dtype_name(dtype) -> str:
    """numpy name of ``dtype`` (also for a CuPy-only bfloat16 type)."""
    try:
        return np.dtype(dtype).name
    except TypeError:  # e.g. a CuPy-only bfloat16 type
        return getattr(dtype, "name", getattr(dtype, "__name__", str(dtype)))


def storage(dtype) -> str:
    """The kernels' storage type for ``dtype``: half_t, bf16_t, float or double (TypeError else)."""
    name = dtype_name(dtype)
    kinds = {"float16": "half_t", "bfloat16": "bf16_t", "uint16": "bf16_t"}
    kinds.update(float32="float", float64="double")
    if name not in kinds:
        raise TypeError(f"GPU tile: unsupported dtype {name}")
    return kinds[name]


def tile_dtype(dtype):
    """Dtype q/k/v are kept in for the kernels: the input dtype, float32 for others."""
    name = dtype_name(dtype)
    if name in ("float16", "uint16", "float32", "float64"):
        return np.dtype(name)
    if name == "bfloat16":
        return dtype  # CuPy's own bfloat16 type, where it has one
    return np.dtype(np.float32)


def acc_dtype(dtype):
    """Accumulation dtype of the state: float64 for float64 inputs, float32 otherwise."""
    name = dtype_name(dtype)
    return np.dtype(np.float64) if name == "float64" else np.dtype(np.float32)


def _xp(x):
    if type(x).__module__.split(".")[0] == "cupy":
        import cupy

        return cupy
    return np


def to_bf16_bits(x):
    """float array (numpy or CuPy) -> uint16 bfloat16 bits, round to nearest even.

    Finite values round to nearest even (overflow gives +-inf, as IEEE does);
    infinities stay infinite and every NaN becomes a quiet NaN of the same sign.

    Parameters
    ----------
    x : numpy.ndarray or cupy.ndarray, any shape
    """
    xp = _xp(x)
    u = xp.ascontiguousarray(x, dtype=xp.float32).view(xp.uint32)
    # add 0x7fff plus the lowest kept bit, then keep the upper half
    r = ((u + xp.uint32(0x7FFF) + ((u >> 16) & xp.uint32(1))) >> 16).astype(xp.uint16)
    # NaN (exponent all ones, mantissa non-zero): the rounding above could carry
    # into the sign or clear the mantissa, so keep sign + exponent and set the quiet bit
    nan = (u & xp.uint32(0x7FFFFFFF)) > xp.uint32(0x7F800000)
    quiet = ((u >> 16) | xp.uint32(0x0040)).astype(xp.uint16)
    return xp.where(nan, quiet, r)


def from_bf16_bits(u):
    """uint16 bfloat16 bits (numpy or CuPy) -> float32, exactly.

    Parameters
    ----------
    u : numpy.ndarray or cupy.ndarray of uint16, any shape
    """
    xp = _xp(u)
    return (xp.asarray(u).astype(xp.uint32) << 16).view(xp.float32)


@functools.lru_cache(maxsize=128)
def _device_pos_cached(dev: int, data: bytes):
    import cupy

    return cupy.asarray(np.frombuffer(data, dtype=np.int64))


def device_pos(pos: np.ndarray, dev: int):
    """Device copy of an int64 position array, cached by content and device.

    Parameters
    ----------
    pos : numpy.ndarray (S,) int64
    dev : int
        CUDA device id.
    """
    return _device_pos_cached(dev, pos.tobytes())


@functools.lru_cache(maxsize=256)
def _plan_cached(
    dev: int,
    qb: bytes,
    kb: bytes,
    bm: int,
    bn: int,
    g: int,
    causal: bool,
    lob: Optional[bytes],
    hib: Optional[bytes],
):
    import cupy

    q_pos, k_pos = np.frombuffer(qb, dtype=np.int64), np.frombuffer(kb, dtype=np.int64)
    rows = None
    if lob is not None:
        rows = (np.frombuffer(lob, dtype=np.int64), np.frombuffer(hib, dtype=np.int64))
    env, order, pairs = plan.host_plan(q_pos, k_pos, bm, bn, g, causal, rows)
    return cupy.asarray(env), cupy.asarray(order), pairs


def device_plan(
    q_pos: np.ndarray,
    k_pos: np.ndarray,
    kern: configs.Config,
    g: int,
    causal: bool,
    dev: int,
    rows: Optional[tuple] = None,
):
    """(device block plan, device order, computed pairs per row group) for a call, cached.

    Parameters
    ----------
    q_pos : numpy.ndarray (Sq,) int64 ; k_pos : numpy.ndarray (Sk,) int64
    kern : ringmpi.gpu.configs.Config
        The configuration whose block sizes (and GQA packing) the plan is for.
    g : int
        Query heads per K/V head (used only by packed configurations).
    causal : bool
    dev : int
    rows : (lo, hi), optional
        The checked pair of :func:`checked_rows`, or None.
    """
    g = g if kern.packed else 1
    lob, hib = (None, None) if rows is None else (rows[0].tobytes(), rows[1].tobytes())
    return _plan_cached(
        dev, q_pos.tobytes(), k_pos.tobytes(), kern.bm, kern.bn, g, causal, lob, hib
    )


def checked_rows(bounds: Optional[tuple], q_pos: np.ndarray) -> Optional[tuple]:
    """``bounds`` checked and made contiguous int64 (ValueError if malformed), or None.

    Parameters
    ----------
    bounds : (lo, hi) of numpy int64 arrays (Sq,), or None
    q_pos : numpy.ndarray (Sq,) int64
    """
    return None if bounds is None else plan.row_bounds(q_pos, False, bounds)


def device_rows(rows: Optional[tuple], dev: int) -> tuple:
    """Kernel arguments row_lo, row_hi: device copies (cached), or two null pointers.

    Parameters
    ----------
    rows : (lo, hi) from :func:`checked_rows`, or None
    dev : int
    """
    if rows is None:
        return NULL, NULL
    return device_pos(rows[0], dev), device_pos(rows[1], dev)


def padded_rows(x, ld: int):
    """Contiguous, 16-byte aligned copy of ``x`` with rows zero-padded to ``ld`` (if needed).

    Parameters
    ----------
    x : cupy.ndarray (..., D)
    ld : int
        Row length (>= D) of the result.
    """
    import cupy

    if x.shape[-1] != ld:
        out = cupy.zeros(x.shape[:-1] + (ld,), dtype=x.dtype)
        out[..., : x.shape[-1]] = x
        return out
    if not x.flags.c_contiguous or x.data.ptr % 16:
        return x.copy()  # CuPy allocations are 256-byte aligned
    return x


@functools.lru_cache(maxsize=128)
def _device_params_cached(dev: int, data: bytes, shape: tuple):
    import cupy

    return cupy.asarray(np.frombuffer(data, dtype=np.float64).reshape(shape))


def modifier_args(mods, dev: int) -> tuple:
    """The kernels' last three arguments ``(mods, mparam, mpos)``: the score modifiers.

    ``mods`` (numpy.uint32): the bits of the active modifiers; ``mparam``: a device copy
    of the (H, NMODS) float64 parameters; ``mpos``: of the rows' int64 positions, or a
    null pointer when no active modifier uses positions (both cached by content).
    Without modifiers: ``(0, NULL, NULL)``. See kernels/attention_common.cuh.

    Parameters
    ----------
    mods : ringmpi.scoremods.TileMods or None
        What :func:`ringmpi.scoremods.pack` made of the tile's modifier keywords.
    dev : int
        CUDA device id.
    """
    if mods is None or not mods.bits:
        return _NO_MODS
    params = np.ascontiguousarray(mods.params, dtype=np.float64)
    mparam = _device_params_cached(dev, params.tobytes(), params.shape)
    mpos = NULL if mods.qpos is None else device_pos(np.ascontiguousarray(mods.qpos, np.int64), dev)
    return np.uint32(mods.bits), mparam, mpos


def check_state(name: str, x, shape: tuple, dtype) -> None:
    """ValueError unless ``x`` is a C-contiguous ``dtype`` array of ``shape``.

    Parameters
    ----------
    name : str
        The argument's name, for the message.
    x : cupy.ndarray
    shape : tuple of int
    dtype : numpy.dtype
    """
    if tuple(x.shape) != tuple(shape) or x.dtype != dtype or not x.flags.c_contiguous:
        raise ValueError(
            f"GPU tile: {name} must be a C-contiguous {dtype} array of shape {tuple(shape)}, "
            f"got {x.dtype} {tuple(x.shape)}"
        )


def clear_caches() -> None:
    """Forget the cached device copies of positions, modifier parameters and plans."""
    _device_pos_cached.cache_clear()
    _device_params_cached.cache_clear()
    _plan_cached.cache_clear()
