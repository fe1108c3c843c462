"""Host memory the GPU reads in place: page-locked, mapped into the device's address space, and
handed to JAX as a device buffer (DLPack), so that a jitted program's kernels read it over PCIe
without a copy (zero-copy).

The expert cache uses it for its misses (`strata-run --miss-path gpu`, runtime/mapped.py
`rebind_misses`): a GPU share's MoE kernels read a resident expert from its slot and a missed one
from the layer's whole host array (backends/xla/pallas_moe.py `_expert_rows`), so a cached layer
needs no host call. Reading a missed expert in place takes about what its cudaMemcpy would
(benchmarks/mapped_experts.py).

On a platform other than CUDA (JAX's CPU platform: tests), `device_view` returns the array
itself, as JAX's CPU client aliases host memory anyway.
"""

from __future__ import annotations

import ctypes
import mmap

import numpy as np

# DLPack (dlpack.h, v0.8 legacy capsule "dltensor")
_KDL_CUDA = 2
_DTYPE = {"u": 1, "i": 0, "f": 2}


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32), ("dtype", _DLDataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


class _DLManaged(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManaged))
_DLManaged._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER)]
_KEEP: list = []        # the structs, shapes and host arrays behind every view (they live as long as the process)


@_DELETER
def _no_delete(_p) -> None:     # the host array outlives the view (_KEEP)
    return None


class _Capsule:
    """What jax.dlpack.from_dlpack takes: __dlpack__ / __dlpack_device__ over a raw device address."""

    def __init__(self, ptr: int, shape: tuple, dtype: np.dtype, device_id: int, device_type: int = _KDL_CUDA) -> None:
        kind = _DTYPE.get(dtype.kind)
        if kind is None:
            raise TypeError(f"mapped arrays of dtype {dtype} are not supported")
        self.shape = (ctypes.c_int64 * len(shape))(*shape)
        self.m = _DLManaged()
        t = self.m.dl_tensor
        t.data, t.device, t.ndim = ptr, _DLDevice(device_type, device_id), len(shape)
        t.dtype = _DLDataType(kind, dtype.itemsize * 8, 1)
        t.shape, t.strides, t.byte_offset = self.shape, None, 0
        self.m.deleter = _no_delete
        self.device_id, self.device_type = device_id, device_type

    def __dlpack_device__(self):
        return self.device_type, self.device_id

    def __dlpack__(self, stream=None, **_kw):
        return _capsule_new(ctypes.addressof(self.m), b"dltensor", None)


# a prototype of our own: ctypes.pythonapi.PyCapsule_New is one object shared with every other
# library in the process, whose argtypes another may set differently (a destructor callback)
_capsule_new = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)(
    ("PyCapsule_New", ctypes.pythonapi))


def aligned_copy(a: np.ndarray) -> np.ndarray:
    """A C-contiguous copy of `a` in fresh page-aligned memory (anonymous mmap)."""
    n = max(a.nbytes, 1)
    buf = mmap.mmap(-1, -(-n // mmap.PAGESIZE) * mmap.PAGESIZE)
    out = np.frombuffer(buf, np.uint8, count=a.nbytes).view(a.dtype).reshape(a.shape)
    out[...] = a
    _KEEP.append(buf)
    return out


def device_pointer(a: np.ndarray) -> int:
    """The GPU's address of host array `a` (its pages registered by cuda_rt.pin, which maps them)."""
    from . import cuda_rt
    from strata_compiler.errors import BackendError

    L = cuda_rt.lib()
    p = ctypes.c_void_p()
    rc = L.cudaHostGetDevicePointer(ctypes.byref(p), ctypes.c_void_p(a.ctypes.data), 0)
    if rc != 0:
        L.cudaGetLastError()
        raise BackendError(f"cudaHostGetDevicePointer failed ({rc}): host memory could not be mapped for the GPU "
                           f"to read in place; run with --miss-path cpu")
    return p.value


def device_view(a: np.ndarray, device):
    """A JAX array on `device` that is host array `a` itself, read by kernels over PCIe. `a` must
    be C-contiguous and must live (unchanged, unless the caller orders its writes) as long as the
    view: the process, here. Registers its pages (cuda_rt.pin) when they are not yet."""
    import jax

    if device.platform == "cpu":
        return jax.device_put(a, device)
    if not a.flags.c_contiguous:
        raise ValueError("a mapped array must be C-contiguous")
    from . import cuda_rt

    if cuda_rt.lib() is None:
        from strata_compiler.errors import BackendError

        raise BackendError("--miss-path gpu reads host memory from the GPU through libcudart (the CUDA runtime), "
                           "which did not load; run with --miss-path cpu")
    cuda_rt.pin([a])
    cap = _Capsule(device_pointer(a), a.shape, a.dtype, int(getattr(device, "local_hardware_id", None) or device.id))
    _KEEP.append((cap, a))
    return jax.dlpack.from_dlpack(cap, copy=False)
