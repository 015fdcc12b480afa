"""Property-based fuzzing of GenerateRequest against a real router: never INTERNAL, never a crash,
every invalid field answered with INVALID_ARGUMENT naming it, and valid requests still served."""
from __future__ import annotations

import grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from splitserve_client.protocol import splitserve_v1_pb2 as pb
from splitserve_client.protocol import splitserve_v1_pb2_grpc as pb_grpc
from splitserve_client.sdk_types import FIELD_KEY

FIELDS = {"prompt", "text", "token_ids", "priority", "tenant", "request_id", "return_text", "slo.ttft_ms",
          "slo.tpot_ms"} | {f"sampling.{f.name}" for f in pb.SamplingParams.DESCRIPTOR.fields}
INT64 = st.integers(-2**63, 2**63 - 1)
FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.floats(-3, 3))
TEXT = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40)


def _maybe(strategy):
    return st.one_of(st.none(), strategy)


sampling = st.fixed_dictionaries({}, optional={
    "max_tokens": st.one_of(st.integers(-5, 6), st.integers(10**6, 2**62)),
    "min_tokens": st.integers(-5, 10), "temperature": FLOATS, "top_k": st.one_of(st.integers(-3, 50), INT64),
    "top_p": FLOATS, "min_p": FLOATS, "repetition_penalty": FLOATS, "presence_penalty": FLOATS,
    "frequency_penalty": FLOATS, "seed": INT64, "stop": st.lists(TEXT, max_size=3),
    "stop_token_ids": st.lists(st.one_of(st.integers(-3, 600), INT64), max_size=4), "ignore_eos": st.booleans(),
    "logprobs": st.integers(-3, 25), "prompt_logprobs": st.integers(-3, 25),
    "logit_bias": st.dictionaries(st.one_of(st.integers(-3, 600), INT64), st.one_of(FLOATS, st.floats(-150, 150)),
                                  max_size=4)})

requests = st.fixed_dictionaries({
    "prompt": st.one_of(st.none(), TEXT.map(lambda t: ("text", t)),
                        st.lists(st.one_of(st.integers(-3, 520), INT64), max_size=24).map(lambda t: ("ids", t))),
    "sampling": _maybe(sampling),
    "slo": _maybe(st.fixed_dictionaries({}, optional={"ttft_ms": FLOATS, "tpot_ms": FLOATS})),
    "priority": st.one_of(st.integers(-1100, 1100), st.integers(-2**31, 2**31 - 1)),
    "tenant": st.one_of(TEXT, st.text(min_size=120, max_size=140)),
    "request_id": st.one_of(st.just(""), TEXT, st.text(alphabet="abc-_1", min_size=1, max_size=130)),
    "return_text": _maybe(st.booleans()),
})


def build(raw: dict) -> pb.GenerateRequest:
    msg = pb.GenerateRequest(priority=raw["priority"], tenant=raw["tenant"], request_id=raw["request_id"])
    if raw["prompt"] is not None:
        kind, value = raw["prompt"]
        if kind == "text":
            msg.text = value
        else:
            msg.token_ids.ids.extend(value)
    if raw["sampling"] is not None:
        msg.sampling.CopyFrom(pb.SamplingParams(**raw["sampling"]))
    if raw["slo"] is not None:
        msg.slo.CopyFrom(pb.Slo(**raw["slo"]))
    if raw["return_text"] is not None:
        msg.return_text = raw["return_text"]
    return msg


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(raw=requests)
def test_fuzzed_requests_get_ok_or_invalid_argument_naming_a_field(router_stack, raw):
    with grpc.insecure_channel(router_stack.target) as channel:
        stub = pb_grpc.RouterStub(channel)
        try:
            replies = list(stub.Generate(build(raw), timeout=30))
            assert replies and replies[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED
        except grpc.RpcError as err:
            assert err.code() is grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details())
            field = dict(err.trailing_metadata() or ()).get(FIELD_KEY)
            assert field in FIELDS and field in err.details(), (field, err.details())
        valid = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[3, 4, 5]),
                                   sampling=pb.SamplingParams(max_tokens=2, temperature=0.0))
        assert len([t for r in stub.Generate(valid, timeout=30) for t in r.token_ids]) == 2


def test_pool_is_clean_after_fuzzing(router_stack):
    router_stack.check_workers_clean()
