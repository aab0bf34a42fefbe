"""RawModule / RawKernel of the stand-in: no compiler; kernels are registered CPU functions.

A test harness registers, per template name (``attn_fwd_mma2``), a function
``impl(expr, grid, block, args, shared_mem)`` that checks the launch and does the
kernel's work with numpy (``tests/tools/standin_kernels.py``), and a function
``static(expr)`` giving the instantiation's static shared memory (its ``__shared__``
arrays: ``shared_size_bytes``, as ptxas reports it). Launch checks done here, as a
device would: block size; dynamic shared memory within
``max_dynamic_shared_size_bytes``, which is 48 KiB minus the static shared memory
unless the kernel opted in, and can be raised to at most the device's opt-in limit
(``sharedMemPerBlockOptin``) minus the static shared memory (cudaErrorInvalidValue
beyond); dynamic and static together within the opt-in limit at launch.
"""

from __future__ import annotations

import re

from .cuda import runtime

__all__ = ["RawModule", "RawKernel", "register", "launches"]

_IMPLS: dict = {}  # template name -> (impl, static)
launches: list = []  # (expression, grid, block, shared_mem) of every launch, in order
_NAME = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*(<.*>)?\s*$")


def register(name: str, impl, static=None) -> None:
    """CPU implementation of every instantiation of kernel template ``name``.

    ``static(expr)``: the static shared memory of instantiation ``expr`` in bytes
    (default 0).
    """
    _IMPLS[name] = (impl, static or (lambda expr: 0))


def _template(expr: str) -> str:
    m = _NAME.match(expr)
    if not m:
        raise ValueError(f"stand-in RawModule: cannot parse name expression {expr!r}")
    return m.group(1)


class RawKernel:
    """One kernel: ``kernel(grid, block, args, shared_mem=0)`` runs its CPU implementation."""

    def __init__(self, expr: str, impl, static: int = 0):
        self.expr, self._impl = expr, impl
        self.shared_size_bytes = int(static)  # static shared memory (CuPy's attribute)
        self._max_dynamic = 48 * 1024 - self.shared_size_bytes

    @property
    def max_dynamic_shared_size_bytes(self) -> int:
        return self._max_dynamic

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, nbytes: int) -> None:
        # cuFuncSetAttribute: at most the opt-in limit less the static shared memory
        room = runtime.getDeviceProperties(0)["sharedMemPerBlockOptin"] - self.shared_size_bytes
        if int(nbytes) > room:
            raise runtime.CUDARuntimeError(
                f"{self.expr}: cudaErrorInvalidValue: {nbytes} B of dynamic shared memory "
                f"requested, the device allows {room} B beside {self.shared_size_bytes} B static"
            )
        self._max_dynamic = int(nbytes)

    def __call__(self, grid, block, args, *, shared_mem: int = 0, stream=None):
        grid, block = tuple(grid), tuple(block)
        if not all(isinstance(g, int) and g >= 1 for g in grid) or len(grid) > 3:
            raise runtime.CUDARuntimeError(f"{self.expr}: invalid grid {grid}")
        threads = 1
        for b in block:
            threads *= b
        if threads > 1024 or len(block) > 3:
            raise runtime.CUDARuntimeError(f"{self.expr}: invalid block {block}")
        limit = runtime.getDeviceProperties(0)["sharedMemPerBlockOptin"]
        static = self.shared_size_bytes
        if shared_mem > self.max_dynamic_shared_size_bytes or shared_mem + static > limit:
            raise runtime.CUDARuntimeError(
                f"{self.expr}: cudaErrorInvalidValue: {shared_mem} B of dynamic shared memory "
                f"(allowed {self.max_dynamic_shared_size_bytes} B; with {static} B static, "
                f"device limit {limit} B)"
            )
        launches.append((self.expr, grid, block, shared_mem))
        self._impl(self.expr, grid, block, tuple(args), shared_mem)


class RawModule:
    """A "compiled" module: each name expression must name a template defined in ``code``."""

    def __init__(self, code=None, path=None, options=(), name_expressions=(), **_):
        if path is not None:
            raise runtime.CUDARuntimeError(
                "ringmpi CuPy stand-in cannot load cubins (set RINGMPI_KERNEL_CACHE=0)"
            )
        self.code, self.options = code or "", tuple(options)
        self.names = tuple(name_expressions)
        for expr in self.names:
            t = _template(expr)
            if not re.search(rf"__global__[^;{{]*\b{t}\s*\(", self.code):
                raise runtime.CUDARuntimeError(f"stand-in RawModule: no __global__ {t} in code")

    def get_function(self, name: str) -> RawKernel:
        if self.names and name not in self.names:
            raise runtime.CUDARuntimeError(f"stand-in RawModule: {name} not in name_expressions")
        t = _template(name)
        if t not in _IMPLS:
            raise runtime.CUDARuntimeError(f"stand-in: no CPU implementation for {t}")
        impl, static = _IMPLS[t]
        return RawKernel(name, impl, static(name))
