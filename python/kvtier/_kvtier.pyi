"""Type stubs of kvtier's pybind11 extension (python/src/kvtier_module.cpp), kept by hand:
tests/python/test_stubs.py checks them against the built module (names, kinds, parameters,
defaults, enum values).
"""

import enum
from typing import ClassVar, Iterable, List, Optional, Sequence, Tuple, Union

import numpy

__version__: str
PROTOCOL_VERSION: int

_Tokens = Union[Sequence[int], numpy.ndarray]

class KvtierError(RuntimeError):
    """A kvtier failure; the message is the C++ one."""

class UsageError(KvtierError):
    """A call this object cannot serve (e.g. a scheduler's connector asked to store)."""

class _Enum(enum.Enum):
    """pybind11's enums: not ints (``DtypeKind.FP32 == 0`` is False); ``int()`` and
    ``operator.index`` give the value, ``.name`` and ``.value`` are an Enum's. Not iterable
    (``__members__`` lists the members)."""

    def __int__(self) -> int: ...
    def __index__(self) -> int: ...

class DtypeKind(_Enum):
    FP32 = 0
    FP16 = 1
    BF16 = 2
    FP8_E4M3 = 3
    FP8_E5M2 = 4
    INT8 = 5

class KvLayoutKind(_Enum):
    NHD = 0
    HND = 1
    MLA = 2

class AttentionKind(_Enum):
    MHA = 0
    MLA = 1

class HashAlgorithm(_Enum):
    XXH3_128 = 0
    SHA256 = 1

class HealthState(_Enum):
    STARTING = 0
    HEALTHY = 1
    UNHEALTHY = 2

def dtype_bytes(dtype: DtypeKind) -> int: ...
def parse_dtype_kind(name: str) -> DtypeKind: ...
def parse_kv_layout_kind(name: str) -> KvLayoutKind: ...

class ModelShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: DtypeKind
    attention: AttentionKind
    def __init__(
        self,
        num_layers: int = 0,
        num_kv_heads: int = 0,
        head_dim: int = 0,
        dtype: DtypeKind = DtypeKind.BF16,
        attention: AttentionKind = AttentionKind.MHA,
    ) -> None: ...
    @property
    def dtype_bytes(self) -> int: ...
    @property
    def planes(self) -> int: ...
    @property
    def token_plane_bytes(self) -> int: ...
    @property
    def token_bytes(self) -> int: ...
    def validation_error(self) -> str: ...
    def __eq__(self, other: object) -> bool: ...
    __hash__: ClassVar[None]  # type: ignore[assignment]

class ChunkLayout:
    model: ModelShape
    chunk_tokens: int
    def __init__(self, model: ModelShape, chunk_tokens: int = 256) -> None: ...
    @property
    def slab_bytes(self) -> int: ...
    @property
    def object_bytes(self) -> int: ...
    def validation_error(self) -> str: ...

class KvStrides:
    layer: int
    plane: int
    block: int
    token: int
    head: int
    def __init__(self, layer: int = 0, plane: int = 0, block: int = 0, token: int = 0, head: int = 0) -> None: ...
    @property
    def dense(self) -> bool: ...
    def __eq__(self, other: object) -> bool: ...
    __hash__: ClassVar[None]  # type: ignore[assignment]

class PagedKvLayout:
    model: ModelShape
    block_size: int
    num_blocks: int
    order: KvLayoutKind
    strides: KvStrides
    def __init__(
        self,
        model: ModelShape,
        block_size: int = 16,
        num_blocks: int = 0,
        order: KvLayoutKind = KvLayoutKind.NHD,
        strides: KvStrides = ...,
    ) -> None: ...
    @property
    def effective_strides(self) -> KvStrides: ...
    @property
    def segment_contiguous(self) -> bool: ...
    def describe(self) -> str: ...
    @property
    def kind(self) -> KvLayoutKind: ...
    @property
    def segment_bytes(self) -> int: ...
    @property
    def head_row_bytes(self) -> int: ...
    @property
    def layer_bytes(self) -> int: ...
    @property
    def total_bytes(self) -> int: ...
    def offset_in_layer(self, plane: int, block: int, token: int = 0, head: int = 0) -> int: ...
    def validation_error(self) -> str: ...
    def compatibility_error(self, chunk: ChunkLayout) -> str: ...
    def __eq__(self, other: object) -> bool: ...
    __hash__: ClassVar[None]  # type: ignore[assignment]

