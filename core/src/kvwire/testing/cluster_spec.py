"""What a test cluster is asked to run and what its ranks report back.

Shared by the parent (:class:`~kvwire.testing.cluster.Cluster`, which spawns the ranks and
collects their reports) and each rank process (:mod:`kvwire.testing.cluster_rank`, which plays
an engine): the cluster's shape (:class:`ClusterSpec`), where a rank runs (:func:`rank_gpu`),
one request as every rank sees it (:class:`RoomPlan`), a rank's report on it
(:class:`RankReport`) and every rank's reports together (:class:`RequestResult`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvwire.config import KVWireConfig
from kvwire.layout import ModelSpec


class ClusterError(RuntimeError):
    """A rank process died or the workload did not finish in time."""


#: int32 values per engine aux row (a stand-in for first token, logprobs, ...).
AUX_WORDS = 16
#: Environment variable naming faults to inject in every rank, comma-separated (see
#: :mod:`kvwire.testing.faults`).
FAULT_ENV = "KVWIRE_TESTING_FAULT"
#: Longest a failed request's page slots stay unused while its writers have not confirmed that
#: their writes ended (``KVReceiver.writes_quiesced``); a late write must not hit a new request.
QUARANTINE_S = 60.0
#: Heartbeat interval for clusters whose tests are not about liveness: its 6 s silence bound
#: (3 misses) outlasts the 1.2-1.4 s starvation CI's loaded 2-core host showed, which at
#: 0.5 s beats (1.5 s) evicted a live prefill rank of a 12-process cluster. A process's
#: starvation is forgiven by its own liveness thread, not by its peers', so processes need
#: this where in-process pairs do not.
RELAXED_HEARTBEAT_S = 2.0


class ClusterSpec(BaseModel):
    """Shape of a test cluster. All ranks of one instance share the model."""

    model_config = ConfigDict(extra="forbid")

    model: ModelSpec
    prefill_tp: int = Field(default=1, ge=1)
    prefill_pp: int = Field(default=1, ge=1)
    decode_tp: int = Field(default=1, ge=1)
    #: Decode pipeline stages (each holds a layer range, split as prefill's are).
    decode_pp: int = Field(default=1, ge=1)
    decode_instances: int = Field(default=1, ge=1)
    slots: int = Field(default=256, ge=1, description="Page slots per KV buffer per rank.")
    aux_slots: int = Field(default=128, ge=1)
    device: str = Field(default="cpu", description="'cpu' (NumPy) or 'cuda' (torch tensors).")
    #: With ``device='cuda'``: the CUDA device indices ranks are placed on, round robin,
    #: prefill ranks first and decode ranks after them (:func:`rank_gpu`), so a 1P1D pair
    #: lands on the first two. None: every device the rank processes see
    #: (``torch.cuda.device_count()``); one device: every rank on it. ``device='cuda:N'``
    #: puts every rank on device N instead.
    gpus: tuple[int, ...] | None = None
    config: KVWireConfig = Field(default_factory=KVWireConfig)
    seed: int = 0
    log_level: str = "WARNING"
    #: Decode ranks' KV page size, when it differs from the model's (prefill's): the core
    #: mappers move token ranges (:mod:`kvwire.index.paging`). None: the model's.
    decode_page_size: int | None = Field(default=None, ge=1)
    #: Decode ranks also get a host pool with this page size (it must divide the model's), for
    #: requests on the HiSparse path (``RoomPlan.hisparse``); None: no host pool.
    host_page_size: int | None = None
    #: The host pool lives in a ``kvwire_hisparse.shm.SharedHostPool`` (same-host ``mapped``
    #: path of the ``hisparse`` host staging; needs kvwire-hisparse).
    host_shared: bool = False
    #: With ``device='cuda'``: odd KV buffers of every rank live in pinned host memory, the
    #: others on the GPU, so transfers mix memory kinds (segments by kind).
    mixed_kinds: bool = False
    #: Fill and check every element (the default). Off for throughput benchmarks: pools are
    #: filled once at start and decode does not check, so the harness costs no CPU per request.
    verify: bool = True
    #: Rank processes create their ``KVManager`` without ``agent_name``, as an engine following
    #: docs/engine-integration.md does (kvwire's unique default names); False: the harness
    #: names them ``{role}{inst}-pp{pp}-tp{tp}``.
    default_names: bool = False
    #: Rank processes hand their KV arrays to ``KVManager`` (``kv_tensors``); False: they pass
    #: none, as the vLLM and SGLang adapters do (bulk staging views the layout's buffers).
    kv_tensors: bool = True
    #: Prefill instances of the same shape, each with its own bootstrap service (run by its
    #: rank 0); a request picks one with ``RoomPlan.prefill_instance``.
    prefill_instances: int = Field(default=1, ge=1)
    #: DP attention on the prefill instance: ``prefill_dp`` groups of ``prefill_tp x
    #: prefill_pp`` ranks sharing its bootstrap service, registered with their ``dp_rank``. A
    #: request goes to DP rank ``room % prefill_dp`` (decode's default pick); the ranks of DP
    #: rank ``d`` are the harness's prefill "instance" ``d`` (:attr:`RoomPlan.prefill_instance`).
    prefill_dp: int = Field(default=1, ge=1)
    #: A rank's engine loop period while it has requests in flight (the engine's scheduler
    #: step: it polls its requests, then sleeps this long; benchmarks use a short one). The
    #: default matches the earlier loop, whose 0.5 ms wait was rounded up to 1 ms.
    engine_step_s: float = Field(default=0.001, gt=0, le=0.1)
    #: The engine loop runs Python for ``engine_step_s`` between polls instead of sleeping:
    #: a scheduler that never sleeps, as a serving engine's is under load. It gives up the
    #: GIL when the interpreter's switch interval asks it to and for the instant of each
    #: poll between steps (a thread woken then may take it), so every kvwire thread
    #: that waits outside the GIL (a socket, a CUDA call) may wait up to that interval to
    #: run again.
    engine_busy: bool = False
    #: Pin each rank process to its own equal share of the CPUs (in rank order; benches on
    #: the many-core GPU hosts, where unpinned runs of one tree varied by 1.5x).
    pin_cpus: bool = False
    #: ``sys.setswitchinterval`` in every rank process (None: the interpreter's default,
    #: 5 ms), as an engine that sets it would.
    switch_interval_s: float | None = Field(default=None, gt=0, le=0.1)
    #: Network namespace per role ("prefill", "decode") or per instance of a role
    #: ("decode:1", before the role's): its rank processes join it before opening any
    #: socket (:mod:`kvwire.testing.netns`). Empty: every rank on this host.
    netns: dict[str, str] = Field(default_factory=dict)
    #: A role's (or an instance's, "decode:1") own config in place of ``config`` (e.g. its
    #: addresses in a namespace).
    role_config: dict[str, KVWireConfig] = Field(default_factory=dict)
    #: Roles whose KV pages are head-major (``[slots, heads, page, dim]``; see
    #: :attr:`KVLayout.head_major <kvwire.layout.KVLayout.head_major>`).
    head_major: tuple[str, ...] = ()
    #: Roles whose pools keep K and V side by side in one buffer per layer (see
    #: :attr:`KVLayout.kv_fused <kvwire.layout.KVLayout.kv_fused>`).
    kv_fused: tuple[str, ...] = ()
    #: Roles whose pools keep K's page then V's page in each slot of one buffer per layer
    #: (see :attr:`KVLayout.kv_in_slot <kvwire.layout.KVLayout.kv_in_slot>`).
    kv_in_slot: tuple[str, ...] = ()
    #: ``host:port`` of a standalone bootstrap service (``kvwire bootstrap``) that every
    #: rank uses instead of one run by prefill rank 0 (one prefill instance only).
    bootstrap_addr: str | None = None
    #: Buffer groups every rank registers beside its KV pool, by name from
    #: :data:`~kvwire.testing.cluster_groups.GROUP_KINDS` (state split by heads, replicated
    #: state, multi-section state, sliding window, draft pages), filled and checked element
    #: by element like the KV (:mod:`kvwire.testing.cluster_groups`). Host memory; one page
    #: size on both sides; ``aux_slots`` state slots per rank.
    groups: tuple[str, ...] = ()

    @model_validator(mode="after")
    def _check_groups(self) -> Self:
        from kvwire.testing.cluster_groups import GROUP_KINDS

        unknown = set(self.groups) - set(GROUP_KINDS)
        if unknown:
            raise ValueError(f"unknown groups {sorted(unknown)}; known: {sorted(GROUP_KINDS)}")
        if self.groups and (self.decode_page_size not in (None, self.model.page_size)):
            raise ValueError("groups: the harness builds them with one page size on both sides")
        return self

    @model_validator(mode="after")
    def _check_gpus(self) -> Self:
        if self.gpus is not None and (not self.gpus or min(self.gpus) < 0):
            raise ValueError(f"gpus: CUDA device indices (>= 0), at least one; got {self.gpus}")
        return self

    @property
    def prefill_ranks(self) -> int:
        """Prefill rank processes: ``max(instances, DP) x PP x TP``."""
        return max(self.prefill_instances, self.prefill_dp) * self.prefill_pp * self.prefill_tp

    def config_for(self, role: str, inst: int = 0) -> KVWireConfig:
        """The config a rank of ``role``'s instance ``inst`` runs with."""
        return self.role_config.get(f"{role}:{inst}") or self.role_config.get(role, self.config)

    def netns_for(self, role: str, inst: int = 0) -> str | None:
        """The network namespace of ``role``'s instance ``inst`` (None: this host's)."""
        return self.netns.get(f"{role}:{inst}") or self.netns.get(role)

    def decode_model(self) -> ModelSpec:
        """The model as decode ranks hold it (their own page size)."""
        if self.decode_page_size is None:
            return self.model
        return self.model.model_copy(update={"page_size": self.decode_page_size})


