"""The real `openai` client (sync and async, streamed and whole) against a real router's HTTP front over a
real cluster: exact greedy text, chat through the template, n with a seed, stop strings, usage,
logprobs, bad fields, deadlines, and a client that disconnects mid-stream."""
from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request

import openai
import pytest

from engine import SamplingParams
from engine.tokenizer import load_tokenizer
from tests.factories import TinySpec, hf_greedy_generate, hf_prompt_logprobs, random_prompts

GREEDY = dict(temperature=0.0, max_tokens=12, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def http_url(router_stack) -> str:
    return router_stack.server.http.url


@pytest.fixture(scope="module")
def client(http_url):
    with openai.OpenAI(base_url=f"{http_url}/v1", api_key="unused", max_retries=0, timeout=60) as sdk:
        yield sdk


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    return load_tokenizer(checkpoint(TinySpec()))


def test_greedy_completions_equal_hf_text_whole_and_streamed(client, model, checkpoint, tokenizer, router_stack):
    prompts = random_prompts(3, 4, 40, 512, seed=21)
    expected = hf_greedy_generate(checkpoint(TinySpec()), prompts, max_new_tokens=12)
    for prompt, want in zip(prompts, expected):
        text = tokenizer.decode(want, skip_special_tokens=True)
        whole = client.completions.create(model=model, prompt=prompt, **GREEDY)
        assert whole.choices[0].text == text and whole.choices[0].finish_reason == "length"
        assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(prompt), 12)
        assert whole.usage.total_tokens == len(prompt) + 12
        chunks = list(client.completions.create(model=model, prompt=prompt, stream=True,
                                                stream_options={"include_usage": True}, **GREEDY))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
        assert all(c.usage is None for c in chunks[:-1])
    router_stack.check_workers_clean()


def test_text_prompt_and_a_list_of_prompts(client, model, checkpoint, tokenizer):
    texts = ["The quick brown fox", "Once upon a time"]
    ids = [tokenizer.encode(t) for t in texts]
    expected = [tokenizer.decode(w, skip_special_tokens=True)
                for w in hf_greedy_generate(checkpoint(TinySpec()), ids, max_new_tokens=12)]
    reply = client.completions.create(model=model, prompt=texts, **GREEDY)
    assert [c.index for c in reply.choices] == [0, 1]
    assert [c.text for c in reply.choices] == expected
    assert reply.usage.prompt_tokens == sum(len(i) for i in ids)
    echoed = client.completions.create(model=model, prompt=texts[0], echo=True, **GREEDY)
    assert echoed.choices[0].text == texts[0] + expected[0]


def test_async_client_streams_and_answers_concurrently(http_url, model, checkpoint, tokenizer):
    prompts = random_prompts(8, 4, 30, 512, seed=22)
    expected = [tokenizer.decode(w, skip_special_tokens=True)
                for w in hf_greedy_generate(checkpoint(TinySpec()), prompts, max_new_tokens=12)]

    async def run():
        async with openai.AsyncOpenAI(base_url=f"{http_url}/v1", api_key="unused", max_retries=0) as sdk:
            async def streamed(prompt):
                stream = await sdk.completions.create(model=model, prompt=prompt, stream=True, **GREEDY)
                return "".join([c.choices[0].text async for c in stream])
            whole = await asyncio.gather(*(sdk.completions.create(model=model, prompt=p, **GREEDY) for p in prompts))
            return [r.choices[0].text for r in whole], await asyncio.gather(*(streamed(p) for p in prompts))
    whole, streamed = asyncio.run(asyncio.wait_for(run(), 120))
    assert whole == expected and streamed == expected


