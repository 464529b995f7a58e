"""Host KV pools in shared memory, so that a prefill process on the same host can fill them.

A decode process that keeps its HiSparse host pool in a :class:`SharedHostPool` lets a prefill
process of the same user on the same host map the very same pages and copy KV rows into them
itself (see :mod:`kvwire_hisparse.copier`): a local pinned copy instead of a cross-process
transfer through an engine.

Who calls what:

- the **decode** engine calls :meth:`SharedHostPool.create` at startup, carves its host KV
  tensors out of :meth:`SharedHostPool.tensor` (or :meth:`SharedHostPool.array`), and calls
  :meth:`SharedHostPool.close` after its kvwire manager is closed;
- decode's ``hisparse`` staging strategy calls :meth:`SharedHostPool.find` for each host-pool
  region and :meth:`SharedHostPool.describe` for the handshake, with :func:`host_identity`;
- prefill's ``hisparse`` strategy compares :func:`host_identity` and calls
  :meth:`SharedHostPool.attach` with what decode described, hands the pools to a
  :class:`~kvwire_hisparse.copier.RowCopier` and closes them when the link goes away.

The backing file is ``kvwire-hisparse-<32 hex digits>`` in ``directory``, ``$KVWIRE_SHM_DIR`` or
``/dev/shm`` (it should be a tmpfs: CUDA can pin shared-memory pages, while pinning pages of a
disk-backed file may be refused by the kernel). ``KVWIRE_SHM_DIR=memfd:`` uses an anonymous
``memfd_create`` file instead, reached by other processes as ``/proc/<pid>/fd/<fd>``: no size
limit other than memory (for containers whose ``/dev/shm`` is tiny) and nothing left behind
even after SIGKILL, but both processes must share a PID namespace.
"""

from __future__ import annotations

import contextlib
import errno
import importlib
import logging
import mmap
import os
import re
import secrets
import stat
import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from kvwire.errors import ConfigError

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

#: Environment variable naming the directory of new pools (default ``/dev/shm``).
SHM_DIR_ENV = "KVWIRE_SHM_DIR"
DEFAULT_SHM_DIR = "/dev/shm"
#: ``directory`` (or ``$KVWIRE_SHM_DIR``) value selecting an anonymous memfd instead of a file.
MEMFD = "memfd:"
FILE_PREFIX = "kvwire-hisparse-"
_NAME_RE = re.compile(r"kvwire-hisparse-[0-9a-f]{32}")
_MEMFD_PATH_RE = re.compile(r"/proc/\d+/fd/\d+")

#: cudaHostRegisterPortable | cudaHostRegisterMapped: usable from every device, and mapped into
#: the device address space (implied under UVA; asked for explicitly all the same).
_REGISTER_FLAGS = 0x1 | 0x2

_registry_lock = threading.Lock()
_registry: weakref.WeakSet[SharedHostPool] = weakref.WeakSet()


def host_identity() -> str:
    """This host's boot and this process's user, as ``"<boot_id>:<uid>"``.

    Two processes with equal identities run on the same booted kernel as the same user, the
    precondition for one of them to attach a pool the other created (the files themselves
    decide the rest: another container with its own ``/dev/shm`` fails at attach). Decode
    sends it at handshake; prefill compares it with its own.
    """
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:
        boot = "no-boot-id:" + os.uname().nodename
    return f"{boot}:{os.geteuid()}"


def _torch_cuda() -> Any | None:
    """The torch module if it imports and CUDA is usable, else None (pin=None decides by it)."""
    try:
        torch = importlib.import_module("torch")
    except ImportError:
        return None
    try:
        return torch if torch.cuda.is_available() else None
    except Exception:  # a broken driver install reports here
        return None


def _fs_type(directory: str) -> str:
    """The file system type of ``directory`` from /proc/self/mountinfo ("" if unknown)."""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8") as f:
            lines = f.readlines()
    except OSError:
        return ""
    real = os.path.realpath(directory)
    best, fstype = "", ""
    for line in lines:
        left, _, right = line.partition(" - ")
        parts = left.split()
        if len(parts) < 5 or not right:
            continue
        mnt = parts[4].replace("\\040", " ")
        if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
            best, fstype = mnt, right.split()[0]
    return fstype


@dataclass(eq=False)
class _Mapping:
    """Everything a pool releases; held by the finalizer, so it must not refer to the pool."""

    path: str
    nbytes: int
    owner: bool
    mm: mmap.mmap | None
    base: NDArray[np.uint8] | None
    addr: int
    fd: int = -1
    pin_device: int | None = None
    closed: bool = False


