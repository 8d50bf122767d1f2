"""The step-level engine the workers drive: add requests, step, abort, stats."""

from __future__ import annotations

import logging
import subprocess
import time

import torch

from halfmoon.engine.config import EngineConfig
from halfmoon.engine.cuda_graphs import DecodeGraphs
from halfmoon.engine.detokenizer import TextDecoder
from halfmoon.engine.errors import RequestNotFoundError
from halfmoon.engine.forks import Forks
from halfmoon.engine.grammar import Grammars
from halfmoon.engine.hooks import KVHooks
from halfmoon.engine.intake import Intake
from halfmoon.engine.loaded_model import load_model
from halfmoon.engine.outputs import EngineStats, RequestOutput, StepTiming
from halfmoon.engine.page_pool import PagePool
from halfmoon.engine.sampler import sample
from halfmoon.engine.sampling_params import SamplingParams
from halfmoon.engine.scheduler import Scheduler
from halfmoon.engine.sequence import Sequence, SequenceStatus, TokenLogprobs
from halfmoon.engine.step_meter import StepMeter
from halfmoon.engine.stopping import Stopping
from halfmoon.engine.tokenizer import Prompt
from halfmoon.kvstore.layout import LayerKV

__all__ = ["EngineStats", "LLMEngine", "RequestOutput", "StepTiming"]  # what the parts import
log = logging.getLogger(__name__)