def rank_gpu(
    spec: ClusterSpec, role: str, inst: int, tp: int, pp: int, device_count: int
) -> int | None:
    """The CUDA device index of a rank (``inst`` is its prefill instance or DP rank, or its
    decode instance), or None when ranks are not placed (``device`` is not ``'cuda'``).

    Ranks are numbered prefill first (instance, then PP stage, then TP rank), decode after
    them, and take ``spec.gpus`` (default ``range(device_count)``) round robin: with two GPUs
    a 1P1D pair is on GPU 0 and GPU 1, a TP 2 prefill and TP 2 decode on 0, 1, 0, 1. Called in
    each rank process (:func:`~kvwire.testing.cluster_rank.rank_main`) with the devices it
    sees, before it allocates anything on a GPU."""
    if spec.device != "cuda":
        return None
    gpus = spec.gpus if spec.gpus is not None else tuple(range(device_count))
    if not gpus:
        raise ClusterError("device='cuda' but no CUDA device is visible")
    bad = [g for g in gpus if g >= device_count]
    if bad:
        raise ClusterError(f"gpus {list(spec.gpus or ())}: {bad} not among {device_count} devices")
    return gpus[rank_number(spec, role, inst, tp, pp) % len(gpus)]


def rank_number(spec: ClusterSpec, role: str, inst: int, tp: int, pp: int) -> int:
    """A rank's place among the cluster's ranks: prefill first (instance, then PP stage,
    then TP rank), decode after them."""
    if role == "prefill":
        return (inst * spec.prefill_pp + pp) * spec.prefill_tp + tp
    return spec.prefill_ranks + (inst * spec.decode_pp + pp) * spec.decode_tp + tp


