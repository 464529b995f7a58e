"""Conformance suite for transfer backends (and the core index mappers), for pytest.

A backend plugin runs the suite against itself with a test file of a few lines::

    from kvwire.testing.conformance import BackendConformance, MapperConformance

    class TestMyConformance(BackendConformance):
        backend_name = "my-backend"          # the name the plugin registers
        backend_options = {}                 # options for its options model
        # optional: options that make a dead peer fail fast (default: derived, see below)
        fast_failure_options = {"transfer_timeout_s": 2.0}

    class TestMyMappers(MapperConformance):  # optional: core mappers' tables through it
        backend_name = "my-backend"
        backend_options = {}

Transfers cross a real process boundary: the test process holds a *local* agent (created
with :func:`kvwire.selection.create_backend`), and a :class:`~kvwire.testing.remote.RemoteAgent`
runs the *target* agent in a spawned child. Both are class-scoped, so a class spawns one
target (plus one short-lived victim for the peer-death test). ``backend_options`` must let
several agents run on one host (e.g. no fixed port). Tests that need a capability the
backend does not declare (``read``, ``notifications``) are skipped and say why.

Optional class attributes: ``fast_failure_options`` (extra options for the peer-death test;
``None`` derives ``{"transfer_timeout_s": 2.0}`` when the options model has that field),
``peer_failure_timeout_s`` (how long a transfer to a killed peer may stay PENDING),
``one_sided_writes`` (True if a WRITE can complete without the target's CPU, as with RDMA:
then a transfer that finished before the peer was killed skips that test instead of failing
it), ``large_transfer_bytes``, ``many_rows``/``many_row_bytes``, ``transfer_timeout_s``
(bound for an ordinary transfer) and ``close_timeout_s`` (bound for ``close()``).

What each test of :class:`BackendConformance` proves:

* ``test_capabilities_and_options``: the class declares a name, ``BackendCapabilities`` and an
  options model that accepts ``backend_options``.
* ``test_register_deregister``: regions can be registered and deregistered; overlapping
  regions (with a registered one, or within one call) are refused with ``LayoutError`` and
  leave the registry unchanged; a deregistered region can no longer be prepared.
* ``test_handle_lifecycle``: prepare/submit/poll/release: ``poll`` returns ``XferState``
  members (never strings or ints), DONE is sticky, a second ``release`` and a ``poll`` after
  release raise ``HandleError``, a released pair cannot be submitted or released again, and
  ``live_handles``/``live_prepared`` return to their baseline.
* ``test_write_random_index_sets``: WRITE of identity, reversed, random permutations,
  random subsets, repeated source rows, single rows and contiguous runs, with fresh random
  data each round: every byte of the target buffer equals a local model, including the gaps
  between rows that must stay untouched.
* ``test_write_mixed_row_lengths``: rows of 1 B to 40 KB, matched within length classes, and
  a round whose rows are contiguous on both sides (mergeable): byte-exact target.
* ``test_read_random_index_sets``: the same for READ into local memory; the remote source is
  not modified.
* ``test_notification_after_data_exactly_once``: each notification arrives once, from the
  initiator, and the target's buffer digest taken when it was drained equals the expected
  final content (the data landed first); nothing more arrives afterwards.
* ``test_concurrent_notifications_exactly_once``: several transfers in flight at once each
  deliver their notification exactly once, and all their data is in place.
* ``test_page_writes``: a backend that declares ``page_writes`` writes chunks in page form
  (head-slice geometry: two slices per source row, different row pitches) byte for byte as
  their rows, each notification after its data; out-of-range pages raise
  ``DescriptorError``. A backend without it raises ``CapabilityError`` from ``submit_pages``.
* ``test_concurrent_submitters``: four worker threads each submit and poll their own WRITEs
  (disjoint local and remote rows, one shared prepared pair, a notification each) to the same
  peer while a progress thread calls ``progress``/``get_notifications`` and a handshake
  thread prepares and releases a second pair for that peer: every round's bytes are verified
  as soon as it is DONE and the whole span at the end, each notification arrives exactly
  once, and ``live_handles``/``live_prepared`` return to their baseline.
* ``test_notification_after_large_transfer``: the notification of a large (multi-part, for
  engines that split) WRITE is delivered only once all of its bytes are in place.
* ``test_large_single_descriptor``: one ``large_transfer_bytes`` row (64 MiB) WRITE (and
  READ) arrives intact and the guard bytes around it are untouched.
* ``test_many_descriptors``: 8192 non-contiguous 512 B rows, permuted, WRITE (and READ):
  byte-exact over the whole span, gaps included.
* ``test_out_of_region_refused``: remote rows reaching into unregistered guard bytes are
  refused (``DescriptorError`` at prepare, or the transfer ends FAILED with an error); the
  target buffer, guards included, is unchanged. Local rows outside local registrations are
  refused at prepare.
* ``test_malformed_requests_refused``: tables of the wrong type, dtype or shape, empty
  tables, zero-length rows, and index arrays out of range, of different lengths, of the
  wrong dtype or rank, empty, or pairing rows of different lengths raise
  ``DescriptorError``; nothing is written and no handle leaks.
* ``test_peer_removal``: a transfer pending at ``remove_peer`` ends promptly, the old pair
  can no longer be submitted, the removed peer cannot be prepared, and adding it again makes
  transfers work.
* ``test_initiator_in_child``: the child initiates WRITE (and READ) to the test process's
  agent: the other direction works, and the local agent's notification arrives after data.
* ``test_close_with_transfers_in_flight``: ``close()`` with several large transfers in
  flight returns within ``close_timeout_s``; handles then poll DONE or FAILED and release
  cleanly; submitting after close raises; the target is still healthy.
* ``test_peer_killed_mid_transfer``: a transfer to a peer SIGKILLed (after SIGSTOP, so the
  transfer is surely pending) ends FAILED with an error within ``peer_failure_timeout_s``;
  the dead peer can be removed and the agent closed promptly.

:class:`MapperConformance` (``test_tables_and_chunks``) checks, for EqualTPMapper, MLAMapper
and HeadSliceMapper on several layout pairs (equal TP, gather, scatter, GQA replication, MLA
dummy senders): tables are ``N x 3`` ``uint64`` inside the layouts' buffers; chunk index
arrays are ``int64``, in range and of equal length; paired rows have equal lengths, join the
same layer and K/V and pair ``src_pages[i]`` with ``dst_pages[i]``; destination rows do not
overlap; the byte count is right; malformed page lists raise ``DescriptorError``. Then
(``test_chunk_transfer``) chunks mapped by each kind of mapper go through the backend across
the two processes and every destination byte is checked
against a model built from head ranges, not from the tables.
"""

from __future__ import annotations

from kvwire.testing.conformance.common import wait_terminal
from kvwire.testing.conformance.concurrency import ConcurrencyConformance
from kvwire.testing.conformance.failure import FailureConformance
from kvwire.testing.conformance.mappers import MapperCase, MapperConformance
from kvwire.testing.conformance.notifications import NotificationConformance
from kvwire.testing.conformance.pages import PageConformance
from kvwire.testing.conformance.register import RegisterConformance
from kvwire.testing.conformance.transfer import TransferConformance

__all__ = [
    "BackendConformance",
    "ConcurrencyConformance",
    "FailureConformance",
    "MapperCase",
    "MapperConformance",
    "NotificationConformance",
    "PageConformance",
    "RegisterConformance",
    "TransferConformance",
    "wait_terminal",
]


class BackendConformance(
    RegisterConformance,
    TransferConformance,
    NotificationConformance,
    PageConformance,
    ConcurrencyConformance,
    FailureConformance,
):
    """Conformance tests every transfer backend must pass; subclass as ``Test...``. A plugin
    whose engine lacks a capability family may subclass only the mixins that apply (each
    inherits the options and the fixture from ``SuiteBase``)."""
