"""kvtier.kv_events against vLLM's KV event format (vllm/distributed/kv_events.py), and our C++
encoder and publisher against kvtier.kv_events.

The fixtures are written by hand from vLLM's field order, as msgspec encodes them with
omit_defaults and tagged events: the map form (a "type" key first, a field that has a default
and holds it left out), the array form (the tag first, trailing defaults left out) and
array_batch (an array batch of map events). They
are packed with python3-msgpack, whose bytes equal msgspec's for these values (smallest int
forms, float64, bin for bytes). tests/kv_events/kv_events_dump.cpp prints the same samples
as our encoder writes them: they must be the same bytes and decode to the same batches.
kvtier_kv_events_serve (tests/kv_events/kv_events_serve.cpp) runs our publisher for the
Subscriber's tests.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtier.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    ReplayGap,
    decode_batch,
    decode_replay_end,
    event_from_object,
)

msgpack = pytest.importorskip("msgpack", reason="python3-msgpack is not installed")

REPO = Path(__file__).resolve().parents[2]
BUILD_DIR = Path(os.environ.get("KVTIER_BUILD_DIR", REPO / "build")).resolve()

HASHES = [b"\xab" * 32, 0xFEDCBA9876543210]


def _minimal_map(**more):
    event = {
        "type": "BlockStored",
        "block_hashes": HASHES,
        "parent_block_hash": None,
        "token_ids": [1, 2, 151643],
        "block_size": 16,
        "lora_id": None,
        "medium": "CPU",
        "lora_name": None,
    }
    event.update(more)
    return event


MINIMAL_ARRAY = ["BlockStored", HASHES, None, [1, 2, 151643], 16, None, "CPU", None]
MINIMAL = BlockStored(HASHES, None, [1, 2, 151643], 16, None, "CPU", None)

FULL_MAP = {
    "type": "BlockStored",
    "block_hashes": [-5, 2**64 - 1],
    "parent_block_hash": b"\x00\x01\x02",
    "token_ids": [7, 8, 9, 10],
    "block_size": 2,
    "lora_id": 3,
    "medium": "STORAGE",
    "lora_name": "adapter",
    "extra_keys": [None, ["salt", 7, b"\x01"]],
    "group_idx": 0,
    "kv_cache_spec_kind": "full_attention",
    "kv_cache_spec_sliding_window": 4096,
}
FULL_ARRAY = ["BlockStored", [-5, 2**64 - 1], b"\x00\x01\x02", [7, 8, 9, 10], 2, 3, "STORAGE", "adapter",
              [None, ["salt", 7, b"\x01"]], 0, "full_attention", 4096]
FULL = BlockStored([-5, 2**64 - 1], b"\x00\x01\x02", [7, 8, 9, 10], 2, 3, "STORAGE", "adapter",
                   [None, ("salt", 7, b"\x01")], 0, "full_attention", 4096)

#: name -> (the batch, its map form, its array form), the samples of kv_events_dump.cpp.
SAMPLES = {
    "cleared": (
        EventBatch(1.5, [AllBlocksCleared()], 0),
        {"ts": 1.5, "events": [{"type": "AllBlocksCleared"}], "data_parallel_rank": 0},
        [1.5, [["AllBlocksCleared"]], 0],
    ),
    "removed": (
        EventBatch(2.0, [BlockRemoved([1, -1], "CPU"), BlockRemoved([b"\x01\x02"], None, 3)], 1),
        {
            "ts": 2.0,
            "events": [
                {"type": "BlockRemoved", "block_hashes": [1, -1], "medium": "CPU"},
                {"type": "BlockRemoved", "block_hashes": [b"\x01\x02"], "medium": None, "group_idx": 3},
            ],
            "data_parallel_rank": 1,
        },
        [2.0, [["BlockRemoved", [1, -1], "CPU"], ["BlockRemoved", [b"\x01\x02"], None, 3]], 1],
    ),
    "stored": (
        EventBatch(1_700_000_000.25, [MINIMAL, FULL], 0),
        {"ts": 1_700_000_000.25, "events": [_minimal_map(), FULL_MAP], "data_parallel_rank": 0},
        [1_700_000_000.25, [MINIMAL_ARRAY, FULL_ARRAY], 0],
    ),
    "no_rank": (
        EventBatch(3.0, [BlockStored(HASHES, None, [1, 2, 151643], 16, None, "CPU", None,
                                     kv_cache_spec_sliding_window=128)], None),
        {"ts": 3.0, "events": [_minimal_map(kv_cache_spec_sliding_window=128)]},
        # array_like + omit_defaults: the defaults before the last field set are written (nil)
        [3.0, [MINIMAL_ARRAY + [None, None, None, 128]]],
    ),
    "empty": (
        EventBatch(0.0, [], 0),
        {"ts": 0.0, "events": [], "data_parallel_rank": 0},
        [0.0, [], 0],
    ),
}


FORMS = ("map", "array", "array_batch")


def _fixture(name: str, form: str):
    """A sample in a form: the map and array forms as written above; array_batch is the
    array form's batch with the map form's events (vLLM's types with the events changed to
    maps and the batch still array_like)."""
    _, as_map, as_array = SAMPLES[name]
    if form == "map":
        return as_map
    if form == "array":
        return as_array
    return [as_map["ts"], as_map["events"]] + ([as_map["data_parallel_rank"]] if "data_parallel_rank" in as_map else [])


def _program(name: str) -> Path:
    return BUILD_DIR / "tests" / name


@pytest.mark.parametrize("name", sorted(SAMPLES))
@pytest.mark.parametrize("form", FORMS)
def test_hand_built_payloads_decode_to_their_batch(name, form):
    assert decode_batch(msgpack.packb(_fixture(name, form))) == SAMPLES[name][0]


def _dump() -> dict:
    program = _program("kvtier_kv_events_dump")
    if not program.is_file():
        pytest.fail(f"no {program}: build it (cmake --build {BUILD_DIR} --target kvtier_kv_events_dump)")
    out = subprocess.run([str(program)], check=True, capture_output=True, text=True, timeout=60).stdout
    lines = {}
    for line in out.splitlines():
        name, form, payload = line.split(" ")
        lines[(name, form)] = bytes.fromhex(payload)
    return lines


def test_the_dump_prints_every_sample_in_every_form():
    assert set(_dump()) == {(name, form) for name in SAMPLES for form in FORMS}


@pytest.mark.parametrize("name", sorted(SAMPLES))
@pytest.mark.parametrize("form", FORMS)
def test_our_encoder_writes_the_bytes_msgspec_writes(name, form):
    batch = SAMPLES[name][0]
    ours = _dump()[(name, form)]
    expected = msgpack.packb(_fixture(name, form))
    # Field by field first (a clearer failure), then byte for byte.
    assert msgpack.unpackb(ours, raw=False) == msgpack.unpackb(expected, raw=False)
    assert ours == expected
    assert decode_batch(ours) == batch


def test_the_map_form_keys_come_in_vllm_declaration_order_with_type_first():
    ours = msgpack.unpackb(_dump()[("stored", "map")], raw=False)
    assert list(ours) == ["ts", "events", "data_parallel_rank"]
    assert list(ours["events"][1]) == ["type"] + list(BlockStored.__dataclass_fields__)


def test_events_from_older_senders_without_the_newer_fields_decode_with_none():
    # An array-form BlockStored before lora_name and the other later fields existed.
    old = event_from_object(["BlockStored", [11, 12], 10, [1, 2, 3, 4], 2, None, "GPU"])
    assert old == BlockStored([11, 12], 10, [1, 2, 3, 4], 2, None, "GPU")
    assert old.lora_name is None and old.extra_keys is None and old.group_idx is None
    assert event_from_object(["BlockRemoved", [11]]) == BlockRemoved([11], None, None)
    # A map-form event leaves out what holds its default; unknown keys are ignored.
    assert event_from_object({"type": "BlockRemoved", "block_hashes": [b"h"], "medium": "CPU", "future": 1}) == \
        BlockRemoved([b"h"], "CPU", None)
    batch = decode_batch(msgpack.packb([1.0, [["AllBlocksCleared"]]]))
    assert batch == EventBatch(1.0, [AllBlocksCleared()], None)


def test_unknown_events_and_shapes_are_refused():
    with pytest.raises(ValueError, match="unknown KV event type 'BlockMoved'"):
        event_from_object({"type": "BlockMoved"})
    with pytest.raises(ValueError):
        event_from_object([])
    with pytest.raises(ValueError):
        decode_batch(msgpack.packb(7))


def test_the_end_of_a_replay_reports_a_gap_only_when_it_has_one():
    assert decode_replay_end(b"") is None
    gap = msgpack.packb({"type": "ReplayGap", "requested_seq": 1, "first_seq": 3})
    assert decode_replay_end(gap) == ReplayGap(1, 3)
    with pytest.raises(ValueError):
        decode_replay_end(msgpack.packb([1]))


def test_import_kvtier_needs_neither_msgpack_nor_zmq():
    code = (
        "import sys\n"
        "sys.modules['msgpack'] = None\n"  # any import of them fails
        "sys.modules['zmq'] = None\n"
        "import kvtier, kvtier.kv_events\n"
        "print(kvtier.kv_events.END_SEQ)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(BUILD_DIR / "python")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "-1"


# --- kvtier.kv_events.Subscriber against our publisher -----------------------------------


class _ServeProcess:
    """kvtier_kv_events_serve, driven line by line."""

    def __init__(self, *args: str) -> None:
        program = _program("kvtier_kv_events_serve")
        if not program.is_file():
            pytest.skip(f"no {program}: it needs kvtier::kv_events (libzmq3-dev, cppzmq-dev) and "
                        f"cmake --build {BUILD_DIR} --target kvtier_kv_events_serve")
        self.proc = subprocess.Popen([str(program), *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, bufsize=1)
        words = self.proc.stdout.readline().split()
        assert words[0] == "endpoint" and words[2] == "replay", words
        self.endpoint, self.replay_endpoint = words[1], words[3]

    def command(self, line: str) -> str:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline().strip()
        assert not answer.startswith("error"), answer
        return answer

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
            assert self.proc.wait(timeout=30) == 0


@pytest.fixture
def serve():
    started = []

    def start(*args: str) -> _ServeProcess:
        started.append(_ServeProcess(*args))
        return started[-1]

    yield start
    for s in started:
        s.close()


def _synced(sub, serve_process, deadline_s: float = 30.0) -> int:
    """Publishes until the subscription has reached the publisher (what a SUB receives
    starts some milliseconds after it connects): the seq of the first batch received."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        serve_process.command("publish 1")
        got = sub.recv(timeout_ms=50)
        if got is not None:
            return got[0]
    pytest.fail("the subscriber never received a batch")


