"""RawModule / RawKernel of the stand-in: no compiler; kernels are registered CPU functions.

A test harness registers, per template name (``attn_fwd_mma2``), a function
``impl(expr, grid, block, args, shared_mem)`` that checks the launch and does the
kernel's work with numpy (``tests/tools/standin_kernels.py``). Launch checks
done here, as a device would: block size, dynamic shared memory within 48 KiB
unless the kernel opted in (``max_dynamic_shared_size_bytes``), and within the
device's opt-in limit.
"""

from __future__ import annotations

import re

from .cuda import runtime

__all__ = ["RawModule", "RawKernel", "register", "launches"]

_IMPLS: dict = {}
launches: list = []  # (expression, grid, block, shared_mem) of every launch, in order
_NAME = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*(<.*>)?\s*$")


def register(name: str, impl) -> None:
    """CPU implementation of every instantiation of kernel template ``name``."""
    _IMPLS[name] = impl


def _template(expr: str) -> str:
    m = _NAME.match(expr)
    if not m:
        raise ValueError(f"stand-in RawModule: cannot parse name expression {expr!r}")
    return m.group(1)


class RawKernel:
    """One kernel: ``kernel(grid, block, args, shared_mem=0)`` runs its CPU implementation."""

    def __init__(self, expr: str, impl):
        self.expr, self._impl = expr, impl
        self.max_dynamic_shared_size_bytes = 48 * 1024

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
        if shared_mem > self.max_dynamic_shared_size_bytes or shared_mem > limit:
            raise runtime.CUDARuntimeError(
                f"{self.expr}: cudaErrorInvalidValue: {shared_mem} B of dynamic shared memory "
                f"(opted in to {self.max_dynamic_shared_size_bytes} B, device limit {limit} B)"
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
        return RawKernel(name, _IMPLS[t])
