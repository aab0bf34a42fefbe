"""Where the kernel sources (``kernels/*.c``, ``kernels/*.cu``) are found.

In order: ``$RINGMPI_KERNEL_DIR`` (a directory), the installed package data
(``ringmpi/kernels``), then the source tree's top-level ``kernels/`` (a checkout
used through ``PYTHONPATH`` or an editable install).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["kernel_dirs", "kernel_path"]

_HERE = Path(__file__).resolve().parent.parent  # the package ringmpi/


def kernel_dirs() -> list:
    """The directories searched for kernel sources, in order."""
    dirs = []
    if os.environ.get("RINGMPI_KERNEL_DIR"):
        dirs.append(Path(os.environ["RINGMPI_KERNEL_DIR"]))
    return dirs + [_HERE / "kernels", _HERE.parent / "kernels"]


def kernel_path(name: str) -> Path:
    """Path of kernel source ``name``; raises FileNotFoundError naming every place looked in."""
    dirs = kernel_dirs()
    for d in dirs:
        if (d / name).is_file():
            return d / name
    raise FileNotFoundError(f"kernel source {name} not found in {', '.join(map(str, dirs))}")
