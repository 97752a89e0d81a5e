"""KV events for routers: decode what kvtier-server (and vLLM) publish on ZMQ.

kvtier's publisher (include/kvtier/kv_events/publisher.hpp, docs/kv-events.md) speaks vLLM's
KV event protocol: a PUB socket sends multipart messages ``[topic, seq, payload]`` (seq an
8-byte big-endian int64, one per batch, from 0), the payload a msgpack ``EventBatch`` of
``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` events; a ROUTER socket replays the
batches it still holds from a sequence number, then ``END_SEQ`` (-1).

* :func:`decode_batch` turns a payload into :class:`EventBatch` (dataclasses with vLLM's
  field names), whichever form it is in: the batch a map or an array, each event a map with
  a ``"type"`` key (current vLLM, our default) or an array with the tag first (vLLM before
  its 2026-06 change). A field that is absent (left out as a default, or unknown to an older
  sender) is None.
* :class:`Subscriber` reads batches from a publisher and asks for replays; a replay that
  asked for batches no longer held ends with :class:`ReplayGap` in :attr:`Subscriber.last_replay_gap`.

Needs ``msgpack`` (Debian: python3-msgpack) and, for :class:`Subscriber`, ``zmq``
(python3-zmq). Both are imported when first used: ``import kvtier`` never needs them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence, Set, Tuple, Union

#: A block hash as the engine's router computes it: bytes (newer vLLM) or an int.
BlockHash = Union[bytes, int]

#: The sequence number of the message that ends a replay.
END_SEQ = -1

__all__ = [
    "END_SEQ",
    "AllBlocksCleared",
    "BlockHash",
    "BlockIndex",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "KVEvent",
    "ReplayGap",
    "Subscriber",
    "batch_from_object",
    "decode_batch",
    "decode_replay_end",
    "event_from_object",
]


@dataclass
class BlockStored:
    """Blocks entered a cache (a tier: ``medium``). Fields in vLLM's order."""

    block_hashes: List[BlockHash]
    parent_block_hash: Optional[BlockHash] = None
    token_ids: Optional[List[int]] = None
    block_size: Optional[int] = None
    lora_id: Optional[int] = None
    medium: Optional[str] = None
    lora_name: Optional[str] = None
    #: One entry per block: a tuple of extra keys, or None.
    extra_keys: Optional[List[Optional[Tuple[Any, ...]]]] = None
    group_idx: Optional[int] = None
    kv_cache_spec_kind: Optional[str] = None
    kv_cache_spec_sliding_window: Optional[int] = None


@dataclass
class BlockRemoved:
    """Blocks left a cache (a tier: ``medium``)."""

    block_hashes: List[BlockHash]
    medium: Optional[str] = None
    group_idx: Optional[int] = None


@dataclass
class AllBlocksCleared:
    """The cache was emptied."""


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


@dataclass
class EventBatch:
    ts: float
    events: List[KVEvent]
    data_parallel_rank: Optional[int] = None


@dataclass
class ReplayGap:
    """A replay asked from ``requested_seq``, but the publisher held batches only from
    ``first_seq`` on: those in between are lost for good (a router rebuilds from a listing)."""

    requested_seq: int
    first_seq: int


# The events by tag, with their fields in vLLM's declaration order (the array form's order).
_EVENT_FIELDS: Dict[str, Tuple[type, Tuple[str, ...]]] = {
    "BlockStored": (
        BlockStored,
        (
            "block_hashes",
            "parent_block_hash",
            "token_ids",
            "block_size",
            "lora_id",
            "medium",
            "lora_name",
            "extra_keys",
            "group_idx",
            "kv_cache_spec_kind",
            "kv_cache_spec_sliding_window",
        ),
    ),
    "BlockRemoved": (BlockRemoved, ("block_hashes", "medium", "group_idx")),
    "AllBlocksCleared": (AllBlocksCleared, ()),
}


def _unpack(payload: bytes) -> Any:
    import msgpack  # python3-msgpack; imported here so that `import kvtier` does not need it

    # raw=False: str as str, bin as bytes; strict_map_key=False: vLLM's maps only have str
    # keys, but a decoder for routers should not refuse what msgpack allows.
    return msgpack.unpackb(payload, raw=False, strict_map_key=False)


