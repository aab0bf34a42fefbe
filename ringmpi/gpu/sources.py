"""CUDA source text and compile options of the GPU kernels: what both the loader and NVRTC see.

The kernel files live in ``kernels/`` (found by :func:`ringmpi.runtime.kernel_files.kernel_path`,
``$RINGMPI_KERNEL_DIR`` first): ``attention_fwd.cu`` and ``attention_bwd.cu``, one
module each, both including ``attention_common.cuh`` (types, helpers and the score
modifiers they share). :func:`source` splices each ``#include "<name>.cuh"`` line
with that header's text, read from the folder of the .cu file, once per translation
unit, between ``#line`` directives (so compiler errors point at the real file and
line). The compiler is thus handed one self-contained text and no include path:
it reads no file itself, and the header is part of the text every kernel cache
key hashes (:mod:`ringmpi.gpu.loader`). This module imports neither CuPy nor NVRTC.
"""

from __future__ import annotations

import re
from typing import Union

from ..runtime.kernel_files import kernel_path

__all__ = ["OPTIONS", "FORWARD_FILE", "BACKWARD_FILES", "HEADERS", "source"]

OPTIONS = ("-std=c++17",)
FORWARD_FILE = "attention_fwd.cu"
BACKWARD_FILES = "attention_bwd.cu"  # its own module: shared code is in the header
HEADERS = ("attention_common.cuh",)  # the only headers a kernel file may include

_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]*)"[ \t]*(?://.*)?$')
_QUOTED = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"')


def _expand(name: str, seen: set, folder=None) -> str:
    """Text of kernel file ``name`` with its quoted includes of :data:`HEADERS` spliced in.

    A header is read from the folder of the file that includes it (as the C
    preprocessor reads a quoted include), a top-level file through ``kernel_path``.
    """
    path = kernel_path(name) if folder is None else folder / name
    if not path.is_file():
        raise FileNotFoundError(f"kernel header {name} not found beside its includer in {folder}")
    lines = path.read_text().split("\n")
    out = [f'#line 1 "{path.as_posix()}"']
    for i, line in enumerate(lines):
        m = _INCLUDE.match(line)
        if m is None:
            if _QUOTED.match(line):  # a malformed quoted include
                raise ValueError(f"{path}:{i + 1}: kernels include only {HEADERS}: {line!r}")
            out.append(line)
            continue
        header = m.group(1)
        if header not in HEADERS:
            raise ValueError(f"{path}:{i + 1}: kernels include only {HEADERS}, not {header!r}")
        if header not in seen:  # once per translation unit
            seen.add(header)
            out.append(_expand(header, seen, path.parent))
        out.append(f'#line {i + 2} "{path.as_posix()}"')
    return "\n".join(out)


def source(names: Union[str, tuple]) -> str:
    """The text of ``kernels/<name>`` (or of several, concatenated), headers spliced in.

    Parameters
    ----------
    names : str or tuple of str
        One kernel file name, or several compiled as one translation unit.
    """
    seen: set = set()
    return "\n".join(_expand(n, seen) for n in ((names,) if isinstance(names, str) else names))