def rank_cpus(
    spec: ClusterSpec, role: str, inst: int, tp: int, pp: int, cpus: list[int]
) -> list[int] | None:
    """With :attr:`ClusterSpec.pin_cpus`, the CPUs a rank process keeps (of the sorted
    ``cpus`` it may use): an equal, disjoint share per rank in rank order (None: not pinned,
    or fewer CPUs than ranks). Called in each rank process before its threads start."""
    if not spec.pin_cpus:
        return None
    ranks = spec.prefill_ranks + spec.decode_instances * spec.decode_pp * spec.decode_tp
    share = len(cpus) // ranks
    if share < 1:
        return None
    n = rank_number(spec, role, inst, tp, pp)
    return cpus[n * share : (n + 1) * share]


def pin_rank(spec: ClusterSpec, role: str, inst: int, tp: int, pp: int) -> list[int] | None:
    """In a rank process, before it starts threads: keep it on :func:`rank_cpus` (if any);
    returns them."""
    cpus = rank_cpus(spec, role, inst, tp, pp, sorted(os.sched_getaffinity(0)))
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    return cpus


class RoomPlan(BaseModel):
    """One request of a workload, as every rank sees it."""

    model_config = ConfigDict(extra="forbid")

    room: int
    num_pages: int = Field(ge=0)
    #: Page counts of the chunks of chunked prefill (sum = num_pages; may contain zeros).
    chunks: list[int]
    #: Leading pages already cached on decode (not transferred).
    cached_pages: int = 0
    decode_instance: int = 0
    #: The prefill instance serving the request (its bootstrap address is the one decode uses).
    prefill_instance: int = 0
    prefill_abort: bool = False
    decode_abort: bool = False
    #: Prefill waits this long before sending its last chunk.
    stall_s: float = 0.0
    #: Fill and check every element of this request (None: the cluster's ``verify``).
    verify: bool | None = None
    #: Decode receives into its host pool (HiSparse path); ``trim`` host pages of the last
    #: prefill page do not exist (a partial last page).
    hisparse: bool = False
    trim: int = 0
    #: Prefill sends each chunk layer-wise (``send(..., layerwise=True)``, then marks this
    #: rank's layers one by one with ``layer_ready``).
    layerwise: bool = False
    #: Prefill inits and sends without waiting for the decode ranks' asks (an engine that
    #: computes first, as vLLM's prefill does): each decode rank gets the chunks once it asks.
    send_first: bool = False

    def verified(self, spec: ClusterSpec) -> bool:
        """Whether this request is filled and checked."""
        return spec.verify if self.verify is None else self.verify


