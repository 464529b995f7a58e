"""The engine-facing API: :class:`KVManager`, :class:`KVSender`, :class:`KVReceiver`,
:class:`KVPoll`, and the :class:`FailureReport` of a failed receive."""

from kvwire.session.manager import KVManager, Role
from kvwire.session.metrics import RequestMetrics
from kvwire.session.poll import KVPoll, reduce_polls
from kvwire.session.prefill.early import RoomIssuer
from kvwire.session.receiver import KVReceiver
from kvwire.session.report import ChunkFault, FailureCause, FailureReport
from kvwire.session.sender import KVSender

__all__ = [
    "ChunkFault",
    "FailureCause",
    "FailureReport",
    "KVManager",
    "KVPoll",
    "KVReceiver",
    "KVSender",
    "RequestMetrics",
    "Role",
    "RoomIssuer",
    "reduce_polls",
]
