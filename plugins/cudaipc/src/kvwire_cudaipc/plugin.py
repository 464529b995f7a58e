"""kvwire hook module of kvwire-cudaipc (entry point ``cudaipc``).

It names the backend and never imports torch or the CUDA bindings: a machine without a GPU
must still run ``kvwire --help`` and the other backends.
"""

from kvwire.plugins import Implementation, hookimpl

#: The kvwire plugin API this plugin is written for (see kvwire.plugin_api).
KVWIRE_PLUGIN_API = "2.0"

#: Below the built-in ``tcp`` (0): never auto's general backend. It is ``link_only``: where
#: CUDA is usable, ``auto`` offers it ahead of the general backend and each link takes it only
#: when its peer is on this host with P2P between the two GPUs (``link_problem``).
PRIORITY = -10


@hookimpl
def kvwire_transfer_backends() -> list[Implementation]:
    """The ``cudaipc`` backend."""
    return [
        Implementation(
            "cudaipc",
            "kvwire_cudaipc.backend:CudaIpcBackend",
            "CUDA IPC between GPUs of one host: one fused Triton mover launch per transfer "
            "(VRAM), ZeroMQ side channel for host rows and notifications; WRITE only",
            priority=PRIORITY,
            link_only=True,
        )
    ]
