"""kvwire-cudaipc: same-host GPU-to-GPU transfers over CUDA IPC with kvwire's fused mover."""

__version__ = "0.1.0"
