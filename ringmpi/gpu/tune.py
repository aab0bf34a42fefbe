"""Device autotuning of the tile configuration, cached per (device, dtype, D, causal).

At the first call for a shape class the forward tile times every configuration
that fits the device (:func:`choose` with a ``measure`` callable) and keeps the
fastest. The choice lives in memory and in a small JSON file
(``$RINGMPI_TUNE_FILE``, else ``ringmpi_gpu_tune.json`` in ``$RINGMPI_CACHE_DIR``,
else ``$CUPY_CACHE_DIR``, else ``~/.cupy/kernel_cache``), so later processes on
the same kind of device skip the timing. The file is read only when it is this
user's regular file, not writable by group or others, and written through an
exclusive temporary. ``RINGMPI_GPU_TUNE=0`` turns timing off (the preferred
configuration runs); ``RINGMPI_GPU_CONFIG`` forces one (see :mod:`.tile`).

Nothing here needs CuPy: the caller passes the timing function.
"""

from __future__ import annotations

import json
import math
import os
import stat
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Callable

from ..runtime.files import check_owned, exclusive_temp, open_private_dir

__all__ = [
    "CACHE_ENV",
    "FILE_ENV",
    "TUNE_ENV",
    "cache_path",
    "enabled",
    "key",
    "choose",
    "cached",
    "forget",
]

CACHE_ENV = "RINGMPI_CACHE_DIR"
FILE_ENV = "RINGMPI_TUNE_FILE"
TUNE_ENV = "RINGMPI_GPU_TUNE"
FILE_NAME = "ringmpi_gpu_tune.json"
_VERSION = 1
_memo: dict = {}
_lock = threading.Lock()


def cache_path() -> Path:
    """Where the choices are stored (the directory may not exist yet)."""
    if os.environ.get(FILE_ENV):
        return Path(os.environ[FILE_ENV])
    base = os.environ.get(CACHE_ENV) or os.environ.get("CUPY_CACHE_DIR")
    if not base:
        base = os.path.join(os.path.expanduser("~"), ".cupy", "kernel_cache")
    return Path(base) / FILE_NAME


def enabled() -> bool:
    """False when ``RINGMPI_GPU_TUNE=0``."""
    val = os.environ.get(TUNE_ENV, "1").strip()
    if val not in ("0", "1"):
        raise ValueError(f"{TUNE_ENV} must be 0 or 1, not {val!r}")
    return val == "1"


def key(device_name: str, dtype: str, d: int, causal: bool, kind: str = "fwd") -> str:
    """Cache key of one shape class."""
    return f"{kind}|{device_name}|{dtype}|D={d}|causal={int(bool(causal))}"


def _load(path: Path) -> dict:
    """The stored choices, or {} when absent, unreadable or not trustworthy.

    The file is read only if it is a regular file of this user (a symlink is not
    followed) that group and others cannot write: a choice planted by another user
    could not run code (names are checked against the candidates) but could force
    a slow configuration.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | os.O_CLOEXEC)
    except OSError:
        return {}
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > (1 << 22):
            return {}
        check_owned(st, str(path))
        data = json.loads(os.pread(fd, st.st_size, 0))
    except (OSError, ValueError):  # UnsafePathError is an OSError
        return {}
    finally:
        os.close(fd)
    if not isinstance(data, dict) or data.get("version") != _VERSION:
        return {}
    choices = data.get("choices")
    return choices if isinstance(choices, dict) else {}


def _save(path: Path, k: str, entry: dict) -> None:
    """Merge one entry into the file (an exclusive temporary next to it, then rename)."""
    try:
        if os.environ.get(FILE_ENV):
            os.makedirs(path.parent, exist_ok=True)
        else:  # the shared cache directory: private, like the cubins
            os.close(open_private_dir(str(path.parent), create=True))
        choices = _load(path)
        choices[k] = entry
        fd, tmp = exclusive_temp(str(path), 0o600)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"version": _VERSION, "choices": choices}, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
        except BaseException:
            if os.path.lexists(tmp):
                os.unlink(tmp)
            raise
    except OSError:
        pass  # a read-only or unsafe cache directory costs a re-tune per process, nothing else


def cached(k: str, names: Sequence[str]):
    """The stored choice for ``k`` if it is one of ``names``, else None."""
    with _lock:
        name = _memo.get(k)
        if name is None:
            entry = _load(cache_path()).get(k)
            name = entry.get("config") if isinstance(entry, dict) else None
        if name in names:
            _memo[k] = name
            return name
    return None


def choose(k: str, names: Sequence[str], measure: Callable[[str], float]) -> str:
    """The fastest of ``names`` for shape class ``k``: from the cache, or timed now.

    Parameters
    ----------
    k : str
        Shape-class key (:func:`key`).
    names : sequence of str
        Candidate configuration names, preferred first (the answer when only one
        fits, when tuning is off, or on a tie).
    measure : callable
        ``measure(name)`` returns seconds per call of that configuration; an
        exception marks the configuration unusable on this device.

    Raises
    ------
    RuntimeError
        If every candidate failed to run.
    """
    names = list(names)
    if not names:
        raise ValueError("choose: no candidate configurations")
    if len(names) == 1:
        return names[0]
    hit = cached(k, names)
    if hit is not None:
        return hit
    if not enabled():
        return names[0]
    times, errors = {}, {}
    for n in names:
        try:
            times[n] = float(measure(n))
        except Exception as exc:  # a configuration the device cannot launch
            errors[n] = f"{type(exc).__name__}: {exc}"
            times[n] = math.inf
    best = min(names, key=lambda n: times[n])  # first of equals: the preferred one
    if math.isinf(times[best]):
        raise RuntimeError(f"GPU autotune {k}: no configuration ran: {errors}")
    with _lock:
        _memo[k] = best
    entry = {
        "config": best,
        "ms": {n: (t * 1e3 if math.isfinite(t) else None) for n, t in times.items()},
    }
    if errors:
        entry["errors"] = errors
    _save(cache_path(), k, entry)
    return best


def forget() -> None:
    """Drop the in-memory choices (the file stays)."""
    with _lock:
        _memo.clear()
