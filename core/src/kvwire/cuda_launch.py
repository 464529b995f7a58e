"""Launching a compiled Triton kernel again without letting go of the GIL.

kvwire's movers and checksum lanes compile each kernel variant once through Triton and then
launch the compiled kernel directly (``kernel[grid](*args, stream=...)``). Triton's C
launcher lets go of the GIL around ``cuLaunchKernelEx``; in a busy rank process the
launching thread then waits for whichever thread took the GIL meanwhile: on the GPU hosts
py-spy put Triton's launcher at 8-13% of a ``cudaipc`` transfer worker's wall time at C=8
(docs/benchmarks.md, "Session 27").

:class:`HeldLaunch` makes the same launch through ``cuLaunchKernel`` of
:func:`kvwire.cuda_driver.held` (``ctypes.PyDLL``: the GIL kept), packing the parameters as
Triton's launcher does: every argument whose signature type is not ``constexpr``, in order,
then Triton's two hidden scratch pointers (null: refused for a kernel that needs scratch
memory). Before it is used, the packing is checked against the compiled function's own
parameter list (``cuFuncGetParamInfo``: the count and each parameter's size), so a Triton
whose packing differs is caught at the first launch of a variant, not by a wrong copy.
Where anything does not fit (no driver, an older driver, a kernel with clusters,
cooperative grids, programmatic dependent launch, tensor descriptors or scratch memory,
a parameter type not packed here, ``KVWIRE_TRITON_LAUNCHER=1`` in the environment),
:func:`launcher` returns Triton's own launch instead.

Contract: the caller's current CUDA device is the kernel's, and ``stream`` is a raw stream
handle of that device (the driver call acts in the current context). Any thread: a
launcher's parameter buffers are reused under a lock of its own, held for the packing and
the driver call only.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Sequence
from typing import Any, Protocol

from kvwire import cuda_driver

logger = logging.getLogger(__name__)

__all__ = ["CompiledKernels", "HeldLaunch", "Launcher", "TritonLaunch", "launcher"]

#: The environment variable that keeps Triton's own launcher (a diagnostic switch).
ENV_TRITON = "KVWIRE_TRITON_LAUNCHER"

_SCALARS: dict[str, Any] = {
    "i8": ctypes.c_int8,
    "i16": ctypes.c_int16,
    "i32": ctypes.c_int32,
    "i64": ctypes.c_int64,
    "u8": ctypes.c_uint8,
    "u16": ctypes.c_uint16,
    "u32": ctypes.c_uint32,
    "u64": ctypes.c_uint64,
    "fp32": ctypes.c_float,
    "fp64": ctypes.c_double,
}
#: Triton's hidden trailing parameters: the global and the profile scratch pointers.
_HIDDEN = 2
_MAX_PARAMS = 256


class Launcher(Protocol):
    """Launches one compiled kernel: ``grid`` programs on raw stream handle ``stream`` with
    every argument of its signature (constexprs included), in order."""

    kernel: Any

    def __call__(self, grid: tuple[int, int, int], stream: int, args: Sequence[Any]) -> None:
        """Enqueue one launch; raises on a launch error."""
        ...


class TritonLaunch:
    """Triton's own launcher of a compiled kernel (lets go of the GIL while it launches)."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel

    def __call__(self, grid: tuple[int, int, int], stream: int, args: Sequence[Any]) -> None:
        """Enqueue one launch through Triton."""
        self.kernel[grid](*args, stream=stream)


def _refusal(kernel: Any) -> str:
    """Why the held launch cannot serve ``kernel`` ('' when it can, as far as the metadata
    tells)."""
    md = kernel.metadata
    if getattr(md, "global_scratch_size", 0) or getattr(md, "profile_scratch_size", 0):
        return "it needs scratch memory"
    if getattr(md, "num_ctas", 1) != 1:
        return "it runs in clusters"
    if getattr(md, "launch_cooperative_grid", False) or getattr(md, "launch_pdl", False):
        return "it needs a cooperative grid or a dependent launch"
    if getattr(md, "tensordesc_meta", None):
        return "it takes tensor descriptors"
    for t in kernel.src.signature.values():
        if t != "constexpr" and not (isinstance(t, str) and (t[:1] == "*" or t in _SCALARS)):
            return f"a parameter of type {t!r} is not packed here"
    return ""


def _param_sizes(lib: Any, function: int) -> list[int]:
    """The compiled function's parameter sizes in bytes, in order (``cuFuncGetParamInfo``
    until it refuses an index)."""
    off, size = ctypes.c_size_t(), ctypes.c_size_t()
    sizes: list[int] = []
    for i in range(_MAX_PARAMS):
        if lib.cuFuncGetParamInfo(function, i, ctypes.byref(off), ctypes.byref(size)):
            break
        sizes.append(int(size.value))
    return sizes