def test_chat_uses_the_checkpoints_template(client, model, checkpoint, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    prompt = tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                              add_special_tokens=False)
    text = tokenizer.decode(hf_greedy_generate(checkpoint(TinySpec()), [prompt], 12)[0], skip_special_tokens=True)
    whole = client.chat.completions.create(model=model, messages=messages, temperature=0, max_completion_tokens=12,
                                           extra_body={"ignore_eos": True})
    assert whole.choices[0].message.role == "assistant" and whole.choices[0].message.content == text
    assert whole.usage.prompt_tokens == len(prompt)
    chunks = list(client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=12,
                                                 stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text


def test_n_with_a_seed_matches_the_offline_engine(client, model, checkpoint, make_llm):
    prompt = random_prompts(1, 6, 6, 512, seed=23)[0]
    options = dict(temperature=1.0, top_p=0.9, seed=1234, max_tokens=10, n=2)
    reply = client.completions.create(model=model, prompt=prompt, extra_body={"ignore_eos": True}, **options)
    again = client.completions.create(model=model, prompt=prompt, extra_body={"ignore_eos": True}, **options)
    offline = make_llm(checkpoint(TinySpec())).generate([prompt], SamplingParams(**options, ignore_eos=True),
                                                        use_tqdm=False)[0]
    assert [c.index for c in reply.choices] == [0, 1]
    assert [c.text for c in reply.choices] == [c.text for c in again.choices] == [o.text for o in offline.outputs]
    assert reply.choices[0].text != reply.choices[1].text
    assert reply.usage.completion_tokens == 20 and reply.usage.prompt_tokens == 6


def test_stop_strings_end_the_text_before_them(client, model):
    prompt = random_prompts(1, 10, 10, 512, seed=24)[0]
    full = client.completions.create(model=model, prompt=prompt, **{**GREEDY, "max_tokens": 16}).choices[0].text
    stop = full[len(full) // 2: len(full) // 2 + 2]
    cut = client.completions.create(model=model, prompt=prompt, stop=[stop], **{**GREEDY, "max_tokens": 16})
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == full[:full.index(stop)]
    streamed = client.completions.create(model=model, prompt=prompt, stop=stop, stream=True,
                                         **{**GREEDY, "max_tokens": 16})
    assert "".join(c.choices[0].text for c in streamed) == full[:full.index(stop)]


def test_logit_bias_steers_greedy_text_as_hf_sequence_bias_does(client, model, checkpoint, tokenizer, router_stack):
    prompts = random_prompts(2, 6, 24, 512, seed=26)
    plain = hf_greedy_generate(checkpoint(TinySpec()), prompts, max_new_tokens=12)
    bias = {**{tokens[0]: -100 for tokens in plain}, 17: 3, 101: 2}  # ban each first pick, favour two others
    expected = hf_greedy_generate(checkpoint(TinySpec()), prompts, max_new_tokens=12,
                                  sequence_bias=[[[token], float(value)] for token, value in bias.items()])
    assert expected != plain
    logit_bias = {str(token): value for token, value in bias.items()}
    for prompt, want in zip(prompts, expected):
        reply = client.completions.create(model=model, prompt=prompt, logit_bias=logit_bias, **GREEDY)
        assert reply.choices[0].text == tokenizer.decode(want, skip_special_tokens=True)
    forced = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], seed=3,
                                            temperature=1.0, max_tokens=6, logit_bias={"42": 100},
                                            extra_body={"ignore_eos": True})
    assert forced.choices[0].message.content == tokenizer.decode([42] * 6, skip_special_tokens=True)
    router_stack.check_workers_clean()


def test_echo_with_logprobs_scores_the_prompt_as_evaluation_harnesses_ask(client, model, checkpoint, tokenizer):
    """lm-evaluation-harness's loglikelihood request: echo, logprobs 1, max_tokens 1; the continuation's
    logprob is the sum of token_logprobs[len(context):-1]."""
    context, continuation = random_prompts(2, 12, 20, 512, seed=27)
    prompt = context + continuation
    reference = hf_prompt_logprobs(checkpoint(TinySpec()), prompt)
    reply = client.completions.create(model=model, prompt=prompt, echo=True, logprobs=1, max_tokens=1, temperature=0)
    logprobs = reply.choices[0].logprobs
    assert len(logprobs.token_logprobs) == len(prompt) + 1 and logprobs.token_logprobs[0] is None
    assert logprobs.tokens[: len(prompt)] == [tokenizer.decode([t]) for t in prompt]
    want = sum(reference[p, prompt[p + 1]].item() for p in range(len(context) - 1, len(prompt) - 1))
    assert abs(sum(logprobs.token_logprobs[len(context) : -1]) - want) < 1e-3
    greedy = [max(top.values()) == lp for lp, top in zip(logprobs.token_logprobs[1:-1], logprobs.top_logprobs[1:-1])]
    assert greedy == [reference[p].argmax().item() == prompt[p + 1] for p in range(len(prompt) - 1)]
    streamed = list(client.completions.create(model=model, prompt=prompt, echo=True, logprobs=1, max_tokens=1,
                                              temperature=0, stream=True))
    assert streamed[0].choices[0].logprobs.token_logprobs[:-1] == logprobs.token_logprobs[:-1]
    # OpenAI's older form (max_tokens 0): the prompt and its logprobs alone, nothing generated.
    only = client.completions.create(model=model, prompt=prompt, echo=True, logprobs=1, max_tokens=0)
    assert only.choices[0].logprobs.token_logprobs == logprobs.token_logprobs[:-1]
    assert only.choices[0].text == tokenizer.decode(prompt) and only.usage.completion_tokens == 0
    streamed_only = list(client.completions.create(model=model, prompt=prompt, echo=True, logprobs=1, max_tokens=0,
                                                   stream=True))
    assert "".join(c.choices[0].text for c in streamed_only) == only.choices[0].text
    assert [lp for c in streamed_only for lp in c.choices[0].logprobs.token_logprobs] == logprobs.token_logprobs[:-1]


