"""The step-level engine the workers drive: add requests, step, abort, stats."""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque

from halfmoon.engine.config import EngineConfig
from halfmoon.engine.detokenizer import TextDecoder
from halfmoon.engine.errors import (
    InvalidRequestError,
    OutOfPagesError,
    RequestNotFoundError,
)
from halfmoon.engine.forks import Forks
from halfmoon.engine.grammar import Grammars
from halfmoon.engine.hooks import KVHooks
from halfmoon.engine.intake import Intake
from halfmoon.engine.kv_sizing import size_kv
from halfmoon.engine.loader import model_directory, pick_device, pick_dtype
from halfmoon.engine.model_config import load_model_config
from halfmoon.engine.model_digest import model_identity
from halfmoon.engine.model_facts import ModelFacts
from halfmoon.engine.model_runner import ModelRunner
from halfmoon.engine.outputs import EngineStats, RequestOutput, StepTiming
from halfmoon.engine.page_pool import PagePool
from halfmoon.engine.sampler import sample
from halfmoon.engine.sampling_params import SamplingParams
from halfmoon.engine.scheduler import Scheduler
from halfmoon.engine.sequence import Sequence, SequenceStatus, TokenLogprobs
from halfmoon.engine.stopping import Stopping
from halfmoon.engine.tokenizer import Prompt, load_tokenizer
from halfmoon.kvstore.keys import model_root_key
from halfmoon.kvstore.layout import LayerKV

log = logging.getLogger(__name__)
STEP_LOG = 512