def event_from_object(obj: Any) -> KVEvent:
    """One event from its unpacked form: a map with ``"type"`` or an array with the tag first."""
    if isinstance(obj, dict):
        tag = obj.get("type")
        values = obj
    elif isinstance(obj, (list, tuple)) and obj:
        tag = obj[0]
        values = None
    else:
        raise ValueError(f"a KV event is a map or a non-empty array, not {obj!r}")
    if tag not in _EVENT_FIELDS:
        raise ValueError(f"unknown KV event type {tag!r} (known: {', '.join(_EVENT_FIELDS)})")
    cls, names = _EVENT_FIELDS[tag]
    if values is None:  # array: by position; missing trailing fields (defaults) are None
        values = dict(zip(names, obj[1:]))
    kwargs = {name: values.get(name) for name in names}
    if kwargs.get("extra_keys") is not None:
        kwargs["extra_keys"] = [None if k is None else tuple(k) for k in kwargs["extra_keys"]]
    if "block_hashes" in kwargs and kwargs["block_hashes"] is None:
        kwargs["block_hashes"] = []
    return cls(**kwargs)


def batch_from_object(obj: Any) -> EventBatch:
    """A batch from its unpacked form: a map (map form) or an array (array form)."""
    if isinstance(obj, dict):
        ts, events, rank = obj.get("ts"), obj.get("events"), obj.get("data_parallel_rank")
    elif isinstance(obj, (list, tuple)) and len(obj) >= 2:
        ts, events = obj[0], obj[1]
        rank = obj[2] if len(obj) > 2 else None
    else:
        raise ValueError(f"a KV event batch is a map or an array of 2 or 3, not {obj!r}")
    if ts is None or events is None:
        raise ValueError("a KV event batch needs ts and events")
    return EventBatch(float(ts), [event_from_object(e) for e in events], rank)


def decode_batch(payload: bytes) -> EventBatch:
    """The :class:`EventBatch` of a message's payload, in either form."""
    return batch_from_object(_unpack(payload))


def decode_replay_end(payload: bytes) -> Optional[ReplayGap]:
    """The gap an END_SEQ message reports: None for an empty payload (no gap; vLLM's END is
    always empty), a :class:`ReplayGap` for kvtier's ``{"type": "ReplayGap", ...}``."""
    if not payload:
        return None
    obj = _unpack(payload)
    if not isinstance(obj, dict) or obj.get("type") != "ReplayGap":
        raise ValueError(f"an END_SEQ payload kvtier does not write: {obj!r}")
    return ReplayGap(int(obj["requested_seq"]), int(obj["first_seq"]))


def _seq_bytes(seq: int) -> bytes:
    return int(seq).to_bytes(8, "big", signed=True)