def test_logprobs_shapes(client, model):
    reply = client.completions.create(model=model, prompt=[5, 6, 7, 8], logprobs=3, **GREEDY)
    logprobs = reply.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 12
    assert all(1 <= len(top) <= 3 for top in logprobs.top_logprobs)
    assert all(lp <= 0 for lp in logprobs.token_logprobs)
    assert logprobs.text_offset == sorted(logprobs.text_offset)
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], temperature=0,
                                          max_tokens=5, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 and all(len(entry.top_logprobs) == 2 for entry in content)
    assert all(entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob for entry in content)


@pytest.mark.parametrize("options, param", [
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"max_tokens": 0}, "max_tokens"),
    ({"n": 0}, "n"), ({"logprobs": 30}, "logprobs"), ({"extra_body": {"top_k": -5}}, "top_k"),
    ({"extra_body": {"ttft_ms": -1}}, "ttft_ms"), ({"extra_body": {"priority": "high"}}, "priority"),
    ({"logit_bias": {"5": 101}}, "logit_bias"), ({"logit_bias": {"99999": 1}}, "logit_bias"),
    ({"prompt": [1, 2, 9999]}, "prompt"), ({"prompt": ""}, "prompt"),
])
def test_a_bad_field_is_a_400_naming_it(client, model, options, param):
    request = {"model": model, "prompt": [1, 2, 3], **options}
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(**request)
    assert err.value.status_code == 400
    assert err.value.body["param"] == param and err.value.body["type"] == "invalid_request_error"
    assert param in err.value.body["message"]


def test_chat_field_names_and_unknown_fields(client, model):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                       max_completion_tokens=10**6)
    assert err.value.body["param"] == "max_completion_tokens"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": [{"type": "image_url"}]}])
    assert err.value.body["param"] == "messages[0].content[0]"
    reply = client.completions.create(model=model, prompt=[1, 2], max_tokens=2, extra_body={"no_such_field": 1})
    assert reply.usage.completion_tokens <= 2  # unknown fields are ignored, as OpenAI does


def _post(url: str, body: bytes) -> tuple[int, dict]:
    """Raw HTTP, as a client that is not the `openai` one sends it: (status, JSON body)."""
    request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as err:
        return err.code, json.load(err)


def _refused(url: str, body: bytes, status: int, param: str | None) -> str:
    """The error's message, after checking its status and OpenAI shape."""
    got, reply = _post(url, body)
    assert got == status, (got, reply)
    assert set(reply["error"]) == {"message", "type", "param", "code"} and reply["error"]["param"] == param
    assert reply["error"]["type"] == "invalid_request_error"
    return reply["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_deeply_nested_body_is_a_400_naming_the_depth_limit(http_url, path):
    deep = b'{"prompt": ' + b"[" * 5000 + b"1" + b"]" * 5000 + b"}"  # once a 500 from the decoder's recursion
    message = _refused(f"{http_url}{path}", deep, 400, "body")
    assert message == "body: JSON nested deeper than 64 levels"
    unclosed = b'{"messages": ' + b'[{"a": ' * 3000
    assert "deeper than 64" in _refused(f"{http_url}{path}", unclosed, 400, "body")
    # Brackets inside strings do not nest, escaped quotes included.
    in_strings = json.dumps({"prompt": [1, 2], "max_tokens": 1, "user": '"[{' * 3000 + "\\"}).encode()
    assert _post(f"{http_url}/v1/completions", in_strings)[0] == 200


def test_a_body_over_the_size_limit_is_a_413_naming_it(http_url):
    limit = 64 * 1024 * 1024
    message = _refused(f"{http_url}/v1/completions", b" " * (limit + 1), 413, "body")
    assert message == f"body: is larger than the limit of {limit} bytes"
    # aiohttp's own refusals come in the same shape: an unknown path, a wrong method.
    assert _refused(f"{http_url}/v1/nothing", b"{}", 404, None) == "POST /v1/nothing: Not Found"
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(f"{http_url}/v1/completions", timeout=10)
    assert err.value.code == 405 and err.value.headers["Allow"] == "POST"
    assert json.load(err.value)["error"]["message"] == "GET /v1/completions: Method Not Allowed"


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": [1, 2], "stop": {"a": 1}}, "stop"),  # once served as if no stop were given
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "stop": {"a": 1}}, "stop"),
    ("/v1/completions", {"prompt": [1, 2], "stop": [["x"]]}, "stop"),
    ("/v1/completions", {"prompt": [1, 2], "user": {"id": 7}}, "user"),
    ("/v1/completions", {"prompt": [1, 2], "stream_options": []}, "stream_options"),
])
def test_a_field_of_the_wrong_type_is_a_400_naming_it(http_url, path, body, param):
    assert _refused(f"{http_url}{path}", json.dumps(body).encode(), 400, param).startswith(f"{param}: ")