def test_a_subscriber_reads_our_batches_in_order_and_a_replay_fills_what_it_missed(serve):
    from kvtier.kv_events import Subscriber

    pytest.importorskip("zmq", reason="python3-zmq is not installed")
    server = serve("--topic", "kvtier")
    with Subscriber(server.endpoint, server.replay_endpoint, topic="kvtier") as sub:
        first = _synced(sub, server)
        server.command("publish 3")
        server.command("stored")
        got = [sub.recv(timeout_ms=30_000) for _ in range(4)]
        assert [seq for seq, _ in got] == [first + 1, first + 2, first + 3, first + 4]
        assert sub.last_topic == b"kvtier"
        hashes = [b.events[0].block_hashes[0] for _, b in got[:3]]
        assert hashes == [hashes[0], hashes[0] + 1, hashes[0] + 2]
        assert got[3][1].events == [FULL]
        assert got[3][1].data_parallel_rank == 0

        replayed = list(sub.replay(0))
        assert [seq for seq, _ in replayed] == list(range(first + 5))
        assert replayed[-1][1].events == [FULL]
        assert sub.last_replay_gap is None
        assert "replays=1 gaps=0" in server.command("stats")


def test_a_replay_from_before_the_history_reports_the_gap(serve):
    from kvtier.kv_events import Subscriber

    pytest.importorskip("zmq", reason="python3-zmq is not installed")
    server = serve("--buffer-steps", "2", "--form", "array")
    assert server.command("publish 5") == "published 5"
    with Subscriber(server.endpoint, server.replay_endpoint) as sub:
        replayed = list(sub.replay(1))
        assert [seq for seq, _ in replayed] == [3, 4]
        assert [b.events for _, b in replayed] == [[BlockRemoved([3], "CPU")], [BlockRemoved([4], "CPU")]]
        assert sub.last_replay_gap == ReplayGap(requested_seq=1, first_seq=3)
        assert list(sub.replay(4)) and sub.last_replay_gap is None
    assert "gaps=1" in server.command("stats")
