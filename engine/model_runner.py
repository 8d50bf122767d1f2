"""Turns a scheduled batch into one forward pass over the paged KV cache."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from halfmoon.engine import step_inputs
from halfmoon.engine.config import EngineConfig
from halfmoon.engine.cpu_linear import pack_linears
from halfmoon.engine.cpu_memory import keep_freed_memory
from halfmoon.engine.cuda_graphs import DecodeBatch, DecodeGraphs
from halfmoon.engine.hooks import KVHooks
from halfmoon.engine.kv_cache import PagedKvCache, create_shared_kv, map_shared_kv
from halfmoon.engine.kv_shards import whole_cache
from halfmoon.engine.loader import load_weights
from halfmoon.engine.model import CausalLM
from halfmoon.engine.model_config import ModelConfig
from halfmoon.engine.moe_block import pack_experts
from halfmoon.engine.rope import cos_sin_cache
from halfmoon.engine.scheduler import ScheduledSeq
from halfmoon.engine.sequence import Sequence
from halfmoon.engine.tensor_parallel import SINGLE, TPGroup, check_divisible
from halfmoon.engine.tp_workers import RankWorkers
from halfmoon.kernels.kv_quant import row_width

log = logging.getLogger(__name__)


class ModelRunner:
    """Owns the model weights and the KV pages; runs one step's forward pass. With a `group` of
    T ranks, this rank's slices of them (rank 0 drives the others: `workers`)."""

    def __init__(
        self,
        model_dir: Path,
        cfg: ModelConfig,
        block_size: int,
        dtype: torch.dtype,
        device,
        group: TPGroup = SINGLE,
    ) -> None:
        self.cfg, self.block_size, self.device, self.group = cfg, block_size, device, group
        self.workers: RankWorkers | None = None
        self.forward_s = 0.0  # time inside the model's forward passes, for overhead figures
        with torch.device("meta"):
            model = CausalLM(cfg, group)
        _materialize(model, device, dtype)
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        load_weights(model, model_dir)
        self.model = model.eval()
        self.weights_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        # A tied head shares the embedding's weight; a packed copy would double it.
        pack_linears(model, skip=(model.lm_head,) if cfg.tie_word_embeddings else ())
        pack_experts(model)
        if device.type == "cpu":
            keep_freed_memory()
        self.cos_sin: torch.Tensor | None = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.decode_graphs: DecodeGraphs | None = None

    @classmethod
    def start(
        cls, model_dir: Path, cfg: ModelConfig, config: EngineConfig, dtype: torch.dtype, device
    ) -> ModelRunner:
        """The engine's runner: at `tensor_parallel_size` T > 1 rank 0, with ranks 1..T-1
        started in processes of their own (loading their slices meanwhile)."""
        size = config.tensor_parallel_size
        if size == 1:
            return cls(model_dir, cfg, config.block_size, dtype, device)
        check_divisible(cfg, size)
        workers = RankWorkers(model_dir, config.block_size, dtype, device, size)
        try:
            runner = cls(model_dir, cfg, config.block_size, dtype, device, workers.group)
        except BaseException:
            workers.close()
            raise
        runner.workers = workers
        return runner

    def close(self) -> None:
        """Stop the other ranks, if any (also done when the runner is collected or at exit)."""
        if self.workers is not None:
            self.workers.close()

    def check_ranks(self) -> None:
        """Raise a RankFailedError if another rank has died (the engine cannot step)."""
        if self.workers is not None:
            self.workers.check()

    def allocate_kv(
        self,
        num_pages: int,
        max_model_len: int,
        shared: bool = False,
        kv_dtype: torch.dtype | None = None,
    ) -> PagedKvCache:
        """Allocate the KV pages and the rotary table once the weights' size is known; returns
        the engine's KV cache, at T > 1 whole-head over every rank's pages (kv_shards.py).
        `kv_dtype`: the pages' storage dtype (`kv_quant.storage_dtype`); None: the model's.

        `shared` on CPU: all layers in one anonymous memory file that other processes of this
        node can map (see `PagedKvCache.export`). A CUDA cache is shared by IPC handles and
        needs nothing here."""
        path = self.allocate_pages(num_pages, max_model_len, shared, kv_dtype)
        if self.workers is None:
            return PagedKvCache(self.kv_caches, path)
        paths = self.workers.allocate(num_pages, max_model_len, self.kv_caches[0][0].dtype)
        shape, layers = self.kv_caches[0][0].shape, self.cfg.num_layers
        dtype = self.kv_caches[0][0].dtype
        return whole_cache(self.kv_caches, paths, lambda p: map_shared_kv(p, layers, shape, dtype))

    def allocate_pages(
        self,
        num_pages: int,
        max_model_len: int,
        shared: bool,
        kv_dtype: torch.dtype | None = None,
    ) -> str | None:
        """This rank's KV pages (its KV heads) and rotary table; on CPU and `shared`, in a
        memory file other processes map by the path returned. A quantized `kv_dtype` widens
        each row by its scale (kv_quant.py)."""
        cfg, device = self.cfg, self.device
        dtype = kv_dtype or self.model.embed_tokens.weight.dtype
        self.cos_sin = cos_sin_cache(
            cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, max_model_len
        ).to(device)
        heads = cfg.num_kv_heads // self.group.size
        shape = (num_pages, self.block_size, heads, row_width(cfg.head_dim, dtype))
        shared_file = None
        if shared and device.type == "cpu":
            shared_file = create_shared_kv(cfg.num_layers, shape, dtype)
        if shared_file is not None:
            path, self.kv_caches = shared_file
            return path
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=dtype, device=device),
                torch.zeros(shape, dtype=dtype, device=device),
            )
            for _ in range(cfg.num_layers)
        ]
        return None

    def enable_decode_graphs(self, max_batch: int, max_model_len: int, capture: bool) -> None:
        """Serve decode-only steps of up to `max_batch` sequences from static buffers, replayed
        as CUDA graphs when `capture` (the caller decides: CUDA and not `enforce_eager`)."""
        if self.group.size > 1:  # the other ranks would have to replay theirs in step
            log.info("tensor_parallel_size > 1: decode steps run eagerly")
            return
        max_blocks = -(-max_model_len // self.block_size)
        self.decode_graphs = DecodeGraphs(
            self.model, self.kv_caches, self.cos_sin, max_batch, max_blocks, capture
        )

    @torch.inference_mode()
    def run(
        self, batch: list[ScheduledSeq], hooks: KVHooks | None = None
    ) -> tuple[torch.Tensor, list[Sequence]]:
        """Forward `batch`; return the logits of every sequence whose known tokens are now all
        computed (it samples next), and those sequences."""
        if hooks is None and self.decode_graphs is not None:
            graphed = self._run_decode_graph(batch)
            if graphed is not None:
                return graphed
        if self.workers is None:
            return self._forward(batch, hooks)
        return self.workers.guard(self._forward, batch, hooks)

    def _forward(self, batch: list[ScheduledSeq], hooks: KVHooks | None):
        batch = sorted(batch, key=lambda item: item.num_new_tokens == 1)  # prefill runs first
        # At T > 1 the other ranks wait for a `before_layer` that writes into their pages.
        waits = self.workers is not None and hooks is not None and hooks.writes_before(batch)
        token_ids, positions, meta, sample_rows, sampled = self._prepare(batch, waits)
        started = time.perf_counter()
        before = after = None
        if hooks is not None:
            before = lambda layer: hooks.before_layer(layer, batch)  # noqa: E731
            if waits:
                before = lambda layer: self._before(hooks, layer, batch)  # noqa: E731
            after = lambda layer: hooks.after_layer(layer, batch)  # noqa: E731
        hidden = self.model(token_ids, positions, self.cos_sin, self.kv_caches, meta, before, after)
        logits = self.model.logits(hidden[sample_rows])
        self.forward_s += time.perf_counter() - started
        return logits, [batch[i].seq for i in sampled]

    def _before(self, hooks: KVHooks, layer: int, batch: list[ScheduledSeq]) -> None:
        """`before_layer`, then the other ranks, waiting for it, go on (T > 1)."""
        hooks.before_layer(layer, batch)
        self.group.barrier()

    def _run_decode_graph(self, batch: list[ScheduledSeq]):
        """This step through the decode graphs; None unless it is decode-only and fits them."""
        if any(item.num_new_tokens != 1 for item in batch):
            return None
        bs = self.block_size
        starts = [item.seq.num_computed_tokens for item in batch]
        tables = [item.seq.block_table for item in batch]
        decode = DecodeBatch(
            token_ids=[item.seq.token_ids[s] for item, s in zip(batch, starts, strict=True)],
            positions=starts,
            slots=[table[s // bs] * bs + s % bs for table, s in zip(tables, starts, strict=True)],
            block_tables=tables,
        )
        if not self.decode_graphs.fits(decode):
            return None
        started = time.perf_counter()
        hidden = self.decode_graphs.run(decode)
        rows = [i for i, item in enumerate(batch) if starts[i] + 1 == len(item.seq)]
        logits = self.model.logits(hidden[rows] if len(rows) < len(batch) else hidden)
        self.forward_s += time.perf_counter() - started
        return logits, [batch[i].seq for i in rows]

    def _prepare(self, batch: list[ScheduledSeq], waits: bool = False):
        """A step's inputs and attention metadata, built on the host and moved to the device in
        one copy (step_inputs.py); at T > 1 the other ranks get them too."""
        inputs = step_inputs.pack(batch, self.block_size, waits)
        if self.workers is not None:
            self.workers.wake()
        header, body = step_inputs.share(self.group, inputs, self.device)
        return *step_inputs.unpack(header, body, inputs.body), inputs.sampled

    @torch.inference_mode()
    def follow(self) -> None:
        """Ranks 1..T-1: run the step rank 0 broadcasts, in step with it."""
        header, body = step_inputs.share(self.group, None, self.device)
        token_ids, positions, meta, sample_rows = step_inputs.unpack(header, body, None)
        before = (lambda layer: self.group.barrier()) if step_inputs.waits(header) else None
        hidden = self.model(token_ids, positions, self.cos_sin, self.kv_caches, meta, before)
        self.model.logits(hidden[sample_rows])


def _materialize(model: torch.nn.Module, device, dtype: torch.dtype) -> None:
    """Give a meta-device model uninitialised tensors on `device` (the checkpoint fills them).

    `Module.to_empty` does the same through `torch.empty_like`, whose meta-tensor path imports
    sympy: most of a second of every worker's start."""
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            tensor = torch.empty(param.shape, dtype=dtype, device=device)
            setattr(module, name, torch.nn.Parameter(tensor, requires_grad=param.requires_grad))
        for name, buffer in module.named_buffers(recurse=False):
            kind = dtype if buffer.is_floating_point() else buffer.dtype
            module.register_buffer(name, torch.empty(buffer.shape, dtype=kind, device=device))
