"""The decode instance as a prefill worker's hand-off session reaches it: calls on its ranks' typed handles.

A thin adapter (`kvtransfer.session.DecodeEndpoint`): it translates the decode side's answers into
the session's terms (`DecodeFull`, `HandoffFailed`) and nothing else; the session decides.
"""

from __future__ import annotations

from ray.exceptions import RayTaskError

from common.membership import Member
from common.messages import GenerateRequest
from kvtransfer.handoff import HandoffTarget, RankTarget
from kvtransfer.session import DecodeEndpoint, DecodeFull, HandoffFailed


class RayDecodeEndpoint(DecodeEndpoint):
    def __init__(self, decode: Member, request: GenerateRequest, first_token_id: int, owner: str, sender_peer: str):
        self.decode, self.request, self.first_token_id = decode, request, first_token_id
        self.owner, self.sender_peer = owner, sender_peer
        self._rank_of = dict(zip(decode.peer_ids, decode.decode_ranks, strict=True))

    async def reserve(self, num_tokens: int) -> HandoffTarget:
        try:
            return await self.decode.decode_instance.reserve(self.request.request_id, num_tokens, self.owner)
        except RayTaskError as err:
            cause = getattr(err, "cause", None)
            if isinstance(cause, (DecodeFull, HandoffFailed)):
                raise cause from None
            raise

    def announce(self, rank: RankTarget):
        return self._rank_of[rank.peer_id].receive_kv(self.sender_peer, self.request.request_id)

    async def adopt(self) -> None:
        await self.decode.decode_instance.adopt(self.request, self.first_token_id)

    async def cancel(self) -> None:
        await self.decode.decode_instance.cancel(self.request.request_id)
