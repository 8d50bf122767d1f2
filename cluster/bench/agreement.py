"""`halfmoon bench agreement`: how often our engine in a lower precision picks the greedy token
transformers picks in fp32, given the same prefix (teacher-forced), beside transformers' own
lower precision on the same positions. Free-running greedy text departs at the first near-tie
and never rejoins, so its agreement says little; this one counts each position once.

The prompts are chat turns (the model's chat template); the reference continuation is
transformers' fp32 greedy one. At each of its positions our engine generates one token from the
prompt plus the reference's tokens so far (prefix caching keeps that cheap), and transformers
in the lower dtype scores the whole sequence in one pass.
"""

from __future__ import annotations

import json
import statistics
import sys

import torch
from tqdm import tqdm

from halfmoon.cluster.bench.options import bench_parser
from halfmoon.engine import LLM, SamplingParams
from halfmoon.engine.errors import ModelLoadError
from halfmoon.engine.model_source import resolve_model

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
                ids, attention_mask=torch.ones_like(ids), do_sample=False,
                max_new_tokens=tokens, pad_token_id=0,
            )  # fmt: skip
        out.append(full[0, len(prompt) :].tolist())
    return out


def transformers_picks(model, prompt: list[int], continuation: list[int]) -> list[int]:
    """The greedy token at each position of `continuation`, the sequence scored in one pass."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + continuation])).logits[0]
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(continuation)].argmax(-1).tolist()


def our_picks(llm: LLM, prompt: list[int], continuation: list[int]) -> list[int]:
    """Our engine's greedy next token after the prompt and each prefix of `continuation`."""
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    prefixes = [prompt + continuation[:k] for k in range(len(continuation))]
    return [out.token_ids[0] for out in llm.generate(prefixes, one)]


def measure(model_dir: str, dtype: str, prompts: int, tokens: int, progress: bool) -> dict:
    from transformers import AutoModelForCausalLM

    def load(torch_dtype):
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).eval()

    llm = LLM(model_dir, dtype=dtype, num_pages=2048)
    ids = chat_prompts(llm.tokenizer, prompts)
    reference = reference_continuations(load(torch.float32), ids, tokens)
    theirs_model = load(getattr(torch, dtype))
    ours_share, theirs_share = [], []
    for prompt, continuation in tqdm(
        list(zip(ids, reference, strict=True)), desc="agreement", disable=not progress
    ):
        ours = our_picks(llm, prompt, continuation)
        theirs = transformers_picks(theirs_model, prompt, continuation)
        ours_share.append(_share_equal(ours, continuation))
        theirs_share.append(_share_equal(theirs, continuation))
    llm.close()
    return {
        "model": model_dir,
        "dtype": dtype,
        "prompts": len(ids),
        "tokens": tokens,
        "ours": statistics.fmean(ours_share),
        "transformers": statistics.fmean(theirs_share),
    }


def _share_equal(picks: list[int], reference: list[int]) -> float:
    return sum(a == b for a, b in zip(picks, reference, strict=True)) / len(reference)


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
    args = parser.parse_args(argv)
    if not 1 <= args.prompts <= len(TOPICS) * len(ASKS) or args.tokens < 1:
        parser.error("--prompts takes 1-32 and --tokens 1 or more")
    try:
        model_dir = str(resolve_model(args.model))
    except ModelLoadError as error:
        print(f"halfmoon bench agreement: {error}", file=sys.stderr)
        return 2
    figures = measure(model_dir, args.dtype, args.prompts, args.tokens, not args.disable_tqdm)
    if args.json:
        print(json.dumps(figures))
        return 0
    print(
        f"{figures['prompts']} prompts x {figures['tokens']} positions, the next greedy token "
        f"equal to transformers fp32's: ours {args.dtype} {figures['ours']:.3f}, transformers "
        f"{args.dtype} {figures['transformers']:.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
