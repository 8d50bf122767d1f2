"""The step-level engine the workers drive: add requests, step, abort, stats."""

from __future__ import annotations

import hashlib
import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch

from halfmoon.engine.config import EngineConfig
from halfmoon.engine.detokenizer import TextDecoder, append_text, flush_text
from halfmoon.engine.errors import (
    InvalidRequestError,
    ModelLoadError,
    OutOfPagesError,
    RequestNotFoundError,
)
from halfmoon.engine.hooks import KVHooks
from halfmoon.engine.kv_cache import PagedKvCache
from halfmoon.engine.kv_sizing import (
    activation_bytes,
    cuda_memory,
    kv_budget_bytes,
    page_bytes,
    plan_num_pages,
)
from halfmoon.engine.loader import checkpoint_files
from halfmoon.engine.model_config import ModelConfig, load_model_config
from halfmoon.engine.model_runner import ModelRunner
from halfmoon.engine.page_pool import PagePool
from halfmoon.engine.sampler import sample
from halfmoon.engine.sampling_params import SamplingParams
from halfmoon.engine.scheduler import Scheduler
from halfmoon.engine.sequence import Sequence, SequenceStatus, TokenLogprobs
from halfmoon.engine.tokenizer import Prompt, load_tokenizer, tokenize_prompt
from halfmoon.kernels import ops, reference
from halfmoon.kvstore.keys import model_root_key

log = logging.getLogger(__name__)
STEP_LOG = 512


class StepTiming(NamedTuple):
    """One engine step: its prefill chunks as (new tokens, tokens before them), its decode
    sequences and the KV tokens they read, and its wall time (`started` is perf_counter).

    `waited_s` is how long the step started after the previous one ended while work was
    pending (lock and interpreter contention between steps); 0 after an idle engine.
    """

    prefill_chunks: tuple[tuple[int, int], ...]
    decode_seqs: int
    decode_kv_tokens: int
    seconds: float
    started: float
    waited_s: float = 0.0