def test_an_unknown_chat_role_is_a_400_listing_the_known_ones(http_url, client, model):
    for role in ("wizard", "", "User", None, 3):  # "wizard" was once rendered as a role of its own
        body = {"messages": [{"role": "user", "content": "Hi"}, {"role": role, "content": "Hi"}], "max_tokens": 2}
        message = _refused(f"{http_url}/v1/chat/completions", json.dumps(body).encode(), 400, "messages[1].role")
        assert message == "messages[1].role: must be one of system, developer, user, assistant, tool, function"
    reply = client.chat.completions.create(model=model, max_tokens=2, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert reply.choices[0].message.role == "assistant"


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
])
def test_a_body_without_model_is_served_by_the_one_model(http_url, model, path, body):
    """As vLLM does: the router serves one model, so `model` may be left out (or null)."""
    for sent in (body, {**body, "model": None}):
        status, reply = _post(f"{http_url}{path}", json.dumps(sent).encode())
        assert status == 200 and reply["model"] == model and reply["usage"]["completion_tokens"] <= 2


def test_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="no-such-model", prompt="Hi")
    assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"


def test_deadline_is_a_504_and_frees_blocks(client, model, router_stack):
    import ray

    prefill = router_stack.cluster.prefill[0].actor
    ray.get(prefill.debug_set_step_delay.remote(1.0))
    try:
        with pytest.raises(openai.APIStatusError) as err:
            client.completions.create(model=model, prompt=[4, 5, 6], max_tokens=4, extra_body={"timeout_ms": 300})
    finally:
        ray.get(prefill.debug_set_step_delay.remote(0.0))
    assert err.value.status_code == 504 and err.value.body["code"] == "deadline_exceeded"
    _wait_idle(router_stack)
    router_stack.check_workers_clean()


def test_a_failure_after_the_first_token_is_an_error_event_then_done(client, model, router_stack):
    request = dict(model=model, prompt=[4, 5, 6], max_tokens=500, stream=True)
    started_s = time.perf_counter()
    times = [time.perf_counter() - started_s for _ in client.completions.create(**request,
                                                                                extra_body={"ignore_eos": True})]
    # A deadline halfway between this machine's first and last token of the same stream.
    timeout_ms = 1000 * (times[0] + times[-1]) / 2
    texts = []
    with pytest.raises(openai.APIError) as err:  # the 200 went out with the first token; the deadline
        for chunk in client.completions.create(**request, extra_body={"ignore_eos": True, "timeout_ms": timeout_ms}):
            texts.append(chunk.choices[0].text)  # passes while decoding
    assert texts and "deadline" in err.value.message
    assert err.value.body["code"] == "deadline_exceeded"
    _wait_idle(router_stack)
    router_stack.check_workers_clean()


def test_client_disconnect_mid_stream_frees_blocks_on_both_workers(http_url, model, router_stack):
    body = json.dumps({"model": model, "prompt": list(range(10, 90)), "max_tokens": 400, "temperature": 0,
                       "ignore_eos": True, "stream": True}).encode()
    request = urllib.request.Request(f"{http_url}/v1/completions", body, {"Content-Type": "application/json"})
    response = urllib.request.urlopen(request, timeout=30)
    events = [response.readline() for _ in range(4)]  # two events, each "data: ..." and a blank line
    assert events[0].startswith(b"data: {") and b'"finish_reason":null' in events[0]
    response.close()  # the server sees the connection drop and cancels the request
    _wait_idle(router_stack)
    router_stack.check_workers_clean()


def test_models_health_and_metrics(http_url, client, model):
    card = client.models.list().data[0]
    assert card.id == model and card.model_extra["max_model_len"] == 512
    assert card.model_extra["splitserve"]["vocab_size"] == 512
    assert json.load(urllib.request.urlopen(f"{http_url}/health", timeout=10)) == {"status": "ok"}
    document = json.load(urllib.request.urlopen(f"{http_url}/openapi.json", timeout=10))  # open without a token
    completion = document["paths"]["/v1/completions"]["post"]
    assert document["openapi"] == "3.1.0" and completion["security"] == []
    assert completion["requestBody"]["content"]["application/json"]["schema"]["properties"]["model"]["enum"][0] == model
    metrics = urllib.request.urlopen(f"{http_url}/metrics", timeout=10).read().decode()
    assert f'splitserve_router_requests_total{{model_name="{model}",outcome="ok"}}' in metrics
    assert f'splitserve_router_requests_total{{model_name="{model}",outcome="invalid_argument"}}' in metrics


def _wait_idle(stack, timeout_s: float = 15.0) -> None:
    deadline_s = time.monotonic() + timeout_s
    while stack.server.service.inflight_requests:
        assert time.monotonic() < deadline_s, "requests still in flight on the router"
        time.sleep(0.05)