@dataclass
class RankReport:
    """What one rank reported for one request."""

    role: str
    rank: int
    status: int
    error: str | None
    mismatches: int = 0
    aux_ok: bool = True
    latency_s: float = 0.0
    bytes: int = 0
    descriptors: int = 0
    #: Decode engine hooks seen for the request (HiSparse path), in order.
    hooks: tuple[str, ...] = ()
    #: The instance of ``role`` this rank belongs to.
    inst: int = 0
    #: ``time.monotonic()`` when this rank's poll first returned the terminal status (the
    #: system-wide monotonic clock: comparable between processes of one host, and with the
    #: time :meth:`Cluster.kill` returns).
    t_done: float = 0.0
    #: The request's :class:`~kvwire.session.metrics.RequestMetrics` on this rank (prefill:
    #: sums over its chunks of worker-queue wait, mapping + submit, submit -> completion).
    queue_s: float = 0.0
    post_s: float = 0.0
    transfer_s: float = 0.0
    #: A failed decode request's :class:`~kvwire.session.FailureReport`: its cause, the
    #: positions of the pages it calls good and missing, and the elements of the good pages
    #: that differ from their encoding (must be 0). Empty cause: no report (not failed).
    cause: str = ""
    good_pages: tuple[int, ...] = ()
    missing_pages: tuple[int, ...] = ()
    good_mismatches: int = 0
    #: The request's stage marks on this rank (``RequestMetrics.marks``, ``time.perf_counter()``
    #: values, comparable across the processes of one host) plus the harness's own:
    #: ``created`` (sender or receiver made) and ``seen`` (its poll returned the terminal
    #: status).
    marks: dict[str, float] = field(default_factory=dict)


@dataclass
class RequestResult:
    """Every rank's report for one request."""

    plan: RoomPlan
    reports: list[RankReport] = field(default_factory=list)
    t_start: float = 0.0
    t_end: float = 0.0

    @property
    def ok(self) -> bool:
        """Success on every rank, every element verified, aux rows intact."""
        return all(r.status == 4 and r.mismatches == 0 and r.aux_ok for r in self.reports)

    @property
    def mismatches(self) -> int:
        return sum(r.mismatches for r in self.reports)

    @property
    def bytes(self) -> int:
        return sum(r.bytes for r in self.reports if r.role == "prefill")

    @property
    def descriptors(self) -> int:
        return sum(r.descriptors for r in self.reports if r.role == "prefill")

    @property
    def latency_s(self) -> float:
        """Decode-side latency: receiver creation to Success (max over decode ranks)."""
        return max((r.latency_s for r in self.reports if r.role == "decode"), default=0.0)
