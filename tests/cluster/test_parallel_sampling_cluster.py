"""`n` > 1 on a real cluster, over HTTP with the official `openai` client: a disaggregated
request is prefilled once and decoded as `n` sequences, and its greedy choices (penalties and
logit_bias included) equal the offline engine's; the same colocated; usage counts the prompt
once and every choice's tokens; seeded choices reproduce; a retry carries the `n` first
tokens; a request with n > 1 is not migrated."""

from __future__ import annotations

import asyncio
import sys
from collections import defaultdict

import openai
import pytest
import ray
import ray.cloudpickle
from cluster_kit import counters, running_cluster, wait_until

from halfmoon.cluster.control import launcher
from halfmoon.cluster.serving.backend import WorkerDiedError
from halfmoon.cluster.serving.cluster_backend import ClusterBackend
from halfmoon.cluster.serving.request import Request
from halfmoon.cluster.serving.trace import RequestTrace
from halfmoon.engine import SamplingParams
from halfmoon.prefill_worker.worker import PrefillWorker

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(600), pytest.mark.slow]

MODEL = "tiny"
# Two full blocks and a partial one: the last page is shared, then copied on write.
PROMPT = "n sequences from one prefill: " + "abcdefgh" * 2
MESSAGES = [{"role": "user", "content": "four choices, please"}]
NUM_TOKENS = 10
PENALTIES = {"frequency_penalty": 0.7, "presence_penalty": 0.3, "repetition_penalty": 1.3}
BIAS = {17: 4.0, 40: -100.0}
# The workers cannot import this test module: the class below travels to them by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class FailingStorePrefill(PrefillWorker):
    """The real prefill worker; armed (`fail_next`), the store of its next request's last
    layer fails, after its first tokens went out: the router retries the request from them."""

    fail_next = False

    def _send(self, item):
        last_layer = item.layer == self.engine.model_config.num_layers - 1
        if self.fail_next and last_layer and item.unit == len(item.job.units) - 1:
            self.fail_next = False
            raise RuntimeError("injected fault: the store refused the layer")
        return super()._send(item)


def offline_params(n: int) -> SamplingParams:
    return SamplingParams(
        max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True, n=n, logit_bias=BIAS, **PENALTIES
    )


def body(n: int) -> dict:
    extra = {"ignore_eos": True, "repetition_penalty": PENALTIES["repetition_penalty"]}
    return {
        "model": MODEL,
        "max_tokens": NUM_TOKENS,
        "temperature": 0,
        "n": n,
        "frequency_penalty": PENALTIES["frequency_penalty"],
        "presence_penalty": PENALTIES["presence_penalty"],
        "logit_bias": {str(token): bias for token, bias in BIAS.items()},
        "extra_body": extra,
    }


@pytest.fixture(scope="module", params=["disaggregated", "colocated"])
def served(request, tiny_model_dir):
    settings = {"served_model_name": MODEL, "router.bypass_threshold_tokens": 0}
    if request.param == "colocated":
        settings["mode"] = "colocated"
    with running_cluster(tiny_model_dir, **settings) as (cluster, _):
        base_url = f"http://127.0.0.1:{cluster.ports['http_port']}/v1"
        with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
            yield request.param, cluster, client


def test_greedy_n4_with_penalties_and_logit_bias_equals_the_offline_engine(served, tiny_llm):
    mode, cluster, oai = served
    want = tiny_llm.generate(PROMPT, offline_params(4))
    plain = tiny_llm.generate(PROMPT, offline_params(1))[0]
    assert [out.text for out in want] == [plain.text] * 4
    before = {name: counters(cluster, name) for name in cluster.workers}
    answer = oai.completions.create(prompt=PROMPT, **body(4))
    assert [choice.index for choice in answer.choices] == [0, 1, 2, 3]
    assert [choice.text for choice in answer.choices] == [out.text for out in want]
    assert [choice.finish_reason for choice in answer.choices] == ["length"] * 4
    num_prompt = want[0].num_prompt_tokens
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (
        num_prompt,
        4 * NUM_TOKENS,
    )
    assert answer.usage.total_tokens == num_prompt + 4 * NUM_TOKENS
    # One prefill: the prompt was computed once, by one worker (less what it had cached).
    uncached = num_prompt - answer.usage.prompt_tokens_details.cached_tokens
    computed = {
        name: counters(cluster, name)["num_prompt_tokens_computed"]
        - before[name]["num_prompt_tokens_computed"]
        for name in cluster.workers
    }
    assert sorted(computed.values()) == ([0, uncached] if mode == "disaggregated" else [uncached])
    for name in cluster.workers:
        wait_until(lambda name=name: counters(cluster, name)["num_used_pages"] == 0)


