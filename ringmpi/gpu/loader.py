"""Load CUDA sources from ``kernels/`` into CuPy modules, memoized per (file, device).

Sources are found by :func:`ringmpi.kernel_files.kernel_path` (``$RINGMPI_KERNEL_DIR`` first).

The source is prefixed with ``#line 1 "<path>"`` so compiler errors point at
the real file and line. Templates are instantiated through NVRTC name
expressions, e.g. ``"attn_fwd_mma<half_t, 64>"``. CuPy is imported lazily.
"""

from __future__ import annotations

import functools

from ..kernel_files import kernel_path

__all__ = ["OPTIONS", "source", "get_function"]

OPTIONS = ("-std=c++17",)


def source(name: str) -> str:
    """The text of ``kernels/<name>`` with a ``#line`` directive naming the file."""
    path = kernel_path(name)
    return f'#line 1 "{path.as_posix()}"\n' + path.read_text()


@functools.cache
def _module(name: str, device_id: int, names: tuple):
    import cupy

    return cupy.RawModule(code=source(name), options=OPTIONS, name_expressions=names)


def get_function(name: str, expr: str, names: tuple):
    """Kernel ``expr`` (one of ``names``) from ``kernels/<name>`` on the current device."""
    import cupy

    return _module(name, cupy.cuda.Device().id, tuple(names)).get_function(expr)