class LLMEngine:
    """Continuous-batching engine over a paged KV cache with automatic prefix caching."""

    def __init__(self, config: EngineConfig, hooks: KVHooks | None = None) -> None:
        self.config = config
        self.hooks = hooks
        loaded = load_model(config)
        self.model_config, self.tokenizer = loaded.config, loaded.tokenizer
        self.device, self.dtype, self.facts = loaded.device, loaded.dtype, loaded.facts
        self.num_pages, self.max_model_len = loaded.num_pages, loaded.config.max_model_len
        self.root_key = self.facts.root_key
        self.kv_cache = loaded.kv_cache  # behind its small API: what the workers move KV through
        self._runner = loaded.runner
        self.model, self.weights_bytes = self._runner.model, self._runner.weights_bytes
        self.pool = PagePool(
            self.num_pages, config.block_size, self.root_key, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(self.pool, config, hooks)
        self.forks = Forks(self.pool, self.scheduler, self.device)
        self._start_requests()
        if self.device.type == "cuda":
            from halfmoon.engine.warmup import warm_up_cuda

            warm_up_cuda(self, graphs=hooks is None)

    def _start_requests(self) -> None:
        """What a request passes through (its intake, its grammar, when it stops), the requests
        it holds, and the counts and step log it keeps."""
        cfg, tokenizer = self.model_config, self.tokenizer
        self.eos_token_ids = set(cfg.eos_token_ids)
        if tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(tokenizer.eos_token_id)
        self.grammars = Grammars(tokenizer, cfg.vocab_size, sorted(self.eos_token_ids))
        self.stopping = Stopping(TextDecoder(tokenizer), self.eos_token_ids, self.max_model_len)
        self.requests: dict[str, Sequence] = {}
        self.intake = Intake(
            tokenizer,
            cfg,
            self.config,
            self.forks,
            self.grammars,
            live=self.requests,
            forks_refused=self.kv_cache.unmapped,
        )
        self.on_step_thread: list = []  # run once by the step loop's thread (`tidy`)
        self.meter = StepMeter()
        self.step_log = self.meter.log  # what recent steps computed, for the router's cost model

    def use_decode_buffers(self, capture: bool, max_model_len: int | None = None) -> None:
        """Run decode-only steps from static buffers, replayed as CUDA graphs when `capture`
        (on CPU, or eager on CUDA, the same path without capture), sized for contexts up to
        `max_model_len` (default: the engine's)."""
        context = max_model_len or self.max_model_len
        self._runner.enable_decode_graphs(self.config.max_num_seqs, context, capture)

    @property
    def decode_graphs(self) -> DecodeGraphs | None:
        """The static decode buffers in use (`use_decode_buffers`), or None."""
        return self._runner.decode_graphs

    @property
    def decode_buffers_in_use(self) -> bool:
        return self.decode_graphs is not None

    @property
    def rank_processes(self) -> list[subprocess.Popen]:
        """The processes of ranks 1..T-1 (none at `tensor_parallel_size` 1)."""
        workers = self._runner.workers
        return [] if workers is None else list(workers.procs)

    def check_ranks(self) -> None:
        """Raise a `RankFailedError` if another rank has died (the engine cannot step)."""
        self._runner.check_ranks()

    def close(self) -> None:
        """Stop the other ranks, if any (also done when the engine is collected or at exit)."""
        self._runner.close()

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        block_keys: list[bytes] | None = None,
        *,
        num_prior_output_tokens: int = 0,
    ) -> str:
        """Validate and queue a request; returns its id. Raises `InvalidRequestError`.
        `block_keys`: the prompt's full-block keys when already hashed (else hashed here);
        `num_prior_output_tokens`: see `RequestTask`."""
        seq = self.intake.sequence(prompt, params, request_id, block_keys, num_prior_output_tokens)
        self.requests[seq.request_id] = seq
        if not self.grammars.park([seq]):  # a grammar still compiling: it waits, not the batch
            self.scheduler.add(seq)
        return seq.request_id

    def reserve(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str,
        block_keys: list[bytes] | None = None,
        *,
        num_prior_output_tokens: int = 0,
    ) -> list[int]:
        """Hold pages for a prompt whose KV will be written from outside (disaggregated decode).

        Returns the pages, in block order. Raises `OutOfPagesError` when they are not free.
        """
        seq = self.intake.sequence(prompt, params, request_id, block_keys, num_prior_output_tokens)
        self.scheduler.reserve(seq)
        self.requests[request_id] = seq
        return list(seq.block_table)

    def join(self, request_id: str, first_token_ids: int | list[int]) -> list[RequestOutput]:
        """A reserved prompt's KV is all in its pages: start decoding after its first token,
        one per sequence of the request (a list when `n` > 1, which forks it here)."""
        ids = first_token_ids if isinstance(first_token_ids, list) else [first_token_ids]
        seq = self.requests.get(request_id)
        if seq is None or seq.status is not SequenceStatus.RESERVED:
            raise RequestNotFoundError(request_id)
        self.scheduler.join(seq, ids)
        group = self.forks.fork(seq) if seq.num_forks > 1 else [seq]
        parked = self.grammars.park(group)  # decodes once its grammar is compiled
        self.scheduler.hold(group, parked)  # or once the batch has room (max_num_seqs)
        return [self._append_token(s, t, None) for s, t in zip(group, ids, strict=True)]

    def record_page_events(self) -> None:
        """Keep the events `take_page_events` returns (a prefill worker reports its pages)."""
        self.pool.events = []

    def take_page_events(self) -> list[tuple[str, bytes]]:
        """(`stored` or `evicted`, block key) of every block that entered or left this engine's
        pages since the last call (none unless `record_page_events` was called)."""
        events, self.pool.events = self.pool.events, None if self.pool.events is None else []
        return events or []

    def tidy(self) -> None:
        """Apply what a step would: pages given back from other threads (`unhold_pages_later`).
        The step loop calls it while idle, so an idle engine's page count is true."""
        while self.on_step_thread:  # the warm-up's part that runs on the step loop's thread
            self.on_step_thread.pop(0)(self)
        self.pool.drain_unholds()

    def hold_pages(self, pages: list[int]) -> None:
        """Keep `pages` (in use by a sequence) from reuse until `unhold_pages_later(pages)`."""
        self.pool.hold(pages)

    def unhold_pages_later(self, pages: list[int]) -> None:
        """Give back a `hold_pages` (any thread; takes effect at the next step)."""
        self.pool.unhold_later(pages)

    @property
    def num_held_pages(self) -> int:
        return self.pool.num_still_held()  # any thread: those given back already count out

    def uncached(self, keys: list[bytes]) -> list[bytes]:
        """The keys of `keys` without a cached page here (see `PagePool.uncached`)."""
        return self.pool.uncached(keys)

    def adopt_blocks(self, keys: list[bytes], layers: list[LayerKV]) -> int:
        """Copy the blocks of `keys` (K/V of every layer in `layers`) into pages cached as
        prefix pages (publishing `stored` events); returns how many were adopted. Blocks
        cached meanwhile are skipped, and no more are taken than there are free pages."""
        adopted = self.pool.adopt(keys)
        rows = [row for row, _ in adopted]
        pages = [page for _, page in adopted]
        for layer, kv in enumerate(layers if adopted else []):
            self.kv_cache.write_layer(layer, pages, LayerKV(kv.k[rows], kv.v[rows]))
        return len(adopted)

    def abort(self, request_id: str) -> list[RequestOutput]:
        """Stop a request now and free its pages; returns the last output of each of its
        sequences still running (finish reason `abort`)."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            raise RequestNotFoundError(request_id)
        live = [s for s in seq.group if not s.finished]
        for s in live:
            self.scheduler.finish(s, "abort")
        return [RequestOutput.of(s, s is live[-1], "abort") for s in live]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work() or bool(self.grammars.parked)

    def step(self) -> list[RequestOutput]:
        """Run one batch; return what each request that progressed produced."""
        started = time.perf_counter()
        self.pool.drain_unholds()
        self.scheduler.resume(self.grammars.unpark())
        batch = self.scheduler.schedule()
        if not batch:
            self.grammars.wait()
            self.meter.idle()
            return []
        if copies := self.pool.take_copies():
            self.kv_cache.copy_within(*zip(*copies, strict=True))
        shape = self.meter.start(batch)
        logits, sampled = self._runner.run(batch, self.hooks)
        self.scheduler.computed(batch)
        outputs = self._sample(logits, sampled) if sampled else []
        self.meter.end(shape, started, busy=self.scheduler.has_work())
        return outputs

    def _sample(self, logits: torch.Tensor, sampled: list[Sequence]) -> list[RequestOutput]:
        """The next token of each sequence whose known tokens are all computed (a prompt just
        computed with `n` > 1 forks here), appended to it."""
        logits, sampled = self.forks.fork_sampled(logits, sampled)
        result = sample(logits, sampled)
        outputs = []
        for seq, token_id, logprobs in zip(sampled, result.token_ids, result.logprobs, strict=True):
            if self.hooks is not None:
                self.hooks.sampled(seq, token_id)
            outputs.append(self._append_token(seq, token_id, logprobs))
        return outputs

    def stats(self) -> EngineStats:
        self.pool.drain_unholds()
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_waiting_tokens=self.scheduler.num_tokens_to_compute(),
            num_kv_tokens=self.scheduler.num_kv_tokens(),
            num_pages=self.num_pages,
            num_used_pages=self.pool.num_used_pages,
            num_preemptions=self.scheduler.num_preemptions,
            num_prompt_tokens_computed=self.meter.num_prompt_tokens_computed,
            num_cached_prompt_tokens=self.scheduler.num_cached_prompt_tokens,
            num_generated_tokens=self.meter.num_generated_tokens,
            num_steps=self.meter.num_steps,
            forward_s=self._runner.forward_s,
        )

    def _append_token(
        self, seq: Sequence, token_id: int, logprobs: TokenLogprobs | None
    ) -> RequestOutput:
        reason, new_text = self.stopping.append(seq, token_id, logprobs)
        self.meter.num_generated_tokens += 1
        if reason is not None:
            self.scheduler.finish(seq, reason)
        finished = reason is not None and all(s.finished for s in seq.group)
        if finished:
            del self.requests[seq.request_id]
        new_logprobs = [logprobs] if logprobs else []
        return RequestOutput.of(seq, finished, reason, [token_id], new_text, new_logprobs)
