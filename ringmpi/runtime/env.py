"""Every environment variable ringmpi reads: one registry (name, default, parser, doc).

``ringmpi info`` prints the ones that are set and the table of
``docs/environment.md`` is generated
from :func:`table` (``python -m ringmpi.runtime.env`` prints it; a test fails when the
two differ). A test also greps the sources: every ``RINGMPI_*`` name they read
must be registered here. :func:`get` reads a variable through its parser, so a
bad value raises one clear ValueError naming the variable.

This module imports nothing heavy (no MPI, no numpy).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

__all__ = ["Var", "REGISTRY", "get", "table", "current", "table_block"]


def _choice(*values: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        t = text.strip().lower()
        if t not in values:
            raise ValueError(f"must be {', '.join(values[:-1])} or {values[-1]}, not {text!r}")
        return t

    parse.__name__ = "one of " + "|".join(values)
    return parse


def _seconds(text: str) -> Optional[float]:
    """Seconds >= 0; 0 means off (None)."""
    x = float(text)
    if not x >= 0 or x == float("inf"):
        raise ValueError(f"must be a number of seconds >= 0, not {text!r}")
    return None if x == 0 else x


def _positive(text: str) -> float:
    x = float(text)
    if not x > 0 or x == float("inf"):
        raise ValueError(f"must be a positive number, not {text!r}")
    return x


def _tokens(text: str) -> int:
    """A whole number of tokens >= 0."""
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise ValueError(f"must be a whole number of tokens >= 0, not {text!r}")
    return n


def _flag(text: str) -> bool:
    """``0`` is False, anything else True."""
    return text.strip() != "0"


def _text(text: str) -> str:
    return text


@dataclass(frozen=True)
class Var:
    """One environment variable.

    Attributes
    ----------
    name : str
    default : str or None
        The value when unset (None: unset has its own meaning, said in ``doc``).
    parse : callable str -> value
        Raises ValueError on a bad value.
    doc : str
        One line for the docs' table and ``ringmpi info``.
    tests : bool
        Only the test suite and the stress checks set it.
    """

    name: str
    default: Optional[str]
    parse: Callable[[str], Any]
    doc: str
    tests: bool = False


_VARS = [
    Var(
        "RINGMPI_CPU_KERNEL",
        "auto",
        _choice("auto", "fused", "numpy"),
        "CPU tiles: `auto` (fused if it builds, else numpy, said in `ringmpi info` and "
        '`stats["tile"]`), `fused` (an error where a fused tile is unavailable), `numpy`; '
        "the same for the reproducible mode's C kernels, forward and backward (same bits either "
        "way)",
    ),
    Var(
        "RINGMPI_CPU_ISA",
        "auto",
        _choice("auto", "avx512", "avx2", "scalar"),
        "ISA path of the fused CPU kernels: `auto` (widest the host runs), `avx512`, `avx2`, "
        "`scalar`; a path the host cannot run is an error",
    ),
    Var(
        "RINGMPI_CACHE_DIR",
        None,
        _text,
        "where compiled kernels (CPU libraries, GPU cubins) and GPU tuning are cached (default "
        "`~/.cache/ringmpi`); must be private: created 0700, refused when another user's or "
        "group/other-writable",
    ),
    Var(
        "RINGMPI_BUILD_LOCK_S",
        "600",
        _positive,
        "longest wait for another process's kernel build lock before a clear error",
    ),
    Var(
        "RINGMPI_ALLOW_VDS",
        "0",
        _flag,
        "`1` accepts virtual datasets in inputs (their source files must exist); refused by "
        "default",
    ),
    Var(
        "CC",
        None,
        _text,
        "C compiler for the CPU kernels (default `cc`, `gcc`, `clang`; part of the cache key)",
    ),
    Var(
        "RINGMPI_CFLAGS",
        "",
        _text,
        "extra compiler flags for the CPU kernels (part of the cache key)",
    ),
    Var(
        "RINGMPI_KERNEL_DIR",
        None,
        _text,
        "read kernel sources from this folder instead of the package",
    ),
    Var(
        "RINGMPI_BATCH_TOKENS",
        "65536",
        _tokens,
        "`ringmpi run` packs consecutive shorter sequences into one ring call of at most this "
        "many tokens (lowered to fit the memory budget); `0`: one sequence per call",
    ),
    Var(
        "RINGMPI_KEEP_MEMORY",
        "1",
        _flag,
        "`0`: `ringmpi run` leaves glibc's malloc as it is (by default freed batch buffers "
        "are kept for the next batch instead of unmapped, saving the page faults)",
    ),
    Var(
        "RINGMPI_FSYNC_S",
        "30",
        _seconds,
        "`ringmpi run` fsyncs its part files and markers at most this often (and before the "
        "output is renamed into place); `0`: after every batch (docs/batch-job.md: what a crash "
        "can lose)",
    ),
    Var(
        "RINGMPI_DIRECT_IO",
        "1",
        _flag,
        "`0`: `ringmpi run` reads inputs and writes part files through the page cache (by "
        "default large transfers use `O_DIRECT` where the file system takes it, saving the "
        "CPU about a second per GB)",
    ),
    Var(
        "RINGMPI_LAUNCH_CHECK",
        "1",
        _flag,
        "`0` turns off the launch check (P tasks but a world of one rank)",
    ),
    Var(
        "RINGMPI_SRUN_MPI",
        "pmi2",
        _text,
        "the `srun --mpi=` plugin `jobs/slurm.sbatch` uses (`pmix` for Open MPI; `none`)",
    ),
    Var("RINGMPI_POLL", "1", _flag, "`0` stops polling MPI between tiles (for measuring overlap)"),
    Var(
        "RINGMPI_WATCHDOG_S",
        "600",
        _seconds,
        "seconds a rank waits on another rank before it aborts the job with one line (`0` off; "
        "more than a week is clamped to a week; `nan`, `inf`, negative: an error at start)",
    ),
    Var(
        "RINGMPI_INTERRUPT_GRACE_S",
        "30",
        _seconds,
        "seconds a SIGINT/SIGTERM may wait for a safe point before the rank exits anyway (`0` off)",
    ),
    Var(
        "RINGMPI_CUDA_AWARE",
        None,
        _choice("0", "1"),
        "`1`/`0`: force CUDA-aware MPI on or off instead of detecting it",
    ),
    Var("RINGMPI_GPU_CONFIG", None, _text, "force a GPU tile configuration by name"),
    Var("RINGMPI_GPU_TUNE", "1", _flag, "`0` stops the first-use timing of GPU configurations"),
    Var(
        "RINGMPI_TUNE_FILE",
        None,
        _text,
        "where the chosen GPU configurations are cached (default in `RINGMPI_CACHE_DIR`)",
    ),
    Var("RINGMPI_KERNEL_CACHE", "1", _flag, "`0` bypasses ringmpi's own CUDA module cache"),
    Var("RINGMPI_NVRTC", None, _text, "the NVRTC library the compile check loads (a file)"),
    Var(
        "RINGMPI_BLAS_THREADS",
        None,
        _text,
        "BLAS/OpenMP threads per rank in `ringmpi run` and `verify` (default: the cores the rank "
        "owns, never more than `OMP_NUM_THREADS` asks; `0` leaves them alone)",
    ),
    Var(
        "RINGMPI_TEST_AGREE_S",
        "10",
        _positive,
        "seconds `ringmpi.pytest_plugin` waits for every rank to finish a test before a rank "
        "that failed prints its error and aborts the job",
    ),
    Var(
        "CUPY_CACHE_DIR",
        None,
        _text,
        "CuPy's kernel cache: a private directory (yours, mode 0700), never a shared one; "
        "`jobs/` use `$TMPDIR/cupy-cache-$UID` made with `mkdir -m 700`, else a fresh "
        "`mktemp -d`",
    ),
    Var(
        "RINGMPI_REQUIRE_MPIO",
        "0",
        _flag,
        "`1` turns the skip of the parallel-HDF5 tests into a failure (CI)",
        tests=True,
    ),
    Var("RINGMPI_SKIP_NVRTC", "0", _flag, "`1` skips the NVRTC compile tests", tests=True),
    Var(
        "RINGMPI_CHECK_CACHE",
        "1",
        _flag,
        "`0`: the NVRTC and nvcc compile checks compile every kernel again instead of reusing "
        "the passing verdicts kept for unchanged sources (`checks/` of the kernel cache)",
        tests=True,
    ),
    Var(
        "RINGMPI_REQUIRE_CXX",
        "0",
        _flag,
        "`1` turns the skip of the CUDA-header host test (no C++ compiler) into a failure",
        tests=True,
    ),
    Var(
        "RINGMPI_EXPECT_SIMD",
        None,
        _text,
        "vector width in bytes (64, 32, 0) the fused backward build must have",
        tests=True,
    ),
    Var(
        "RINGMPI_TEST_FAULT",
        None,
        _text,
        "`RANK:STEP`: that rank raises before that ring step (never set it in production)",
        tests=True,
    ),
    Var(
        "RINGMPI_TEST_KILL_AFTER",
        None,
        _text,
        "SIGKILL rank 0 after this many sequences of a run",
        tests=True,
    ),
    Var(
        "RINGMPI_TEST_KILL_IN_BATCH",
        None,
        _text,
        "SIGKILL rank 0 after reading this batch of a run (0-based), before it is computed",
        tests=True,
    ),
    Var(
        "RINGMPI_TEST_KILL_AT_STEP",
        None,
        _text,
        "`SEQ:STEP`: after ring step STEP of sequence SEQ (0-based) the ring passes a barrier "
        "and ring rank 0 SIGKILLs itself (`SEQ:STEP:TERM`: every rank of the ring gets SIGTERM; "
        "the checkpoint tests)",
        tests=True,
    ),
    Var(
        "RINGMPI_TEST_MPIO_KILL",
        None,
        _text,
        "SIGKILL rank 0 after writing this sequence of a one-file output",
        tests=True,
    ),
    Var(
        "RINGMPI_TEST_READ_STALL_S",
        None,
        _text,
        "`[RANK:]S`: each input read of the job blocks S seconds holding h5py's lock, like a "
        "stuck file system (that ring rank only with `RANK:`)",
        tests=True,
    ),
    Var(
        "RINGMPI_TEST_RING_DONE_STALL",
        None,
        _text,
        "`RANK:J:S`: after batch J's ring (0-based), ring rank RANK waits S seconds before the "
        "agreement that follows (the interrupt tests' slow rank)",
        tests=True,
    ),
    Var(
        "RINGMPI_KEEP",
        None,
        _text,
        "set: the cluster test scripts keep their work folder",
        tests=True,
    ),
]

REGISTRY: dict = {v.name: v for v in _VARS}


def get(name: str) -> Any:
    """The parsed value of variable ``name`` (its default when unset or blank).

    Raises
    ------
    KeyError
        ``name`` is not registered.
    ValueError
        The value does not parse: "NAME must be ..., not 'x'".
    """
    var = REGISTRY[name]
    text = os.environ.get(name, "")
    if not text.strip():
        if var.default is None:
            return None
        text = var.default
    try:
        return var.parse(text)
    except ValueError as e:
        msg = str(e)
        msg = msg if msg.startswith("must") else f"must parse ({msg})"
        raise ValueError(f"{name} {msg}") from None


def table(tests: bool = False) -> str:
    """The Markdown table of the registered variables (``tests``: the test-only ones)."""
    rows = ["| variable | default | effect |", "| --- | --- | --- |"]
    for v in _VARS:
        if v.tests == tests:
            default = "(unset)" if v.default is None else f"`{v.default}`" if v.default else "empty"
            rows.append(f"| `{v.name}` | {default} | {v.doc} |")
    return "\n".join(rows)


def current() -> list:
    """``NAME=value`` for every registered variable that is set, in registry order."""
    return [f"{v.name}={os.environ[v.name]}" for v in _VARS if os.environ.get(v.name)]


def table_block() -> str:
    """The generated block of docs/environment.md: the user table, then the test-only one."""
    return f"{table()}\n\nOnly for the test suite and the stress checks:\n\n{table(tests=True)}"


if __name__ == "__main__":
    print(table_block())
