"""Raw memory as arrays: device and host pointers wrapped for ``torch.as_tensor`` and
``numpy.asarray``, and the device address of registered host memory. Used by the row copier
(:mod:`kvwire_hisparse.copier`) at construction and per copy, on the caller's thread."""

from __future__ import annotations

import ctypes

from kvwire.errors import ConfigError

__all__ = ["CudaPtr", "HostPtr", "cudart_lib", "device_pointer"]


class CudaPtr:
    """A raw CUDA pointer with a shape, for ``torch.as_tensor`` (``__cuda_array_interface__``
    v2: no stream synchronisation is requested)."""

    def __init__(self, addr: int, shape: tuple[int, ...], typestr: str) -> None:
        self.__cuda_array_interface__ = {
            "shape": shape,
            "typestr": typestr,
            "data": (addr, False),
            "strides": None,
            "version": 2,
        }


class HostPtr:
    """A raw host pointer with a shape, for ``numpy.asarray`` (``__array_interface__``)."""

    def __init__(self, addr: int, shape: tuple[int, ...], typestr: str) -> None:
        self.__array_interface__ = {
            "shape": shape,
            "typestr": typestr,
            "data": (addr, False),
            "strides": None,
            "version": 3,
        }


def cudart_lib() -> ctypes.CDLL | None:
    """The CUDA runtime library this process (torch) loaded, or None if it cannot be found."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as f:
            for line in f:
                path = line.rsplit(" ", 1)[-1].strip()
                if "/libcudart.so" in path:
                    return ctypes.CDLL(path)
    except OSError:
        pass
    return None


def device_pointer(host_addr: int) -> tuple[int, str]:
    """Device address of registered host memory: ``cudaHostGetDevicePointer`` through the
    runtime library when reachable ("device-pointer", or "uva" when it equals the host
    address), else the host address itself ("uva-assumed")."""
    lib = cudart_lib()
    if lib is None:
        return host_addr, "uva-assumed"
    fn = lib.cudaHostGetDevicePointer
    fn.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    out = ctypes.c_void_p()
    err = fn(ctypes.byref(out), ctypes.c_void_p(host_addr), 0)
    if err != 0 or out.value is None:
        raise ConfigError(f"cudaHostGetDevicePointer({host_addr:#x}) failed with CUDA error {err}")
    dev = int(out.value)
    return dev, ("uva" if dev == host_addr else "device-pointer")