def test_a_streamed_chat_interleaves_its_choices_by_index(served, tiny_llm):
    _, _, oai = served
    want = tiny_llm.generate([MESSAGES], offline_params(3))
    chunks = list(
        oai.chat.completions.create(
            messages=MESSAGES, stream=True, stream_options={"include_usage": True}, **body(3)
        )
    )
    texts, roles, reasons = defaultdict(str), defaultdict(list), {}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] += choice.delta.content or ""
        if choice.delta.role:
            roles[choice.index].append(choice.delta.role)
        if choice.finish_reason:
            reasons[choice.index] = choice.finish_reason
    assert [texts[i] for i in range(3)] == [out.text for out in want]
    assert dict(roles) == {0: ["assistant"], 1: ["assistant"], 2: ["assistant"]}
    assert reasons == {0: "length", 1: "length", 2: "length"}
    usage = chunks[-1].usage
    assert chunks[-1].choices == []
    assert (usage.prompt_tokens, usage.completion_tokens) == (want[0].num_prompt_tokens, 30)


def test_seeded_choices_reproduce_and_differ_from_each_other(served):
    _, _, oai = served
    request = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": 12,
        "temperature": 1.0,
        "seed": 11,
        "n": 3,
        "extra_body": {"ignore_eos": True},
    }
    first = [choice.text for choice in oai.completions.create(**request).choices]
    again = [choice.text for choice in oai.completions.create(**request).choices]
    assert first == again
    assert len(set(first)) > 1


def test_n_out_of_range_is_a_400_naming_n(served):
    _, _, oai = served
    for n in (0, 17):
        with pytest.raises(openai.BadRequestError) as caught:
            oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, n=n)
        assert caught.value.body["param"] == "n"
        assert "[1, 16]" in caught.value.body["message"]


@pytest.fixture(scope="module")
def failing(tiny_model_dir):
    """A disaggregated cluster whose prefill workers can fail to store a request's KV; the
    decode worker reads the store (no lent pages), so it waits for what never lands."""
    launcher.WORKER_CLASSES["prefill"] = FailingStorePrefill
    settings = {
        "served_model_name": MODEL,
        "router.bypass_threshold_tokens": 0,
        "prefill.replicas": 2,
        "store.lend_pages": False,
    }
    try:
        with running_cluster(tiny_model_dir, **settings) as (cluster, _):
            base_url = f"http://127.0.0.1:{cluster.ports['http_port']}/v1"
            with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
                yield cluster, client
    finally:
        launcher.WORKER_CLASSES["prefill"] = PrefillWorker


def test_a_retry_after_the_first_tokens_continues_every_choice_from_its_own(failing, tiny_llm):
    cluster, oai = failing
    prefills = [name for name, w in cluster.workers.items() if w.kind == "prefill"]

    def arm(worker):
        worker.fail_next = True

    ray.get([cluster.workers[name].actor.__ray_call__.remote(arm) for name in prefills])
    want = tiny_llm.generate(PROMPT, offline_params(4))
    answer = oai.completions.create(prompt=PROMPT, **body(4))
    failed = sum(counters(cluster, name)["num_failed_flushes"] for name in prefills)
    assert failed in (1, 2)  # the retry may land on the other armed worker once
    assert [choice.text for choice in answer.choices] == [out.text for out in want]
    assert answer.usage.completion_tokens == 4 * NUM_TOKENS


def test_a_request_with_n_above_1_is_not_migrated_once_its_output_began():
    # Its sequences diverged, so no one prompt continues them: the router says so instead.
    req = Request("r", SamplingParams(n=2), RequestTrace(0.0))
    req.streamed = True
    backend = object.__new__(ClusterBackend)  # `_recover` decides before it touches the pool
    died = WorkerDiedError("worker decode-0 died while serving the request")
    with pytest.raises(WorkerDiedError, match="n > 1 .* not migrated") as caught:
        asyncio.run(backend._recover(req, died))
    assert caught.value.__cause__ is died
