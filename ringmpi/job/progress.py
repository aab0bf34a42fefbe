"""A small progress bar for rank 0 on stderr: sequences, and ring steps within one.

On a terminal the bar redraws in place (at most ~10 times a second). In a log
file (stderr not a TTY, which is also the case under mpiexec) it prints one line
per finished sequence, plus a ring-step line at most every LOG_EVERY seconds
within a long sequence.
"""

from __future__ import annotations

import sys
import time
from typing import Optional, TextIO

__all__ = ["Progress", "LOG_EVERY"]

LOG_EVERY = 10.0  # seconds between ring-step lines when stderr is not a terminal


class Progress:
    """Progress over ``total`` sequences; ``enabled=False`` makes every call a no-op."""

    def __init__(self, total: int, enabled: bool = True, stream: Optional[TextIO] = None):
        self.total, self.enabled = total, enabled
        self.stream = stream or sys.stderr
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0 = time.perf_counter()
        self.index, self.name, self.tokens = 0, "", 0
        self._last = 0.0
        self._step = (0, 0)

    def _bar(self, frac: float, width: int = 24) -> str:
        full = int(round(frac * width))
        return "#" * full + "." * (width - full)

    def _draw(self, force: bool = False) -> None:
        now = time.perf_counter()
        if not self.tty or (not force and now - self._last < 0.1):
            return
        self._last = now
        step, nsteps = self._step
        frac = (self.index + (step / nsteps if nsteps else 0)) / max(1, self.total)
        ring = f" ring step {step}/{nsteps}" if nsteps else ""
        line = (
            f"\r[{self._bar(frac)}] seq {self.index + 1}/{self.total} {self.name}{ring}"
            f"  {now - self.t0:6.1f}s"
        )
        self.stream.write(line.ljust(78))
        self.stream.flush()

    def start(self, index: int, name: str, tokens: int) -> None:
        """A sequence (0-based ``index`` among those to do) begins."""
        if self.enabled:
            self.index, self.name, self.tokens, self._step = index, name, tokens, (0, 0)
            self._last = time.perf_counter() if not self.tty else self._last
            self._draw(force=True)

    def step(self, step: int, nsteps: int) -> None:
        """Ring step ``step`` of ``nsteps`` finished (the ``on_step`` callback)."""
        if not self.enabled:
            return
        self._step = (step, nsteps)
        if self.tty:
            self._draw()
            return
        now = time.perf_counter()
        if now - self._last >= LOG_EVERY and step < nsteps:  # long sequence in a log file
            self._last = now
            self.stream.write(
                f"ringmpi: sequence {self.index + 1}/{self.total} {self.name}: "
                f"ring step {step}/{nsteps}, {now - self.t0:.0f} s\n"
            )
            self.stream.flush()

    def finish_seq(self, seconds: float) -> None:
        """The current sequence is written."""
        if not self.enabled:
            return
        if self.tty:
            self._step = (0, 0)
            self.index += 1
            self._draw(force=True)
            self.index -= 1
        else:
            rate = self.tokens / seconds if seconds > 0 else float("inf")
            self.stream.write(
                f"ringmpi: sequence {self.index + 1}/{self.total} {self.name}: {self.tokens} tokens"
                f" in {seconds:.2f} s ({rate:,.0f} tokens/s)\n"
            )
            self.stream.flush()

    def close(self) -> None:
        """End the bar line."""
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()