class LLMEngine:
    """Continuous-batching engine over a paged KV cache with automatic prefix caching."""

    def __init__(self, config: EngineConfig, hooks: KVHooks | None = None) -> None:
        self.config = config
        self.hooks = hooks
        model_dir = model_directory(config.model)
        self.model_config = cfg = load_model_config(model_dir)
        self.device = pick_device(config.device)
        self.dtype = pick_dtype(config.dtype, model_dir, self.device)
        self.tokenizer = load_tokenizer(model_dir)
        self.runner = ModelRunner.start(model_dir, cfg, config, self.dtype, self.device)
        self.num_pages, self.max_model_len = size_kv(
            config, cfg, self.dtype, self.device, self.runner.weights_bytes
        )
        cfg.max_model_len = self.max_model_len
        self.kv = self.runner.allocate_kv(self.num_pages, self.max_model_len, config.share_kv)
        self.root_key = model_root_key(
            model_identity(model_dir), str(self.dtype), cfg.num_layers, cfg.num_kv_heads,
            cfg.head_dim, config.block_size,
        )  # fmt: skip
        self.pool = PagePool(
            self.num_pages, config.block_size, self.root_key, config.enable_prefix_caching
        )
        self.facts = ModelFacts(
            config.model, cfg.architecture, cfg.vocab_size, cfg.num_layers, config.block_size,
            self.root_key, config.enable_prefix_caching,
        )  # fmt: skip
        self.scheduler = Scheduler(
            self.pool, config.max_num_batched_tokens, config.max_num_seqs,
            config.prefill_chunk_size, hooks,
        )  # fmt: skip
        self.forks = Forks(self.pool, self.scheduler, self.device)
        self.eos_token_ids = set(cfg.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.grammars = Grammars(self.tokenizer, cfg.vocab_size, sorted(self.eos_token_ids))
        self.stopping = Stopping(
            TextDecoder(self.tokenizer), self.eos_token_ids, self.max_model_len
        )
        self.intake = Intake(
            self.tokenizer, cfg.vocab_size, self.max_model_len, config.max_num_seqs,
            config.block_size, self.forks, self.grammars, self.kv.unmapped,
        )  # fmt: skip
        self._start_books()
        if self.device.type == "cuda":
            from halfmoon.engine.warmup import warm_up_cuda

            warm_up_cuda(self, graphs=hooks is None)

    def _start_books(self) -> None:
        """The requests it holds and the counters and step log it keeps."""
        self.requests: dict[str, Sequence] = {}
        self.reserved: dict[str, Sequence] = {}
        self.on_step_thread: list = []  # run once by the step loop's thread (`tidy`)
        self._ids = itertools.count()
        self.num_prompt_tokens_computed = 0
        self.num_generated_tokens = 0
        self.num_steps = 0
        # What each recent step computed and how long it took, for the router's cost model.
        self.step_log: deque[StepTiming] = deque(maxlen=STEP_LOG)
        self._busy_since: float | None = None  # end of the last step if it left work pending

    def use_decode_buffers(self, capture: bool) -> None:
        """Run decode-only steps from static buffers, replayed as CUDA graphs when `capture`
        (on CPU, or eager on CUDA, the same path without capture)."""
        self.runner.enable_decode_graphs(self.config.max_num_seqs, self.max_model_len, capture)

    @property
    def decode_buffers_in_use(self) -> bool:
        return self.runner.decode_graphs is not None

    @property
    def weights_bytes(self) -> int:
        return self.runner.weights_bytes

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
        seq = self._new_sequence(prompt, params, request_id, block_keys)
        seq.num_prior_output_tokens = num_prior_output_tokens
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
        seq = self._new_sequence(prompt, params, request_id, block_keys)
        seq.num_prior_output_tokens = num_prior_output_tokens
        if not self.pool.can_grow(seq, len(seq)):
            raise OutOfPagesError(self.pool.pages_needed(seq, len(seq)), self.pool.num_free_pages)
        self.pool.grow(seq, len(seq))
        self.requests[request_id] = seq
        self.reserved[request_id] = seq
        return list(seq.block_table)

    def join(self, request_id: str, first_token_ids: int | list[int]) -> list[RequestOutput]:
        """A reserved prompt's KV is all in its pages: start decoding after its first token,
        one per sequence of the request (a list when `n` > 1, which forks it here)."""
        ids = first_token_ids if isinstance(first_token_ids, list) else [first_token_ids]
        seq = self.reserved.get(request_id)
        if seq is None:
            raise RequestNotFoundError(request_id)
        if len(ids) != seq.num_forks:
            raise InvalidRequestError(
                "first_token_ids", ids, f"must be one per sequence: n = {seq.num_forks}"
            )
        del self.reserved[request_id]
        seq.num_computed_tokens = seq.num_prompt_tokens
        seq.status = SequenceStatus.RUNNING
        self.pool.cache_full_blocks(seq)
        self.scheduler.running.append(seq)
        group = self.forks.fork(seq) if seq.num_forks > 1 else [seq]
        parked = self.grammars.park(group)  # decodes once its grammar is compiled
        self.scheduler.hold(group, parked)  # or once the batch has room (max_num_seqs)
        return [self._append_token(s, t, None) for s, t in zip(group, ids, strict=True)]

    def _new_sequence(
        self,
        prompt: Prompt,
        params: SamplingParams | None,
        request_id: str | None,
        block_keys: list[bytes] | None,
    ) -> Sequence:
        params = params or SamplingParams()
        params.validate(self.model_config.vocab_size)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise InvalidRequestError(
                "request_id", request_id, "must be unique among live requests"
            )
        return self.intake.sequence(prompt, params, request_id, block_keys)

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
            self.kv.write_layer(layer, pages, LayerKV(kv.k[rows], kv.v[rows]))
        return len(adopted)

    def abort(self, request_id: str) -> list[RequestOutput]:
        """Stop a request now and free its pages; returns the last output of each of its
        sequences still running (finish reason `abort`)."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            raise RequestNotFoundError(request_id)
        self.reserved.pop(request_id, None)
        live = [s for s in seq.group if not s.finished]
        for s in live:
            self.scheduler.finish(s, "abort")
        return [_aborted(s, last=s is live[-1]) for s in live]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work() or bool(self.grammars.parked)

    def step(self) -> list[RequestOutput]:
        """Run one batch; return what each request that progressed produced."""
        started = time.perf_counter()
        self.pool.drain_unholds()
        self._admit_compiled()
        batch = self.scheduler.schedule()
        if not batch:
            self.grammars.wait()
            self._busy_since = None
            return []
        if copies := self.pool.take_copies():
            self.kv.copy_within(*zip(*copies, strict=True))
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
            logits, sampled = self.forks.fork_sampled(logits, sampled)
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

    def _admit_compiled(self) -> None:
        """Sequences parked while their grammar compiled go on: new ones to the queue, joined
        ones (their prompt's KV in) to the batch."""
        for seq in self.grammars.unpark():
            if seq.status is SequenceStatus.WAITING:
                self.scheduler.add(seq)
            else:
                self.scheduler.running.append(seq)

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
            num_prompt_tokens_computed=self.num_prompt_tokens_computed,
            num_cached_prompt_tokens=self.scheduler.num_cached_prompt_tokens,
            num_generated_tokens=self.num_generated_tokens,
            num_steps=self.num_steps,
            forward_s=self.runner.forward_s,
        )

    def _append_token(
        self, seq: Sequence, token_id: int, logprobs: TokenLogprobs | None
    ) -> RequestOutput:
        reason, new_text = self.stopping.append(seq, token_id, logprobs)
        self.num_generated_tokens += 1
        if reason is not None:
            self.scheduler.finish(seq, reason)
        finished = reason is not None and all(s.finished for s in seq.group)
        if finished:
            del self.requests[seq.request_id]
        return RequestOutput(
            seq.request_id, [token_id], new_text, finished, reason, seq.num_prompt_tokens,
            seq.num_cached_tokens, [logprobs] if logprobs else [], index=seq.index,
        )  # fmt: skip


def _aborted(seq: Sequence, last: bool) -> RequestOutput:
    """The output that ends an aborted sequence (`last`: the request's last one)."""
    return RequestOutput(
        seq.request_id, [], "", last, "abort", seq.num_prompt_tokens, seq.num_cached_tokens,
        index=seq.index,
    )  # fmt: skip
