"""Choosing the tile backend from the array type; what its tiles can and cannot run.

numpy arrays run on the CPU: the fused C tiles when they can be built and loaded,
the numpy tiles otherwise (``RINGMPI_CPU_KERNEL=numpy|fused|auto`` forces one).
CuPy arrays run the CUDA tiles. There is no global switch inside the library.
The ring loops only talk to :class:`Backend`.

No silent fallback: :meth:`Backend.supports` lists the reasons a backend cannot
run a call (the agreement raises them on every rank before any message), and
:meth:`Backend.describe` says which tile runs each pass. Where the fused forward
tile loads but the fused backward does not, ``auto`` takes the numpy backward
tile and says so in ``describe()`` (and ``stats["tile"]``); ``fused`` refuses
the backward with the reason. The fused tiles are wrapped so that arrays they
would hand to the numpy tile (float16, non-contiguous state) raise instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

import numpy as np

from . import reproducible, scoremods, softmax
from .cpu import numpy_tile
from .ring import Ring
from .runtime import env

__all__ = ["Backend", "select", "is_cupy", "ForwardTile", "BackwardTile"]


@dataclass(frozen=True)
class Backend:
    """What the ring loops need from a tile backend."""

    name: str
    xp: Any  # array module: numpy or cupy
    forward_tile: ForwardTile
    backward_tile: Optional[BackwardTile]  # None: this backend has no backward tile yet
    tile_dtype: Callable[[Any], Any]  # dtype q/k/v are converted to for the tile
    acc_dtype: Callable[[Any], Any]  # dtype of the online-softmax state
    ring: Callable[..., Any]  # factory: comm -> Ring-like exchanger
    dtypes: tuple  # input dtype names accepted
    # output (B, S, H, D) in the accumulation dtype -> C-contiguous in the input dtype
    cast_out: Callable[[Any, Any], Any] = lambda o, dt: o.astype(dt, order="C", copy=False)
    # state (acc, m, l) -> (out (B, S, H, D), lse (B, H, S))
    finalize: Optional[Callable[..., Any]] = None
    # input array -> floating values (bfloat16 bit patterns held as uint16 -> float32)
    decode: Callable[[Any], Any] = lambda x: x
    max_d: int = 0  # largest head dim the tiles take (0: any)
    notes: tuple = ()  # what runs: ("forward: ...", "backward: ...")
    backward_missing: str = "no backward tile"  # why backward_tile is None
    # score modifiers (AttentionSpec fields) the forward / backward tiles run; sinks act at
    # finish (every backend), not in a tile
    # (every tile applies every registered modifier through the one parameter block)
    forward_mods: tuple = scoremods.names()
    backward_mods: tuple = scoremods.names()
    # why the backend refuses a mask of slices (issue 41; "" = it runs them)
    slices_missing: str = ""
    # why the forward / backward tiles cannot take keys and values of different widths
    # (Dk != Dv, issue 42); empty: they can
    widths_missing: str = ""
    backward_widths_missing: str = ""

    def supports(
        self,
        spec,
        dtype,
        d: int,
        *,
        backward: bool = False,
        tiles: bool = True,
        dv: Optional[int] = None,
    ) -> list:
        """The reasons this backend cannot run a call (empty: it can).

        Parameters
        ----------
        spec : ringmpi.spec.AttentionSpec
            The validated options of the call.
        dtype : dtype
            The dtype of q, k and v.
        d : int
            The head dim D (the key width Dk).
        backward : bool
            The call is a backward pass.
        tiles : bool
            The call runs the tiles (False: decode, plain array operations).
        dv : int, optional
            The value width Dv (default: ``d``).
        """
        why = []
        try:
            name = np.dtype(dtype).name
        except TypeError:  # e.g. a CuPy-only bfloat16 type
            name = getattr(dtype, "name", str(dtype))
        if name not in self.dtypes:
            why.append(f"dtype {name} (it takes {', '.join(self.dtypes)})")
        if tiles and self.max_d and not 1 <= d <= self.max_d:
            why.append(f"head dim D={d} (its tiles take 1..{self.max_d})")
        widths = self.backward_widths_missing if backward else self.widths_missing
        if tiles and dv is not None and dv != d and widths:
            why.append(f"key width Dk={d} != value width Dv={dv} ({widths})")
        if backward and self.backward_tile is None:
            why.append(self.backward_missing)
        if tiles:
            mods = self.backward_mods if backward else self.forward_mods
            which = "backward" if backward else "forward"
            for f in scoremods.names():
                if getattr(spec, f, None) is not None and f not in mods:
                    why.append(f"{f} (its {which} tile does not apply it yet)")
        if tiles and getattr(spec, "slices", None) is not None and self.slices_missing:
            why.append(f"slices ({self.slices_missing})")
        if spec.head_parallel > 1 and self.xp is not np:
            why.append("head_parallel > 1 (the heads x ring all-to-all takes numpy arrays only)")
        why += reproducible.refusals(spec, self.xp, backward=backward, tiles=tiles)
        return why

    def describe(self) -> str:
        """The tiles this backend runs, e.g. 'fused: forward fused C (avx512); backward ...'."""
        return f"{self.name}: " + "; ".join(self.notes) if self.notes else self.name

    def finish(self, acc, m, l, sinks=None):
        """Normalised output in sequence-major layout and the lse.

        Parameters
        ----------
        acc : (B, H, S, D) ; m, l : (B, H, S)
            The online-softmax state.
        sinks : sequence of float (H,), optional
            Sink logits of these heads, folded in here (:func:`ringmpi.softmax.add_sinks`).

        Returns
        -------
        out : (B, S, H, D) ; lse : (B, H, S)
        """
        if self.finalize is not None:
            out, lse = self.finalize(acc, m, l)
        else:
            out, lse = softmax.finalize(acc, m, l, self.xp)
            out = self.xp.moveaxis(out, -3, -2)
        if sinks is not None:
            out, lse = softmax.add_sinks(out, lse, sinks, self.xp)
        return out, lse


def is_cupy(x) -> bool:
    """True for a CuPy array (checked without importing CuPy)."""
    return type(x).__module__.split(".")[0] == "cupy"


_CPU_DTYPES = ("float16", "float32", "float64")


def _numpy_backend(why: str = "") -> Backend:
    cd = numpy_tile.compute_dtype
    note = "forward and backward: numpy tiles" + (f" ({why})" if why else "")
    return Backend(
        "numpy",
        np,
        numpy_tile.forward_tile,
        numpy_tile.backward_tile,
        cd,
        cd,
        Ring,
        _CPU_DTYPES,
        notes=(note,),
    )


_MODS = scoremods.names()
_ISA = {64: "avx512", 32: "avx2", 16: "sse/neon", 0: "scalar"}
_FUSED_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def _strict(tile: Callable, name: str, state: tuple, widths: str = "") -> Callable:
    """``tile`` refusing the arrays it would silently hand to the numpy tile.

    ``widths``: why the tile cannot take keys and values of different widths ("": it can).
    """

    def run(*args, **kwargs):
        dt = args[0].dtype
        held = [args[i] for i in state if i < len(args)]
        bad = [a for a in held if a.dtype != dt or not a.flags.c_contiguous]
        if dt not in _FUSED_DTYPES or bad:
            raise TypeError(
                f"{name}: takes float32/float64 q and C-contiguous state of the same dtype "
                f"(got {dt}); convert with Backend.tile_dtype instead of a silent numpy fallback"
            )
        if widths and args[1].shape[-1] != args[2].shape[-1]:
            raise ValueError(
                f"{name}: key width Dk={args[1].shape[-1]} != value width "
                f"Dv={args[2].shape[-1]} ({widths})"
            )
        return tile(*args, **kwargs)

    run.__name__ = run.__qualname__ = getattr(tile, "__name__", "tile")
    run.__doc__ = tile.__doc__
    return run


def _fused_backend(forced: bool, differ: bool = False) -> Optional[Backend]:
    """The fused C backend (None where it cannot load); ``differ``: the call's keys and
    values differ in width. Where a backward build cannot take that
    (``fused_backward.WIDTHS_MISSING``, a build from before the value width), ``auto``
    gives that pass to the numpy tile and says so; ``fused`` refuses it in :meth:`supports`."""
    try:
        from .cpu import fused
    except ImportError:
        return None
    if not fused.available():
        return None
    from .cpu import fused_backward

    cd = numpy_tile.compute_dtype
    # a build from before the value width (benchmarks' baselines) takes Dk == Dv only
    fwd_widths = "" if fused.LOADER.default().widths else "this fused C build takes Dk == Dv only"
    fwd = _strict(fused.forward_tile, "fused forward tile", (5, 6, 7), fwd_widths)
    notes = [f"forward: fused C ({fused.isa()})"]
    # the modifiers each build applies (its slots): the others are refused up front
    fmods = scoremods.fields_of(fused.LOADER.default().mods)
    bmods = scoremods.names()  # (the numpy backward tile applies every one)
    bwd_widths = ""
    if fused_backward.available():
        bwd_widths = fused_backward.WIDTHS_MISSING or (
            ""
            if fused_backward.LOADER.default().widths
            else "this fused C backward build takes Dk == Dv only"
        )
    if fused_backward.available() and (forced or not differ or not bwd_widths):
        bwd = _strict(fused_backward.backward_tile, "fused backward tile", (8, 9, 10), bwd_widths)
        notes.append(f"backward: fused C ({_ISA.get(fused_backward.simd_width(), '?')})")
        bmods = scoremods.fields_of(fused_backward.LOADER.default().mods)
        missing = ""
    elif fused_backward.available():  # auto, Dk != Dv: the numpy backward tile, said so
        missing = ""
        bwd = numpy_tile.backward_tile
        notes.append(f"backward: numpy tile ({bwd_widths})")
        bwd_widths = ""
    else:
        reason = str(fused_backward.unavailable_reason()).strip().splitlines()[0]
        missing = f"the fused backward tile is unavailable ({reason})"
        bwd = None if forced else numpy_tile.backward_tile
        notes.append(f"backward: {'none' if forced else 'numpy tile'} ({missing})")
    return Backend(
        "fused",
        np,
        fwd,
        bwd,
        cd,
        cd,
        Ring,
        _CPU_DTYPES,
        finalize=lambda acc, m, l: fused.finalize(acc, m, l, seq_major=True),
        notes=tuple(notes),
        backward_missing=missing or "no backward tile",
        forward_mods=fmods,
        backward_mods=bmods,
        widths_missing=fwd_widths,
        backward_widths_missing=bwd_widths,
    )


def _gpu_backend() -> Backend:
    import cupy

    from . import gpu
    from .gpu.configs import MAX_D

    return Backend(
        "gpu",
        cupy,
        gpu.forward_tile,
        gpu.backward_tile,
        gpu.tile_dtype,
        gpu.acc_dtype,
        gpu.GpuRing,
        # uint16 arrays are bfloat16 bit patterns (gpu.to_bf16_bits), for CuPy without bfloat16
        ("float16", "bfloat16", "uint16", "float32", "float64"),
        _gpu_cast_out,
        decode=_gpu_decode,
        max_d=MAX_D,
        notes=("forward and backward: CUDA tiles",),
        slices_missing="a mask of slices is not yet tested on the CUDA tiles",
        widths_missing="the CUDA tiles are instantiated for one head dim D = Dk = Dv",
        backward_widths_missing="the CUDA tiles are instantiated for one head dim D = Dk = Dv",
    )


def _gpu_decode(x):
    from . import gpu

    return gpu.from_bf16_bits(x) if str(x.dtype) == "uint16" else x


def _gpu_cast_out(out, dtype):
    from . import gpu

    if np.dtype(dtype) == np.uint16:  # bfloat16 bits in, bfloat16 bits out
        return gpu.to_bf16_bits(out)
    return out.astype(dtype, order="C", copy=False)


def select(x, widths: Optional[tuple] = None) -> Backend:
    """Backend for array ``x``: GPU for CuPy arrays, otherwise a CPU tile.

    ``widths`` (Dk, Dv): the key and value widths of the call. Where they differ and
    a fused C tile cannot take that, ``RINGMPI_CPU_KERNEL=auto`` gives that pass to
    the numpy tile and says why in :meth:`Backend.describe`; ``fused`` keeps the fused
    tiles, and :meth:`Backend.supports` refuses the pass they cannot run, with the reason.
    """
    if is_cupy(x):
        return _gpu_backend()
    choice = env.get("RINGMPI_CPU_KERNEL")
    if choice != "numpy":
        differ = widths is not None and widths[0] != widths[1]
        fused = _fused_backend(forced=choice == "fused", differ=differ)
        if fused is not None:
            if differ and fused.widths_missing and choice != "fused":
                return _numpy_backend(f"fused C tiles: {fused.widths_missing}")
            return fused
        if choice == "fused":
            raise RuntimeError("RINGMPI_CPU_KERNEL=fused but the fused CPU tile is unavailable")
        return _numpy_backend(f"fused unavailable: {_fused_reason()}")
    return _numpy_backend("RINGMPI_CPU_KERNEL=numpy")


def _fused_reason() -> str:
    try:
        from .cpu import fused
    except ImportError as e:
        return f"ImportError: {e}"
    return str(fused.unavailable_reason()).strip().splitlines()[0]


# ----------------------------------------------------------------------
# The tile contract: what every forward and backward tile (numpy, fused C, CUDA) implements.
#
# A *tile call* takes this rank's queries and one visiting K/V block. Arrays are in
# the internal head-major layout, all of one array module (numpy or CuPy):
#
#     q      (B, H,   Sq, D)   tile dtype
#     k, v   (B, Hkv, Sk, D)   same dtype; query head h reads K/V head h // (H // Hkv)
#                              (v, and with it acc, dout and dv below, may have another
#                              last axis Dv than q and k: keys and values of different
#                              widths, multi-head latent attention)
#     q_pos  (Sq,)             int64 global token positions (numpy, host)
#     k_pos  (Sk,)             int64 global token positions (numpy, host)
#
# Forward: fold the block into the online-softmax state, in place,
#
#     acc (B, H, Sq, D), m (B, H, Sq), l (B, H, Sq)    accumulation dtype
#
# Backward: add the block's contribution to the gradients, in place,
#
#     dout (B, H, Sq, D)  lse, delta (B, H, Sq)   (delta_i = dout_i . out_i)
#     dq   (B, H, Sq, D)  dk, dv (B, Hkv, Sk, D)  (dk, dv summed over each query group)
#
# Both take ``scale`` (score scale), ``causal`` (key j visible to query i iff
# k_pos[j] <= q_pos[i]; blocks with no visible pair are skipped, not computed)
# and ``progress`` (called between blocks so MPI can progress a pending
# exchange; an exception it raises stops the tile and propagates). Both return
# the flops of their matrix products over the blocks actually computed: 4 * pairs
# * D per head forward, 10 * pairs * D backward (2 * pairs * (Dk + Dv) and
# 2 * pairs * (3 Dk + 2 Dv) where the widths differ). Rows with no visible key keep
# l = 0 (forward) and get no gradient (backward, lse = -inf).
#
# Masks beyond causal (windows, packed sequences, cross-attention; built by
# :meth:`ringmpi.mask.Mask.bounds`) come as the keyword ``bounds=(lo, hi)``:
#
#     lo, hi (Sq,)   int64 numpy arrays over this rank's query rows, global key
#                    positions, inclusive: key j visible to query i iff
#                    lo[i] <= k_pos[j] <= hi[i]; lo[i] > hi[i]: no visible key
#
# ``bounds`` replaces ``causal`` (it already holds the causal limit; the flag is
# then ignored); None (the default) means the ``causal`` flag alone. A tile
# skips any block whose key positions lie outside every row's range and need
# not mask one that every row sees fully; k_pos need not be sorted or
# contiguous (zigzag, striped and packed layouts). What "block" means, and so
# the flops returned, is the tile's own (the fused C tile counts per strip of
# rows, see :func:`ringmpi.cpu.fused.forward_tile`); every visible pair is
# always counted. For a mask of slices ``bounds`` is a :class:`ringmpi.mask.Layer`,
# still a pair (lo, hi), whose ranges need not move with the rows' positions:
# a tile may group rows by range for it (the numpy tile does) or ignore the tag.
#
# Score modifiers (:class:`ringmpi.spec.AttentionSpec` fields registered in
# :mod:`ringmpi.scoremods`; built by :func:`ringmpi.mask.tile_modifiers`) come as
# keywords, passed only when in use; every tile turns them into one parameter
# block with :func:`ringmpi.scoremods.pack` (an unknown keyword: TypeError)::
#
#     softcap  float > 0        s = softcap * tanh(scale * q.k / softcap)
#     alibi    (slopes, qa)     slopes float64 numpy (H,) (this call's query heads),
#                               qa int64 numpy (Sq,): s += -slopes[h] * abs(qa[i] - k_pos[j])
#
# in this order, then the mask; qa[i] is row i's ALiBi position in key
# coordinates (q_pos + Lk_s - Lq_s of its packed sequence s: bottom-right
# aligned; q_pos for self-attention). ALiBi never unhides a hidden key, so
# skipping is unchanged. Backward: dS is multiplied by 1 - tanh^2 of the capped
# score (d/dx of c tanh(x / c)); ALiBi adds no gradient term. Attention sinks
# never enter a tile: the forward's finalize folds them into (out, lse)
# (:meth:`ringmpi.backend.Backend.finish`), and the backward's lse and delta
# already account for them.
#
# The ring loops report ``stats["flops"]`` from :mod:`ringmpi.cost` (the visible
# pairs, the same on every backend); the tiles' own counts go to
# ``stats["tile_flops"]``. What a backend's tiles cannot run (a dtype, a head dim,
# a missing backward, an option) it lists in :meth:`ringmpi.backend.Backend.supports`
# and the agreement raises on every rank: no tile hands a call to another silently.
#
# :mod:`ringmpi.cpu.numpy_tile` is the specification; the other tiles are tested
# against it.


class ForwardTile(Protocol):
    """Fold one K/V block into (acc, m, l); return the flops spent."""

    def __call__(
        self,
        q,
        k,
        v,
        q_pos,
        k_pos,
        acc,
        m,
        l,
        *,
        scale: float,
        causal: bool,
        progress: Optional[Callable[[], None]] = None,
        bounds: Optional[tuple] = None,
        **modifiers,
    ) -> int: ...


class BackwardTile(Protocol):
    """Add one K/V block's gradient contributions to (dq, dk, dv); return the flops spent."""

    def __call__(
        self,
        q,
        k,
        v,
        dout,
        lse,
        delta,
        q_pos,
        k_pos,
        dq,
        dk,
        dv,
        *,
        scale: float,
        causal: bool,
        progress: Optional[Callable[[], None]] = None,
        bounds: Optional[tuple] = None,
        **modifiers,
    ) -> int: ...
