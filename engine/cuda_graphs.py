"""Decode steps replayed from CUDA graphs: one graph per padded batch size, captured at start.

A decode step launches a few hundred small kernels; replaying them as one graph removes the
Python and launch cost that dominates a step on a GPU. Each graph reads its inputs from
static buffers, so a step only copies its token ids, positions, slots, block tables and
context lengths in and replays. Rows past the real batch are padding: slot -1 (writes no
KV), context 1 over page 0 (reads harmless data), outputs discarded.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from halfmoon.engine.model import CausalLM
from halfmoon.kernels.attention import AttentionMetadata

log = logging.getLogger(__name__)


def batch_buckets(max_batch: int) -> list[int]:
    """Padded batch sizes: 1, 2, 4, 8, then every 8 up to `max_batch` (which is always one)."""
    sizes = [size for size in (1, 2, 4) if size < max_batch]
    sizes += list(range(8, max_batch, 8))
    return sorted(set(sizes + [max_batch]))


@dataclass(slots=True)
class DecodeBatch:
    """One decode step's inputs on the host: a token per sequence at `positions`."""

    token_ids: list[int]
    positions: list[int]
    slots: list[int]
    block_tables: list[list[int]]

    def __len__(self) -> int:
        return len(self.token_ids)


class DecodeGraphs:
    """Static input buffers and, on CUDA, one captured graph per batch bucket.

    With `capture=False` (CPU) `run` executes the same padded static-buffer forward eagerly,
    which is how the CPU tests check the padding.
    """

    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        cos_sin: torch.Tensor,
        max_batch: int,
        max_blocks_per_seq: int,
        capture: bool,
    ) -> None:
        self.model, self.kv_caches, self.cos_sin = model, kv_caches, cos_sin
        self.buckets = batch_buckets(max_batch)
        self.max_blocks = max_blocks_per_seq
        device = kv_caches[0][0].device
        self.token_ids = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.slots = torch.full((max_batch,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(
            (max_batch, max_blocks_per_seq), dtype=torch.int32, device=device
        )
        self.seq_lens = torch.ones(max_batch, dtype=torch.int64, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if capture:
            self._capture_all()

    def bucket_for(self, num_seqs: int) -> int | None:
        """The smallest bucket that holds `num_seqs` rows, or None when none does."""
        return next((size for size in self.buckets if size >= num_seqs), None)

    def fits(self, batch: DecodeBatch) -> bool:
        widest = max(len(table) for table in batch.block_tables)
        return self.bucket_for(len(batch)) is not None and widest <= self.max_blocks

    @torch.inference_mode()
    def run(self, batch: DecodeBatch) -> torch.Tensor:
        """Final hidden states `[len(batch), hidden]` of one decode step (graph or eager)."""
        size = self.bucket_for(len(batch))
        self._load(batch, size)
        if size in self.graphs:
            graph, hidden = self.graphs[size]
            graph.replay()
        else:
            hidden = self._forward(size)
        return hidden[: len(batch)]

    def _load(self, batch: DecodeBatch, size: int) -> None:
        """Copy the batch into the buffers' first rows and reset rows up to `size` to padding."""
        n = len(batch)
        width = self.max_blocks
        tables = [table + [0] * (width - len(table)) for table in batch.block_tables]
        host = torch.tensor(
            [batch.token_ids, batch.positions, batch.slots, [p + 1 for p in batch.positions]],
            dtype=torch.int64,
        )
        self.token_ids[:n].copy_(host[0], non_blocking=True)
        self.positions[:n].copy_(host[1], non_blocking=True)
        self.slots[:n].copy_(host[2], non_blocking=True)
        self.seq_lens[:n].copy_(host[3], non_blocking=True)
        self.block_tables[:n].copy_(torch.tensor(tables, dtype=torch.int32), non_blocking=True)
        if size > n:
            self.slots[n:size].fill_(-1)
            self.seq_lens[n:size].fill_(1)
            self.block_tables[n:size].zero_()

    def _forward(self, size: int) -> torch.Tensor:
        device = self.token_ids.device
        meta = AttentionMetadata(
            slot_mapping=self.slots[:size],
            num_prefill_tokens=0,
            prefill_cu_seqlens_q=torch.zeros(1, dtype=torch.int64, device=device),
            prefill_block_tables=self.block_tables[:0],
            prefill_prefix_lens=self.seq_lens[:0],
            decode_block_tables=self.block_tables[:size],
            decode_seq_lens=self.seq_lens[:size],
        )
        return self.model(
            self.token_ids[:size], self.positions[:size], self.cos_sin, self.kv_caches, meta
        )

    @torch.inference_mode()
    def _capture_all(self) -> None:
        """Capture the largest bucket first so the smaller ones reuse its memory pool."""
        started = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for size in reversed(self.buckets):
                self._forward(size)  # compiles the kernels and settles the allocator
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    hidden = self._forward(size)
                self.graphs[size] = (graph, hidden)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        log.info(
            "captured decode CUDA graphs for batch sizes %s in %.1f s",
            self.buckets,
            time.perf_counter() - started,
        )
