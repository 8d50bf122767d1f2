"""The request fields of OpenAI and vLLM clients that halfmoon takes without implementing:
ignored outright when no value changes the output, else taken only at their neutral value.

A null value is the same as leaving the field out, for every field. A field in neither table
and not in the request schema is an error (a typo such as `max_token` must not pass
silently); docs/openai.md lists every table here.
"""

from __future__ import annotations

from typing import Any

from halfmoon.engine.errors import InvalidRequestError

# Taken and ignored, whatever their value: none changes the tokens sent back.
IGNORED_FIELDS = frozenset(
    {
        "user",  # OpenAI: an end-user id for abuse monitoring
        "metadata",
        "store",  # OpenAI stores completions for its dashboard; halfmoon keeps nothing
        "service_tier",
        "safety_identifier",
        "prompt_cache_key",  # a cache routing hint; the Conductor routes by prefix itself
        "prediction",  # predicted outputs only make a response faster
        "parallel_tool_calls",  # `required` makes one call; `auto` reads all the model writes
        "length_penalty",  # vLLM: weighs beams, and beam search is off
    }
)

STRUCTURED = (
    "not supported; constrain the output with response_format or structured_outputs "
    "(json, regex, choice, grammar)"
)
# name -> (the value that asks for nothing, why any other is refused); null always passes, so
# None here means "only null".
COMMON_NEUTRAL: dict[str, tuple[Any, str]] = {
    "best_of": (1, "only best_of=1 is supported; send one request per candidate"),
    "use_beam_search": (False, "beam search is not supported"),
    "min_tokens": (0, "min_tokens is not supported; use ignore_eos with max_tokens"),
    "include_stop_str_in_output": (
        False,
        "not supported: the text always ends before the stop string",
    ),
    "skip_special_tokens": (True, "not supported: special tokens never reach the text"),
    "spaces_between_special_tokens": (True, "not supported: special tokens never reach the text"),
    "prompt_logprobs": (None, "prompt log-probabilities are not computed"),
    "truncate_prompt_tokens": (
        None,
        "prompts are never truncated; one at or beyond max_model_len is refused",
    ),
    "allowed_token_ids": (None, "not supported; logit_bias -100 bans single tokens"),
    "bad_words": ([], "not supported; logit_bias -100 bans single tokens"),
    "logits_processors": ([], "custom logits processors are not supported"),
    "structural_tag": (None, STRUCTURED),
    "guided_whitespace_pattern": (None, STRUCTURED),
    "return_tokens_as_token_ids": (False, "logprobs tokens are always text"),
    "priority": (0, "request priorities are not supported; the router orders requests"),
    "cache_salt": (None, "per-tenant prefix-cache isolation is not supported"),
    "kv_transfer_params": (None, "halfmoon moves the KV cache itself"),
    "vllm_xargs": ({}, "no extension takes extra arguments here"),
}
COMPLETION_NEUTRAL = COMMON_NEUTRAL | {
    "suffix": ("", "insertion (a suffix after the completion) is not supported"),
    "add_special_tokens": (True, "the tokenizer always adds its special tokens (BOS)"),
}
CHAT_NEUTRAL = COMMON_NEUTRAL | {
    "echo": (False, "echoing the last message is not supported"),
    "add_generation_prompt": (True, "the chat template always adds it"),
    "continue_final_message": (False, "not supported: a new assistant turn is started"),
    "add_special_tokens": (False, "only the chat template's special tokens are used"),
    "chat_template": (None, "the model's own chat template is used"),
    "chat_template_kwargs": ({}, "the chat template takes no arguments here"),
    "documents": ([], "the chat template is not given documents"),
    "mm_processor_kwargs": ({}, "the served models take text only"),
    "modalities": (["text"], "only text output is supported"),
    "audio": (None, "only text output is supported"),
    "reasoning_effort": (None, "reasoning controls are not supported"),
    "web_search_options": (None, "web search is not supported"),
}
LEGACY_FUNCTIONS = (
    "the legacy functions API is not supported: send them as tools "
    '([{"type": "function", "function": ...}]) and choose with tool_choice; function_call '
    "'none' has them ignored"
)


def take_extras(data: Any, neutral: dict[str, tuple[Any, str]]) -> Any:
    """`data` (a request body) without the ignored fields and the neutral-only ones; raises
    `InvalidRequestError` naming the first of those set to a value halfmoon does not honour."""
    if not isinstance(data, dict):
        return data  # the schema reports it
    kept = {}
    for name, value in data.items():
        if value is None:
            continue  # null asks for the default, as leaving the field out does
        if name in neutral:
            allowed, why = neutral[name]
            if value != allowed:  # as JSON compares loosely: 1 is true, 1.0 is 1
                raise InvalidRequestError(name, value, why)
        elif name not in IGNORED_FIELDS:
            kept[name] = value
    return kept


def check_functions(data: Any) -> Any:
    """The legacy `functions` pass only when none would be called (none sent, or a
    `function_call` of 'none': they are then ignored, not shown to the model); `tools` replace
    them."""
    if not isinstance(data, dict):
        return data
    functions, choice = data.pop("functions", None), data.pop("function_call", None)
    if functions and choice != "none":
        shown = f"<{len(functions)} functions>" if isinstance(functions, list) else functions
        raise InvalidRequestError("functions", shown, LEGACY_FUNCTIONS)
    if choice not in (None, "none", "auto"):
        raise InvalidRequestError("function_call", choice, LEGACY_FUNCTIONS)
    return data
