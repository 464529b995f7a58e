"""kvwire.cuda_launch: compiled Triton kernels launched with the GIL kept, Triton's launcher as
the fallback, and the owners' direct-launch bookkeeping.

No GPU here: the driver and the compiled kernel are stand-ins recording what they are handed
(what no machine here can run). On a GPU, scripts/gpu_launch_gil_probe.py checks that the
real driver call writes the same bytes as Triton's launcher for kvwire's own movers, and
that a busy thread gets no GIL hand-off from it.
"""

from __future__ import annotations

import ctypes
from types import SimpleNamespace
from typing import Any

import pytest

from kvwire import cuda_driver, cuda_launch
from kvwire.cuda_launch import CompiledKernels, HeldLaunch, TritonLaunch, launcher

SIGNATURE = {"table": "*i64", "n": "i32", "rows": "i64", "scale": "fp32", "block": "constexpr"}
SIZES = [8, 4, 8, 4]  # the non-constexpr parameters' sizes, in order


class _Kernel:
    """A compiled Triton kernel as kvwire's movers hold it: ``src.signature``, ``metadata``,
    ``function``; ``kernel[grid](*args, stream=...)`` is Triton's own launch (recorded)."""

    def __init__(self, signature: dict[str, Any] | None = None, **md: Any) -> None:
        meta = {"num_warps": 4, "shared": 96, "global_scratch_size": 0}
        meta.update(md)
        self.metadata = SimpleNamespace(**meta)
        self.src = SimpleNamespace(signature=dict(signature or SIGNATURE))
        self.function = 0xF00
        self.inits = 0
        self.triton_calls: list[tuple[Any, ...]] = []

    def _init_handles(self) -> None:
        self.inits += 1

    def __getitem__(self, grid: tuple[int, int, int]) -> Any:
        def run(*args: Any, stream: int) -> None:
            self.triton_calls.append((grid, stream, args))

        return run


class _Driver:
    """``libcuda`` as kvwire calls it: parameter info from ``sizes``, launches recorded with
    the parameter values read back from the packed buffers."""

    def __init__(self, sizes: list[int], rc: int = 0) -> None:
        self.sizes = sizes
        self.rc = rc
        self.launches: list[dict[str, Any]] = []

    def cuFuncGetParamInfo(self, f: int, i: int, off: Any, size: Any) -> int:  # noqa: N802
        assert f == 0xF00
        if i >= len(self.sizes):
            return 1  # CUDA_ERROR_INVALID_VALUE
        off._obj.value = sum(self.sizes[:i])
        size._obj.value = self.sizes[i]
        return 0

    def cuLaunchKernel(self, f: int, gx: int, gy: int, gz: int, bx: int, by: int, bz: int,  # noqa: N802
                       shared: int, stream: int, params: Any, extra: Any) -> int:  # fmt: skip
        raw = [
            ctypes.string_at(params[i], s) for i, s in enumerate(self.sizes)
        ]  # each parameter's bytes, as the GPU would read them
        self.launches.append(
            {"f": f, "grid": (gx, gy, gz), "block": (bx, by, bz), "shared": shared,
             "stream": stream, "raw": raw, "extra": extra}
        )  # fmt: skip
        return self.rc


@pytest.fixture
def driver(monkeypatch: pytest.MonkeyPatch) -> _Driver:
    d = _Driver([*SIZES, 8, 8])  # Triton's global and profile scratch pointers
    monkeypatch.setattr(cuda_driver, "_lib", d)
    monkeypatch.delenv(cuda_launch.ENV_TRITON, raising=False)
    return d


class _Tensor:
    def data_ptr(self) -> int:
        return 0xABC000


def test_parameters_are_packed_as_tritons_launcher_packs_them(driver: _Driver) -> None:
    k = _Kernel()
    launch = launcher(k)
    assert isinstance(launch, HeldLaunch) and k.inits == 1
    launch((6, 2, 1), 0x5000, (0x7F0000001000, -7, 1 << 40, 0.5, 256))
    launch((1, 1, 1), 0x5000, (_Tensor(), 3, 4, 2.0, 256))
    first, second = driver.launches
    assert first["f"] == 0xF00 and first["grid"] == (6, 2, 1) and first["block"] == (128, 1, 1)
    assert first["shared"] == 96 and first["stream"] == 0x5000 and first["extra"] is None
    assert first["raw"] == [
        (0x7F0000001000).to_bytes(8, "little"),
        (-7).to_bytes(4, "little", signed=True),
        (1 << 40).to_bytes(8, "little"),
        bytes(ctypes.c_float(0.5)),
        bytes(8),  # scratch pointers: null
        bytes(8),
    ]
    assert second["raw"][0] == (0xABC000).to_bytes(8, "little")  # a tensor's data_ptr()
    assert k.triton_calls == []  # Triton's launcher (which lets go of the GIL) not called


