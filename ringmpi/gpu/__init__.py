"""The GPU path: CUDA tiles (CuPy RawKernels from kernels/*.cu) and the GPU ring.

Modules: :mod:`.tile` (the forward tile), :mod:`.backward` (the backward tile),
:mod:`.configs` (kernel configurations, chosen by the device's shared memory),
:mod:`.tune` (autotuning cache), :mod:`.plan` (block bounds, launch order, flops),
:mod:`.device` (device facts), :mod:`.ring` (device binding, CUDA-aware MPI
detection, staged exchange),
:mod:`.loader` (sources -> CuPy modules), :mod:`.nvrtc` (compile check without a
GPU: ``python -m ringmpi.gpu.nvrtc``), :mod:`.bench` (TFLOP/s beside torch SDPA:
``python -m ringmpi.gpu.bench``). Importing this package needs neither CuPy nor a GPU.
"""

from .backward import backward_tile
from .kernel_args import acc_dtype, from_bf16_bits, tile_dtype, to_bf16_bits
from .ring import TAG_KV, GpuRing, bind_device, cuda_aware, info
from .tile import KERNEL_FILE, forward_tile, kernel_names

__all__ = [
    "KERNEL_FILE",
    "TAG_KV",
    "GpuRing",
    "acc_dtype",
    "backward_tile",
    "bind_device",
    "cuda_aware",
    "forward_tile",
    "from_bf16_bits",
    "info",
    "kernel_names",
    "tile_dtype",
    "to_bf16_bits",
]
