"""Progress of the batch job on rank 0 (stderr): a start line, then percentage and ETA.

The fraction done counts work, not sequences: a sequence of S tokens weighs
S^2. Within a sequence it follows the ring steps and, within a step, the tile
kernels' progress callbacks ("ticks": the fused CPU tile calls back every
``CHUNK_Q`` query rows of all heads, so a step of n local queries makes
ceil(n / CHUNK_Q) ticks; otherwise the previous step's count is the estimate).
The ETA is the compute time so far * (1 - done) / done, where the compute time
starts when the first sequence's ring starts (:meth:`Progress.computing`): the
first read (with features inputs, a float64 projection) is not work the
fraction counts, and counting it made the first ETA of a 262k-token run 11x too
long. While less than ``TRUST`` of the work is done, the ETA leans on the
start line's prediction (``predicted`` seconds, when given): a weighted mean
moving from the prediction to the measurement.

On a terminal the bar redraws in place (at most every ``TTY_EVERY`` seconds).
In a log file (stderr not a TTY, which is also the case under mpiexec) it
prints a line at most every ``LOG_EVERY`` seconds while work goes on, and one
line per finished sequence.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import Optional, TextIO

__all__ = ["Progress", "LOG_EVERY", "TTY_EVERY", "TRUST", "duration"]

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
