"""A router with a bearer token and room for one request at a time, through the real `openai` client:
401 without the token, 429 with Retry-After when the router refuses work, and the open probes."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest

from tests.factories import TinySpec
from tests.router.conftest import router_config, start_router

TOKEN = "http-s3cret"


@pytest.fixture(scope="module")
def limited(ray_session, checkpoint, tmp_path_factory):
    token_file = tmp_path_factory.mktemp("auth") / "token"
    token_file.write_text(TOKEN)
    stack = start_router(checkpoint(TinySpec()), router_config(auth_token_file=str(token_file),
                                                               max_concurrent_requests=1))
    yield stack
    stack.stop()


def _client(stack, token: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.server.http.url}/v1", api_key=token, max_retries=0, timeout=60)


def test_missing_or_wrong_token_is_a_401_and_probes_stay_open(limited):
    with _client(limited, "wrong") as client:
        with pytest.raises(openai.AuthenticationError) as err:
            client.completions.create(model="llama0", prompt=[1, 2, 3], max_tokens=2)
        assert err.value.status_code == 401 and err.value.body["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
    url = limited.server.http.url
    # The openai client always sends a key; without one (plain HTTP) it is a 401 too.
    bare = urllib.request.Request(f"{url}/v1/completions", b'{"prompt": [1, 2]}', {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(bare, timeout=10)
    assert err.value.code == 401 and json.load(err.value)["error"]["type"] == "authentication_error"
    assert json.load(urllib.request.urlopen(f"{url}/health", timeout=10))["status"] == "ok"
    assert b"splitserve_router_requests_total" in urllib.request.urlopen(f"{url}/metrics", timeout=10).read()
    with _client(limited, TOKEN) as client:
        assert client.completions.create(prompt=[1, 2, 3], max_tokens=2, model=client.models.list().data[0].id)


def test_a_refused_request_is_a_429_with_retry_after(limited):
    with _client(limited, TOKEN) as client:
        model = client.models.list().data[0].id
        stream = client.completions.create(model=model, prompt=list(range(10, 40)), max_tokens=300, stream=True,
                                           extra_body={"ignore_eos": True})
        assert next(iter(stream)).choices  # the one slot is taken while this stream runs
        with pytest.raises(openai.RateLimitError) as err:
            client.completions.create(model=model, prompt=[1, 2, 3], max_tokens=2)
        with pytest.raises(openai.RateLimitError):  # streamed requests get the status too, not a 200
            client.completions.create(model=model, prompt=[1, 2, 3], max_tokens=2, stream=True)
        stream.close()
    assert err.value.status_code == 429 and err.value.body["type"] == "rate_limit_error"
    assert err.value.response.headers["Retry-After"] == "1"
    assert err.value.response.headers["retry-after-ms"] == "1000"
    limited.check_workers_clean()


def test_the_openapi_document_needs_the_token_too(limited):
    url = f"{limited.server.http.url}/openapi.json"
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(url, timeout=10)
    assert err.value.code == 401
    granted = urllib.request.Request(url, headers={"Authorization": f"Bearer {TOKEN}"})
    document = json.load(urllib.request.urlopen(granted, timeout=10))
    assert document["components"]["securitySchemes"]["bearer"] == {"type": "http", "scheme": "bearer"}
    assert document["paths"]["/v1/completions"]["post"]["security"] == [{"bearer": []}]
    assert document["paths"]["/health"]["get"]["security"] == []