class HeldLaunch:
    """One compiled Triton kernel launched through ``cuLaunchKernel`` with the GIL kept (see
    the module docstring). Built by :func:`launcher` once per compiled variant; called by the
    thread that launches (any), under this object's lock for the packing and the call."""

    def __init__(self, kernel: Any, lib: Any) -> None:
        """Raises ValueError where the held launch does not fit ``kernel``."""
        why = _refusal(kernel)
        if why:
            raise ValueError(why)
        if hasattr(kernel, "_init_handles"):
            kernel._init_handles()
        self.kernel = kernel
        self._lib = lib
        self._function = int(kernel.function)
        self._threads = 32 * int(kernel.metadata.num_warps)
        self._shared = int(kernel.metadata.shared)
        types = list(kernel.src.signature.values())
        self._nargs = len(types)
        self._take = tuple(i for i, t in enumerate(types) if t != "constexpr")
        self._pointer = tuple(types[i][:1] == "*" for i in self._take)
        self._vals: list[Any] = [
            ctypes.c_uint64() if types[i][:1] == "*" else _SCALARS[types[i]]() for i in self._take
        ]
        self._vals += [ctypes.c_uint64(0) for _ in range(_HIDDEN)]
        declared = [ctypes.sizeof(v) for v in self._vals]
        actual = _param_sizes(lib, self._function)
        n = len(self._take)
        if (
            actual[:n] != declared[:n]
            or len(actual) - n > _HIDDEN
            or any(s != 8 for s in actual[n:])
        ):
            raise ValueError(
                f"the compiled function's parameters ({actual} bytes) are not the "
                f"signature's ({declared[:n]} + {_HIDDEN} scratch pointers)"
            )
        self._params = (ctypes.c_void_p * len(self._vals))(
            *[ctypes.addressof(v) for v in self._vals]
        )
        self._lock = threading.Lock()

    def __call__(self, grid: tuple[int, int, int], stream: int, args: Sequence[Any]) -> None:
        """Enqueue one launch of ``grid`` programs on raw stream ``stream``; ``args`` as the
        kernel's signature lists them (constexprs included; pointers as ints or objects with
        ``data_ptr()``). Raises ValueError on a wrong argument count, RuntimeError on a
        driver error (nothing launched)."""
        if len(args) != self._nargs:
            raise ValueError(f"{len(args)} arguments for a signature of {self._nargs}")
        with self._lock:
            for v, i, ptr in zip(self._vals, self._take, self._pointer, strict=False):
                a = args[i]
                v.value = a.data_ptr() if ptr and not isinstance(a, int) else a
            rc = self._lib.cuLaunchKernel(
                self._function,
                grid[0],
                grid[1],
                grid[2],
                self._threads,
                1,
                1,
                self._shared,
                stream,
                self._params,
                None,
            )
        if rc != cuda_driver.SUCCESS:
            raise RuntimeError(f"cuLaunchKernel failed: CUDA driver error {rc}")


def launcher(kernel: Any) -> Launcher:
    """The launcher of an already compiled Triton kernel: :class:`HeldLaunch` where it fits,
    else Triton's own (:class:`TritonLaunch`, the reason logged once per variant at debug
    level). Called by a mover or checksum lane after a variant's first (compiling) launch."""
    lib = cuda_driver.held()
    if os.environ.get(ENV_TRITON, "") not in ("", "0"):
        why = f"{ENV_TRITON} is set"
    elif lib is None or not hasattr(lib, "cuFuncGetParamInfo"):
        why = "the driver has no cuLaunchKernel with parameter info"
    else:
        try:
            return HeldLaunch(kernel, lib)
        except (ValueError, AttributeError, TypeError) as exc:
            why = str(exc)
    logger.debug("Triton's launcher for %s: %s", getattr(kernel, "name", "a kernel"), why)
    return TritonLaunch(kernel)


class CompiledKernels:
    """The compiled variants of one owner's Triton kernels (a mover or a checksum hasher),
    each launched directly after its first launch compiled it.

    The owner calls :meth:`launch` first; where it returns False (the variant is not compiled
    yet, or direct launches were refused), the owner launches through Triton's JIT, which
    compiles and binds the arguments, and hands the compiled kernel to :meth:`add`. A direct
    launch that raises (another Triton's launcher, a driver error before anything was
    enqueued) is logged once and turns direct launches off for this owner. Called on the
    owner's launching threads; the owner serialises :meth:`add` with its compilation (a
    dict's get and setdefault are atomic under the GIL).
    """

    def __init__(self, what: str, *, direct: bool = True) -> None:
        self.what = what
        self.direct = direct
        self._launchers: dict[tuple[Any, ...], Launcher] = {}

    def launch(
        self, key: tuple[Any, ...], grid: tuple[int, int, int], stream: int, args: Sequence[Any]
    ) -> bool:
        """Launch variant ``key`` directly; False where the caller must launch through Triton
        (see the class docstring). The caller's current device is the kernel's."""
        launch = self._launchers.get(key)
        if launch is None or not self.direct:
            return False
        try:
            launch(grid, stream, args)
            return True
        except Exception as exc:  # another Triton's launcher: Triton binds arguments from now
            logger.warning("%s: direct launch refused (%s); using Triton's", self.what, exc)
            self.direct = False
            return False

    def add(self, key: tuple[Any, ...], kernel: Any) -> None:
        """Keep the compiled ``kernel`` of variant ``key`` (the first one kept wins)."""
        if key not in self._launchers:
            self._launchers.setdefault(key, launcher(kernel))

    def kernel(self, key: tuple[Any, ...]) -> Any:
        """The compiled kernel of variant ``key`` (None before its first launch)."""
        launch = self._launchers.get(key)
        return None if launch is None else launch.kernel

    def kernels(self) -> list[Any]:
        """Every compiled kernel kept, in the order of their first launches."""
        return [launch.kernel for launch in self._launchers.values()]
