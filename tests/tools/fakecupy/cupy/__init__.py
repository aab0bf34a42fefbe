"""A CPU stand-in for the subset of CuPy that ringmpi uses: tests only, NOT CuPy, NOT a GPU.

Device arrays are :class:`ndarray` wrappers around numpy arrays in host memory;
the module functions are numpy's, with CuPy's rules where tests should catch
mistakes that real CuPy would reject:

- implicit conversion to numpy (``np.asarray(x)``, ``__array__``) raises
  TypeError, as CuPy does: use :func:`asnumpy` or ``x.get()``;
- a numpy array (ndim > 0) mixed into a ufunc or a function with device arrays
  raises TypeError (``cupy.asarray`` and friends copy host data to the "device");
- ``__cuda_array_interface__`` (how mpi4py hands a device buffer to MPI) raises
  unless ``RINGMPI_CUDA_AWARE=1``: a staged ring must never give MPI a device
  buffer;
- ``memcpyAsync`` on a non-default stream is deferred until an event recorded
  after it is synchronised or queried (a query reports "not done" once), so a
  host buffer read before its copy completed holds stale bytes.

Kernels: :class:`RawModule` compiles nothing; :meth:`RawModule.get_function`
returns a :class:`RawKernel` that runs the CPU implementation registered for the
template's name (:func:`register`, done by ``tests/tools/standin_kernels.py``).
Array operations and kernels run at once, on the host, whatever the stream.
"""

from __future__ import annotations

import numpy as _np

from . import cuda, random
from ._core import asnumpy, get_array_module, ndarray
from ._core import host_function as _host_function
from ._core import upload_function as _upload_function
from ._kernel import RawKernel, RawModule, launches, register

__version__ = "0.0.0+ringmpi.standin"
STANDIN = True  # ringmpi's tests check this: results from here are not from a GPU

inf, nan, pi, e, newaxis = _np.inf, _np.nan, _np.pi, _np.e, _np.newaxis
bool_ = _np.bool_
for _n in (
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
    "complex64",
    "complex128",
    "dtype",
    "finfo",
    "iinfo",
    "intp",
):
    globals()[_n] = getattr(_np, _n)

_UPLOADS = ("asarray", "array", "ascontiguousarray", "asanyarray")
for _n in _UPLOADS:
    globals()[_n] = _upload_function(getattr(_np, _n))


def __getattr__(name: str):
    """Every other numpy function, with device-array rules (see module doc)."""
    f = getattr(_np, name, None)
    if f is None or not callable(f) or name.startswith("_"):
        raise AttributeError(f"module 'cupy' (ringmpi stand-in) has no attribute {name!r}")
    return _host_function(f)


class _Pool:
    def free_all_blocks(self) -> None:
        """Nothing to free: host memory."""

    def used_bytes(self) -> int:
        return 0


_POOL = _Pool()


def get_default_memory_pool():
    return _POOL


def get_default_pinned_memory_pool():
    return _POOL


__all__ = [
    "ndarray",
    "asnumpy",
    "get_array_module",
    "cuda",
    "random",
    "RawKernel",
    "RawModule",
    "register",
    "launches",
    "STANDIN",
]
del _n


def _register_standin_kernels() -> None:
    """``CUPY_STANDIN_KERNELS=1`` (the emulated node of jobs/gpu_check.sh): register the CPU
    kernels of tests/tools/standin_kernels.py at import, as standin.installed() does."""
    import importlib.util
    import os
    import sys

    if os.environ.get("CUPY_STANDIN_KERNELS") != "1":
        return
    path = os.path.join(
        os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "standin_kernels.py"
    )
    spec = importlib.util.spec_from_file_location("ringmpi_standin_kernels", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    mod.install(sys.modules[__name__])


_register_standin_kernels()
