"""Rotary position embeddings (RoPE) at global token positions.

Convention: rotate-half, as GPT-NeoX and Llama. Feature i of a head (i < D/2)
is paired with feature i + D/2 and the pair is rotated by the angle

    angle(p, i) = (p / scale) * theta ** (-2 i / D)

so that, for x1 = x[..., :D/2] and x2 = x[..., D/2:],

    rope(x)[..., :D/2] = x1 cos(angle) - x2 sin(angle)
    rope(x)[..., D/2:] = x2 cos(angle) + x1 sin(angle)

``scale`` divides the position (linear position interpolation; 1 = plain
RoPE). Angles and products are computed in float64, the result is rounded once
to the dtype of ``x``. A rotation keeps every pair's norm, and the score
q(i) . k(j) of rotated vectors depends on i - j only.
"""

from __future__ import annotations

import numpy as np

__all__ = ["apply_rope", "rope_angles", "positions_in_sequence"]


def rope_angles(positions, head_dim: int, theta: float = 10000.0, scale: float = 1.0):
    """Rotation angles in float64, shape (S, D/2), for ``positions`` (S,).

    Parameters
    ----------
    positions : int or float array (S,)
        Token positions (global, or within a packed sequence).
    head_dim : int
        D, even.
    theta : float
        Base of the frequencies (> 0).
    scale : float
        Positions are divided by ``scale`` (> 0).
    """
    d = int(head_dim)
    if d < 2 or d % 2:
        raise ValueError(f"RoPE needs an even head dimension, got D={head_dim}")
    if not (np.isfinite(theta) and theta > 0):
        raise ValueError(f"RoPE theta must be a positive number, got {theta!r}")
    if not (np.isfinite(scale) and scale > 0):
        raise ValueError(f"RoPE scale must be a positive number, got {scale!r}")
    pos = np.asarray(positions, dtype=np.float64).reshape(-1) / float(scale)
    inv_freq = float(theta) ** (-np.arange(0, d // 2, dtype=np.float64) * 2.0 / d)
    return pos[:, None] * inv_freq[None, :]


def apply_rope(x, positions, theta: float = 10000.0, scale: float = 1.0):
    """Rotate ``x`` by the rotary embedding of each token's position (rotate-half pairs).

    Parameters
    ----------
    x : array (..., S, H, D)
        Token-major queries or keys, D even.
    positions : int array (S,)
        Position of each token (any order; the same rule for every layout).
    theta : float
        Frequency base (default 10000).
    scale : float
        Linear position interpolation: positions are divided by ``scale`` (default 1).

    Returns
    -------
    numpy.ndarray
        Shape and dtype of ``x`` (float64 arithmetic, rounded once).
    """
    x = np.asarray(x)
    if x.ndim < 3:
        raise ValueError(f"apply_rope needs x of shape (..., S, H, D), got {x.shape}")
    s, d = x.shape[-3], x.shape[-1]
    pos = np.asarray(positions)
    if pos.shape != (s,):
        raise ValueError(f"positions has shape {pos.shape}, expected ({s},) for x {x.shape}")
    ang = rope_angles(pos, d, theta, scale)[:, None, :]  # (S, 1, D/2)
    cos, sin = np.cos(ang), np.sin(ang)
    x64 = x.astype(np.float64, copy=False)
    x1, x2 = x64[..., : d // 2], x64[..., d // 2 :]
    out = np.concatenate((x1 * cos - x2 * sin, x2 * cos + x1 * sin), axis=-1)
    return out.astype(x.dtype if x.dtype.kind == "f" else np.float64, copy=False)


def positions_in_sequence(positions, cu_seqlens=None) -> np.ndarray:
    """Position of each global token within its packed sequence: p - cu_seqlens[s].

    Parameters
    ----------
    positions : int array (S,)
        Global token positions.
    cu_seqlens : int array (n+1,), optional
        Offsets [0, n1, ..., N] of packed sequences; None: one sequence (positions as given).

    Returns
    -------
    numpy.ndarray
        int64 (S,).
    """
    pos = np.asarray(positions, dtype=np.int64)
    if cu_seqlens is None:
        return pos
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    s = np.searchsorted(cu, pos, side="right") - 1
    return pos - cu[s]
