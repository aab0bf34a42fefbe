"""What the batch job tells: provenance attributes, the start line, the summary.

The output's attributes are a deterministic function of the run (no time
stamp, so a resumed run writes the same bytes); times and hosts go to the
summary (``--summary-json``).
"""

from __future__ import annotations

import math
import os
import platform
import resource
import sys
import time
from collections.abc import Sequence
from typing import Optional, TextIO

import numpy as np

from .. import cost
from .output.parts import FORMAT
from .plan import sliced, value_width
from .resources import rank_bytes, resident_bytes, seq_counts

__all__ = [
    "provenance",
    "start_line",
    "format_summary",
    "measure_rate",
    "ticks_per_step",
    "visible_pairs",
    "one_process_note",
    "predicted_seconds",
    "Progress",
    "LOG_EVERY",
    "TTY_EVERY",
    "TRUST",
    "duration",
]


def _kernel(dev: str, dtype: str) -> tuple:
    """(kernel name, ISA) of the tile the run uses."""
    if dev == "gpu":
        return "cuda", "cuda"
    from ..backend import select

    name = select(np.empty(0, dtype)).name
    if name != "fused":
        return name, "numpy"
    from ..cpu import fused

    isa = getattr(fused, "isa", None)
    if callable(isa):
        return name, str(isa())
    width = fused.simd_width()
    return name, {64: "avx512", 32: "avx2", 16: "sse/neon", 0: "scalar"}.get(width, f"simd{width}")


def provenance(
    plan, layout: str, causal: bool, scale, size: int, dev: str, window=None, rope=None
) -> dict:
    """Typed attributes of the output: options, resolved scale, sizes, versions, kernel, host.

    ``window`` (left, right) or None is recorded as ``window`` = [left, right]
    ([-1, -1]: none); ``rope`` (theta, scale) or None as ``rope`` (bool),
    ``rope_theta`` and ``rope_scale``; ``packed`` and ``cross`` say whether any
    sequence is packed (``cu_seqlens``) or has S_k != S_q. No time stamp: the
    output is a deterministic function of these (the run's time is in the summary).
    """
    import h5py

    from .. import __version__

    try:
        import mpi4py
        from mpi4py import MPI

        # Open MPI pads its version string with NULs, which HDF5 string attributes refuse
        mpi = MPI.Get_library_version().replace("\x00", "").strip().splitlines()[0].strip()
        mpi4py_version = mpi4py.__version__
    except ImportError:  # pragma: no cover - the job always has mpi4py
        mpi, mpi4py_version = "none", "none"
    kernel, isa = _kernel(dev, plan.dtype)
    return {
        "format": FORMAT,
        "structure": plan.structure,
        "layout": layout,
        "causal": bool(causal),
        "scale": float(scale) if scale is not None else 1.0 / math.sqrt(plan.head_dim),
        "scale_is_default": scale is None,
        "ranks": int(size),
        "dtype": plan.dtype,
        "heads": int(plan.heads),
        "kv_heads": int(plan.kv_heads),
        "head_dim": int(plan.head_dim),
        **({"value_dim": int(value_width(plan))} if value_width(plan) != plan.head_dim else {}),
        "sequences": len(plan.sequences),
        "tokens": int(sum(s.length for s in plan.sequences)),
        "window": [int(x) for x in (window if window is not None else (-1, -1))],
        "packed": any(s.packed for s in plan.sequences),
        "cross": any(s.cross or s.x_kv for s in plan.sequences),
        "rope": rope is not None,
        "rope_theta": float(rope[0]) if rope is not None else 10000.0,
        "rope_scale": float(rope[1]) if rope is not None else 1.0,
        "inputs": [os.path.abspath(p) for p in plan.files],
        "weights": os.path.abspath(plan.weights) if plan.weights else "",
        "device": dev,
        "kernel": kernel,
        "isa": isa,
        "ringmpi_version": __version__,
        "numpy_version": np.__version__,
        "h5py_version": h5py.version.version,
        "hdf5_version": h5py.version.hdf5_version,
        "mpi_version": mpi,
        "mpi4py_version": mpi4py_version,
        "python_version": platform.python_version(),
        "host": platform.node(),
    }


