"""Put the CuPy stand-in (tests/tools/fakecupy) in place of ``cupy`` for a block of tests.

    with standin.installed() as cupy:   # sys.modules["cupy"] is the stand-in
        ...                              # ringmpi's GPU path runs on the host

What was imported as ``cupy`` before (the real CuPy, on a GPU machine) is put
back afterwards, and every cache of ringmpi.gpu that may hold stand-in objects
(device facts, kernels, plans, position copies, autotune choices) is cleared on
entry and exit. Kernel loading goes straight to ``cupy.RawModule``
(``RINGMPI_KERNEL_CACHE=0``: the stand-in loads no cubin) and autotuning is off
unless a test turns it on (``RINGMPI_GPU_TUNE``), with a private choice file.
Nothing here runs CUDA code: results are the numpy tiles' (tests/tools/standin_kernels.py).
"""

from __future__ import annotations

import os
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

__all__ = ["installed", "clear_caches", "FAKE"]

FAKE = Path(__file__).resolve().parent / "fakecupy"
_ENV = {"RINGMPI_KERNEL_CACHE": "0", "RINGMPI_GPU_TUNE": "0"}


def _cupy_modules() -> dict:
    return {n: m for n, m in sys.modules.items() if n == "cupy" or n.startswith("cupy.")}


def clear_caches() -> None:
    """Forget every per-process GPU cache of ringmpi (device facts, kernels, plans, tuning)."""
    from ringmpi.gpu import backward, device, kernel_args, loader, tile, tune

    for f in (
        device.props,
        device.check_arch,
        tile._function,
        backward._function,
        loader._function,
    ):
        f.cache_clear()
    kernel_args.clear_caches()
    loader.last_path.clear()
    tune.forget()


@contextmanager
def installed():
    """Context in which ``import cupy`` gives the stand-in; yields that module."""
    saved = _cupy_modules()
    for n in saved:
        del sys.modules[n]
    old_env = {k: os.environ.get(k) for k in (*_ENV, "RINGMPI_TUNE_FILE")}
    tmp = tempfile.TemporaryDirectory(prefix="ringmpi_standin.")
    sys.path.insert(0, str(FAKE))
    try:
        import cupy
    finally:
        sys.path.remove(str(FAKE))
    try:
        if not getattr(cupy, "STANDIN", False) or Path(cupy.__file__).parent.parent != FAKE:
            raise RuntimeError(f"the CuPy stand-in did not load (got {cupy.__file__})")
        from . import standin_kernels

        standin_kernels.install(cupy)
        os.environ.update(_ENV)
        os.environ["RINGMPI_TUNE_FILE"] = os.path.join(tmp.name, "tune.json")
        clear_caches()
        yield cupy
    finally:
        clear_caches()
        for n in _cupy_modules():
            del sys.modules[n]
        sys.modules.update(saved)
        for k, val in old_env.items():
            if val is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = val
        tmp.cleanup()
