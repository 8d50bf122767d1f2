"""`halfmoon bench agreement`: how often our engine in a lower precision picks the greedy token
transformers picks in fp32, given the same prefix (teacher-forced), beside transformers' own
lower precision on the same positions. Free-running greedy text departs at the first near-tie
and never rejoins, so its agreement says little; this one counts each position once.

The prompts are chat turns (the model's chat template); the reference continuation is
transformers' fp32 greedy one. At each of its positions our engine generates one token from the
prompt plus the reference's tokens so far (prefix caching keeps that cheap), and transformers
in the lower dtype scores the whole sequence in one pass. Beside the share, the mean absolute
difference between each side's log-probability of the reference token and fp32's (ours where
the token is among its top 20).
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from halfmoon.bench.options import bench_parser
from halfmoon.engine import LLM, SamplingParams
from halfmoon.engine.errors import ModelLoadError
from halfmoon.engine.model_source import resolve_model
from halfmoon.kernels.kv_quant import KV_CACHE_DTYPES

TOPICS = ("the sea", "a cat", "Paris", "rain", "mountains", "a robot", "coffee", "the moon")
ASKS = (
    "Write one sentence about {}.",
    "What do you know about {}?",
    "Give two facts about {}.",
    "Describe {} briefly.",
)


def chat_prompts(tokenizer, count: int) -> list[list[int]]:
    """`count` chat turns (up to 32), as prompt token ids under the model's chat template."""
    texts = [ask.format(topic) for topic in TOPICS for ask in ASKS][:count]
    prompts = []
    for text in texts:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return prompts


def reference_continuations(model, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, past any end of turn (no token
    suppressed: the model's own pick at every position)."""
    model.generation_config.eos_token_id = None
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            full = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=tokens,
                pad_token_id=0,
            )
        out.append(full[0, len(prompt) :].tolist())
    return out


TOP_LOGPROBS = 20  # of ours, where the reference token is looked for


@dataclass(slots=True)
class Picks:
    """A side's greedy token at each position, and its log-probability of the reference's
    token there (None where ours did not list it in its top TOP_LOGPROBS)."""

    tokens: list[int]
    reference_logprobs: list[float | None]


def transformers_picks(model, prompt: list[int], continuation: list[int]) -> Picks:
    """The greedy token at each position of `continuation`, the sequence scored in one pass."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + continuation])).logits[0].float()
    at = logits[len(prompt) - 1 : len(prompt) - 1 + len(continuation)]
    logprobs = torch.log_softmax(at, -1)[torch.arange(len(continuation)), continuation]
    return Picks(at.argmax(-1).tolist(), logprobs.tolist())


def our_picks(llm: LLM, prompt: list[int], continuation: list[int]) -> Picks:
    """Our engine's greedy next token after the prompt and each prefix of `continuation`."""
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=TOP_LOGPROBS)
    prefixes = [prompt + continuation[:k] for k in range(len(continuation))]
    outs = llm.generate(prefixes, one)
    pairs = zip(outs, continuation, strict=True)
    found = [dict(out.logprobs[0].top).get(want) for out, want in pairs]
    return Picks([out.token_ids[0] for out in outs], found)


