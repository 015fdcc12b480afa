"""schemathesis against a real 1P1D cluster's HTTP front, from the OpenAPI document the front serves.

A bounded run (a ~30 s budget, `MAX_EXAMPLES` cases per operation and fuzzing round) with every
built-in check (no 5xx but a requested deadline's 504, documented statuses, content types, headers and
response schemas, invalid data rejected) and splitserve's own (`http_fuzz_checks`): valid data served
unless a listed rule refuses it, every 400 naming a documented field, strict JSON. Then the cluster
still serves a greedy request token for token as HF does, and both workers' pools are clean. The
deeper run is benchmarks/http_fuzz.py.
"""
from __future__ import annotations

import time

import openai
import pytest

from engine.tokenizer import load_tokenizer
from tests.factories import TinySpec, hf_greedy_generate, random_prompts
from tests.router.conftest import start_router
from tests.router.http_fuzz import run_fuzz

# A short context bounds what a valid body may ask for (max_tokens < 64, prompts x n <= 256 choices), so
# that the budget goes to many cases rather than to a few long generations.
SPEC = TinySpec(max_position_embeddings=64)
FUZZ_TIME_S = 30
MAX_EXAMPLES = 20


@pytest.fixture(scope="module")
def fuzz_stack(ray_session, checkpoint):
    stack = start_router(checkpoint(SPEC))
    yield stack
    stack.stop()


def test_schemathesis_finds_nothing_and_the_cluster_still_serves(fuzz_stack, checkpoint, tmp_path):
    url = fuzz_stack.server.http.url
    run = run_fuzz(url, tmp_path, max_time_s=FUZZ_TIME_S, max_examples=MAX_EXAMPLES)
    report = run.report
    assert run.exit_code == 0 and not report["failures"] and not report["errors"], run.output[-8000:]
    operations = report["operations"]  # all but GET /openapi.json, which st run leaves out as the document's own
    assert operations["tested"] == operations["total"] == 9, operations
    assert run.generated >= 50, report["test_cases"]  # the budget went to requests, not to a stall

    _wait_idle(fuzz_stack)
    prompt = random_prompts(1, 8, 8, SPEC.vocab_size, seed=31)[0]
    expected = hf_greedy_generate(checkpoint(SPEC), [prompt], max_new_tokens=8)[0]
    tokenizer = load_tokenizer(checkpoint(SPEC))
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
        model = client.models.list().data[0].id
        reply = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True, "return_token_ids": True})
    assert reply.choices[0].model_extra["token_ids"] == expected
    assert reply.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True)
    fuzz_stack.check_workers_clean()


def _wait_idle(stack, timeout_s: float = 30.0) -> None:
    """Streams the fuzzer cut short end on the router once their cancellation has run."""
    deadline_s = time.monotonic() + timeout_s
    while stack.server.service.inflight_requests:
        assert time.monotonic() < deadline_s, "requests still in flight on the router after fuzzing"
        time.sleep(0.05)