@dataclass(slots=True)
class RequestOutput:
    """What one step added to one request; the last one has `finished=True`."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # (stage, wall clock) pairs for the router's per-request trace: the engine step that made
    # this output (`AsyncEngine`), and on a stream's first output the worker's own stages.
    timeline: tuple[tuple[str, float], ...] = ()


@dataclass(slots=True)
class EngineStats:
    """Counters and gauges for metrics and load reports."""

    num_running: int
    num_waiting: int
    num_pages: int
    num_used_pages: int
    num_preemptions: int
    num_prompt_tokens_computed: int
    num_cached_prompt_tokens: int
    num_generated_tokens: int
    num_steps: int


class LLMEngine:
    """Continuous-batching engine over a paged KV cache with automatic prefix caching."""

    def __init__(self, config: EngineConfig, hooks: KVHooks | None = None) -> None:
        self.config = config
        self.hooks = hooks
        model_dir = Path(config.model)
        if not model_dir.is_dir():
            raise ModelLoadError(
                f"model directory {config.model!r} does not exist: pass a Hugging Face checkpoint "
                "directory, or run `halfmoon init-model DIR` to create the default tiny model"
            )
        self.model_config = cfg = load_model_config(model_dir)
        self.device = _pick_device(config.device)
        self.dtype = _pick_dtype(config.dtype, model_dir, self.device)
        self.tokenizer = load_tokenizer(model_dir)
        self.decode_text = TextDecoder(self.tokenizer)
        self.runner = ModelRunner(model_dir, cfg, config.block_size, self.dtype, self.device)
        self.num_pages, self.max_model_len = _size_kv(config, cfg, self.dtype, self.runner)
        cfg.max_model_len = self.max_model_len
        shared_path = self.runner.allocate_kv(self.num_pages, self.max_model_len, config.share_kv)
        self.kv = PagedKvCache(self.runner.kv_caches, shared_path)
        self.root_key = model_root_key(
            _model_identity(model_dir),
            str(self.dtype),
            cfg.num_layers,
            cfg.num_kv_heads,
            cfg.head_dim,
            config.block_size,
        )
        self.pool = PagePool(
            self.num_pages, config.block_size, self.root_key, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.pool,
            config.max_num_batched_tokens,
            config.max_num_seqs,
            config.prefill_chunk_size,
            hooks,
        )
        self.eos_token_ids = set(cfg.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.requests: dict[str, Sequence] = {}
        self.reserved: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self.num_prompt_tokens_computed = 0
        self.num_generated_tokens = 0
        self.num_steps = 0
        # What each recent step computed and how long it took, for the router's cost model.
        self.step_log: deque[StepTiming] = deque(maxlen=STEP_LOG)
        self._busy_since: float | None = None  # end of the last step if it left work pending
        if self.device.type == "cuda":
            self._warm_up(hooks is None)

    def _warm_up(self, graphs: bool) -> None:
        """Compile every kernel specialisation now, then capture the decode graphs (decode
        engines only, unless `enforce_eager`), so no request waits for a compiler."""
        from halfmoon.engine.warmup import warm_up

        warm_up(self)
        # The torch references sync with the host (`.tolist()`), which a graph cannot capture.
        if graphs and ops.backend_for(self.runner.kv_caches[0][0]) is reference:
            log.info("HALFMOON_KERNELS=torch: decode steps run eagerly (no CUDA graphs)")
            graphs = False
        if graphs and not self.config.enforce_eager:
            self.runner.enable_decode_graphs(
                self.config.max_num_seqs, self.max_model_len, capture=True
            )

    def add_request(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        """Validate and queue a request; returns its id. Raises `InvalidRequestError`."""
        seq = self._new_sequence(prompt, params, request_id)
        self.requests[seq.request_id] = seq
        self.scheduler.add(seq)
        return seq.request_id

    def reserve(self, prompt: Prompt, params: SamplingParams, request_id: str) -> list[int]:
        """Hold pages for a prompt whose KV will be written from outside (disaggregated decode).

        Returns the pages, in block order. Raises `OutOfPagesError` when they are not free.
        """
        seq = self._new_sequence(prompt, params, request_id)
        if not self.pool.can_grow(seq, len(seq)):
            raise OutOfPagesError(self.pool.pages_needed(seq, len(seq)), self.pool.num_free_pages)
        self.pool.grow(seq, len(seq))
        self.requests[request_id] = seq
        self.reserved[request_id] = seq
        return list(seq.block_table)

    def join(self, request_id: str, first_token_id: int) -> RequestOutput:
        """A reserved prompt's KV is all in its pages: start decoding after `first_token_id`."""
        seq = self.reserved.pop(request_id, None)
        if seq is None:
            raise RequestNotFoundError(request_id)
        seq.num_computed_tokens = seq.num_prompt_tokens
        seq.status = SequenceStatus.RUNNING
        self.pool.cache_full_blocks(seq)
        self.scheduler.running.append(seq)
        return self._append_token(seq, first_token_id, None)

    def _new_sequence(
        self, prompt: Prompt, params: SamplingParams | None, request_id: str | None
    ) -> Sequence:
        params = params or SamplingParams()
        params.validate()
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise InvalidRequestError(
                "request_id", request_id, "must be unique among live requests"
            )
        token_ids = tokenize_prompt(self.tokenizer, prompt, self.model_config.vocab_size)
        if len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                "prompt",
                f"<{len(token_ids)} tokens>",
                f"must be shorter than the context length of {self.max_model_len} tokens",
            )
        seq = Sequence(request_id, token_ids, len(token_ids), params, time.monotonic())
        if params.seed is not None:
            seq.generator = torch.Generator(device=self.device).manual_seed(params.seed)
        return seq

    def record_page_events(self) -> None:
        """Keep the events `take_page_events` returns (a prefill worker reports its pages)."""
        self.pool.events = []

    def take_page_events(self) -> list[tuple[str, bytes]]:
        """(`stored` or `evicted`, block key) of every block that entered or left this engine's
        pages since the last call (none unless `record_page_events` was called)."""
        events = self.pool.events or []
        if self.pool.events is not None:
            self.pool.events = []
        return events

    def abort(self, request_id: str) -> None:
        """Stop a request now and free its pages."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            raise RequestNotFoundError(request_id)
        self.reserved.pop(request_id, None)
        self.scheduler.finish(seq, "abort")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[RequestOutput]:
        """Run one batch; return what each request that progressed produced."""
        started = time.perf_counter()
        self.pool.drain_unholds()
        batch = self.scheduler.schedule()
        if not batch:
            self._busy_since = None
            return []
        self.num_steps += 1
        chunks, decode_seqs, decode_kv = [], 0, 0
        for item in batch:
            seq = item.seq
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                self.num_prompt_tokens_computed += min(
                    item.num_new_tokens, seq.num_prompt_tokens - seq.num_computed_tokens
                )
                chunks.append((item.num_new_tokens, seq.num_computed_tokens))
            else:
                decode_seqs += 1
                decode_kv += seq.num_computed_tokens + 1
        logits, sampled = self.runner.run(batch, self.hooks)
        for item in batch:
            item.seq.num_computed_tokens += item.num_new_tokens
            self.pool.cache_full_blocks(item.seq)
        outputs = []
        if sampled:
            result = sample(logits, sampled)
            for seq, token_id, logprobs in zip(
                sampled, result.token_ids, result.logprobs, strict=True
            ):
                if self.hooks is not None:
                    self.hooks.sampled(seq, token_id)
                outputs.append(self._append_token(seq, token_id, logprobs))
        ended = time.perf_counter()
        waited_s = started - self._busy_since if self._busy_since is not None else 0.0
        self.step_log.append(
            StepTiming(tuple(chunks), decode_seqs, decode_kv, ended - started, started, waited_s)
        )
        self._busy_since = ended if self.scheduler.has_work() else None
        return outputs

    def stats(self) -> EngineStats:
        self.pool.drain_unholds()
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_pages=self.num_pages,
            num_used_pages=self.pool.num_used_pages,
            num_preemptions=self.scheduler.num_preemptions,
            num_prompt_tokens_computed=self.num_prompt_tokens_computed,
            num_cached_prompt_tokens=self.scheduler.num_cached_prompt_tokens,
            num_generated_tokens=self.num_generated_tokens,
            num_steps=self.num_steps,
        )

    def _append_token(
        self, seq: Sequence, token_id: int, logprobs: TokenLogprobs | None
    ) -> RequestOutput:
        seq.token_ids.append(token_id)
        self.num_generated_tokens += 1
        if logprobs is not None:
            seq.logprobs.append(logprobs)
        params = seq.params
        stop_token = token_id in params.stop_token_ids or (
            not params.ignore_eos and token_id in self.eos_token_ids
        )
        reason = "stop" if stop_token else None
        if not stop_token:
            added = append_text(self.decode_text, seq)
            if params.stop and (cut := _find_stop(seq.text, added, params.stop)) is not None:
                seq.text = seq.text[:cut]
                reason = "stop"
        if reason is None and (
            seq.num_output_tokens >= params.max_tokens or len(seq) >= self.max_model_len
        ):
            reason = "length"
            flush_text(self.decode_text, seq)
        new_text = _emit_text(seq, finished=reason is not None)
        if reason is not None:
            self.scheduler.finish(seq, reason)
            del self.requests[seq.request_id]
        return RequestOutput(
            seq.request_id,
            [token_id],
            new_text,
            reason is not None,
            reason,
            seq.num_prompt_tokens,
            seq.num_cached_tokens,
            [logprobs] if logprobs else [],
        )


def _emit_text(seq: Sequence, finished: bool) -> str:
    """Text ready to stream; a tail that could still grow into a stop string is held back."""
    hold = 0 if finished or not seq.params.stop else max(len(s) for s in seq.params.stop) - 1
    end = max(seq.num_emitted_chars, len(seq.text) - hold)
    text = seq.text[seq.num_emitted_chars : end]
    seq.num_emitted_chars = end
    return text


def _find_stop(text: str, new_text: str, stops: list[str]) -> int | None:
    """Index in `text` where the earliest stop string that the new text completed starts."""
    window = len(new_text) + max(len(s) for s in stops) - 1
    start = max(0, len(text) - window)
    hits = [i for s in stops if (i := text.find(s, start)) != -1]
    return min(hits) if hits else None


def _model_identity(model_dir: Path) -> str:
    """Name plus a hash of the config and the first weight bytes: equal across nodes that
    hold the same checkpoint, different for checkpoints that differ."""
    digest = hashlib.sha256((model_dir / "config.json").read_bytes())
    with checkpoint_files(model_dir)[0].open("rb") as weights:
        digest.update(weights.read(1 << 16))
    return f"{model_dir.resolve().name}@{digest.hexdigest()[:16]}"


def _size_kv(
    config: EngineConfig, cfg: ModelConfig, dtype: torch.dtype, runner: ModelRunner
) -> tuple[int, int]:
    """(num_pages, max_model_len): the pages the budget allows and the context they can hold."""
    if config.max_model_len is not None and config.max_model_len > cfg.max_model_len:
        raise ModelLoadError(
            f"max_model_len={config.max_model_len} exceeds the model's context of "
            f"{cfg.max_model_len} tokens (max_position_embeddings / sliding window); lower it"
        )
    max_len = config.max_model_len or cfg.max_model_len
    pages_per_seq = -(-max_len // config.block_size)
    num_pages = config.num_pages
    if num_pages is None:
        activations = activation_bytes(cfg, config.max_num_batched_tokens, config.max_num_seqs)
        memory = cuda_memory(runner.device, runner.weights_bytes)
        budget = kv_budget_bytes(
            config.kv_cache_memory_bytes, config.gpu_memory_utilization, memory, activations
        )
        capped = memory is None and config.kv_cache_memory_bytes is None
        bytes_per_page = page_bytes(cfg, config.block_size, dtype)
        num_pages = plan_num_pages(
            budget, bytes_per_page, pages_per_seq, config.max_num_seqs, capped
        )
    capacity = num_pages * config.block_size
    if config.max_model_len is not None and capacity < config.max_model_len:
        raise ModelLoadError(
            f"the KV cache holds {capacity} tokens ({num_pages} pages), fewer than "
            f"max_model_len={config.max_model_len}; give it more memory (--kv-cache-memory, "
            "--gpu-memory-utilization) or lower --max-model-len"
        )
    if capacity < max_len:
        log.info("context limited to %d tokens by the KV cache (%d pages)", capacity, num_pages)
    return num_pages, min(max_len, capacity)


def _pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _pick_dtype(name: str, model_dir: Path, device: torch.device) -> torch.dtype:
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cpu":
        return torch.float32
    import json

    stored = json.loads((model_dir / "config.json").read_text())
    stored_name = stored.get("dtype") or stored.get("torch_dtype") or "bfloat16"
    return getattr(torch, stored_name) if stored_name != "float32" else torch.bfloat16