class TokenHasher:
    def __init__(self, chunk_tokens: int = 256, algorithm: HashAlgorithm = HashAlgorithm.XXH3_128) -> None: ...
    @property
    def chunk_tokens(self) -> int: ...
    @property
    def algorithm(self) -> HashAlgorithm: ...
    def root(self) -> int: ...
    def chunk_hashes(self, tokens: _Tokens, extras: Optional[Sequence[bytes]] = None) -> List[int]:
        """One hash per full chunk; ``extras`` (one ``bytes`` per full chunk, ``b""`` for none)
        are folded into each chunk's hash after its tokens (an empty one changes nothing)."""

def make_model_id(model_name: str, shape: ModelShape, layout: KvLayoutKind = KvLayoutKind.NHD, salt: str = "") -> int: ...
def salted_model_id(model_id: int, salt: str) -> int: ...

class ChunkKey:
    def __init__(self, model_id: int, world_size: int, rank: int, hash: int) -> None: ...
    @property
    def model_id(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def rank(self) -> int: ...
    @property
    def hash(self) -> int: ...
    def encode(self) -> bytes: ...
    def __eq__(self, other: object) -> bool: ...
    def __hash__(self) -> int: ...

class LayerBuffer:
    """One layer's tensor as writable bytes (the buffer protocol); keeps its region alive."""

    @property
    def layer(self) -> int: ...
    def __len__(self) -> int: ...
    def __buffer__(self, flags: int) -> memoryview: ...

class KvRegion:
    @staticmethod
    def create(layout: PagedKvLayout, name: str = "kvtier-kv") -> "KvRegion": ...
    @staticmethod
    def bytes_for(layout: PagedKvLayout) -> int: ...
    @property
    def layout(self) -> PagedKvLayout: ...
    @property
    def bytes(self) -> int: ...
    @property
    def fd(self) -> int: ...
    @property
    def num_layers(self) -> int: ...
    def layer(self, layer: int) -> LayerBuffer: ...
    def data(self) -> LayerBuffer:
        """Every layer's KV as one writable byte buffer (layer 0's base to the end of the last
        layer's rows), for layouts whose layers interleave."""
    def begin_reuse(self, block: int) -> None: ...
    def generation(self, block: int) -> int: ...

class ConnectorTimeouts:
    ping_interval_ms: int
    ping_timeout_ms: int
    request_timeout_ms: int
    lookup_timeout_ms: int
    retrieve_timeout_ms: int
    store_timeout_ms: int
    reconnect_initial_ms: int
    reconnect_max_ms: int
    quarantine_limit_ms: int
    def __init__(self) -> None: ...

class ConnectorOptions:
    socket_path: str
    rank: int
    world_size: int
    scheduler: Optional[bool]
    model_name: str
    model: ModelShape
    layout_kind: KvLayoutKind
    cache_salt: str
    prefill_tokens_per_second: int
    chunk_tokens: int
    hash: HashAlgorithm
    instance_id: int
    engine_id: str
    timeouts: ConnectorTimeouts
    timeout_scale: int
    breaker_threshold: int
    finished_window: int
    max_lookups: int
    describe_chunks: bool
    block_size: int
    described_chunks_window: int
    def __init__(self) -> None: ...
    def is_scheduler(self) -> bool: ...
    def validation_error(self) -> str: ...

class Connector:
    def __init__(self, options: ConnectorOptions, region: Optional[KvRegion] = None) -> None: ...
    def close(self) -> None: ...
    @property
    def closed(self) -> bool: ...
    def wait_ready(self, timeout_s: float) -> bool: ...
    @property
    def healthy(self) -> bool: ...
    @property
    def state(self) -> HealthState: ...
    @property
    def last_error(self) -> str: ...
    @property
    def boot_token(self) -> int: ...
    @property
    def has_region(self) -> bool: ...
    @property
    def options(self) -> ConnectorOptions: ...
    def stats(self) -> dict: ...
    @property
    def counters(self) -> Tuple[int, int, int, int]:
        """``(registrations, late_replies, quarantined_blocks, unhealthy_ns)`` of :meth:`stats`,
        without its dict: what the vLLM connector samples every step, in one call (one lock).
        ``unhealthy_ns``: the time spent without a registered server since the start, the
        current outage included."""
    def chunk_hashes(self, tokens: _Tokens) -> List[int]:
        """One hash per full chunk of ``tokens``, with the connector's chunk size and hash
        (no extras: :meth:`TokenHasher.chunk_hashes` folds those)."""
    def lookup(self, request_id: str, tokens: _Tokens, cache_salt: str = "") -> None: ...
    def lookup_hashes(self, request_id: str, hashes: Iterable[int], cache_salt: str = "") -> None: ...
    @property
    def describes_chunks(self) -> bool:
        """Whether :meth:`describe_chunks` may send anything now: False once this connection's
        server answered that it publishes no KV events (until a reconnection), or with the
        ``describe_chunks`` option off."""
    def describe_chunks(
        self,
        hashes: Iterable[int],
        tokens: _Tokens,
        cache_salt: str = "",
        *,
        block_size: int = 0,
        parent: Optional[int] = None,
        lora_name: str = "",
        lora_id: int = -1,
        block_extra_keys: Sequence[bytes] = ...,
    ) -> None:
        """Tells the server the token ids of consecutive chunks of one prompt (``tokens``: at
        least ``len(hashes) * chunk_tokens``), for the KV events it may publish for routers.
        Fire and forget; nothing is sent while unhealthy, with ``describe_chunks`` off, after
        the connection's server said it publishes none, or for chunks described on the
        connection recently."""
    def lookup_result(self, request_id: str) -> Optional[int]: ...
    @property
    def progress(self) -> int:
        """A count that moves each time something an engine acts on happens: a lookup answered,
        a retrieve's progress or end, a store's end, quarantined blocks released."""
    def wait_progress(self, seen: int, timeout_s: Optional[float] = None) -> bool:
        """Blocks (the GIL released) until ``progress`` differs from ``seen`` (True, at once when
        it moved already) or ``timeout_s`` passes (False)."""
    def wait_lookups(
        self, request_ids: Sequence[str], timeout_s: Optional[float] = None, *, release_gil: bool = True
    ) -> bool:
        """Blocks until every listed lookup is answered (True) or the timeout passes (False);
        ``release_gil=False`` keeps the GIL through a short wait on an engine's thread."""
    def free_lookup_locks(self, request_id: str) -> None: ...
    def end_request(self, request_id: str) -> None: ...
    def retrieve(
        self,
        request_id: str,
        tokens: _Tokens,
        first_chunk: int,
        block_ids: Sequence[int],
        skip_tokens: int = 0,
        cache_salt: str = "",
        *,
        synchronous: bool = False,
    ) -> None: ...
    def retrieve_hashes(
        self,
        request_id: str,
        hashes: Iterable[int],
        first_chunk: int,
        block_ids: Sequence[int],
        skip_tokens: int = 0,
        cache_salt: str = "",
        *,
        synchronous: bool = False,
    ) -> None: ...
    def store(
        self,
        request_id: str,
        tokens: _Tokens,
        first_chunk: int,
        chunk_count: int,
        block_ids: Sequence[int],
        cache_salt: str = "",
    ) -> None: ...
    def store_hashes(
        self, request_id: str, hashes: Iterable[int], first_chunk: int, block_ids: Sequence[int], cache_salt: str = ""
    ) -> None: ...
    def get_finished(self, finished_by_engine: Sequence[str]) -> Tuple[List[str], List[str]]: ...
    def take_load_error_blocks(self) -> List[int]: ...
    def layers_ready(self, request_id: str) -> int: ...
    def wait_layers(self, request_ids: Sequence[str], layers: int, timeout_s: Optional[float] = None) -> bool: ...
    def wait_retrieves(self, request_ids: Sequence[str], timeout_s: Optional[float] = None) -> bool: ...
    def wait_stores(self, request_ids: Sequence[str], timeout_s: Optional[float] = None) -> bool: ...
    def wait_released(self, blocks: Sequence[int], timeout_s: Optional[float] = None) -> bool: ...
    def block_is_quarantined(self, block: int) -> bool: ...
    def quarantined_blocks(self) -> List[int]: ...
    def block_reused(self, block: int) -> bool: ...
    def blocks_reused(self, blocks: Sequence[int]) -> List[int]: ...