def test_one_hidden_pointer_is_accepted(driver: _Driver) -> None:
    """An older Triton appends only the global scratch pointer."""
    driver.sizes = [*SIZES, 8]
    assert isinstance(launcher(_Kernel()), HeldLaunch)


@pytest.mark.parametrize(
    ("sizes", "what"),
    [
        ([8, 8, 8, 4, 8, 8], "an i32 compiled as 8 bytes"),
        ([8, 4, 8, 8, 8], "a parameter missing"),
        ([*SIZES, 8, 8, 8], "three trailing pointers"),
        ([*SIZES, 4, 8], "a 4-byte trailing parameter"),
        ([], "no parameter info"),
    ],
)
def test_a_packing_unlike_the_compiled_function_falls_back_to_triton(
    driver: _Driver, sizes: list[int], what: str
) -> None:
    driver.sizes = sizes
    k = _Kernel()
    launch = launcher(k)
    assert isinstance(launch, TritonLaunch), what
    launch((3, 1, 1), 0x5000, (1, 2, 3, 4.0, 256))
    assert k.triton_calls == [((3, 1, 1), 0x5000, (1, 2, 3, 4.0, 256))]
    assert driver.launches == []


@pytest.mark.parametrize(
    "kernel",
    [
        _Kernel(global_scratch_size=64),
        _Kernel(profile_scratch_size=16),
        _Kernel(num_ctas=2),
        _Kernel(launch_cooperative_grid=True),
        _Kernel(launch_pdl=True),
        _Kernel(tensordesc_meta=[{"swizzle": 0}]),
        _Kernel({"x": "*i64", "h": "fp16"}),
        _Kernel({"x": "*i64", "t": ("i32", "i32")}),
    ],
)
def test_kernels_the_held_launch_does_not_cover_use_triton(driver: _Driver, kernel: Any) -> None:
    assert isinstance(launcher(kernel), TritonLaunch)


def test_no_driver_an_old_driver_or_the_switch_use_triton(
    driver: _Driver, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(cuda_launch.ENV_TRITON, "1")
    assert isinstance(launcher(_Kernel()), TritonLaunch)
    monkeypatch.setenv(cuda_launch.ENV_TRITON, "0")
    assert isinstance(launcher(_Kernel()), HeldLaunch)
    monkeypatch.setattr(cuda_driver, "_lib", SimpleNamespace(cuLaunchKernel=None))  # pre-12.4
    assert isinstance(launcher(_Kernel()), TritonLaunch)
    monkeypatch.setattr(cuda_driver, "_lib", False)  # libcuda could not be loaded
    assert isinstance(launcher(_Kernel()), TritonLaunch)


def test_no_libcuda_here_kernels_use_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cuda_driver, "_lib", None)  # the real loader runs
    assert isinstance(launcher(_Kernel()), TritonLaunch)


def test_wrong_argument_count_and_driver_errors_raise(driver: _Driver) -> None:
    launch = launcher(_Kernel())
    with pytest.raises(ValueError, match="4 arguments for a signature of 5"):
        launch((1, 1, 1), 0, (1, 2, 3, 4.0))
    driver.rc = 701
    with pytest.raises(RuntimeError, match="cuLaunchKernel failed: CUDA driver error 701"):
        launch((1, 1, 1), 0, (1, 2, 3, 4.0, 256))


def test_compiled_kernels_launch_directly_after_the_first_and_stop_on_a_refusal(
    driver: _Driver,
) -> None:
    kernels = CompiledKernels("test mover")
    k, other = _Kernel(), _Kernel()
    args = (0x1000, 2, 3, 1.0, 256)
    assert not kernels.launch(("a",), (2, 1, 1), 0x5000, args)  # not compiled yet
    assert kernels.kernel(("a",)) is None
    kernels.add(("a",), k)
    kernels.add(("a",), other)  # the first kept wins
    assert kernels.kernel(("a",)) is k and kernels.kernels() == [k]
    assert kernels.launch(("a",), (2, 1, 1), 0x5000, args)
    assert len(driver.launches) == 1
    driver.rc = 1  # a refused launch: logged, direct launches off from then on
    assert not kernels.launch(("a",), (2, 1, 1), 0x5000, args)
    driver.rc = 0
    assert not kernels.launch(("a",), (2, 1, 1), 0x5000, args)
    assert len(driver.launches) == 2 and not kernels.direct


def test_compiled_kernels_off_the_gpu_never_launch_directly(driver: _Driver) -> None:
    kernels = CompiledKernels("interpreter", direct=False)
    kernels.add(("a",), _Kernel())
    assert not kernels.launch(("a",), (1, 1, 1), 0, (1, 2, 3, 4.0, 256))
    assert driver.launches == []
