"""The thin gRPC servicer: proto → domain, one call into `RouterService`, domain → proto.

No decisions are made here and no status codes are chosen here (that is the error interceptor's job).
"""

from __future__ import annotations

import dataclasses

from engine.block_hash import spec_fingerprint
from router.request_keys import deadline_from_remaining
from router.service import RouterService
from router.service_types import RouterOutput
from router.validation import client_wait_s, parse_request
from splitserve_client.protocol import splitserve_v1_pb2 as pb
from splitserve_client.protocol import splitserve_v1_pb2_grpc as pb_grpc
from splitserve_client.sdk_types import UPSTREAM_MS_KEY

_FINISH: dict[str | None, pb.FinishReason] = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH}


class RouterServicer(pb_grpc.RouterServicer):
    def __init__(self, service: RouterService):
        self.service = service

    async def Generate(self, request: pb.GenerateRequest, context):
        domain = parse_request(request, self.service.limits, self.service.tokenize)
        deadline_s = deadline_from_remaining(context.time_remaining())
        waited_s = client_wait_s(context.invocation_metadata())
        async for output in self.service.generate(domain, deadline_s, waited_s):
            if output.upstream_s is not None:  # the last message: say what the cluster took (Envoy-style)
                context.set_trailing_metadata(((UPSTREAM_MS_KEY, f"{output.upstream_s * 1e3:.3f}"),))
            yield output_to_proto(output)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context) -> pb.ModelInfo:
        info = self.service.info
        return pb.ModelInfo(
            model_identity=info.model_identity,
            max_model_len=info.max_model_len,
            vocab_size=info.vocab_size,
            block_size=info.block_size,
            hash_spec=spec_fingerprint(),
            eos_token_ids=list(info.eos_token_ids),
            has_tokenizer=self.service.limits.has_tokenizer,
        )

    async def GetClusterStatus(self, request: pb.GetClusterStatusRequest, context) -> pb.ClusterStatus:
        service = self.service
        monitor, loads, figures = service.monitor, service.worker_loads(), service.metrics.snapshot()
        workers = [_worker(member, monitor, loads) for member in service.cluster.members]
        return pb.ClusterStatus(
            workers=workers,
            inflight_requests=service.inflight_requests,
            requests_total=service.metrics.requests_by_outcome(),
            routing_policy=service.policy.name,
            prompt_tokens_total=int(figures["prompt_tokens_total"]),
            cached_prompt_tokens_total=int(figures["cached_prompt_tokens_total"]),
            index_entries=await service.index_entries(),
            migrations_total=service.metrics.migrations_by_cause(),
        )


def _worker(member, monitor, loads) -> pb.WorkerStatus:
    stats, worker_id = monitor.stats.get(member.worker_id), member.worker_id
    return pb.WorkerStatus(
        worker_id=worker_id,
        role=member.role,
        healthy=monitor.is_healthy(worker_id),
        inflight_requests=loads.get(worker_id, 0),
        waiting=stats.waiting if stats else 0,
        running=stats.running if stats else 0,
        num_kv_blocks=member.info.num_blocks,
        kv_usage=stats.kv_usage if stats else 0.0,
        tp_size=member.tp_size,
        epoch=member.epoch,
        restarts=member.restarts,
        state=member.state,
        kv_tiers=[pb.KVTierStatus(**dataclasses.asdict(tier)) for tier in stats.kv_tiers] if stats else [],
        **_speculation(stats),
    )


def _speculation(stats) -> dict:
    spec = stats.spec if stats is not None else None
    if spec is None:
        return {}
    return {
        "spec_draft_tokens": spec.draft_tokens,
        "spec_accepted_tokens": spec.accepted_tokens,
        "spec_verify_steps": spec.sequence_steps,
        "spec_acceptance_rate": spec.acceptance_rate,
        "spec_mean_accepted_length": spec.mean_accepted_length,
    }


def output_to_proto(output: RouterOutput) -> pb.GenerateResponse:
    message = pb.GenerateResponse(
        request_id=output.request_id,
        token_ids=output.token_ids,
        text=output.text,
        finish_reason=_FINISH.get(output.finish_reason, pb.FINISH_REASON_UNSPECIFIED),
    )
    for token_id, logprobs in zip(output.token_ids, output.logprobs, strict=False):
        if logprobs is not None:
            message.logprobs.append(_token_logprob(token_id, logprobs))
    if output.prompt_logprobs:
        message.prompt_logprobs.extend(_token_logprob(t, logprobs) for t, logprobs in output.prompt_logprobs)
    if output.route is not None:  # fields set in place: a RouteInfo built and copied in costs twice as much
        route, proto = output.route, message.route
        proto.prefill_worker, proto.decode_instance = route.prefill_worker, route.decode_instance
        proto.policy, proto.cached_prompt_tokens = route.policy, route.cached_prompt_tokens
    if output.migrations:
        message.migrations = output.migrations
    if output.usage is not None:
        usage, counts = output.usage, message.usage
        counts.prompt_tokens, counts.completion_tokens = usage.prompt_tokens, usage.completion_tokens
        counts.cached_prompt_tokens = usage.cached_prompt_tokens
    return message


def _token_logprob(token_id: int, logprobs) -> pb.TokenLogprob:
    return pb.TokenLogprob(
        token_id=token_id,
        logprob=logprobs.sampled_logprob,
        top=[pb.TopLogprob(token_id=t, logprob=lp) for t, lp in logprobs.top],
    )
