"""The block-hash spec: one chained, versioned hash of KV blocks, identical in every process and host.

The router hashes a prompt to ask the prefix index where its blocks live; every worker hashes the blocks
it stores. If the two ever disagree, prefix routing silently stops working (or worse, matches the wrong
blocks), so the algorithm is written down here exactly enough to reimplement it in another language.

Spec version 1 (`spec_fingerprint() == "blake2b-128/v1/u32le"`)
--------------------------------------------------------------
* H(x) is BLAKE2b from RFC 7693 with a 16-byte digest (128 bits) and default parameters: no key, no
  salt, no personalization (Python: ``hashlib.blake2b(x, digest_size=16).digest()``).
* ``u32(n)`` is n as a 4-byte unsigned little-endian integer; ``lp(b) = u32(len(b)) || b``;
  strings are UTF-8 encoded before ``lp``.
* Root of a namespace (model identity, block size, tenant salt)::

      root = H(b"splitserve-kv" || u32(1) || u32(block_size) || lp(model_identity) || lp(tenant_salt))

  The literal ``1`` is HASH_SPEC_VERSION.
* Block i of a sequence, tokens t_0..t_{n-1} (n == block_size for every hashed block)::

      h_i = H(h_{i-1} || u32(n) || u32(t_0) || ... || u32(t_{n-1}) || lp(extra))

  with ``h_{-1} = root``. ``extra`` is opaque bytes (empty today; reserved for e.g. LoRA or
  multimodal inputs that change a block's KV without changing its token ids).
* Only full blocks are hashed; a trailing partial block has no hash until it fills.
* Token ids must be integers in [0, 2**32); block_size in [1, 2**32).

Why each choice: 128 bits makes accidental collisions negligible across a fleet (local hits are still
verified against stored tokens); the token count ``u32(n)`` keeps the encoding unambiguous when
``extra`` is non-empty (without it, a last token and the length of ``extra`` could trade bytes);
Python's ``hash()`` is salted per process and would break the "identical everywhere" rule.

`BlockHash` is ``NewType("BlockHash", bytes)``: exactly 16 raw digest bytes. Bytes rather than a
class because they are hashable, cheap, and cross every boundary as-is (proto ``bytes``, Redis keys);
``.hex()`` is the printable form. Use `as_block_hash` to accept one from the wire.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NewType

HASH_SPEC_VERSION = 1
BLOCK_HASH_BYTES = 16
MAX_U32 = 2**32 - 1

BlockHash = NewType("BlockHash", bytes)

_DOMAIN_TAG = b"splitserve-kv"
_U32 = struct.Struct("<I")


class HashSpecMismatchError(RuntimeError):
    """Two processes would hash blocks differently; the later one must refuse to start."""


@dataclass(frozen=True)
class HashNamespace:
    """What seeds the root: caches of different models, block sizes or tenants never share a hash.

    `model_identity` must be a stable name for the weights (e.g. a name plus a content digest) chosen
    by the cluster config, the same string on the router and on every worker.
    """

    model_identity: str
    block_size: int
    tenant_salt: str = ""

    def __post_init__(self):
        if not isinstance(self.model_identity, str) or not self.model_identity:
            raise ValueError("model_identity must be a non-empty string")
        if not isinstance(self.tenant_salt, str):
            raise ValueError("tenant_salt must be a string")
        if not _is_int(self.block_size) or not 1 <= self.block_size <= MAX_U32:
            raise ValueError(f"block_size must be an integer in [1, {MAX_U32}], got {self.block_size!r}")


def spec_fingerprint() -> str:
    """Algorithm, version and packing in one string; router and workers compare it at startup."""
    return f"blake2b-{BLOCK_HASH_BYTES * 8}/v{HASH_SPEC_VERSION}/u32le"


def check_spec_fingerprint(remote: str) -> None:
    """Raise HashSpecMismatchError unless `remote` (a peer's fingerprint) equals ours."""
    local = spec_fingerprint()
    if remote != local:
        raise HashSpecMismatchError(f"block-hash spec mismatch: peer uses {remote!r}, this process {local!r}")


def as_block_hash(raw: bytes) -> BlockHash:
    """Accept a hash received from another process, checking only its size."""
    if not isinstance(raw, (bytes, bytearray)) or len(raw) != BLOCK_HASH_BYTES:
        raise ValueError(f"a block hash is {BLOCK_HASH_BYTES} bytes, got {raw!r}")
    return BlockHash(bytes(raw))


@functools.lru_cache(maxsize=256)
def root_hash(ns: HashNamespace) -> BlockHash:
    """The parent of a sequence's first block. Cached: namespaces are few and frozen."""
    data = b"".join(
        (
            _DOMAIN_TAG,
            _U32.pack(HASH_SPEC_VERSION),
            _U32.pack(ns.block_size),
            _length_prefixed(ns.model_identity.encode("utf-8")),
            _length_prefixed(ns.tenant_salt.encode("utf-8")),
        )
    )
    return _digest(data)


def hash_block(parent: BlockHash, token_ids: Sequence[int], extra: bytes = b"") -> BlockHash:
    """Hash of one block given its parent's hash (the root for a sequence's first block)."""
    if not isinstance(parent, bytes) or len(parent) != BLOCK_HASH_BYTES:
        raise ValueError(f"parent must be a {BLOCK_HASH_BYTES}-byte BlockHash, got {parent!r}")
    return _digest(
        b"".join((parent, _U32.pack(len(token_ids)), _pack_tokens(token_ids), _length_prefixed(bytes(extra))))
    )


def hash_blocks(
    ns: HashNamespace, token_ids: Sequence[int], *, start_parent: BlockHash | None = None
) -> list[BlockHash]:
    """Hashes of every full block of `token_ids`, chained from `start_parent` (default: the root).

    With `start_parent` set, `token_ids` are the tokens that follow the block that hash belongs to.
    """
    parent = root_hash(ns) if start_parent is None else start_parent
    size = ns.block_size
    hashes: list[BlockHash] = []
    for start in range(0, len(token_ids) - size + 1, size):
        parent = hash_block(parent, token_ids[start : start + size])
        hashes.append(parent)
    return hashes


def extend_block_hashes(
    ns: HashNamespace, token_ids: Sequence[int], existing_hashes: Sequence[BlockHash]
) -> list[BlockHash]:
    """Full hash list of `token_ids`, reusing `existing_hashes` (those of its leading blocks).

    Only the blocks after the existing ones are hashed, so a growing sequence pays O(new blocks).
    The existing hashes are trusted to belong to `token_ids`' prefix under `ns`.
    """
    done = len(existing_hashes)
    if done > len(token_ids) // ns.block_size:
        raise ValueError(f"{done} existing hashes but only {len(token_ids) // ns.block_size} full blocks")
    parent = existing_hashes[-1] if done else None
    tail = hash_blocks(ns, token_ids[done * ns.block_size :], start_parent=parent)
    return [*existing_hashes, *tail]


def _digest(data: bytes) -> BlockHash:
    return BlockHash(hashlib.blake2b(data, digest_size=BLOCK_HASH_BYTES).digest())


def _length_prefixed(raw: bytes) -> bytes:
    if len(raw) > MAX_U32:
        raise ValueError("field longer than 2**32 - 1 bytes cannot be length-prefixed")
    return _U32.pack(len(raw)) + raw


def _pack_tokens(token_ids: Sequence[int]) -> bytes:
    # struct checks the range and the integer-ness in C; we only translate its error.
    try:
        return struct.pack(f"<{len(token_ids)}I", *token_ids)
    except struct.error as exc:
        bad = [t for t in token_ids if not _is_int(t) or not 0 <= t <= MAX_U32]
        raise ValueError(f"token ids must be integers in [0, 2**32), got {bad[:3]!r}") from exc


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
