"""The stand-in's device array: a numpy array behind CuPy's rules (see the package doc)."""

from __future__ import annotations

import functools
import operator
import os

import numpy as np

__all__ = ["ndarray", "wrap", "unwrap", "asnumpy", "get_array_module", "MemoryPointer"]


class MemoryPointer:
    """``x.data``: the address of the first element (``ptr``), as CuPy's MemoryPointer."""

    def __init__(self, ptr: int, owner):
        self.ptr = int(ptr)
        self._owner = owner  # keeps the memory alive


def _host(x) -> bool:
    return isinstance(x, np.ndarray) and x.ndim > 0


def unwrap(x, check: bool = True):
    """Device arrays -> their numpy arrays (recursively in tuples/lists/dicts)."""
    if isinstance(x, ndarray):
        return x._a
    if isinstance(x, (list, tuple)):
        return type(x)(unwrap(y, check) for y in x)
    if isinstance(x, dict):
        return {k: unwrap(v, check) for k, v in x.items()}
    if check and _host(x):
        raise TypeError(
            "Unsupported type <class 'numpy.ndarray'> (ringmpi CuPy stand-in: a host array "
            "mixed with device arrays; copy it with cupy.asarray)"
        )
    return x


def wrap(x):
    """numpy results -> device arrays (reductions give 0-d arrays, as in CuPy)."""
    if isinstance(x, np.ndarray):
        return ndarray(x)
    if isinstance(x, np.generic) and not isinstance(x, (np.str_, np.bytes_)):
        return ndarray(np.asarray(x))
    if isinstance(x, tuple):
        return tuple(wrap(y) for y in x)
    if isinstance(x, list):
        return [wrap(y) for y in x]
    return x


def host_function(f):
    """A numpy function on device arrays: host arrays in the arguments raise TypeError."""

    @functools.wraps(f)
    def g(*args, **kwargs):
        return wrap(f(*unwrap(args), **unwrap(kwargs)))

    return g


def upload_function(f):
    """cupy.asarray & co: host data is copied into a new device array."""

    @functools.wraps(f)
    def g(a, *args, **kwargs):
        if isinstance(a, ndarray):
            r = f(a._a, *args, **unwrap(kwargs))
            return a if r is a._a else ndarray(r)
        return ndarray(np.array(f(a, *args, **unwrap(kwargs)), copy=True))

    return g


def asnumpy(x, stream=None):
    """Device array -> a numpy copy (host input: a numpy array)."""
    if isinstance(x, ndarray):
        return x._a.copy()
    return np.asarray(x)


def get_array_module(*args):
    import cupy

    return cupy if any(isinstance(a, ndarray) for a in args) else np


class ndarray:
    """A device array of the stand-in: numpy storage, CuPy's conversion rules."""

    __slots__ = ("_a", "__weakref__")
    __array_priority__ = 1000

    def __init__(self, a):
        if not isinstance(a, np.ndarray):
            raise TypeError("stand-in ndarray wraps a numpy array; use cupy.asarray")
        self._a = a

    # -- conversion rules --------------------------------------------------
    def __array__(self, *args, **kwargs):
        raise TypeError(
            "Implicit conversion to a NumPy array is not allowed. Please use `.get()` to "
            "construct a NumPy array explicitly. (ringmpi CuPy stand-in)"
        )

    def get(self, stream=None, out=None):
        if out is not None:
            out[...] = self._a
            return out
        return self._a.copy()

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        args = unwrap(inputs)
        if "out" in kwargs:
            kwargs["out"] = tuple(unwrap(o) for o in kwargs["out"])
        return wrap(getattr(ufunc, method)(*args, **kwargs))

    def __array_function__(self, func, types, args, kwargs):
        return wrap(func(*unwrap(args), **unwrap(kwargs)))

    @property
    def __cuda_array_interface__(self):
        if os.environ.get("RINGMPI_CUDA_AWARE", "").strip() != "1":
            raise TypeError(
                "ringmpi CuPy stand-in: a device buffer was handed to MPI while "
                "RINGMPI_CUDA_AWARE is not 1 (a staged ring must send host buffers)"
            )
        a = self._a
        return {
            "shape": a.shape,
            "typestr": a.dtype.str,
            "data": (a.ctypes.data, False),
            "strides": None if a.flags.c_contiguous else a.strides,
            "version": 3,
        }

    @property
    def data(self) -> MemoryPointer:
        return MemoryPointer(self._a.ctypes.data, self._a)

    # -- attributes ----------------------------------------------------------
    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    size = property(lambda self: self._a.size)
    ndim = property(lambda self: self._a.ndim)
    nbytes = property(lambda self: self._a.nbytes)
    strides = property(lambda self: self._a.strides)
    itemsize = property(lambda self: self._a.itemsize)
    flags = property(lambda self: self._a.flags)
    T = property(lambda self: ndarray(self._a.T))

    @property
    def device(self):
        from . import cuda

        return cuda.Device()

    def __getattr__(self, name):
        if name.startswith("__"):  # no buffer protocol, DLPack or array interface of the host
            raise AttributeError(name)
        attr = getattr(self._a, name)
        if callable(attr):
            return host_function(attr)
        return wrap(attr)

    def __getitem__(self, key):
        return wrap(self._a[unwrap(key, check=False)])

    def __setitem__(self, key, value):
        self._a[unwrap(key, check=False)] = unwrap(value, check=False)

    def __len__(self):
        return len(self._a)

    def __iter__(self):
        return (wrap(x) for x in self._a)

    def __bool__(self):
        return bool(self._a)

    def __float__(self):
        return float(self._a)

    def __int__(self):
        return int(self._a)

    def __index__(self):
        return operator.index(self._a)

    def __repr__(self):
        return "stand-in " + repr(self._a)

    def copy(self, order="C"):
        return ndarray(self._a.copy(order=order))

    def view(self, dtype=None):
        return ndarray(self._a.view(dtype))

    def astype(self, dtype, order="K", casting=None, subok=None, copy=True):
        return ndarray(self._a.astype(dtype, order=order, copy=copy))


def _make_ops():
    binary = {
        "add": np.add,
        "sub": np.subtract,
        "mul": np.multiply,
        "truediv": np.true_divide,
        "floordiv": np.floor_divide,
        "mod": np.remainder,
        "pow": np.power,
        "matmul": np.matmul,
        "and": np.bitwise_and,
        "or": np.bitwise_or,
        "xor": np.bitwise_xor,
        "lshift": np.left_shift,
        "rshift": np.right_shift,
        "lt": np.less,
        "le": np.less_equal,
        "gt": np.greater,
        "ge": np.greater_equal,
        "eq": np.equal,
        "ne": np.not_equal,
    }
    for name, uf in binary.items():

        def fwd(self, other, uf=uf):
            return uf(self, other)

        def rev(self, other, uf=uf):
            return uf(other, self)

        def inplace(self, other, uf=uf):
            uf(self, other, out=(self,))
            return self

        setattr(ndarray, f"__{name}__", fwd)
        if name not in ("lt", "le", "gt", "ge", "eq", "ne"):
            setattr(ndarray, f"__r{name}__", rev)
            setattr(ndarray, f"__i{name}__", inplace)
    for name, uf in {
        "neg": np.negative,
        "pos": np.positive,
        "abs": np.absolute,
        "invert": np.invert,
    }.items():
        setattr(ndarray, f"__{name}__", lambda self, uf=uf: uf(self))


_make_ops()
