"""CUDA source text and compile options of the GPU kernels: what both the loader and NVRTC see.

The kernel files live in ``kernels/`` (found by :func:`ringmpi.kernel_files.kernel_path`,
``$RINGMPI_KERNEL_DIR`` first). A module may be several files compiled as one
translation unit, in order: the backward kernels use the forward file's helpers,
so :data:`BACKWARD_FILES` is ``("attention_fwd.cu", "attention_bwd.cu")``. Each
file is prefixed with ``#line 1 "<path>"`` so compiler errors point at the real
file and line. This module imports neither CuPy nor NVRTC.
"""

from __future__ import annotations

from typing import Union

from ..kernel_files import kernel_path

__all__ = ["OPTIONS", "FORWARD_FILE", "BACKWARD_FILES", "source"]

OPTIONS = ("-std=c++17",)
FORWARD_FILE = "attention_fwd.cu"
BACKWARD_FILES = ("attention_fwd.cu", "attention_bwd.cu")  # one module: bwd uses fwd's helpers


def source(names: Union[str, tuple]) -> str:
    """The text of ``kernels/<name>`` (or of several, concatenated), with ``#line`` directives.

    Parameters
    ----------
    names : str or tuple of str
        One kernel file name, or several compiled as one translation unit.
    """
    parts = []
    for name in (names,) if isinstance(names, str) else names:
        path = kernel_path(name)
        parts.append(f'#line 1 "{path.as_posix()}"\n' + path.read_text())
    return "\n".join(parts)
