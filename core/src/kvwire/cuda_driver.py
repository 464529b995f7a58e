"""The CUDA driver library, loaded so that its calls keep the GIL.

``ctypes.PyDLL`` calls a C function without letting go of the GIL (``ctypes.CDLL`` lets go
of it around every call). kvwire calls a few driver functions this way on its hot paths
(:mod:`kvwire.cuda_events`, :mod:`kvwire.cuda_launch`): each takes microseconds, and in a
busy rank process a caller that lets go of the GIL for that long waits afterwards for
whichever thread took it (docs/benchmarks.md, "Session 27").

One owner: the handle is loaded once per process, on the first :func:`held` call, with the
argument types of every function kvwire calls. Any thread.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import Any

logger = logging.getLogger(__name__)

#: ``CUDA_SUCCESS`` (the driver API's result code).
SUCCESS = 0

_lock = threading.Lock()
_lib: Any = None  # the PyDLL handle, False once loading failed, None before the first try

_P = ctypes.c_void_p
_U = ctypes.c_uint
_SIGNATURES: dict[str, list[Any]] = {
    "cuEventRecord": [_P, _P],
    # f, grid x/y/z, block x/y/z, shared bytes, stream, params, extra
    "cuLaunchKernel": [_P, _U, _U, _U, _U, _U, _U, _U, _P, _P, _P],
    # f, index, offset out, size out (CUDA 12.4)
    "cuFuncGetParamInfo": [
        _P,
        ctypes.c_size_t,
        ctypes.POINTER(ctypes.c_size_t),
        ctypes.POINTER(ctypes.c_size_t),
    ],
}


def held() -> Any:
    """``libcuda`` through ``ctypes.PyDLL`` (None where it cannot be loaded, e.g. a machine
    without the NVIDIA driver). A function the driver lacks is absent from the handle's
    attributes (``hasattr`` is False) rather than an error here."""
    global _lib
    if _lib is None:
        with _lock:
            if _lib is None:
                try:
                    lib = ctypes.PyDLL("libcuda.so.1")
                    for name, argtypes in _SIGNATURES.items():
                        try:
                            fn = getattr(lib, name)
                        except AttributeError:
                            logger.debug("libcuda has no %s", name)
                            continue
                        fn.argtypes = argtypes
                        fn.restype = ctypes.c_int
                    _lib = lib
                except OSError as exc:
                    logger.debug("libcuda not loadable (%s): torch's and Triton's calls", exc)
                    _lib = False
    return _lib or None


__all__ = ["SUCCESS", "held"]
