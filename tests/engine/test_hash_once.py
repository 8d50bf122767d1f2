"""The prompt's block keys are hashed once, by whoever first needs them (the router, in the
cluster): an engine given them never hashes a prompt block again."""

from halfmoon.engine import LLM, SamplingParams, page_pool
from halfmoon.kvstore import keys as keys_module
from halfmoon.kvstore.keys import block_keys
from halfmoon.kvstore.transfer.plan import plan_transfer

PROMPT = list(range(20, 60))  # two full blocks of 16 and a partial one
FIRST = SamplingParams(max_tokens=1, temperature=0.0)


def _count_hashes(monkeypatch) -> list:
    calls = []
    real = keys_module.block_key

    def counted(parent, token_ids):
        calls.append(tuple(token_ids))
        return real(parent, token_ids)

    monkeypatch.setattr(keys_module, "block_key", counted)
    monkeypatch.setattr(page_pool, "block_key", counted)
    return calls


def _prefill(engine, **kwargs) -> None:
    engine.add_request(PROMPT, FIRST, "r", **kwargs)
    while engine.has_unfinished_requests():
        engine.step()


def test_a_prefill_given_its_prompt_keys_hashes_no_prompt_block(tiny_model_dir, monkeypatch):
    engine = LLM(str(tiny_model_dir), num_pages=64, block_size=16).engine
    keys = block_keys(engine.facts.root_key, PROMPT, 16)
    calls = _count_hashes(monkeypatch)
    _prefill(engine, block_keys=keys)
    units = plan_transfer(engine.facts.root_key, keys, PROMPT, 16, 32, "r")
    assert calls == []
    assert [key for unit in units for key in unit.keys][:2] == keys


def test_an_engine_given_no_keys_hashes_each_prompt_block_once(tiny_model_dir, monkeypatch):
    engine = LLM(str(tiny_model_dir), num_pages=64, block_size=16).engine
    calls = _count_hashes(monkeypatch)
    _prefill(engine)
    assert calls == [tuple(PROMPT[:16]), tuple(PROMPT[16:32])]