def _seq_of(frame: bytes) -> int:
    if len(frame) != 8:
        raise ValueError(f"a sequence number is 8 bytes, not {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)


class Subscriber:
    """A SUB socket connected to a publisher's ``endpoint`` (subscribed to ``topic``, every
    message by default) and, for :meth:`replay`, its ``replay_endpoint``.

    A SUB receives only what is published after its subscription reached the publisher
    (ZMQ, some milliseconds after connecting): ask for a replay to fill what came before."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: Optional[str] = None,
        topic: str = "",
        context: Any = None,
    ) -> None:
        import zmq  # python3-zmq; imported here so that `import kvtier` does not need it

        self._zmq = zmq
        self._ctx = context if context is not None else zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.connect(endpoint)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode("utf-8"))
        self.replay_endpoint = replay_endpoint
        #: The topic of the last message :meth:`recv` returned.
        self.last_topic: Optional[bytes] = None
        #: Set by each :meth:`replay` that ended: the gap it reported, or None.
        self.last_replay_gap: Optional[ReplayGap] = None

    def recv(self, timeout_ms: Optional[int] = None) -> Optional[Tuple[int, EventBatch]]:
        """The next ``(seq, batch)``, or None when nothing came within ``timeout_ms`` (None:
        wait as long as it takes)."""
        if timeout_ms is not None and not self._sub.poll(timeout_ms, self._zmq.POLLIN):
            return None
        frames: Sequence[bytes] = self._sub.recv_multipart()
        if len(frames) != 3:
            raise ValueError(f"a KV event message has 3 frames, not {len(frames)}")
        self.last_topic = frames[0]
        return _seq_of(frames[1]), decode_batch(frames[2])

    def replay(self, since_seq: int, timeout_ms: int = 10_000) -> Iterator[Tuple[int, EventBatch]]:
        """Asks for every batch from ``since_seq`` on and yields ``(seq, batch)`` until
        END_SEQ; then :attr:`last_replay_gap` says whether batches were lost. Raises
        TimeoutError when the publisher does not answer within ``timeout_ms`` (each message)."""
        if not self.replay_endpoint:
            raise ValueError("this Subscriber has no replay_endpoint")
        zmq = self._zmq
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(self.replay_endpoint)
            # The empty delimiter first, as a REQ socket would send it (vLLM's clients do).
            dealer.send_multipart([b"", _seq_bytes(since_seq)])
            while True:
                if not dealer.poll(timeout_ms, zmq.POLLIN):
                    raise TimeoutError(f"no replay answer from {self.replay_endpoint} within {timeout_ms} ms")
                frames = dealer.recv_multipart()
                if len(frames) != 3 or frames[0] != b"":
                    raise ValueError(f"a replay answer is [b'', seq, payload], not {len(frames)} frames")
                seq = _seq_of(frames[1])
                if seq == END_SEQ:
                    self.last_replay_gap = decode_replay_end(frames[2])
                    return
                yield seq, decode_batch(frames[2])
        finally:
            dealer.close(linger=0)

    def close(self) -> None:
        self._sub.close(linger=0)

    def __enter__(self) -> "Subscriber":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class BlockIndex:
    """What a router learns from one publisher: per medium the blocks held now, and for every
    block ever stored its tokens and parent (so a chunk can be named by its whole prefix).

    Feed it batches in sequence order with :meth:`apply`, or let :meth:`follow` read a
    :class:`Subscriber` (live batches, a replay from 0 on any discontinuity). A restarted
    publisher starts a new stream (seq 0, ``AllBlocksCleared`` first); seq alone cannot tell
    it from a late duplicate, so whoever knows of a restart (kvtier-server's boot token in
    ``/healthz``) calls :meth:`resync`."""

    def __init__(self) -> None:
        #: medium -> the block hashes held there now.
        self.by_medium: Dict[Optional[str], Set[BlockHash]] = {}
        #: block hash -> (parent block hash, its token ids), for every block ever stored.
        self.blocks: Dict[BlockHash, Tuple[Optional[BlockHash], Tuple[int, ...]]] = {}
        #: The sequence number expected next (None: nothing applied yet).
        self.next_seq: Optional[int] = None
        #: Replays that reported lost batches (their blocks are unknown to this index).
        self.gaps: List[ReplayGap] = []

    def apply(self, batch: EventBatch) -> None:
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                bs = ev.block_size or 0
                held = self.by_medium.setdefault(ev.medium, set())
                for i, h in enumerate(ev.block_hashes):
                    parent = ev.parent_block_hash if i == 0 else ev.block_hashes[i - 1]
                    tokens = tuple(ev.token_ids[i * bs : (i + 1) * bs]) if ev.token_ids is not None and bs else ()
                    self.blocks[h] = (parent, tokens)
                    held.add(h)
            elif isinstance(ev, BlockRemoved):
                held = self.by_medium.get(ev.medium, set())
                for h in ev.block_hashes:
                    held.discard(h)
            elif isinstance(ev, AllBlocksCleared):
                self.by_medium.clear()

    def prefix_tokens(self, block: BlockHash) -> List[int]:
        """Every token from the sequence's start to the end of ``block`` (its parents' first)."""
        parts: List[Tuple[int, ...]] = []
        seen: Set[BlockHash] = set()
        h: Optional[BlockHash] = block
        while h is not None and h not in seen:
            seen.add(h)
            parent, tokens = self.blocks[h]
            parts.append(tokens)
            h = parent
        return [t for part in reversed(parts) for t in part]

    def resync(self, sub: "Subscriber", timeout_ms: int = 10_000) -> None:
        """Forgets what is held and rebuilds it from a replay of everything the publisher
        keeps (from seq 0)."""
        self.by_medium.clear()
        self.next_seq = None
        for seq, batch in sub.replay(0, timeout_ms):
            self.apply(batch)
            self.next_seq = seq + 1
        if sub.last_replay_gap is not None:
            self.gaps.append(sub.last_replay_gap)
        if self.next_seq is None:
            self.next_seq = 0

    def follow(self, sub: "Subscriber", idle_ms: int = 200) -> int:
        """Applies live batches until none comes for ``idle_ms``; returns how many. A batch
        past the one expected (a gap: ZMQ dropped, or the subscriber joined late) resyncs."""
        n = 0
        while True:
            got = sub.recv(idle_ms)
            if got is None:
                return n
            seq, batch = got
            if self.next_seq is not None and seq < self.next_seq:
                continue  # already applied (a replay covered it)
            if self.next_seq is None or seq > self.next_seq:
                self.resync(sub)
                continue
            self.apply(batch)
            self.next_seq = seq + 1
            n += 1
