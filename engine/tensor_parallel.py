"""Tensor parallelism inside a worker (Megatron-LM's split, as vLLM does it): each rank holds a
slice of every layer, and a few collectives join the slices.

- Column-parallel (`qkv_proj`, `gate_up_proj`): a rank holds the output rows of its query heads
  and KV heads, or of its slice of the intermediate size; its output stays sliced.
- Row-parallel (`o_proj`, `down_proj`): a rank holds the input columns of that slice, and an
  all-reduce sums the ranks' partial outputs.
- Experts (engine/moe_block.py): each expert's MLP split as a dense one is; the router whole.
- Vocabulary-parallel embedding and LM head: a rank holds `ceil(vocab / T)` rows; a lookup
  outside them gives zeros before the all-reduce, and the head's logits are gathered on rank 0.

At T = 1 every layer is a plain `nn.Linear` / `nn.Embedding` and no collective runs.
"""

from __future__ import annotations

import math
import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from halfmoon.engine.errors import ModelLoadError
from halfmoon.engine.model_config import ModelConfig

# The ranks of a worker share one node: their rendezvous (the TCPStore) and their collectives
# (gloo's sockets, NCCL's bootstrap) listen on loopback only, never on the node's interfaces.
HOST = "127.0.0.1"
# A collective waits this long for a live but stuck rank; a dead rank's closed socket fails it
# at once.
TIMEOUT = timedelta(seconds=120)


@dataclass(frozen=True, slots=True)
class TPGroup:
    """This rank's place among the `size` ranks of one worker; `pg` None at size 1."""

    rank: int = 0
    size: int = 1
    pg: dist.ProcessGroup | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `x`, in place."""
        if self.pg is not None:
            self.pg.allreduce([x]).wait()
        return x

    def barrier(self) -> None:
        """Wait until every rank has reached it."""
        self.pg.barrier().wait()

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` on every rank, in place."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.pg.broadcast([x], options).wait()
        return x

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's `x` side by side along the last dimension, on rank 0 (None elsewhere)."""
        if self.pg is None:
            return x
        options = dist.GatherOptions()
        options.rootRank = 0
        parts = [[torch.empty_like(x) for _ in range(self.size)]] if self.rank == 0 else []
        self.pg.gather(parts, [x.contiguous()], options).wait()
        return torch.cat(parts[0], dim=-1) if self.rank == 0 else None


SINGLE = TPGroup()


def process_group_backend(device: torch.device) -> str:
    """The collectives' backend for ranks on `device`: NCCL on CUDA, gloo otherwise."""
    return "nccl" if device.type == "cuda" else "gloo"


def rank_devices(device: torch.device, size: int) -> list[torch.device]:
    """Each rank's device, rank 0's being `device`: on CUDA one GPU each, from rank 0's on (a
    ModelLoadError naming both counts if fewer are visible); otherwise `device` for all."""
    if device.type != "cuda":
        return [device] * size
    first, visible = device.index or 0, torch.cuda.device_count()
    if first + size > visible:
        raise ModelLoadError(
            f"tensor_parallel_size={size} from cuda:{first} needs {first + size} visible GPUs "
            f"(one per rank: cuda:{first} to cuda:{first + size - 1}), but "
            f"{visible} {'is' if visible == 1 else 'are'} visible: lower tensor_parallel_size "
            "or make more GPUs visible (CUDA_VISIBLE_DEVICES)"
        )
    return [torch.device("cuda", first + rank) for rank in range(size)]


def listening_store(size: int) -> dist.TCPStore:
    """Rank 0's rendezvous for `size` ranks on a free loopback port (`.port`). TCPStore itself
    would listen on every interface; it is handed a socket bound to `HOST` instead."""
    listener = socket.create_server((HOST, 0), backlog=128)
    port = listener.getsockname()[1]
    fd = listener.detach()
    return dist.TCPStore(
        HOST, port, size, True, timeout=TIMEOUT, wait_for_workers=False, master_listen_fd=fd
    )


def joined_store(port: int, size: int) -> dist.TCPStore:
    """A rank's client of rank 0's `listening_store`."""
    return dist.TCPStore(HOST, port, size, False, timeout=TIMEOUT)


def connect(rank: int, size: int, store: dist.Store, device: torch.device) -> TPGroup:
    """Join the worker's process group through `store` (`process_group_backend`); on CUDA
    `device` becomes this process's current GPU first, the one NCCL's communicator binds to."""
    if process_group_backend(device) == "nccl":
        torch.cuda.set_device(device)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")  # the bootstrap's sockets
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = TIMEOUT
        return TPGroup(rank, size, dist.ProcessGroupNCCL(store, rank, size, options))
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=HOST)]
    options._timeout = TIMEOUT
    return TPGroup(rank, size, dist.ProcessGroupGloo(store, rank, size, options))


def check_divisible(cfg: ModelConfig, size: int) -> None:
    """Raise a ModelLoadError naming the counts unless `size` ranks split the model evenly."""
    counts = {
        "attention heads": cfg.num_heads,
        "KV heads": cfg.num_kv_heads,
        "intermediate size": cfg.intermediate_size,
    }
    if cfg.moe is not None:
        counts["expert intermediate size"] = cfg.moe.expert_intermediate_size
        if cfg.moe.shared_expert_intermediate_size:
            counts["shared expert intermediate size"] = cfg.moe.shared_expert_intermediate_size
    uneven = [f"{name} ({count})" for name, count in counts.items() if count % size]
    if uneven:
        common = math.gcd(*counts.values())
        divisors = [d for d in range(1, common + 1) if common % d == 0 and d <= 64]
        raise ModelLoadError(
            f"tensor_parallel_size={size} does not divide the model's {', '.join(uneven)}: "
            f"each rank must hold whole heads and an equal MLP slice; use one of "
            f"{', '.join(map(str, divisors))}"
        )


def vocab_rows(vocab_size: int, size: int) -> int:
    """Rows of the embedding and LM head each rank holds (the last one padded)."""
    return -(-vocab_size // size)


class VocabParallelEmbedding(nn.Embedding):
    """An embedding over this rank's rows of the vocabulary, summed over the ranks."""

    def __init__(self, vocab_size: int, hidden_size: int, group: TPGroup) -> None:
        rows = vocab_rows(vocab_size, group.size)
        super().__init__(rows, hidden_size, _weight=torch.empty(rows, hidden_size))
        self.group, self.first_row = group, group.rank * rows

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        local = token_ids - self.first_row
        outside = (local < 0) | (local >= self.num_embeddings)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.group.all_reduce(x.masked_fill_(outside.unsqueeze(-1), 0.0))
