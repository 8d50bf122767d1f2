"""A `Backend` over one in-process `AsyncEngine`: the API without a cluster behind it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import asdict

from halfmoon.cluster.serving.backend import (
    GenerateInput,
    ModelInfo,
    TokenDelta,
    Usage,
    delta_from_output,
)
from halfmoon.engine.async_engine import AsyncEngine
from halfmoon.engine.llm_engine import RequestOutput


class LocalBackend:
    """Serves every request from one engine; SLO overrides are accepted and not enforced."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def generate(self, request: GenerateInput) -> AsyncIterator[TokenDelta]:
        """Stream deltas; closing this iterator early aborts the request and frees its pages."""
        request.params.validate()
        await self.engine.add_request(request.prompt, request.params, request.request_id)
        num_tokens = 0
        async with aclosing(self.engine.stream(request.request_id)) as outputs:
            async for out in outputs:
                num_tokens += len(out.new_token_ids)
                yield delta_from_output(out, _usage(out, num_tokens))

    async def abort(self, request_id: str) -> bool:
        return self.engine.abort(request_id)

    async def model_info(self) -> ModelInfo:
        facts, max_model_len = await self.engine.run(lambda e: (e.facts, e.max_model_len))
        return ModelInfo(
            model=facts.model,
            architecture=facts.architecture,
            vocab_size=facts.vocab_size,
            max_model_len=max_model_len,
            block_size=facts.block_size,
        )

    async def server_info(self) -> dict:
        stats, facts = await self.engine.run(lambda engine: (engine.stats(), engine.facts))
        return {"mode": "local", "model": facts.model, "engine": asdict(stats)}

    async def health(self) -> tuple[bool, str]:
        if not self.engine.running:
            return False, "the engine's step thread has stopped"
        return True, "serving"

    async def explain(self, request_id: str) -> str:
        return f"request {request_id}: served by the one local engine (no routing decision)"


def _usage(out: RequestOutput, num_tokens: int) -> Usage:
    return Usage(out.num_prompt_tokens, num_tokens, out.num_cached_tokens)
