"""The offline API: `LLM(model_dir).generate(prompts, params)`, like vLLM's."""

from __future__ import annotations

from dataclasses import dataclass, field

from tqdm import tqdm

from halfmoon.engine.config import EngineConfig
from halfmoon.engine.llm_engine import LLMEngine
from halfmoon.engine.model_source import resolve_model
from halfmoon.engine.sampling_params import SamplingParams
from halfmoon.engine.sequence import TokenLogprobs
from halfmoon.engine.tokenizer import Prompt


@dataclass(slots=True)
class CompletionOutput:
    """The whole result of one prompt (of one of its sequences, `index`, when `n` > 1)."""

    request_id: str
    index: int = 0
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)


class LLM:
    """Batch generation with continuous batching; `model` is a checkpoint directory or a model id
    in the local Hugging Face cache, None the tiny default model."""

    def __init__(self, model: str | None = None, **engine_args) -> None:
        model_dir = str(resolve_model(model))
        self.engine = LLMEngine(EngineConfig(model=model_dir, **engine_args))
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[CompletionOutput]:
        """One output per prompt, in order; a prompt whose params ask for `n` > 1 gives `n` in
        a row (`index` 0 to n-1). A single prompt may be passed bare."""
        if isinstance(prompts, str) or _is_single_non_text(prompts):
            prompts = [prompts]
        params_list = (
            params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        )
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts")
        results: dict[tuple[str, int], CompletionOutput] = {}
        for prompt, sp in zip(prompts, params_list, strict=True):
            rid = self.engine.add_request(prompt, sp)
            results |= {(rid, index): CompletionOutput(rid, index) for index in range(sp.n)}
        with tqdm(total=len(results), disable=not use_tqdm, desc="generate") as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    result = results[out.request_id, out.index]
                    result.token_ids.extend(out.new_token_ids)
                    result.text += out.new_text
                    result.logprobs.extend(out.new_logprobs)
                    result.num_prompt_tokens = out.num_prompt_tokens
                    result.num_cached_tokens = out.num_cached_tokens
                    if out.finish_reason is not None:
                        result.finish_reason = out.finish_reason
                        bar.update()
        return list(results.values())

    def close(self) -> None:
        """Stop the engine's other tensor-parallel ranks now, not when it is collected."""
        self.engine.close()


def _is_single_non_text(prompts) -> bool:
    """A bare token-id list or a bare message list is one prompt, not a batch."""
    return isinstance(prompts, list) and bool(prompts) and not isinstance(prompts[0], str | list)