def measure(
    model_dir: str,
    dtype: str,
    prompts: int,
    tokens: int,
    progress: bool,
    kv_cache_dtype: str = "auto",
) -> dict:
    """The shares and logprob differences of each side; with an 8-bit `kv_cache_dtype`, also
    ours with KV in it ("ours_kv"), and how often its pick equals ours with KV in `dtype`
    ("kv_vs_ours", where the two sides differ only in the KV format)."""
    from transformers import AutoModelForCausalLM

    def load(torch_dtype):
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).eval()

    engines = {"ours": LLM(model_dir, dtype=dtype, num_pages=2048)}
    if kv_cache_dtype != "auto":
        engines["ours_kv"] = LLM(
            model_dir, dtype=dtype, num_pages=2048, kv_cache_dtype=kv_cache_dtype
        )
    ids = chat_prompts(engines["ours"].tokenizer, prompts)
    reference_model = load(torch.float32)
    reference = reference_continuations(reference_model, ids, tokens)
    theirs_model = load(getattr(torch, dtype))
    tally = {side: Tally() for side in (*engines, "transformers")}
    kv_vs_ours = Tally()
    for prompt, continuation in tqdm(
        list(zip(ids, reference, strict=True)), desc="agreement", disable=not progress
    ):
        exact = transformers_picks(reference_model, prompt, continuation).reference_logprobs
        picks = {side: our_picks(llm, prompt, continuation) for side, llm in engines.items()}
        for side, pick in picks.items():
            tally[side].add(pick, continuation, exact)
        if "ours_kv" in picks:
            kv_vs_ours.add(picks["ours_kv"], picks["ours"].tokens, exact)
        theirs = transformers_picks(theirs_model, prompt, continuation)
        tally["transformers"].add(theirs, continuation, exact)
    for llm in engines.values():
        llm.close()
    figures = {"model": model_dir, "dtype": dtype, "prompts": len(ids), "tokens": tokens}
    figures["kv_cache_dtype"] = kv_cache_dtype
    for side, counts in tally.items():
        figures |= {side: counts.share(), f"{side}_logprob_mad": counts.mad()}
    figures["ours_logprob_positions"] = len(tally["ours"].differences)
    if "ours_kv" in engines:
        figures["kv_vs_ours"] = kv_vs_ours.share()
    return figures


@dataclass(slots=True)
class Tally:
    """Positions agreeing with the reference, and |logprob - reference logprob| of its token."""

    equal: int = 0
    positions: int = 0
    differences: list[float] = field(default_factory=list)

    def add(self, picks: Picks, reference: list[int], exact: list[float]) -> None:
        self.equal += sum(a == b for a, b in zip(picks.tokens, reference, strict=True))
        self.positions += len(reference)
        pairs = zip(picks.reference_logprobs, exact, strict=True)
        self.differences += [abs(ours - want) for ours, want in pairs if ours is not None]

    def share(self) -> float:
        return self.equal / self.positions

    def mad(self) -> float | None:
        return statistics.fmean(self.differences) if self.differences else None


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(
        "agreement",
        description="Teacher-forced greedy agreement with transformers in fp32: our engine in "
        "--dtype against transformers in --dtype, on the same chat prompts and positions.",
        progress=True,
    )
    parser.add_argument("--model", required=True, help="checkpoint directory or GGUF file")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--prompts", type=int, default=32, help="chat prompts, 1-32 (32)")
    parser.add_argument("--tokens", type=int, default=64, help="positions a prompt (64)")
    parser.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="also ours with its KV cache in this 8-bit format, beside ours in --dtype: each "
        "against fp32's token, and how often the two of ours agree (auto: not run)",
    )
    args = parser.parse_args(argv)
    if not 1 <= args.prompts <= len(TOPICS) * len(ASKS) or args.tokens < 1:
        parser.error("--prompts takes 1-32 and --tokens 1 or more")
    try:
        model_dir = str(resolve_model(args.model))
    except ModelLoadError as error:
        print(f"halfmoon bench agreement: {error}", file=sys.stderr)
        return 2
    figures = measure(
        model_dir,
        args.dtype,
        args.prompts,
        args.tokens,
        not args.disable_tqdm,
        args.kv_cache_dtype,
    )
    if args.json:
        print(json.dumps(figures))
        return 0
    mads = (_number(figures["ours_logprob_mad"]), _number(figures["transformers_logprob_mad"]))
    print(
        f"{figures['prompts']} prompts x {figures['tokens']} positions, the next greedy token "
        f"equal to transformers fp32's: ours {args.dtype} {figures['ours']:.3f}, transformers "
        f"{args.dtype} {figures['transformers']:.3f}; mean |logprob - fp32's| of its token: "
        f"ours {mads[0]} (at the {figures['ours_logprob_positions']} positions where ours listed "
        f"it), transformers {mads[1]}"
    )
    if "kv_vs_ours" in figures:
        kv = args.kv_cache_dtype
        print(
            f"ours with KV in {kv}: {figures['ours_kv']:.3f} equal to fp32's (mean |logprob - "
            f"fp32's| {_number(figures['ours_kv_logprob_mad'])}); its token equal to ours with "
            f"KV in {args.dtype} at {figures['kv_vs_ours']:.3f} of positions"
        )
    return 0


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


if __name__ == "__main__":
    sys.exit(main())
