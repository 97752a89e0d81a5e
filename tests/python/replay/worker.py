"""A replay worker process: one tensor-parallel rank, as vLLM's GPU model runner would drive
its KV connector (vllm/v1/worker/kv_connector_model_runner_mixin.py), per step:

    bind_connector_metadata(meta); handle_preemptions(meta); start_load_kv(ctx)
    forward: per layer wait_for_layer_load(name), then that layer for every scheduled
             request ... save_kv_layer(name, kv, attn_md)
    wait_for_save(); get_finished(finished_req_ids); get_block_ids_with_load_errors();
    get_kv_connector_stats(); get_kv_connector_kv_cache_events();
    build_connector_worker_meta(); clear_connector_metadata()

A step with no scheduled token takes vLLM's ``kv_connector_no_forward`` path: the same calls
without the forward pass and without ``wait_for_save``.

The model is the synthetic KV pattern or the TinyDecoder (replay/model.py); the KV cache
tensors are made the way vLLM makes them (zeros, per layer, of the model's dtype: vLLM's
``cache_dtype`` "auto") and handed to ``register_kv_caches``, which moves them into the
kvtier region.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch


@dataclass
class WorkerSpec:
    rank: int
    world_size: int
    layout: str  # "NHD" or "HND"
    runner: str  # "synthetic" or "model"
    num_layers: int
    kv_heads: int  # of the whole model (split over the ranks)
    head_dim: int
    block_size: int
    num_blocks: int
    kvtier: bool  # False: no connector at all (the baseline)
    extra: Dict[str, Any] = field(default_factory=dict)  # kv_connector_extra_config
    model_seed: int = 1234
    dist_init: Optional[str] = None  # the model at world_size > 1: the gloo group's rendezvous file
    kv_role: str = "kv_both"
    kv_load_failure_policy: str = "recompute"
    engine_id: Optional[str] = None
    dtype: str = "float32"  # the model's dtype, so the KV caches' (replay.model.KV_DTYPES; the TinyDecoder: float32)


def _layer_names(n: int) -> List[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(n)]


class Worker:
    def __init__(self, spec: WorkerSpec) -> None:
        from kvtier.integrations.vllm import KVConnectorRole, KVTierConnector

        from .model import PagedKV, RequestInputs, SyntheticRunner, TinyDecoder, check_runner_dtype, make_kv_caches
        from .vllm_configs import full_attention_config
        from .vllm_shapes import vllm_config

        torch.set_num_threads(1)
        check_runner_dtype(spec.runner, spec.dtype)
        self.spec = spec
        heads = spec.kv_heads // spec.world_size
        self.kv_caches = make_kv_caches(
            spec.layout, spec.num_layers, spec.num_blocks, spec.block_size, heads, spec.head_dim, spec.dtype
        )
        self.connector: Optional[KVTierConnector] = None
        if spec.kvtier:
            cfg = vllm_config(
                model="replay/tiny",
                num_layers=spec.num_layers,
                num_kv_heads=spec.kv_heads,
                head_size=spec.head_dim,
                block_size=spec.block_size,
                tp=spec.world_size,
                rank=spec.rank,
                extra=spec.extra,
                kv_role=spec.kv_role,
                kv_load_failure_policy=spec.kv_load_failure_policy,
                engine_id=spec.engine_id,
                dtype=spec.dtype,
            )
            kv_cache_config = full_attention_config(
                list(self.kv_caches), spec.num_blocks, spec.block_size, heads, spec.head_dim, spec.dtype
            )
            self.connector = KVTierConnector(cfg, KVConnectorRole.WORKER, kv_cache_config)
            self.connector.register_kv_caches(self.kv_caches)
        self.pages = [PagedKV(t, spec.layout, spec.block_size) for t in self.kv_caches.values()]
        if spec.runner == "model":
            all_reduce = None
            if spec.world_size > 1:  # the ranks' attention outputs are summed (vLLM's TP all-reduce)
                import datetime

                import torch.distributed as dist

                dist.init_process_group(
                    "gloo",
                    init_method=f"file://{spec.dist_init}",
                    rank=spec.rank,
                    world_size=spec.world_size,
                    timeout=datetime.timedelta(seconds=60),
                )
                all_reduce = dist.all_reduce
            self.model: Any = TinyDecoder(
                layers=spec.num_layers,
                kv_heads=spec.kv_heads,
                head_dim=spec.head_dim,
                seed=spec.model_seed,
                rank=spec.rank,
                world_size=spec.world_size,
                all_reduce=all_reduce,
            )
        else:
            self.model = SyntheticRunner(spec.layout, spec.rank, spec.block_size, heads, spec.head_dim, spec.dtype)
        self.tables: Dict[str, List[int]] = {}
        # What vLLM's worker keeps of each request from its NewRequestData until it finishes.
        self._inputs_of = RequestInputs
        self.inputs: Dict[str, Any] = {}

    def step(self, so: Any) -> Dict[str, Any]:
        c = self.connector
        meta = so.kv_connector_metadata
        if c is not None:
            c.bind_connector_metadata(meta)
            c.handle_preemptions(meta)
            c.start_load_kv(None)
        for rid in so.finished_req_ids:
            self.tables.pop(rid, None)
            self.inputs.pop(rid, None)
        for rid in so.preempted_req_ids or ():
            self.tables.pop(rid, None)
        for new in so.scheduled_new_reqs:
            self.tables[new.req_id] = list(new.block_ids[0])
            lora = new.lora_request.lora_name if new.lora_request is not None else None
            mm = [(f.mm_position.offset, f.data) for f in new.mm_features]
            if lora is not None or mm or new.prompt_embeds is not None:
                self.inputs[new.req_id] = self._inputs_of(lora, mm, new.prompt_embeds)
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            ids = list(cached.new_block_ids[i][0]) if cached.new_block_ids[i] else []
            if rid in cached.resumed_req_ids:
                self.tables[rid] = ids
            else:
                self.tables.setdefault(rid, []).extend(ids)
        computed = {n.req_id: n.num_computed_tokens for n in so.scheduled_new_reqs}
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        out: Dict[str, Any] = {"sampled": {}, "logits": {}, "bad_rows": {}}
        names = _layer_names(self.spec.num_layers)
        # The forward pass: every scheduled request, layer by layer; each attention layer waits
        # for its KV first (vLLM's wait_for_layer_load: a no-op for asynchronous loads).
        batch = [
            (so.token_ids[rid], computed[rid], computed[rid] + n, self.tables[rid], self.inputs.get(rid))
            for rid, n in so.num_scheduled_tokens.items()
        ]
        forward = so.total_num_scheduled_tokens > 0  # else vLLM's kv_connector_no_forward
        before_layer = (lambda layer: c.wait_for_layer_load(names[layer])) if c is not None else None
        results = self.model.forward_batch(batch, self.pages, before_layer) if batch else []
        for (rid, _), (tokens, _, end, _, _), result in zip(so.num_scheduled_tokens.items(), batch, results):
            if self.spec.runner == "model":
                if end == len(tokens):
                    out["logits"][rid] = result.clone()
                    out["sampled"][rid] = int(torch.argmax(result))
            else:
                bad, token = result
                if bad:
                    out["bad_rows"][rid] = bad
                if end == len(tokens):
                    out["sampled"][rid] = token
        if c is not None:
            if forward:
                for name, t in self.kv_caches.items():
                    c.save_kv_layer(name, t, None)
                c.wait_for_save()
            sending, recving = c.get_finished(set(so.finished_req_ids))
            out["finished_sending"] = sending
            out["finished_recving"] = recving
            out["invalid_block_ids"] = c.get_block_ids_with_load_errors()
            out["kv_connector_stats"] = c.get_kv_connector_stats()
            out["kv_cache_events"] = c.get_kv_connector_kv_cache_events()
            out["kv_connector_worker_meta"] = c.build_connector_worker_meta()
            c.clear_connector_metadata()
            ws = c.worker_side
            out["quarantined"] = sorted(ws.connector.quarantined_blocks())
            out["fence_refusals"] = ws.fence_refusals
            out["held"] = ws.held()
            out["healthy"] = ws.connector.healthy
            out["connector_stats"] = ws.connector.stats()
            out["kv_dtype"] = ws.region.layout.model.dtype.name  # the dtype kind kvtier registered this rank's KV as
        return out

    def shutdown(self) -> None:
        if self.connector is not None:
            self.connector.shutdown()


def worker_main(conn: Any, spec: WorkerSpec) -> None:
    """The process body: ("step", SchedulerOutput) -> ("out", dict); ("stop",) ends it."""
    try:
        w = Worker(spec)
        conn.send(("ready", None))
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            w.shutdown()
            conn.send(("stopped", None))
            return
        try:
            conn.send(("out", w.step(msg[1])))
        except Exception:
            conn.send(("error", traceback.format_exc()))
            return
