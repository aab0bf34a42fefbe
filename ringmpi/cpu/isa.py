"""ISA paths of the fused CPU kernels: which the host can run, which one a call uses.

Three paths, widest first: ``avx512`` (AVX-512F, 16 float32 lanes), ``avx2``
(AVX2 + FMA, 8 lanes) and ``scalar`` (one element at a time, libm exp), each
compiled with its own flags (:data:`ISA_FLAGS`). ``$RINGMPI_CPU_ISA`` (``auto`` |
``avx512`` | ``avx2`` | ``scalar``) picks the path; ``auto`` is the widest the host
can execute, and a path the host cannot execute is refused with a clear error.
The host's features come from ``/proc/cpuinfo`` (the kernel's view, which includes
the operating system's support for the wide registers).
"""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path
from typing import Optional

__all__ = [
    "ISAS",
    "ISA_FLAGS",
    "ISA_NEEDS",
    "is_x86",
    "cpu_flags",
    "host_features",
    "host_isas",
    "isa_setting",
    "resolve_isa",
    "isa_flags",
    "l2_bytes",
]

#: ISA paths of the kernels, widest first
ISAS = ("avx512", "avx2", "scalar")

# flags per ISA path on x86 (-mno-avx512f also drops every AVX-512 subset; -mno-avx drops
# AVX2, FMA and AVX-512: the kernel's #if's then select its plain C path)
ISA_FLAGS = {
    "avx512": ["-march=native"],
    "avx2": ["-march=native", "-mno-avx512f"],
    "scalar": ["-march=native", "-mno-avx"],
}
# CPU feature flags (as /proc/cpuinfo names them) each path executes
ISA_NEEDS = {"avx512": ("avx512f", "avx2", "fma"), "avx2": ("avx2", "fma"), "scalar": ()}


def is_x86() -> bool:
    """Whether this host is an x86 machine (the ISA flags apply only there)."""
    return platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")


@functools.cache
def _cpuinfo_flags() -> Optional[str]:
    """The first CPU's feature line of /proc/cpuinfo (``flags`` on x86, ``Features`` on
    Arm), or None: the one place the file is read."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_flags() -> str:
    """Host CPU identity for the cache key: -march=native depends on it."""
    return _cpuinfo_flags() or platform.processor() or platform.machine()


def host_features() -> Optional[frozenset]:
    """CPU feature flags of the host from /proc/cpuinfo, or None when unknown."""
    line = _cpuinfo_flags()
    return None if line is None else frozenset(line.split())


def l2_bytes() -> Optional[int]:
    """Size of the first CPU's level-2 cache from sysfs, or None when unknown."""
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    try:
        for idx in sorted(base.glob("index*")):
            level, kind = ((idx / f).read_text().strip() for f in ("level", "type"))
            if level == "2" and kind in ("Data", "Unified"):
                size = (idx / "size").read_text().strip().upper()
                mult = {"K": 1 << 10, "M": 1 << 20}.get(size[-1:], 1)
                return int(size.rstrip("KM")) * mult
    except (OSError, ValueError):
        pass
    return None


def host_isas() -> tuple[str, ...]:
    """ISA paths this host can execute, widest first (always ends with ``"scalar"``).

    On x86 the features come from /proc/cpuinfo (the kernel's view, which includes the
    operating system's support for the wide registers); elsewhere, or when they are
    unknown, only ``scalar`` is listed.
    """
    feats = host_features()
    if not is_x86() or feats is None:
        return ("scalar",)
    return tuple(name for name in ISAS if all(f in feats for f in ISA_NEEDS[name]))


def isa_setting() -> str:
    """``$RINGMPI_CPU_ISA`` as given (lower case; ``auto`` when unset)."""
    return os.environ.get("RINGMPI_CPU_ISA", "auto").strip().lower()


def resolve_isa(isa: Optional[str]) -> str:
    """Map None/``auto`` (or ``$RINGMPI_CPU_ISA``) to a path the host can execute."""
    name = isa.strip().lower() if isa is not None else isa_setting()
    if name in ("", "auto"):
        return host_isas()[0]
    if name not in ISAS:
        raise ValueError(
            f"unknown CPU ISA path {name!r} (RINGMPI_CPU_ISA): use auto, " + ", ".join(ISAS)
        )
    have = host_isas()
    if name not in have:
        if not is_x86():
            why = f"this is a {platform.machine()} host"
        elif host_features() is None:
            why = "its CPU features are unknown (no /proc/cpuinfo)"
        else:
            missing = [f for f in ISA_NEEDS[name] if f not in host_features()]
            why = "it lacks " + ", ".join(missing)
        raise ValueError(
            f"CPU ISA path {name!r} cannot run on this host: {why}; it can run " + ", ".join(have)
        )
    return name


def isa_flags(isa: str) -> list[str]:
    """Compiler flags of ISA path ``isa`` on this host (``-march=native`` off x86)."""
    return list(ISA_FLAGS[isa]) if is_x86() else ["-march=native"]
