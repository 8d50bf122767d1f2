"""A step's model inputs as one int64 buffer: built on the host from the scheduled batch, moved
to the device in one copy (and, at tensor_parallel_size > 1, broadcast to the other ranks from
rank 0), then read back as the token ids, positions and attention metadata views of it."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from halfmoon.engine.scheduler import ScheduledSeq
from halfmoon.engine.tensor_parallel import TPGroup
from halfmoon.kernels import ops
from halfmoon.kernels.attention import AttentionMetadata

# The header: the 7 parts' sizes, the block tables' rows and width, the prefill tokens,
# whether the prefill runs attend densely (`AttentionMetadata.prefill_dense_lens`) and whether
# the other ranks wait for rank 0 before each layer (its KV hooks write into their pages).
NUM_PARTS = 7
HEADER_LEN = NUM_PARTS + 5


@dataclass(slots=True)
class StepInputs:
    """A step's inputs on the host; `sampled` indexes the batch rows that sample."""

    header: np.ndarray
    body: np.ndarray
    sampled: list[int]


def pack(batch: list[ScheduledSeq], block_size: int, waits: bool = False) -> StepInputs:
    """The inputs of `batch` (prefill runs first), computed with numpy on the host: each small
    torch op costs several times more."""
    bs = block_size
    counts = [item.num_new_tokens for item in batch]
    starts = [item.seq.num_computed_tokens for item in batch]
    tokens = list(
        itertools.chain.from_iterable(
            item.seq.token_ids[s : s + n] for item, s, n in zip(batch, starts, counts, strict=True)
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
    num_prefill_tokens = int(ends[num_prefill - 1]) if num_prefill else 0
    dense = bool(num_prefill and not any(starts[:num_prefill]) and ops.dense_prefill())
    header = [*map(len, parts), len(batch), width, num_prefill_tokens, int(dense), int(waits)]
    # Each width is a multiple of 16 int32s: the tables pack into whole int64s.
    parts.append(tables.reshape(-1).view(np.int64))
    return StepInputs(np.array(header, dtype=np.int64), _concat(parts), sampled)


def _concat(parts: list) -> np.ndarray:
    """`parts` in one int64 buffer, each starting 16 bytes aligned (Triton specialises a kernel
    on its pointers' alignment)."""
    starts = _starts([len(part) for part in parts])
    host = np.zeros(int(starts[-1]), dtype=np.int64)
    for part, start in zip(parts, starts, strict=False):
        host[start : start + len(part)] = part
    return host


def _starts(sizes: list[int]) -> np.ndarray:
    return np.cumsum([0] + [-(-size // 2) * 2 for size in sizes])


def share(group: TPGroup, inputs: StepInputs | None, device) -> tuple[np.ndarray, torch.Tensor]:
    """(header, body on `device`): from `inputs` on rank 0 in one non-blocking copy (a blocking
    one would wait for the stream to drain; from pageable memory CUDA stages the bytes at once,
    so the host arrays may go away after the call), broadcast to the others at T > 1."""
    if group.rank == 0:
        body = torch.from_numpy(inputs.body).to(device, non_blocking=True)
        if group.size > 1:
            group.broadcast(torch.from_numpy(inputs.header).to(device, non_blocking=True))
            group.broadcast(body)
        return inputs.header, body
    header = group.broadcast(torch.empty(HEADER_LEN, dtype=torch.int64, device=device))
    header = header.cpu().numpy()
    body = torch.empty(int(_starts(_sizes(header))[-1]), dtype=torch.int64, device=device)
    return header, group.broadcast(body)


def _sizes(header: np.ndarray) -> list[int]:
    rows, width = int(header[NUM_PARTS]), int(header[NUM_PARTS + 1])
    return [*map(int, header[:NUM_PARTS]), rows * width // 2]


def waits(header: np.ndarray) -> bool:
    """Whether the other ranks wait for rank 0 before each layer of this step."""
    return bool(header[NUM_PARTS + 4])


def unpack(header: np.ndarray, body: torch.Tensor, host: np.ndarray | None):
    """(token ids, positions, attention metadata, rows to sample) as views of `body`; `host`,
    its copy on the host where at hand, gives the dense prefill lengths without a device read."""
    sizes, starts = _sizes(header), _starts(_sizes(header)).tolist()
    views = [body[start : start + size] for start, size in zip(starts, sizes, strict=False)]
    token_ids, positions, slots, cu_seqlens, prefix_lens, seq_lens, sample_rows, packed = views
    rows, width, num_prefill_tokens, dense = map(int, header[NUM_PARTS : NUM_PARTS + 4])
    tables = packed.view(torch.int32).view(rows, width)
    num_prefill = len(prefix_lens)
    meta = AttentionMetadata(
        slot_mapping=slots,
        num_prefill_tokens=num_prefill_tokens,
        prefill_cu_seqlens_q=cu_seqlens,
        prefill_block_tables=tables[:num_prefill],
        prefill_prefix_lens=prefix_lens,
        decode_block_tables=tables[num_prefill:],
        decode_seq_lens=seq_lens,
    )
    if dense:
        start, size = starts[3], sizes[3]
        cu = host[start : start + size] if host is not None else cu_seqlens.cpu().numpy()
        meta.prefill_dense_lens = np.diff(cu).tolist()
    return token_ids, positions, meta, sample_rows
