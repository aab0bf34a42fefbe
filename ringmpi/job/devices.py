"""Which device the batch job computes on: a GPU on every rank, or the CPUs."""

from __future__ import annotations

from .schema import InputError

__all__ = ["gpu_probe", "pick_device"]


def gpu_probe() -> tuple:
    """(usable, reason) for this process: is there a GPU ringmpi can use, and if not, why."""
    try:
        import cupy
    except ImportError:
        return False, "CuPy is not installed"
    except Exception as e:  # noqa: BLE001 - a broken CuPy install
        return False, f"CuPy does not import ({type(e).__name__}: {e})"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001 - no driver, no device, no permission
        text = str(e)
        if "insufficient" in text.lower():
            why = "no NVIDIA driver is loaded; CUDA reports an insufficient driver"
        elif "NoDevice" in text or "no CUDA-capable device" in text:
            why = "CUDA sees no device"
        else:
            why = f"CUDA: {type(e).__name__}: {text}"
        return False, f"no GPU found: {why}"
    if n < 1:
        return False, "no GPU found: CUDA sees 0 devices"
    try:
        from .. import gpu  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return False, f"ringmpi.gpu does not import ({type(e).__name__}: {e})"
    return True, f"{n} GPU(s)"


def pick_device(device: str, comm) -> str:
    """Resolve ``auto`` to ``gpu`` when CuPy sees a GPU on every rank, else ``cpu``.

    Every rank first reports whether it has a usable GPU; only when all do are
    the ranks bound to devices (a collective step), so a node without CuPy
    cannot leave the others waiting. ``gpu`` without a GPU on some rank is an
    InputError giving each such rank's reason.
    """
    if device == "cpu":
        return "cpu"
    probe = gpu_probe()
    probes = [probe] if comm is None else comm.allgather(probe)
    flags = [ok for ok, _ in probes]
    if device == "gpu" and not all(flags):
        bad = [f"rank {r}: {why}" for r, (ok, why) in enumerate(probes) if not ok]
        more = f" (and {len(bad) - 3} more rank(s))" if len(bad) > 3 else ""
        raise InputError(f"--device gpu: no usable GPU on {'; '.join(bad[:3])}{more}")
    if all(flags) and comm is not None:
        from .. import gpu

        gpu.bind_device(comm)
    return "gpu" if all(flags) else "cpu"