def _unpin(m: _Mapping) -> None:
    if m.pin_device is None:
        return
    device, m.pin_device = m.pin_device, None
    try:
        torch = importlib.import_module("torch")
        cudart = torch.cuda.cudart()
        err = cudart.cudaHostUnregister(m.addr)
        if int(err) != 0:
            logger.warning(
                "cudaHostUnregister(%#x) of shared host pool %s failed: %s",
                m.addr,
                m.path,
                cudart.cudaGetErrorString(err),
            )
    except Exception as exc:  # at interpreter exit CUDA may already be torn down
        logger.debug("unpinning shared host pool %s (device %s): %s", m.path, device, exc)


def _release(m: _Mapping) -> None:
    """Unpin, unmap (unless views are alive), close the fd, unlink if owner. Runs once, from
    :meth:`SharedHostPool.close`, garbage collection or interpreter exit."""
    if m.closed:
        return
    m.closed = True
    _unpin(m)
    m.base = None
    if m.mm is not None:
        try:
            m.mm.close()
        except BufferError:
            logger.warning(
                "shared host pool %s is closed while NumPy/torch views of it are still alive: "
                "its mapping stays until they are gone (the file is unlinked now)",
                m.path,
            )
        m.mm = None
    if m.fd >= 0:
        with contextlib.suppress(OSError):
            os.close(m.fd)
        m.fd = -1
    if m.owner and not _MEMFD_PATH_RE.fullmatch(m.path):
        try:
            os.unlink(m.path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            logger.warning("could not unlink shared host pool %s: %s", m.path, exc)


class SharedHostPool:
    """A host memory pool backed by a shared-memory file that other processes of the same user
    on the same host can map (and pin) too.

    Build with :meth:`create` (decode: owns the file and unlinks it on :meth:`close` or at
    interpreter exit) or :meth:`attach` (prefill: maps a pool another process created; never
    unlinks). Both register the instance for :meth:`find` until it is closed.
    """

    def __init__(self, m: _Mapping) -> None:
        """Internal: use :meth:`create` or :meth:`attach`."""
        self._m = m
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _release, m)
        with _registry_lock:
            _registry.add(self)

    # ------------------------------------------------------------------ construction
    @classmethod
    def create(
        cls,
        nbytes: int,
        *,
        pin: bool | None = None,
        directory: str | None = None,
        device: int | None = None,
    ) -> SharedHostPool:
        """Decode: a new zero-filled pool of ``nbytes`` in a fresh file (mode 0600, random
        128-bit name) in ``directory``, ``$KVWIRE_SHM_DIR`` or ``/dev/shm``.

        ``pin``: register the pages with CUDA (``None``: when torch sees a GPU); ``device``:
        the CUDA device current while registering (default: torch's current device).
        Raises :class:`~kvwire.errors.ConfigError` when the directory lacks the space or the
        pool cannot be created or pinned.
        """
        if nbytes <= 0:
            raise ConfigError(f"a shared host pool needs nbytes > 0, got {nbytes}")
        where = directory or os.environ.get(SHM_DIR_ENV) or DEFAULT_SHM_DIR
        name = FILE_PREFIX + secrets.token_hex(16)
        if where == MEMFD:
            fd, path = cls._new_memfd(name)
        else:
            fd, path = cls._new_file(where, name, nbytes)
        m: _Mapping | None = None
        try:
            cls._reserve(fd, path, where, nbytes)
            mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            base = np.frombuffer(mm, dtype=np.uint8)
            m = _Mapping(path, nbytes, True, mm, base, int(base.ctypes.data))
            if where == MEMFD:
                m.fd = fd  # the /proc/<pid>/fd path lives as long as the descriptor
            else:
                os.close(fd)
            fd = -1
            pool = cls(m)
        except BaseException:
            if m is not None:
                _release(m)
            else:
                if fd >= 0:
                    os.close(fd)
                if where != MEMFD:
                    with contextlib.suppress(OSError):
                        os.unlink(path)
            raise
        pool._pin_if_wanted(pin, device)
        logger.info(
            "created shared host pool %s (%d bytes at %#x%s)",
            path,
            nbytes,
            pool.addr,
            ", pinned" if pool.pinned else "",
        )
        return pool

    @staticmethod
    def _new_memfd(name: str) -> tuple[int, str]:
        try:
            fd = os.memfd_create(name, os.MFD_CLOEXEC)
        except (AttributeError, OSError) as exc:
            raise ConfigError(
                f"{SHM_DIR_ENV}={MEMFD} needs memfd_create, which failed: {exc}"
            ) from exc
        return fd, f"/proc/{os.getpid()}/fd/{fd}"

    @staticmethod
    def _new_file(where: str, name: str, nbytes: int) -> tuple[int, str]:
        if not os.path.isdir(where):
            raise ConfigError(
                f"shared-memory directory {where!r} does not exist; create it or set "
                f"{SHM_DIR_ENV} to a tmpfs directory"
            )
        st = os.statvfs(where)
        free = st.f_bavail * st.f_frsize
        if nbytes > free:
            raise ConfigError(
                f"shared-memory directory {where!r} has {free} bytes free but the host pool "
                f"needs {nbytes} bytes; point {SHM_DIR_ENV} at a larger tmpfs (in Docker: "
                f"--shm-size or --ipc=host), or set {SHM_DIR_ENV}={MEMFD}"
            )
        fstype = _fs_type(where)
        if fstype and fstype not in ("tmpfs", "hugetlbfs", "ramfs"):
            logger.warning(
                "shared-memory directory %s is on %s, not tmpfs: pinning its pages for GPU "
                "copies may fail; set %s to a tmpfs directory",
                where,
                fstype,
                SHM_DIR_ENV,
            )
        path = os.path.join(where, name)
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
        try:
            fd = os.open(path, flags, 0o600)
        except OSError as exc:
            raise ConfigError(f"cannot create shared host pool file {path}: {exc}") from exc
        return fd, path

    @staticmethod
    def _reserve(fd: int, path: str, where: str, nbytes: int) -> None:
        """Size the file and allocate its pages now, so that a full tmpfs fails here rather
        than with SIGBUS at the first write."""
        os.ftruncate(fd, nbytes)
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                raise ConfigError(
                    f"shared-memory directory {where!r} cannot hold {nbytes} bytes for {path} "
                    f"({exc.strerror}); point {SHM_DIR_ENV} at a larger tmpfs"
                ) from exc
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise ConfigError(f"cannot allocate shared host pool {path}: {exc}") from exc

    @classmethod
    def attach(
        cls,
        path: str,
        nbytes: int,
        *,
        pin: bool | None = None,
        device: int | None = None,
    ) -> SharedHostPool:
        """Prefill: map a pool that another process of this user created (``path`` and
        ``nbytes`` from its :meth:`describe`). Never unlinks the file.

        The file must be a regular file named like a pool (or a ``/proc/<pid>/fd/<fd>`` memfd
        of one), owned by this user, of exactly ``nbytes`` bytes; anything else raises
        :class:`~kvwire.errors.ConfigError`. ``pin``/``device`` as in :meth:`create`.
        """
        memfd = bool(_MEMFD_PATH_RE.fullmatch(path))
        if not memfd and not _NAME_RE.fullmatch(os.path.basename(path)):
            raise ConfigError(
                f"{path!r} is not a shared host pool (names are {FILE_PREFIX}<32 hex digits>)"
            )
        flags = os.O_RDWR | os.O_CLOEXEC | (0 if memfd else os.O_NOFOLLOW)
        try:
            fd = os.open(path, flags)
        except OSError as exc:
            raise ConfigError(
                f"cannot open shared host pool {path}: {exc} (is the creating process on this "
                "host, in the same container / PID namespace, and still alive?)"
            ) from exc
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ConfigError(f"shared host pool {path} is not a regular file")
            if memfd:
                target = os.readlink(path)
                if not target.startswith("/memfd:" + FILE_PREFIX):
                    raise ConfigError(f"{path} ({target}) is not a shared host pool memfd")
            if st.st_uid != os.geteuid():
                raise ConfigError(
                    f"shared host pool {path} belongs to uid {st.st_uid}, not to this process's "
                    f"uid {os.geteuid()}; prefill and decode must run as the same user"
                )
            if st.st_size != nbytes:
                raise ConfigError(
                    f"shared host pool {path} has {st.st_size} bytes, expected {nbytes}"
                )
            if nbytes <= 0:
                raise ConfigError(f"shared host pool {path} is empty")
            mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        base = np.frombuffer(mm, dtype=np.uint8)
        pool = cls(_Mapping(path, nbytes, False, mm, base, int(base.ctypes.data)))
        try:
            pool._pin_if_wanted(pin, device)
        except BaseException:
            pool.close()
            raise
        logger.debug("attached shared host pool %s at %#x", path, pool.addr)
        return pool

    # ------------------------------------------------------------------ pinning
    def _pin_if_wanted(self, pin: bool | None, device: int | None) -> None:
        if pin is False:
            return
        if pin is None and _torch_cuda() is None:
            return
        try:
            self.pin(device)
        except BaseException:
            self.close()
            raise

    def pin(self, device: int | None = None) -> None:
        """Register the mapping with CUDA (``cudaHostRegister``, portable and mapped) while
        ``device`` (default: torch's current device) is current. A pool pinned under another
        device is unregistered first. Called by :meth:`create`/:meth:`attach` and by
        :class:`~kvwire_hisparse.copier.RowCopier`, which needs the pages registered under the
        device of its source rows. Raises :class:`~kvwire.errors.ConfigError` on failure."""
        torch = _torch_cuda()
        if torch is None:
            raise ConfigError(
                f"cannot pin shared host pool {self.path}: torch with a usable CUDA device is "
                "needed (pass pin=False for a pool that no GPU copies touch)"
            )
        with self._lock:
            m = self._live()
            dev = int(torch.cuda.current_device()) if device is None else int(device)
            if m.pin_device == dev:
                return
            _unpin(m)
            with torch.cuda.device(dev):
                cudart = torch.cuda.cudart()
                err = cudart.cudaHostRegister(m.addr, m.nbytes, _REGISTER_FLAGS)
                if int(err) != 0:
                    fstype = "" if _MEMFD_PATH_RE.fullmatch(m.path) else _fs_type(m.path)
                    hint = (
                        f" (the file is on {fstype}: CUDA pins shared-memory pages, not those "
                        f"of a disk file; set {SHM_DIR_ENV} to a tmpfs directory or {MEMFD})"
                        if fstype and fstype not in ("tmpfs", "hugetlbfs", "ramfs")
                        else ""
                    )
                    raise ConfigError(
                        f"cudaHostRegister of shared host pool {m.path} ({m.nbytes} bytes at "
                        f"{m.addr:#x}) on cuda:{dev} failed: "
                        f"{cudart.cudaGetErrorString(err)}{hint}"
                    )
            m.pin_device = dev

    def unpin(self) -> None:
        """Unregister the mapping from CUDA (no-op when not pinned)."""
        with self._lock:
            _unpin(self._m)

    # ------------------------------------------------------------------ attributes
    @property
    def path(self) -> str:
        """The backing file (``/proc/<pid>/fd/<fd>`` for a memfd pool)."""
        return self._m.path

    @property
    def nbytes(self) -> int:
        """Size of the pool in bytes."""
        return self._m.nbytes

    @property
    def addr(self) -> int:
        """Base address of the mapping in this process."""
        return self._m.addr

    @property
    def pinned(self) -> bool:
        """True while the mapping is registered with CUDA."""
        return self._m.pin_device is not None

    @property
    def pin_device(self) -> int | None:
        """The CUDA device that was current when the mapping was registered, or None."""
        return self._m.pin_device

    @property
    def owner(self) -> bool:
        """True for the creating process (which unlinks the file on close)."""
        return self._m.owner

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._m.closed

    def _live(self) -> _Mapping:
        if self._m.closed or self._m.base is None:
            raise ConfigError(f"shared host pool {self._m.path} is closed")
        return self._m

    def array(self) -> NDArray[np.uint8]:
        """A uint8 NumPy view of the whole pool (no copy). Views keep the mapping alive: a pool
        closed while views exist is unlinked but stays mapped until they are gone."""
        base = self._live().base
        assert base is not None
        return base[:]

    def tensor(self) -> torch.Tensor:
        """A CPU uint8 torch tensor viewing the whole pool (no copy; pinned if the pool is)."""
        torch_mod = importlib.import_module("torch")
        t: torch.Tensor = torch_mod.from_numpy(self.array())
        return t

    def describe(self) -> dict[str, Any]:
        """What a prefill process needs to :meth:`attach` (JSON/msgpack-safe): path, nbytes,
        addr (base address in this process, to translate remote addresses) and identity."""
        m = self._live()
        return {"path": m.path, "nbytes": m.nbytes, "addr": m.addr, "identity": host_identity()}

    def contains(self, addr: int, length: int) -> bool:
        """True when [addr, addr + length) lies inside this process's mapping of the pool."""
        m = self._m
        return not m.closed and m.addr <= addr and addr + length <= m.addr + m.nbytes

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Unpin, unmap (unless views are still alive: then a warning, and the mapping stays
        until they are gone), unlink if this process created the pool. Idempotent; also runs
        at interpreter exit (weakref.finalize) for pools that were never closed."""
        with _registry_lock:
            _registry.discard(self)
        with self._lock:
            self._finalizer()

    def __enter__(self) -> SharedHostPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.nbytes} B at {self.addr:#x}"
        return f"SharedHostPool({self.path!r}, {state}{', pinned' if self.pinned else ''})"

    @classmethod
    def find(cls, addr: int, length: int) -> SharedHostPool | None:
        """The live pool created or attached in this process whose mapping holds
        [addr, addr + length), or None. Decode's staging strategy calls it per host region."""
        with _registry_lock:
            pools = list(_registry)
        for p in pools:
            if p.contains(addr, length):
                return p
        return None
