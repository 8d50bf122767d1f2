"""Turns a scheduled batch into one forward pass over the paged KV cache."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import numpy as np
import torch

from halfmoon.engine.cpu_linear import pack_linears
from halfmoon.engine.cpu_memory import keep_freed_memory
from halfmoon.engine.cuda_graphs import DecodeBatch, DecodeGraphs
from halfmoon.engine.hooks import KVHooks
from halfmoon.engine.kv_cache import create_shared_kv
from halfmoon.engine.loader import load_weights
from halfmoon.engine.model import CausalLM
from halfmoon.engine.model_config import ModelConfig
from halfmoon.engine.rope import cos_sin_cache
from halfmoon.engine.scheduler import ScheduledSeq
from halfmoon.engine.sequence import Sequence
from halfmoon.kernels import ops
from halfmoon.kernels.attention import AttentionMetadata


class ModelRunner:
    """Owns the model weights and the KV pages; runs one step's forward pass."""

    def __init__(
        self, model_dir: Path, cfg: ModelConfig, block_size: int, dtype: torch.dtype, device
    ) -> None:
        self.cfg, self.block_size, self.device = cfg, block_size, device
        self.forward_s = 0.0  # time inside the model's forward passes, for overhead figures
        with torch.device("meta"):
            model = CausalLM(cfg)
        _materialize(model, device, dtype)
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        load_weights(model, model_dir)
        self.model = model.eval()
        self.weights_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        # A tied head shares the embedding's weight; a packed copy would double it.
        pack_linears(model, skip=(model.lm_head,) if cfg.tie_word_embeddings else ())
        if device.type == "cpu":
            keep_freed_memory()
        self.cos_sin: torch.Tensor | None = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.decode_graphs: DecodeGraphs | None = None

    def allocate_kv(self, num_pages: int, max_model_len: int, shared: bool = False) -> str | None:
        """Allocate the KV pages and the rotary table once the weights' size is known.

        `shared` on CPU: all layers in one anonymous memory file that other processes of this
        node can map (returns its path; see `PagedKvCache.export`). A CUDA cache is shared by
        IPC handles and needs nothing here."""
        cfg, dtype, device = self.cfg, self.model.embed_tokens.weight.dtype, self.device
        self.cos_sin = cos_sin_cache(
            cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, max_model_len
        ).to(device)
        shape = (num_pages, self.block_size, cfg.num_kv_heads, cfg.head_dim)
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
        batch = sorted(batch, key=lambda item: item.num_new_tokens == 1)  # prefill runs first
        token_ids, positions, meta, sample_rows, sampled = self._prepare(batch)
        started = time.perf_counter()
        before = after = None
        if hooks is not None:
            before = lambda layer: hooks.before_layer(layer, batch)  # noqa: E731
            after = lambda layer: hooks.after_layer(layer, batch)  # noqa: E731
        hidden = self.model(token_ids, positions, self.cos_sin, self.kv_caches, meta, before, after)
        logits = self.model.logits(hidden[sample_rows])
        self.forward_s += time.perf_counter() - started
        return logits, [batch[i].seq for i in sampled]

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

    def _prepare(self, batch: list[ScheduledSeq]):
        """A step's inputs and attention metadata, computed with numpy on the host (each small
        torch op costs several times more) and moved to the device in two non-blocking copies:
        one int64 buffer for everything but the block tables, whose parts are the views.

        A blocking copy would wait for the stream to drain; from pageable memory CUDA stages
        the bytes at once, so the host arrays may go away after the call."""
        device, bs = self.device, self.block_size
        counts = [item.num_new_tokens for item in batch]
        starts = [item.seq.num_computed_tokens for item in batch]
        tokens = list(
            itertools.chain.from_iterable(
                item.seq.token_ids[s : s + n]
                for item, s, n in zip(batch, starts, counts, strict=True)
            )
        )
        # Widths rounded up to 16 pages: one kernel specialisation instead of one per width.
        width = -(-max(len(item.seq.block_table) for item in batch) // 16) * 16
        tables = np.zeros((len(batch), width), dtype=np.int32)
        for row, item in enumerate(batch):
            tables[row, : len(item.seq.block_table)] = item.seq.block_table
        counts_np = np.array(counts, dtype=np.int64)
        ends = np.cumsum(counts_np)
        row_of_token = np.repeat(np.arange(len(batch)), counts_np)
        offsets = np.arange(len(tokens)) - (ends - counts_np)[row_of_token]
        positions = np.array(starts, dtype=np.int64)[row_of_token] + offsets
        slots = tables[row_of_token, positions // bs].astype(np.int64) * bs + positions % bs
        num_prefill = sum(1 for n in counts if n > 1)
        sampled = [
            i
            for i, (item, s, n) in enumerate(zip(batch, starts, counts, strict=True))
            if s + n == len(item.seq)
        ]
        parts = [
            tokens,
            positions,
            slots,
            [0, *ends[:num_prefill].tolist()],  # prefill runs' cumulative lengths
            starts[:num_prefill],  # their cached prefixes
            [s + 1 for s in starts[num_prefill:]],  # decode context lengths
            (ends[sampled] - 1).tolist(),  # rows to sample from
        ]
        token_ids, positions_t, slots_t, cu_seqlens, prefix_lens, seq_lens, sample_rows = (
            _on_device(parts, device)
        )
        tables_t = torch.from_numpy(tables).to(device, non_blocking=True)
        meta = AttentionMetadata(
            slot_mapping=slots_t,
            num_prefill_tokens=int(ends[num_prefill - 1]) if num_prefill else 0,
            prefill_cu_seqlens_q=cu_seqlens,
            prefill_block_tables=tables_t[:num_prefill],
            prefill_prefix_lens=prefix_lens,
            decode_block_tables=tables_t[num_prefill:],
            decode_seq_lens=seq_lens,
        )
        if num_prefill and not any(starts[:num_prefill]) and ops.dense_prefill():
            meta.prefill_dense_lens = counts[:num_prefill]
        return token_ids, positions_t, meta, sample_rows, sampled


def _on_device(parts: list, device) -> list[torch.Tensor]:
    """int64 tensors of `parts` on `device` from one copy: views of one buffer, each starting
    16 bytes aligned (Triton specialises a kernel on its pointers' alignment)."""
    sizes = [len(part) for part in parts]
    starts = np.cumsum([0] + [-(-size // 2) * 2 for size in sizes])
    host = np.zeros(int(starts[-1]), dtype=np.int64)
    for part, start, size in zip(parts, starts, sizes, strict=False):
        host[start : start + size] = part
    packed = torch.from_numpy(host).to(device, non_blocking=True)
    return [packed[start : start + size] for start, size in zip(starts, sizes, strict=False)]


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
