"""Structured outputs through xgrammar: each constraint compiled once per engine, off the step
thread, against the model's vocabulary; a matcher per sequence, fed the tokens it generated; the
batch's token masks, applied by the sampler.

xgrammar is imported where first needed (~0.5 s): only a process that meets a grammar pays it.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from halfmoon.engine.errors import InvalidRequestError
from halfmoon.engine.structured_output import FIELD, StructuredOutput, shown
from halfmoon.engine.utf8_guard import Utf8Guard

if TYPE_CHECKING:
    from halfmoon.engine.sequence import Sequence

log = logging.getLogger(__name__)
COMPILE_THREADS = 2  # compiles at once per engine, and xgrammar's threads for each
CACHE_SIZE = 256  # compiled grammars kept per engine, the least recently asked for dropped first
IDLE_WAIT_S = 0.01  # how long a step with only parked sequences waits for a compile
# A JSON layout with no free whitespace: a small model asked for `{"a": 1}` under xgrammar's
# default (any whitespace) can emit newlines until it runs out of tokens.
JSON_LAYOUT = {"any_whitespace": False}
ANY_OBJECT = '{"type": "object"}'
DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})  # values, not schemas
# xgrammar's errors start with where in its C++ they were raised.
_ERROR_PREFIX = re.compile(r"^\[[^\]]*\]\s+\S+:\d+:\s+(Check failed: .*? is false: )?")


def check(structured: StructuredOutput) -> None:
    """Raise `InvalidRequestError` naming `structured_output` when no grammar comes from it: the
    frontends' check, before any worker work (the grammar is built, not yet compiled against a
    vocabulary, which is what a worker does)."""
    import xgrammar as xgr

    structured.validate()
    form, text, options = _source(structured)
    build = {"json": xgr.Grammar.from_json_schema, "regex": xgr.Grammar.from_regex}
    try:
        build.get(form, xgr.Grammar.from_ebnf)(text, **options)
    except RuntimeError as error:
        raise InvalidRequestError(FIELD, shown(structured.spec), _reason(error)) from None


def _compile(compiler, structured: StructuredOutput):
    """Compiled from its source text: xgrammar 0.2 compiles a `Grammar` object by printing and
    reading it again, which turns a non-ASCII character before a hex digit into another one."""
    form, text, options = _source(structured)
    compile_ = {"json": compiler.compile_json_schema, "regex": compiler.compile_regex}
    return compile_.get(form, compiler.compile_grammar)(text, **options)


def _source(structured: StructuredOutput) -> tuple[str, str, dict]:
    """How xgrammar reads the constraint (`json` schema, `regex` or `ebnf`), its text, options."""
    kind, spec = structured.kind, structured.spec
    if kind == "json":
        return "json", _for_xgrammar(spec), JSON_LAYOUT
    if kind == "json_object":
        return "json", ANY_OBJECT, {**JSON_LAYOUT, "strict_mode": False}
    if kind == "regex":
        return "regex", spec, {}
    if kind == "choice":
        options = (json.dumps(choice, ensure_ascii=False) for choice in structured.choices)
        return "ebnf", "root ::= " + " | ".join(options), {}
    return "ebnf", spec, {}


def _for_xgrammar(spec: str) -> str:
    """The schema as xgrammar is given it. xgrammar 0.2 builds a string with `minLength` or
    `maxLength` from a character class that admits raw control characters, which JSON forbids
    (its issue 800): such a string's bounds become the same bounds as a `pattern`, whose strings
    are always valid JSON."""
    return json.dumps(_bounds_as_pattern(json.loads(spec)), ensure_ascii=False)


def _bounds_as_pattern(node: Any) -> Any:
    if isinstance(node, list):
        return [_bounds_as_pattern(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = {k: v if k in DATA_KEYWORDS else _bounds_as_pattern(v) for k, v in node.items()}
    bounded = "minLength" in node or "maxLength" in node
    if node.get("type") == "string" and bounded and "pattern" not in node and "format" not in node:
        low, high = node.pop("minLength", 0), node.pop("maxLength", "")
        node["pattern"] = f"^.{{{low},{high}}}$"
    return node


def _reason(error: Exception) -> str:
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return _ERROR_PREFIX.sub("", first)


class Grammars:
    """One engine's grammars, compiled in a small thread pool and cached by constraint; the
    sequences whose grammar is still compiling wait here (`park`), out of the batch."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self.parked: list[Sequence] = []
        self._compiled: OrderedDict[StructuredOutput, Future] = OrderedDict()
        self._pool: ThreadPoolExecutor | None = None
        self._compiler = None
        self.utf8: Utf8Guard | None = None  # set with the compiler, by the first compile
        self._vocabulary_lock = threading.Lock()
        self._stop_row: torch.Tensor | None = None

    def start(self, structured: StructuredOutput | None) -> GrammarState | None:
        """A request's grammar state, its compile started (or found); None without a constraint."""
        if structured is None:
            return None
        return GrammarState(self._compile(structured), self)

    def park(self, seqs: list[Sequence]) -> bool:
        """Hold one request's `seqs` while their grammar compiles; False (not held) when it is
        compiled already, or they have none."""
        state = seqs[0].grammar
        if state is None or state.ready:
            return False
        self.parked += seqs
        return True

    def unpark(self) -> list[Sequence]:
        """The parked sequences whose grammar is now compiled (or failed to), in arrival order;
        those finished meanwhile (aborted) are dropped."""
        ready, waiting = [], []
        for seq in self.parked:
            if not seq.finished:
                (ready if seq.grammar.ready else waiting).append(seq)
        self.parked = waiting
        return ready

    def wait(self) -> None:
        """Block a moment (`IDLE_WAIT_S`) for a parked sequence's grammar: the step loop has
        nothing else to run and must not spin."""
        if self.parked:
            wait({seq.grammar.compiled for seq in self.parked}, IDLE_WAIT_S, FIRST_COMPLETED)

    def _compile(self, structured: StructuredOutput) -> Future:
        future = self._compiled.pop(structured, None)
        if future is None:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar")
            future = self._pool.submit(self._build, structured)
        self._compiled[structured] = future  # the most recently asked for last
        if len(self._compiled) > CACHE_SIZE:
            self._compiled.popitem(last=False)
        return future

    def _build(self, structured: StructuredOutput):
        with self._vocabulary_lock:
            if self._compiler is None:
                self._compiler, self.utf8 = self._vocabulary()
        return _compile(self._compiler, structured)

    def _vocabulary(self) -> tuple[Any, Utf8Guard]:
        """xgrammar's compiler for the model's vocabulary, and the UTF-8 guard over its bytes."""
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(
            self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
        )
        compiler = xgr.GrammarCompiler(info, max_threads=COMPILE_THREADS)
        return compiler, Utf8Guard(info.decoded_vocab, self.vocab_size)

    def stop_row(self) -> torch.Tensor:
        """A bitmask row that allows only the stop tokens: what a grammar that has ended (or
        could not be compiled) leaves its sequence."""
        if self._stop_row is None:
            words = np.zeros((self.vocab_size + 31) // 32, dtype=np.uint32)
            for token_id in self.stop_token_ids:
                words[token_id // 32] |= np.uint32(1 << (token_id % 32))
            self._stop_row = torch.from_numpy(words.view(np.int32))
        return self._stop_row


@dataclass(slots=True)
class _Matcher:
    """One sequence's place in its grammar: how many of its generated tokens it was fed, and
    where they leave its UTF-8."""

    matcher: Any  # xgrammar's GrammarMatcher; None when the grammar failed to compile
    num_fed: int = 0
    utf8: int = 0
    ended: bool = False  # the grammar is complete, refused a token, or failed to compile


class GrammarState:
    """One request's grammar: its compile, and a matcher per sequence of the request (the `n`
    sequences of one share this), each fed that sequence's generated tokens."""

    __slots__ = ("compiled", "grammars", "_matchers")

    def __init__(self, compiled: Future, grammars: Grammars) -> None:
        self.compiled = compiled
        self.grammars = grammars
        self._matchers: dict[int, _Matcher] = {}

    @property
    def ready(self) -> bool:
        return self.compiled.done()

    def advance(self, seq: Sequence) -> bool:
        """Feed `seq`'s matcher the tokens `seq` generated since it last looked (a new matcher:
        all of them, so a joined first token or a migrated request's earlier output is replayed);
        True once `seq` must stop: its grammar is complete or could not go on."""
        if not self.ready:  # parked; its matcher replays these tokens once compiled
            return False
        return self._catch_up(self._matcher(seq), seq)

    def fill(self, seq: Sequence, bitmask: torch.Tensor, row: int) -> int:
        """Set row `row` of `bitmask` to the tokens the grammar lets `seq` generate next; returns
        the UTF-8 state of `seq`, whose guard mask the row must be narrowed by."""
        matcher = self._matcher(seq)
        if self._catch_up(matcher, seq):
            bitmask[row] = self.grammars.stop_row()
            return 0  # stop tokens are whole characters
        matcher.matcher.fill_next_token_bitmask(bitmask, row)
        return matcher.utf8

    def _catch_up(self, matcher: _Matcher, seq: Sequence) -> bool:
        if matcher.ended:
            return True
        first = seq.num_prompt_tokens - seq.num_prior_output_tokens + matcher.num_fed
        for token_id in seq.token_ids[first:]:
            if not matcher.matcher.accept_token(token_id):
                matcher.ended = True
                return True
            matcher.utf8 = self.grammars.utf8.advance(matcher.utf8, token_id)
            matcher.num_fed += 1
        matcher.ended = matcher.matcher.is_terminated()
        return matcher.ended

    def _matcher(self, seq: Sequence) -> _Matcher:
        matcher = self._matchers.get(seq.index)
        if matcher is None:
            matcher = self._matchers[seq.index] = self._new_matcher(seq.request_id)
        return matcher

    def _new_matcher(self, request_id: str) -> _Matcher:
        import xgrammar as xgr

        try:
            compiled = self.compiled.result()  # at once: the engine parks uncompiled requests
        except Exception as error:  # noqa: BLE001 - any compile failure ends only this request
            log.error("request %s: its grammar failed to compile: %s", request_id, error)
            return _Matcher(None, ended=True)
        return _Matcher(xgr.GrammarMatcher(compiled))


def mask_logits(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Set to -inf, in place, each row's tokens that its sequence's grammar does not allow next
    (or that would break its UTF-8); rows without a grammar are left alone. One bitmask for the
    batch, filled on the host."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(seqs), logits.shape[-1])
    rows = [row for row, seq in enumerate(seqs) if seq.grammar is not None]
    states = [seqs[row].grammar.fill(seqs[row], bitmask, row) for row in rows]
    utf8 = seqs[rows[0]].grammar.grammars.utf8
    if utf8 is not None:  # None: the vocabulary failed, and every row allows only stop tokens
        bitmask[rows] &= utf8.masks[states]
    xgr.apply_token_bitmask_inplace(
        logits, bitmask.to(logits.device, non_blocking=True), indices=rows
    )


def warm_mask_kernel(device: torch.device, vocab_size: int, max_rows: int) -> None:
    """Run xgrammar's mask (`mask_logits`' last call) now for every kind of count of masked
    rows a step can meet: on CUDA it is a Triton kernel that Triton specialises by that count
    (1, a multiple of 16, any other), so the first structured requests would otherwise wait
    for a compiler in the middle of a step. The logits and bitmask are shaped as a step's."""
    import xgrammar as xgr

    counts = sorted({1, min(2, max_rows), min(16, max_rows)})
    logits = torch.zeros(counts[-1], vocab_size, device=device)
    bitmask = xgr.allocate_token_bitmask(counts[-1], vocab_size).to(device)
    for count in counts:
        xgr.apply_token_bitmask_inplace(logits, bitmask, indices=list(range(count)))
