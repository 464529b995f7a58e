"""vLLM resolves its platform once per process, on the first import of a module that asks for
it: test modules here import such modules at collection, so the CPU platform is named before
any of them is collected (this machine has no GPU vLLM could find)."""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
