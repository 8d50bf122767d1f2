"""Decode steps replayed from CUDA graphs: one graph per padded batch size and context bucket,
captured at start.

A decode step launches a few hundred small kernels; replaying them as one graph removes the
Python and launch cost that dominates a step on a GPU. Each graph reads its inputs from
static buffers, so a step only copies its token ids, positions, slots, block tables and
context lengths in and replays. Rows past the real batch are padding: slot -1 (writes no
KV), context 1 over page 0 (reads harmless data), outputs discarded.

The decode kernel sizes its splits by the block tables' width. Past `FULL_SPLIT_TOKENS` the
splits grow with it, so one graph at the full context would give a short sequence a few long
serial splits: graphs are captured per context bucket (doubling from there), each over a
narrower view of the tables, and a step replays the narrowest that holds its longest table.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from halfmoon.engine.model import CausalLM
from halfmoon.kernels.attention import AttentionMetadata
from halfmoon.kernels.decode_splits import FULL_SPLIT_TOKENS

log = logging.getLogger(__name__)


def batch_buckets(max_batch: int) -> list[int]:
    """Padded batch sizes: 1, 2, 4, 8, then every 8 up to `max_batch` (which is always one)."""
    sizes = [size for size in (1, 2, 4) if size < max_batch]
    sizes += list(range(8, max_batch, 8))
    return sorted(set(sizes + [max_batch]))


def context_widths(max_blocks: int, block_size: int) -> list[int]:
    """Block-table widths to capture: the pages of `FULL_SPLIT_TOKENS`, doubling, up to
    `max_blocks` (always one). In the first the kernel's splits are as short as eager mode's;
    in the others at most twice as long, for the contexts past the bucket below."""
    width = -(-FULL_SPLIT_TOKENS // block_size)
    widths = []
    while width < max_blocks:
        widths.append(width)
        width *= 2
    return widths + [max_blocks]


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
        self.widths = context_widths(max_blocks_per_seq, kv_caches[0][0].shape[1])
        device = kv_caches[0][0].device
        # Token ids, positions, slots and context lengths as the rows of one buffer (one copy
        # a step), the block tables beside it; each graph reads its first `size` columns/rows.
        self.inputs = torch.zeros((4, max_batch), dtype=torch.int64, device=device)
        self.token_ids, self.positions, self.slots, self.seq_lens = self.inputs.unbind(0)
        self.slots.fill_(-1)
        self.seq_lens.fill_(1)
        self.block_tables = torch.zeros(
            (max_batch, max_blocks_per_seq), dtype=torch.int32, device=device
        )
        # Their host side, written through numpy views (far cheaper than building tensors from
        # lists each step) and page-locked on CUDA so the copies are asynchronous. On CPU they
        # are the buffers themselves.
        on_cuda = device.type == "cuda"
        self._host_inputs = self.inputs.cpu().pin_memory() if on_cuda else self.inputs
        self._host_tables = self.block_tables.cpu().pin_memory() if on_cuda else self.block_tables
        self._inputs_np = self._host_inputs.numpy()
        self._tables_np = self._host_tables.numpy()
        # What each host table row holds: (the block table list it mirrors, how many of its
        # entries). A block table only grows in place and is replaced, never edited (see
        # `Sequence.block_table`), so a step writes only the pages added since the last one.
        self._rows: list[tuple[list[int] | None, int]] = [(None, 0)] * max_batch
        self._copied = torch.cuda.Event() if on_cuda else None
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if capture:
            self._capture_all()

    def bucket_for(self, num_seqs: int) -> int | None:
        """The smallest bucket that holds `num_seqs` rows, or None when none does."""
        return next((size for size in self.buckets if size >= num_seqs), None)

    def width_for(self, batch: DecodeBatch) -> int | None:
        """The narrowest context bucket that holds the batch's longest block table."""
        widest = max(len(table) for table in batch.block_tables)
        return next((width for width in self.widths if width >= widest), None)

    def fits(self, batch: DecodeBatch) -> bool:
        return self.bucket_for(len(batch)) is not None and self.width_for(batch) is not None

    @torch.inference_mode()
    def run(self, batch: DecodeBatch) -> torch.Tensor:
        """Final hidden states `[len(batch), hidden]` of one decode step (graph or eager)."""
        size, width = self.bucket_for(len(batch)), self.width_for(batch)
        self._load(batch, size)
        if (size, width) in self.graphs:
            graph, hidden = self.graphs[(size, width)]
            graph.replay()
        else:
            hidden = self._forward(size, width)
        return hidden[: len(batch)]

    def _load(self, batch: DecodeBatch, size: int) -> None:
        """Write the batch into the first rows of the buffers and padding up to `size`."""
        n = len(batch)
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copies have read the host buffers
        inputs = self._inputs_np
        inputs[0, :n] = batch.token_ids
        inputs[1, :n] = batch.positions
        inputs[2, :n] = batch.slots
        inputs[3, :n] = inputs[1, :n] + 1
        inputs[2, n:size] = -1  # padding rows write no KV and read one token of page 0
        inputs[3, n:size] = 1
        self._tables_np[n:size, 0] = 0
        rows, tables = self._rows, self._tables_np
        for row, table in enumerate(batch.block_tables):
            mirrored, known = rows[row]
            if mirrored is not table or known > len(table):
                known = 0
            if known < len(table):
                tables[row, known : len(table)] = table[known:]
                rows[row] = (table, len(table))
        for row in range(n, size):
            rows[row] = (None, 0)
        if self._copied is not None:
            self.inputs.copy_(self._host_inputs, non_blocking=True)
            self.block_tables[:size].copy_(self._host_tables[:size], non_blocking=True)
            self._copied.record()

    def _forward(self, size: int, width: int) -> torch.Tensor:
        device = self.token_ids.device
        meta = AttentionMetadata(
            slot_mapping=self.slots[:size],
            num_prefill_tokens=0,
            prefill_cu_seqlens_q=torch.zeros(1, dtype=torch.int64, device=device),
            prefill_block_tables=self.block_tables[:0],
            prefill_prefix_lens=self.seq_lens[:0],
            decode_block_tables=self.block_tables[:size, :width],
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
                for width in reversed(self.widths):
                    self._forward(size, width)  # compiles the kernels, settles the allocator
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, stream=stream):
                        hidden = self._forward(size, width)
                    self.graphs[(size, width)] = (graph, hidden)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        log.info(
            "captured decode CUDA graphs for batch sizes %s and table widths %s in %.1f s",
            self.buckets,
            self.widths,
            time.perf_counter() - started,
        )
