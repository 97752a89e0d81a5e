"""One worker's half of the adapter (:class:`WorkerSide`): its KV region, its connector, the
execution of each step's plan. The semantics are in :mod:`kvtier.integrations.core`'s
docstring."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

from .._kvtier import Connector, KvLayoutKind, KvRegion, ModelShape, PagedKvLayout
from ..views import dtype_kind_of, torch_layers
from .config import KVTierConfig
from .kv_layouts import describe_layer, dims_for, legacy_dims
from .plan import StepPlan

__all__ = ["WorkerSide"]

log = logging.getLogger("kvtier")


@dataclass
class _WorkerState:
    load_blocks: Dict[str, Set[int]] = field(default_factory=dict)  # id -> blocks of its retrieve
    held_recving: List[str] = field(default_factory=list)
    held_sending: List[str] = field(default_factory=list)
    unissued: List[str] = field(default_factory=list)  # loads not sent: finished receiving at once
    recv_last: Set[str] = field(default_factory=set)  # StepPlan.recv_last: never reported sending
    extra_errors: Set[int] = field(default_factory=set)
    stored_plan: Optional["StepPlan"] = None  # the plan whose stores were issued
    step_loads: List[str] = field(default_factory=list)  # layerwise: this step's retrieves in flight
    step_failed: Set[str] = field(default_factory=set)  # layerwise: ids whose load of this step failed


class WorkerSide:
    """One worker's half: its region, its connector, the execution of each step's plan.

    Counters (attributes, for tests and logs): ``fence_refusals`` (blocks the engine was about
    to write while quarantined: never expected, but in layerwise mode a request's own blocks
    after its load failed with the server hung, which it recomputes in place),
    ``loads_issued``, ``stores_issued``, ``stores_dropped`` (layerwise: stores of a request
    whose load of the step failed), ``preemption_waits`` (layerwise: preemptions that waited
    for quarantined blocks)."""

    def __init__(self, config: KVTierConfig) -> None:
        config.validate()
        self.config = config
        self.region: Optional[KvRegion] = None
        self.connector: Optional[Connector] = None
        self.layer_names: List[str] = []
        self.fence_refusals = 0
        self.loads_issued = 0
        self.stores_issued = 0
        self.stores_dropped = 0
        self.preemption_waits = 0
        self._layerwise = config.layerwise
        self._layer_index: Dict[str, int] = {}
        self._st = _WorkerState()

    # -- vLLM: register_kv_caches ----------------------------------------------------------
    def register(self, kv_caches: Mapping[str, Any], dtype: Optional[str] = None, backend: Any = None) -> None:
        """Moves the engine's layer tensors (CPU torch tensors, one per layer, same shape,
        strides and dtype) into a new kvtier region, in place (``Tensor.set_``: every reference
        the engine holds now sees the region, with exactly the shape, strides and dtype it
        allocated, so its kernels keep working; the contents start zeroed), and registers it.

        What the tensor's dimensions mean comes from ``backend`` (vLLM's attention backend
        class, or a :data:`~kvtier.integrations.kv_layouts.BACKENDS` name), the
        ``kv_cache_backend`` option, the device, or the rank
        (:func:`~kvtier.integrations.kv_layouts.dims_for`); the region then keeps the tensor's
        own strides (:func:`~kvtier.integrations.kv_layouts.describe_layer`). A layout kvtier
        cannot copy is refused with ValueError naming the shape and strides. Several names
        of one tensor (vLLM's KV-sharing layers) are one layer of the region.

        ``dtype``: the kvtier dtype name when the tensors' dtype is ambiguous (fp8 as uint8:
        vLLM's ``cache_dtype``)."""
        import torch

        if self.region is not None:
            raise RuntimeError("kvtier: register_kv_caches was called twice")
        names = list(kv_caches)
        if not names:
            raise ValueError("kvtier: no KV caches to register")
        # One region layer per distinct tensor; aliases (KV-sharing layers) share its index.
        tensors: List[Any] = []
        index: Dict[str, int] = {}
        seen: Dict[Tuple[int, Tuple[int, ...], Tuple[int, ...]], int] = {}
        for name in names:
            t = kv_caches[name]
            key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()))
            if key not in seen:
                seen[key] = len(tensors)
                tensors.append(t)
            index[name] = seen[key]
        t0 = tensors[0]
        first = names[0]
        for name in names:
            t = tensors[index[name]]
            if t.device.type != "cpu":
                raise NotImplementedError(
                    f"kvtier: layer {name} is on {t.device}: GPU KV caches travel as cuda_ipc regions, which this "
                    "kvtier build does not open; run the engine's KV cache on the CPU"
                )
            if t.shape != t0.shape or t.dtype != t0.dtype or t.stride() != t0.stride():
                raise ValueError(
                    f"kvtier: layer {name} (shape {tuple(t.shape)}, strides {tuple(t.stride())}, {t.dtype}) differs "
                    f"from {first} (shape {tuple(t0.shape)}, strides {tuple(t0.stride())}, {t0.dtype}): kvtier serves "
                    "models whose attention layers share one KV layout (a hybrid model's other groups are not served)"
                )
        if self.config.cache_dtype == "fp8_ds_mla":
            raise ValueError(
                f"kvtier: cache_dtype fp8_ds_mla (FlashMLA sparse: 656-byte rows of fp8 latent, fp32 scales and bf16 "
                f"rope in a uint8 tensor of shape {tuple(t0.shape)}) has no kvtier dtype kind to key it by: use "
                "cache_dtype auto or fp8"
            )
        want = self.config.layout_kind()
        shape, stride = list(t0.shape), list(t0.stride())
        dims = dims_for(len(shape), t0.device.type, backend, self.config.kv_cache_backend, self.config.cache_dtype)
        if dims is None:
            dims = legacy_dims(shape, stride, self.config.block_size, want)
        desc = describe_layer(shape, stride, t0.element_size(), dims, self.config.block_size, want)
        kind_dtype = dtype_kind_of(dtype) if dtype else dtype_kind_of(t0.dtype)
        model = ModelShape(len(tensors), desc.num_kv_heads, desc.head_dim, kind_dtype, desc.attention)
        if self.config.model is not None and self.config.model != model:
            raise ValueError(
                f"kvtier: the KV tensors (shape {tuple(shape)}, strides {tuple(stride)}, read as {dims.name}) are "
                f"{model}, the scheduler registers {self.config.model}"
            )
        # Layers a page apart (their own tensors in the engine: any placement works).
        strides = desc.strides
        strides.layer = (desc.extent_bytes + 4095) // 4096 * 4096
        order = desc.kind if desc.kind != KvLayoutKind.MLA else KvLayoutKind.NHD
        layout = PagedKvLayout(model, desc.block_size, desc.num_blocks, order, strides)
        problem = layout.validation_error()
        if problem:
            raise ValueError(
                f"kvtier: cannot use KV layer tensors of shape {tuple(shape)} and strides {tuple(stride)} (elements of "
                f"{t0.element_size()} bytes, read as {dims.name} {dims.dims}): {problem}"
            )
        if layout.layer_bytes != desc.extent_bytes:  # the tensor's elements are exactly the rows'
            raise ValueError(
                f"kvtier: the KV layer tensors of shape {tuple(shape)} and strides {tuple(stride)} hold elements "
                f"outside the KV rows ({desc.extent_bytes} bytes against {layout.layer_bytes}): not a layout of "
                f"{dims.name}"
            )
        region = KvRegion.create(layout, "kvtier-kv-rank%d" % self.config.rank)
        with torch.no_grad():
            for t, view in zip(tensors, torch_layers(region, shape, stride, dtype=t0.dtype)):
                t.set_(view)
        log.info(
            "kvtier: rank %d: %d KV layers of shape %s, strides %s (%s, %s) in a region of %d bytes",
            self.config.rank,
            len(tensors),
            tuple(shape),
            tuple(stride),
            dims.name,
            layout.describe(),
            region.bytes,
        )
        self.region = region
        self.layer_names = names
        self._layer_index = index
        self.connector = Connector(self.config.connector_options(scheduler=False), region)
        if not self.connector.wait_ready(self.config.ready_timeout_s):
            log.warning(
                "kvtier: rank %d: no kvtier-server at %s yet (%s): running without loads and stores until it comes",
                self.config.rank,
                self.config.socket_path,
                self.connector.last_error,
            )

    def register_cross_layers(self, kv_cache: Any, backend: Any = None) -> None:
        """vLLM's ``register_cross_layers_kv_cache``: refused. vLLM makes the per-layer views
        of the cross-layer tensor (``allocate_uniform_kv_caches``, which returns them with the
        tensor) before it calls the connector, and ``Tensor.set_`` on the cross-layer tensor
        redirects only views made after it: the engine's layers would keep computing in the
        old memory while kvtier copied the region's. kvtier therefore keeps
        ``prefer_cross_layer_blocks`` False, so vLLM never calls this; the C++ core copies
        cross-layer layouts (``KvStrides.layer`` below the block stride) for an engine that
        allocates its KV in a kvtier region from the start."""
        raise NotImplementedError(
            f"kvtier: register_cross_layers_kv_cache (a cross-layer KV tensor of shape {tuple(kv_cache.shape)}, "
            f"strides {tuple(kv_cache.stride())}) is not supported: vLLM made the per-layer views of that tensor "
            "before handing it over, so kvtier cannot move them into its shared region; leave "
            "prefer_cross_layer_blocks False (KVTierConnector's default) and vLLM registers the layers one by one"
        )

    def register_region(self, region: KvRegion, layer_names: Optional[Sequence[str]] = None) -> None:
        """Registers a region the engine allocated itself (its tensors are views of it,
        :func:`kvtier.torch_layers`). ``layer_names``: the names ``wait_layer`` is given, in the
        region's layer order (else it takes layer indices)."""
        if self.region is not None:
            raise RuntimeError("kvtier: a region is registered already")
        self.region = region
        self.layer_names = list(layer_names or [])
        self._layer_index = {n: i for i, n in enumerate(self.layer_names)}
        self.connector = Connector(self.config.connector_options(scheduler=False), region)
        self.connector.wait_ready(self.config.ready_timeout_s)

    def _conn(self) -> Connector:
        if self.connector is None:
            raise RuntimeError("kvtier: register_kv_caches must come first")
        return self.connector

    # -- vLLM: handle_preemptions ----------------------------------------------------------
    def handle_preemptions(self, plan: StepPlan) -> None:
        """Preempted requests' blocks go back to the engine now. Their stores need nothing: they
        read the blocks' generations when issued, and the fence before the next write of each
        block makes the server drop a store that had not copied it yet. In layerwise mode a
        preempted request that was running may hold blocks of a load the connector gave up on
        (the server hung): wait until none is quarantined, since vLLM hands them out at once."""
        if not self._layerwise or not plan.preempted:
            return None
        conn = self._conn()
        quarantined = set(conn.quarantined_blocks())
        if not quarantined:
            return None
        held: Set[int] = set()
        for rid in plan.preempted:
            held |= self._st.load_blocks.get(rid, set()) & quarantined
        if held:
            self.preemption_waits += 1
            log.warning(
                "kvtier: rank %d: a preempted request holds %d blocks a hung server may still write: waiting for "
                "their release (the server's answer or death, or quarantine_limit_ms)",
                self.config.rank,
                len(held),
            )
            conn.wait_released(sorted(held))
        return None

    # -- vLLM: start_load_kv ---------------------------------------------------------------
    def start_step(self, plan: StepPlan) -> None:
        """Before the forward pass: fence the blocks the step writes, issue the loads."""
        conn = self._conn()
        st = self._st
        refused = set(conn.blocks_reused(plan.fence_blocks)) if plan.fence_blocks else set()
        if refused:
            # The engine was handed a block the server may still write: never expected (the
            # requests owning quarantined blocks are held); load nothing into them. In
            # layerwise mode a running request whose load failed with the server hung
            # recomputes into its own quarantined blocks: expected, and harmless (a late copy
            # writes the same chunk's KV into the same positions).
            own = set().union(*st.load_blocks.values()) if self._layerwise and st.load_blocks else set()
            unexpected = refused - own
            if unexpected:
                self.fence_refusals += len(unexpected)
                log.error(
                    "kvtier: rank %d: %d quarantined blocks were scheduled for writing", self.config.rank, len(unexpected)
                )
        st.step_loads = []
        st.step_failed = set()
        st.recv_last.update(plan.recv_last)
        for op in plan.loads:
            st.extra_errors.update(op.error_blocks)
            if op.error_blocks:
                st.step_failed.add(op.request_id)
            if not op.hashes or refused.intersection(op.block_ids):
                # Nothing to send (or nowhere safe to put it): every block is a load error and,
                # for an asynchronous load, the request is finished receiving at the next
                # report, as for a failed load.
                if op.hashes:
                    st.extra_errors.update(op.block_ids)
                    st.step_failed.add(op.request_id)
                if not self._layerwise:
                    st.unissued.append(op.request_id)
                continue
            st.load_blocks[op.request_id] = set(op.block_ids)
            conn.retrieve_hashes(
                op.request_id,
                op.hashes,
                op.first_chunk,
                op.block_ids,
                op.skip_tokens,
                op.cache_salt,
                synchronous=self._layerwise,
            )
            if self._layerwise:
                st.step_loads.append(op.request_id)
            self.loads_issued += 1

    # -- vLLM: wait_for_layer_load -------------------------------------------------------
    def wait_layer(self, layer: Any) -> None:
        """Layerwise mode: blocks (the GIL released) until layer ``layer`` (a registered layer
        name, or an index) of every retrieve of this step is in the blocks, or the retrieve
        ended (its failures are load errors, taken at ``end_step``). Asynchronous mode: nothing
        (loads complete between steps)."""
        st = self._st
        if not self._layerwise or not st.step_loads:
            return
        index = layer if isinstance(layer, int) else self._layer_index.get(layer)
        if index is None:  # a name kvtier was not given: wait for every layer
            index = self.region.num_layers - 1 if self.region is not None else 0
        self._conn().wait_layers(st.step_loads, int(index) + 1)

    def _finish_step_loads(self) -> None:
        """Layerwise mode: waits for the end of this step's retrieves and takes their load
        errors (for this step's report), marking the requests whose blocks did not land."""
        st = self._st
        if not st.step_loads:
            return
        conn = self._conn()
        conn.wait_retrieves(st.step_loads)
        errors = set(conn.take_load_error_blocks())
        st.extra_errors |= errors
        if errors:
            for rid in st.step_loads:
                if st.load_blocks.get(rid, set()) & errors:
                    st.step_failed.add(rid)
        st.step_loads = []

    # -- vLLM: wait_for_save ---------------------------------------------------------------
    def end_step(self, plan: StepPlan) -> None:
        """After the forward pass wrote this step's blocks: issue the stores (non-blocking).
        Idempotent per plan."""
        if self._st.stored_plan is plan:
            return
        self._st.stored_plan = plan
        self._finish_step_loads()
        conn = self._conn()
        for op in plan.stores:
            if op.request_id in self._st.step_failed:
                # Computed this step from blocks that did not land: vLLM discards it and
                # recomputes; never stored.
                self.stores_dropped += 1
                continue
            conn.store_hashes(op.request_id, op.hashes, op.first_chunk, op.block_ids, op.cache_salt)
            self.stores_issued += 1

    # -- vLLM: get_finished ----------------------------------------------------------------
    def finished(self, finished_by_engine: Iterable[str]) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        """(finished sending, finished receiving) ids, each once; an id whose retrieve blocks
        are quarantined waits here until they are released."""
        conn = self._conn()
        sending, recving = conn.get_finished(sorted(finished_by_engine))
        st = self._st
        if not (sending or recving or st.held_sending or st.held_recving or st.unissued):
            return None, None  # nothing finished and nothing held: most steps
        st.held_sending.extend(sending)
        st.held_recving.extend(recving)
        quarantined = set(conn.quarantined_blocks()) if (st.held_sending or st.held_recving) else set()

        def ready(rid: str) -> bool:
            blocks = st.load_blocks.get(rid)
            return not blocks or not (blocks & quarantined)

        out_recv = st.unissued + [r for r in st.held_recving if ready(r)]
        st.unissued = []
        # An id released from both holds at once (its receiving report was held back, then the
        # engine finished it: an abort while its load's blocks were quarantined) gets one
        # last report, receiving: vLLM frees a finished request on finished_recving and
        # asserts on a later finished_sending of it (the tracker's rule, engine/finished_tracker.hpp).
        # The same for an id the scheduler says vLLM still awaits receiving of (StepPlan.recv_last):
        # this rank's receiving report may have gone before the abort, another rank's not; the
        # aggregated finished_recving frees it, so this rank reports nothing more.
        released_send = [r for r in st.held_sending if ready(r)]
        recv_now = set(out_recv)
        out_send = [r for r in released_send if r not in recv_now and r not in st.recv_last]
        st.held_recving = [r for r in st.held_recving if not ready(r)]
        st.held_sending = [r for r in st.held_sending if not ready(r)]
        for rid in out_recv + released_send:
            st.load_blocks.pop(rid, None)
            st.recv_last.discard(rid)
        return (set(out_send) or None, set(out_recv) or None)

    # -- vLLM: get_block_ids_with_load_errors ----------------------------------------------
    def load_error_blocks(self) -> Set[int]:
        """Blocks whose KV did not land since the last call (each reported once); in layerwise
        mode every block of this step's loads that did not land."""
        self._finish_step_loads()
        out = set(self._conn().take_load_error_blocks())
        out |= self._st.extra_errors
        self._st.extra_errors = set()
        return out

    def held(self) -> int:
        """Finished reports held back for quarantined blocks, and ids whose last report is
        still to come as receiving (StepPlan.recv_last); 0 at idle (for tests)."""
        return len(self._st.held_recving) + len(self._st.held_sending) + len(self._st.recv_last)

    def shutdown(self) -> None:
        if self.connector is not None:
            self.connector.close()