def ticks_per_step(kernel: str, n_local: int) -> int:
    """Progress callbacks one forward tile call makes (fused: one per CHUNK_Q query rows)."""
    if kernel != "fused" or n_local == 0:
        return 0
    from ..cpu import fused

    return -(-n_local // fused.CHUNK_Q)


def measure_rate(plan, dev: str) -> float:
    """Flop/s of this rank's forward tile on a small block of the plan's shape (0 if unknown)."""
    if dev != "cpu":
        return 0.0
    from ..backend import select
    from ..softmax import init_state

    be = select(np.empty(0, plan.dtype))
    dt = be.tile_dtype(np.dtype(plan.dtype))
    rng = np.random.default_rng(0)
    # small: every rank waits for it (a 512 x 2048 probe was a tenth of a short job);
    # the rate is within a few % of the larger probe's on this kernel (per-call costs)
    sq, sk = 256, 1024
    q = rng.standard_normal((1, plan.heads, sq, plan.head_dim)).astype(dt)
    k = rng.standard_normal((1, plan.kv_heads, sk, plan.head_dim)).astype(dt)
    dv = value_width(plan)  # values of another width (MLA): their own array
    v = k if dv == plan.head_dim else rng.standard_normal((1, plan.kv_heads, sk, dv)).astype(dt)
    if dv != plan.head_dim:  # the tiles the job runs for these widths
        be = select(np.empty(0, plan.dtype), (plan.head_dim, dv))
    pos_q, pos_k = np.arange(sq, dtype=np.int64) + sk, np.arange(sk, dtype=np.int64)
    best = 0.0
    for _ in range(2):  # the first call may compile or warm the caches
        acc, m, l = init_state((*q.shape[:-1], dv), be.acc_dtype(dt), np)
        t0 = time.perf_counter()
        f = be.forward_tile(q, k, v, pos_q, pos_k, acc, m, l, scale=0.1, causal=False)
        t = time.perf_counter() - t0
        best = max(best, f / t if t > 0 else 0.0)
    return best


def visible_pairs(seq, causal: bool, window=None) -> int:
    """Number of (query, key) pairs the mask leaves visible in sequence ``seq`` of a plan.

    A sequence with a mask of slices counts its union (overlaps once), in blocks of rows
    that keep the count's memory O(2**22) entries whatever the number of slices.
    """
    from ..mask import make_mask

    if sliced(seq) is not None:
        s = sliced(seq)
        return s.pairs(seq.length, block=max(1, (1 << 22) // max(1, len(s))))

    mask = make_mask(seq.length, seq.length_k, causal, window, seq.cu_seqlens, seq.cu_seqlens_k)
    return cost.mask_pairs(mask)


def _flops(plan, causal: bool, seqs: list, window=None) -> float:
    """Model flops of the sequences: 4 D H (2 (Dk + Dv) H) per visible pair of the mask."""
    per = float(cost.flops(1, plan.head_dim, plan.heads, dv=value_width(plan)))
    return sum(per * visible_pairs(s, causal, window) for s in seqs)


def predicted_seconds(plan, todo, size: int, causal: bool, rate: float, window=None) -> float:
    """Predicted compute seconds of the sequences ``todo`` on ``size`` ranks at ``rate`` flop/s."""
    if rate <= 0:
        return 0.0
    return _flops(plan, causal, [plan.sequences[i] for i in todo], window) / size / rate


def one_process_note(env=None) -> str:
    """What the start line says about a world of one rank: launched alone, or by a launcher."""
    from ..runtime.launch import launcher_tasks

    launch = launcher_tasks(os.environ if env is None else env)
    if launch.tasks is None and launch.rank is None:
        return (
            "one process: not started by mpiexec/srun, so 1 rank does all the work "
            "(mpiexec -n P ringmpi run ... for P ranks)"
        )
    return f"1 rank, as {launch.launcher} started it"


def start_line(
    plan,
    todo,
    size,
    layout,
    causal,
    dev,
    kernel,
    isa,
    rate,
    ring=None,
    window=None,
    notes=(),
    units=None,
    unit_rings=None,
) -> str:
    """The job's first line: what, where, how much memory, how long (predicted).

    ``notes``: more clauses (BLAS threads, a run of one process), joined with "; ".
    ``units``: what one ring call computes (:class:`ringmpi.job.resources.Batch`: one
    sequence or several packed), which sizes the memory; default the sequences.
    ``unit_rings``: the ring size of each unit (``--ring-size auto``), default
    ``ring`` for all.
    """
    ring = size if ring is None else ring
    seqs = [plan.sequences[i] for i in todo]
    units = seqs if units is None else list(units)
    rings = [ring] * len(units) if unit_rings is None else list(unit_rings)
    tokens = sum(s.length for s in seqs)
    mem = 0
    for r in set(rings):
        mine = [u for u, ur in zip(units, rings) if ur == r]
        ahead = len(mine) > size // r  # read-ahead of a next call's inputs on some ring
        mem = max(
            [mem]
            + [
                rank_bytes(plan, n, prefetch=ahead, n_local_k=nk, ranks=r)
                for n, nk in (seq_counts(s, r, layout) for s in mine)
            ]
        )
    mem = (mem + resident_bytes()) / 2**30  # the peak resident memory it should match
    where = f"{dev} ({kernel}, {isa})" if dev == "cpu" else dev
    text = (
        f"{len(todo)} sequence(s), {tokens:,} tokens (H={plan.heads}, Hkv={plan.kv_heads}, "
        + (
            f"D={plan.head_dim}"
            if value_width(plan) == plan.head_dim
            else f"Dk={plan.head_dim}, Dv={value_width(plan)}"
        )
        + f", {plan.dtype}), {size} rank(s)"
        + _rings_text(size, ring, rings, units)
        + f", {layout}{', causal' if causal else ''}"
        + (f", window {tuple(window)}" if window is not None else "")
        + (", packed" if any(s.packed for s in seqs) else "")
        + (", slices" if any(sliced(s) is not None for s in seqs) else "")
        + (", cross" if any(s.cross for s in seqs) else "")
        + (f", {len(units)} ring call(s)" if len(units) != len(seqs) else "")
        + f", {where}; ~{mem:.2f} GiB per rank"
    )
    if rate > 0 and tokens:
        secs = predicted_seconds(plan, todo, size, causal, rate, window)
        text += f"; predicted ~{duration(secs)} at {rate / 1e9:.1f} GFLOP/s per rank (measured)"
    text += "".join(f"; {n}" for n in notes)
    return text


def _rings_text(size: int, ring: int, rings: list, units: list) -> str:
    """' as 2 rings of 2', or per ring size under --ring-size auto; '' for one ring of all."""
    if len(set(rings)) <= 1:
        return f" as {size // ring} rings of {ring}" if ring != size else ""
    parts = []
    for r in sorted(set(rings), reverse=True):
        n = sum(len(getattr(u, "members", (0,))) for u, ur in zip(units, rings) if ur == r)
        parts.append(f"{n} sequence(s) on {'rings' if size // r > 1 else 'a ring'} of {r}")
    return " as " + " and ".join(parts) + " (--ring-size auto)"


def peak_rss() -> int:
    """Peak resident memory of this process in bytes (Linux reports KiB)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def utc() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def format_summary(s: dict) -> str:
    """Human-readable two-line summary of :func:`run`'s result."""
    skip = f" ({s['skipped_done']} already done)" if s["skipped_done"] else ""
    head = (
        f"ringmpi: {s['sequences']} sequence(s){skip}, {s['tokens']:,} tokens, {s['ranks']} ranks, "
        f"{s['layout']}{', causal' if s['causal'] else ''}, {s['device']} -> {s['output']}"
    )
    body = (
        f"  {s['wall_s']:.2f} s | {s['tokens_per_s']:,.0f} tokens/s | {s['gflops']:.2f} GFLOP/s | "
        f"peak memory/rank {s['peak_rss_bytes_max'] / 2**20:,.0f} MiB | "
        f"MPI wait {100 * s['mpi_wait_share']:.1f}% | I/O {100 * s['io_share']:.1f}%"
    )
    name = os.path.basename(s["output"])
    keep = (
        f"  {name} reads its data from {name}.parts/: keep the two together, or write one "
        f"self-contained file with 'ringmpi pack {name} -o FILE'"
    )
    if s.get("output_mode") == "single":
        keep = f"  {name}: one self-contained file written by all ranks (parallel HDF5)"
    return head + "\n" + body + "\n" + keep


# ----------------------------------------------------------------------
# Progress of the batch job on rank 0 (stderr): a start line, then percentage and ETA.
#
# The fraction done counts work, not sequences: a sequence of S tokens weighs
# S^2. Within a sequence it follows the ring steps and, within a step, the tile
# kernels' progress callbacks ("ticks": the fused CPU tile calls back every
# ``CHUNK_Q`` query rows of all heads, so a step of n local queries makes
# ceil(n / CHUNK_Q) ticks; otherwise the previous step's count is the estimate).
# The ETA is the compute time so far * (1 - done) / done, where the compute time
# starts when the first sequence's ring starts (:meth:`Progress.computing`): the
# first read (with features inputs, a float64 projection) is not work the
# fraction counts, and counting it made the first ETA of a 262k-token run 11x too
# long. While less than ``TRUST`` of the work is done, the ETA leans on the
# start line's prediction (``predicted`` seconds, when given): a weighted mean
# moving from the prediction to the measurement.
#
# On a terminal the bar redraws in place (at most every ``TTY_EVERY`` seconds).
# In a log file (stderr not a TTY, which is also the case under mpiexec) it
# prints a line at most every ``LOG_EVERY`` seconds while work goes on, and one
# line per finished sequence.


LOG_EVERY = 5.0  # seconds between progress lines when stderr is not a terminal
TRUST = 0.1  # fraction of the work after which the ETA is the measurement alone
TTY_EVERY = 0.2  # seconds between redraws of the terminal bar


def duration(seconds: float) -> str:
    """``3 h 05 min``, ``4 min 10 s``, ``12.3 s``."""
    s = max(0.0, float(seconds))
    if s < 60:
        return f"{s:.1f} s"
    if s < 3600:
        return f"{int(s // 60)} min {int(s % 60):02d} s"
    return f"{int(s // 3600)} h {int(s % 3600 // 60):02d} min"


class Progress:
    """Progress over the sequences to do; ``enabled=False`` makes every call a no-op.

    Parameters
    ----------
    lengths : sequence of int
        Tokens of each sequence (or batch of sequences) to do, in order.
    enabled : bool
    stream : text stream, optional
        Default ``sys.stderr``.
    predicted : float, optional
        Predicted seconds of compute for all of it (the start line's figure).
    work : sequence of float, optional
        The work of each item (default length**2; a batch: the sum over its sequences).
    unit : str
        What an item is called in the lines ("sequence", "batch").
    """

    def __init__(
        self,
        lengths: Sequence[int],
        enabled: bool = True,
        stream: Optional[TextIO] = None,
        predicted: Optional[float] = None,
        work: Optional[Sequence[float]] = None,
        unit: str = "sequence",
    ):
        self.lengths = [int(n) for n in lengths]
        self.total = len(self.lengths)
        self.work = [float(n) ** 2 for n in self.lengths] if work is None else list(work)
        self.unit = unit
        self.all_work = sum(self.work) or 1.0
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0 = time.perf_counter()
        self.index, self.name, self.tokens = 0, "", 0
        self.done_work = 0.0
        self.steps_done, self.nsteps = 0, 0
        self.ticks, self.expected = 0, 0
        self._last = self.t0
        self._drawn = False
        self.predicted = predicted if predicted and predicted > 0 else None
        self.t_compute: Optional[float] = None  # when the first ring started

    # -- what is known -----------------------------------------------------------
    def seq_fraction(self) -> float:
        """Fraction of the current sequence done (ring steps and ticks within the step)."""
        if not self.nsteps:
            return 0.0
        within = min(0.99, self.ticks / self.expected) if self.expected else 0.0
        return min(1.0, (self.steps_done + within) / self.nsteps)

    def fraction(self) -> float:
        """Fraction of the whole job done."""
        cur = self.work[self.index] if self.index < self.total else 0.0
        return min(1.0, (self.done_work + cur * self.seq_fraction()) / self.all_work)

    def computing(self) -> None:
        """The ring of the current sequence starts (the first call starts the ETA's clock)."""
        if self.t_compute is None:
            self.t_compute = time.perf_counter()

    def eta(self) -> Optional[float]:
        """Seconds left, or None before anything is measurable."""
        f = self.fraction()
        start = self.t0 if self.t_compute is None else self.t_compute
        spent = time.perf_counter() - start
        guess = None if self.predicted is None else max(0.0, self.predicted * (1 - f))
        if f <= 0:
            return guess if self.t_compute is not None else None
        measured = spent * (1 - f) / f
        if guess is None or f >= TRUST:
            return measured
        w = f / TRUST
        return w * measured + (1 - w) * guess

    # -- output ----------------------------------------------------------------
    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()

    def _status(self) -> str:
        eta = self.eta()
        where = f"{self.unit} {self.index + 1}/{self.total} {self.name}"
        if self.nsteps:
            where += f" ring step {min(self.steps_done + 1, self.nsteps)}/{self.nsteps}"
        left = f", ETA {duration(eta)}" if eta is not None else ""
        spent = duration(time.perf_counter() - self.t0)
        return f"{100 * self.fraction():3.0f}% {where}, {spent}{left}"

    def _update(self, force: bool = False) -> None:
        now = time.perf_counter()
        if self.tty:
            if force or now - self._last >= TTY_EVERY:
                self._last = now
                full = int(round(self.fraction() * 24))
                bar = "#" * full + "." * (24 - full)
                self._write(f"\r[{bar}] {self._status()}".ljust(79))
                self._drawn = True
        elif force or now - self._last >= LOG_EVERY:
            self._last = now
            self._write(f"ringmpi: {self._status()}\n")

    def note(self, text: str) -> None:
        """One more line between sequences (e.g. the next phase of ring sizes)."""
        if self.enabled:
            self._write(f"ringmpi: {text}\n")

    def header(self, text: str) -> None:
        """The start line of the job."""
        if self.enabled:
            self._write(f"ringmpi: {text}\n")
            self.t0 = self._last = time.perf_counter()

    def start(
        self, index: int, name: str, tokens: int, nsteps: int = 0, ticks_per_step: int = 0
    ) -> None:
        """A sequence (0-based ``index`` among those to do) begins.

        ``nsteps``: ring steps (the number of ranks); ``ticks_per_step``: progress
        callbacks one ring step makes on this rank (0: unknown).
        """
        if self.enabled:
            self.index, self.name, self.tokens = index, name, tokens
            self.steps_done, self.nsteps, self.ticks = 0, int(nsteps), 0
            self.expected = int(ticks_per_step)
            if self.tty:
                self._update(force=True)

    def tick(self, step: int) -> None:
        """A tile's progress callback during ring step ``step`` (0-based): the ``on_tick`` hook."""
        if not self.enabled:
            return
        if step != self.steps_done:  # a step ended without on_step (defensive)
            self.steps_done = step
            self.ticks = 0
        self.ticks += 1
        self._update()

    def step(self, step: int, nsteps: int) -> None:
        """Ring step ``step`` of ``nsteps`` finished: the ``on_step`` hook."""
        if not self.enabled:
            return
        if self.ticks and (self.expected == 0 or self.ticks > self.expected):
            self.expected = self.ticks  # no model (or an underestimate): learn from this step
        self.steps_done, self.nsteps, self.ticks = step, nsteps, 0
        self._update()

    def finish_seq(self, seconds: float) -> None:
        """The current sequence is written."""
        if not self.enabled:
            return
        self.done_work += self.work[self.index]
        self.steps_done, self.nsteps, self.ticks = 0, 0, 0
        if self.tty:
            self._update(force=True)
            return
        rate = self.tokens / seconds if seconds > 0 else float("inf")
        eta = self.eta() if self.index + 1 < self.total else None
        left = f", ETA {duration(eta)}" if eta is not None else ""
        self._write(
            f"ringmpi: {self.unit} {self.index + 1}/{self.total} {self.name}: "
            f"{self.tokens:,} tokens"
            f" in {seconds:.2f} s ({rate:,.0f} tokens/s); {100 * self.fraction():.0f}% done{left}\n"
        )
        self._last = time.perf_counter()

    def close(self) -> None:
        """End the bar line."""
        if self.enabled and self.tty and self._drawn:
            self._write("\n")
            self._drawn = False
