"""What a worker tells the router about the model it serves."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from halfmoon.engine.cpu_linear import describe
from halfmoon.engine.llm_engine import LLMEngine, StepTiming
from halfmoon.engine.outputs import EngineStats
from halfmoon.kernels.kv_quant import row_width
from halfmoon.kvstore.block_events import BlockEvent
from halfmoon.kvstore.layout import KvLayout


@dataclass(slots=True)
class WorkerInfo:
    """Model identity and KV layout; the router keys blocks with `root_key` and `block_size`."""

    name: str
    kind: str
    model: str
    architecture: str
    vocab_size: int
    max_model_len: int
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    num_pages: int
    root_key: bytes
    device: str = "cpu"  # the device type its weights and KV are on: cpu or cuda
    tensor_parallel_size: int = 1  # ranks it splits the model across; its KV moves whole-head
    kernels: str = ""  # what runs the model (cpu_linear.describe): "avx2 kernels, linear blocks"
    # How its KV crosses nodes: "mooncake tcp", or "ray (why not the engine)"; "" for none.
    kv_transfer: str = ""
    # The KV pages' storage dtype when quantized (kernels/kv_quant.py: "int8",
    # "float8_e4m3fn", ...); "": the model's `dtype`.
    kv_dtype: str = ""

    @property
    def kv_layout(self) -> KvLayout:
        """A block's KV layout on this worker, as the store and the wire hold it (a quantized
        row holds its scale after its values)."""
        dtype = getattr(torch, self.kv_dtype or self.dtype)
        width = row_width(self.head_dim, dtype)
        return KvLayout(self.num_layers, self.block_size, self.num_kv_heads, width, dtype)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of one token's K and V over every layer, as stored and moved."""
        return self.kv_layout.block_bytes // self.block_size


def worker_info(name: str, kind: str, engine: LLMEngine, kv_transfer: str = "") -> WorkerInfo:
    cfg = engine.model_config
    return WorkerInfo(
        name=name,
        kind=kind,
        model=engine.config.model,
        architecture=cfg.architecture,
        vocab_size=cfg.vocab_size,
        max_model_len=engine.max_model_len,
        block_size=engine.config.block_size,
        num_layers=cfg.num_layers,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        dtype=str(engine.dtype).removeprefix("torch."),
        num_pages=engine.num_pages,
        root_key=engine.root_key,
        device=engine.device.type,
        tensor_parallel_size=engine.config.tensor_parallel_size,
        kernels=describe(engine.device, engine.dtype),
        kv_transfer=kv_transfer,
        kv_dtype=_kv_dtype(engine),
    )


def _kv_dtype(engine: LLMEngine) -> str:
    """The engine's KV storage dtype where it is not the model's, else ""."""
    dtype = engine.kv_cache.dtype
    return "" if dtype == engine.dtype else str(dtype).removeprefix("torch.")


@dataclass(slots=True)
class WorkerLoad:
    """A worker's load report: what the router's instance views are fed with."""

    name: str
    kind: str
    num_running: int
    num_waiting: int
    num_waiting_tokens: int
    num_used_pages: int
    num_pages: int
    num_kv_tokens: int
    age_s: float  # how long before the reply the counts were taken (the last step's end)

    @property
    def pages_used_ratio(self) -> float:
        return self.num_used_pages / self.num_pages


@dataclass(slots=True)
class WorkerReport:
    """What a worker tells the router at each poll, in one call."""

    load: WorkerLoad
    steps: list[StepTiming]  # engine steps since the last report
    events: list[BlockEvent]  # blocks that entered or left its own pages (the device tier)
    transfers: list[tuple[int, float]]  # (bytes, seconds) of each KV receive since then


def worker_load(name: str, kind: str, stats: EngineStats, age_s: float) -> WorkerLoad:
    """The load report of a worker whose engine's stats are `stats`, taken `age_s` ago."""
    return WorkerLoad(
        name=name,
        kind=kind,
        num_running=stats.num_running,
        num_waiting=stats.num_waiting,
        num_waiting_tokens=stats.num_waiting_tokens,
        num_used_pages=stats.num_used_pages,
        num_pages=stats.num_pages,
        num_kv_tokens=stats.num_kv_tokens,
        age_s=age_s,
    )
