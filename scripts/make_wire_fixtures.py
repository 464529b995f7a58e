"""Write encoded control messages of the current protocol version as test fixtures.

Run once per released protocol version (never overwrite an older version's folder):

    uv run python scripts/make_wire_fixtures.py

``core/tests/test_wire.py`` checks that every stored version still parses.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from kvwire.control.wire import (
    PROTOCOL_MAJOR,
    PROTOCOL_MINOR,
    BackendOffer,
    ChunkNote,
    Codec,
    Completion,
    Evicted,
    Failure,
    Goodbye,
    Heartbeat,
    Hello,
    HelloAck,
    HelloReject,
    Message,
    StagingMessage,
    TransferRequest,
    WritesDone,
    WritesQuery,
    pages_to_bytes,
)
from kvwire.layout import (
    BufferGroup,
    GroupSection,
    KVLayout,
    MemoryRegion,
    ModelSpec,
    RankPosition,
)

SECRET = b"fixture-secret"


def samples() -> list[Message]:
    """One message of every kind, with every field set to a recognisable value."""
    model = ModelSpec(num_layers=2, total_kv_heads=4, head_dim=8, dtype="bfloat16", page_size=4)
    rank = RankPosition(tp_size=2, tp_rank=1)
    bufs = tuple(
        MemoryRegion(addr=0x10000 * (i + 1), length=128 * 16, item_len=128) for i in range(4)
    )
    groups = (
        BufferGroup(
            name="mamba_ssm",
            kind="state",
            num_layers=1,
            total_heads=4,
            head_elems=16,
            dtype="float32",
            buffers=(MemoryRegion(addr=0x200000, length=128 * 8, item_len=128),),
        ),
        BufferGroup(
            name="swa",
            kind="window",
            num_layers=1,
            per_layer=2,
            total_heads=4,
            head_elems=8,
            page_size=4,
            window=64,
            buffers=tuple(
                MemoryRegion(addr=0x300000 + 0x10000 * i, length=128 * 8, item_len=128)
                for i in range(2)
            ),
        ),
        BufferGroup(  # 1.6: a GDN conv state, q | k | v channels sharded separately
            name="gdn_conv",
            kind="state",
            num_layers=1,
            sections=(
                GroupSection(total_heads=2, head_elems=24),
                GroupSection(total_heads=2, head_elems=24),
                GroupSection(total_heads=4, head_elems=24),
            ),
            buffers=(MemoryRegion(addr=0x400000, length=192 * 8, item_len=192),),
        ),
    )
    layout = KVLayout(model=model, rank=rank, buffers=bufs, groups=groups)
    aux = [MemoryRegion(addr=0x900000, length=64 * 8, item_len=64)]
    return [
        Hello(
            session="d-session",
            agent="decode-dp0-pp0-tp1",
            endpoint="tcp://127.0.0.1:5001",
            rank=rank,
            layout=layout,
            layout_hash=layout.compatibility_hash(),
            backend="tcp",
            backend_metadata=b"\x01meta",
            aux_regions=aux,
            host_layout=layout,
            host_staging={"identity": "boot-id:1000", "pools": [{"path": "/dev/shm/x"}]},
            pools={"host": layout, "ssd": layout},
            pool_staging={"host": {"identity": "boot-id:1000", "pools": [{"path": "/dev/shm/x"}]}},
            checksum=True,
            backends=[
                BackendOffer(name="tcp", metadata=b"\x01meta"),
                BackendOffer(name="nixl", metadata=b"\x02nixl-meta"),
            ],
            host={"boot_id": "0f1e2d3c", "hostname": "decode-host"},
            aux_in_note=True,
            local_control="kvwire-ctl-" + "0123456789abcdef" * 2,
        ),
        HelloAck(
            session="p-session",
            agent="prefill-dp0-pp0-tp0",
            endpoint="tcp://127.0.0.1:5000",
            rank=RankPosition(tp_size=1),
            sender_id=0,
            layout_hash=layout.compatibility_hash(),
            dummy=False,
            peer_session="d-session",
            layout=layout,
            staged=True,
            groups=True,
            checksum=True,
            backend="tcp",
            fallbacks=["nixl"],
            local_control="kvwire-ctl-" + "fedcba9876543210" * 2,
            group_checksum=True,  # 1.14: state notes carry the groups' sums
        ),
        HelloReject(
            session="p-session",
            peer_session="d-session",
            reason="incompatible layouts",
            problems=["page_size: prefill=4 decode=8"],
        ),
        TransferRequest(
            room=1234567890123,
            session="d-session",
            dst_pages=pages_to_bytes(np.array([5, 9, 2], dtype=np.int64)),
            aux_index=7,
            pool="host",
            group_indices={
                "state": pages_to_bytes(np.array([3], dtype=np.int64)),
                "window": pages_to_bytes(np.array([6, 1], dtype=np.int64)),
            },
            cached_tokens=16,
        ),
        Completion(room=42, sender_id=1, session="p-session", data_chunks=3, dummy=True),
        Failure(  # 1.9: a request dropped unread (the sender evicted the requester)
            room=42, session="p-session", reason="not accepted: evicted", unheard=True
        ),
        Evicted(session="p-session", peer_session="d-session", reason="no heartbeat for 3.0s"),
        Heartbeat(session="p-session", sent_at=1700000000.5),
        Goodbye(session="p-session"),
        ChunkNote(
            room=42,
            sender_id=1,
            session="p-session",
            what="kv",
            chunk_id=2,
            last=True,
            parts=2,
            part=1,
            span=(4, 6),
            num_pages=6,
            sum_layers=[0, 1],
            sums=[(1 << 64) - 1, 7],
            aux=[b"\x2a" + bytes(63), b"\x01\x02\x03\x04"],
            piece_layers=(0, 2),  # 1.12: a piece of the chunk, checked on arrival
        ),
        StagingMessage(
            session="d",
            pool="host",
            strategy="bulk",
            type="grant",
            body={"room": 42, "chunk_id": 2, "alloc_id": 9, "offset": 65536},
        ),
        WritesDone(room=42, sender_id=1, session="p"),
        WritesQuery(room=42, session="d"),
    ]


def main() -> None:
    out = Path(__file__).resolve().parents[1] / "core/tests/fixtures/wire"
    folder = out / f"v{PROTOCOL_MAJOR}.{PROTOCOL_MINOR}"
    folder.mkdir(parents=True, exist_ok=True)
    plain, signed = Codec(), Codec(SECRET)
    expect = {}
    for msg in samples():
        (folder / f"{msg.kind}.bin").write_bytes(plain.encode(msg))
        (folder / f"{msg.kind}.signed.bin").write_bytes(signed.encode(msg))
        expect[msg.kind] = msg.model_dump(mode="json")
    (folder / "expected.json").write_text(json.dumps(expect, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(expect)} messages to {folder}")


if __name__ == "__main__":
    main()
