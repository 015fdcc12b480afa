"""The block-hash spec: frozen test vectors, namespacing, chaining, cross-process stability."""
import hashlib
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from engine.block_hash import (
    BLOCK_HASH_BYTES,
    HASH_SPEC_VERSION,
    HashNamespace,
    HashSpecMismatchError,
    as_block_hash,
    check_spec_fingerprint,
    extend_block_hashes,
    hash_block,
    hash_blocks,
    root_hash,
    spec_fingerprint,
)

NS = HashNamespace("test-model@v1", block_size=4, tenant_salt="tenant-a")
TOKENS = list(range(1, 11))  # two full blocks of 4 and a partial block of 2

# Frozen at spec version 1. If one of these changes, every deployed cache and index is invalidated:
# bump HASH_SPEC_VERSION instead of editing the vectors.
ROOT_HEX = "d19a8301ea1e21b506841551d276d4b5"
CHAIN_HEX = ["00919b08dd000b7980b8e4fd5d12aa44", "6f898e98f2bb97de7693a2728ccf8ff9"]
EXTRA_HEX = "98734086851ff56cfc40c5d4c5e58b43"  # block [1, 2, 3, 4] under the root with extra b"lora:7"


def test_spec_identity():
    assert HASH_SPEC_VERSION == 1
    assert spec_fingerprint() == "blake2b-128/v1/u32le"
    check_spec_fingerprint("blake2b-128/v1/u32le")
    with pytest.raises(HashSpecMismatchError, match="blake2b-128/v2/u32le"):
        check_spec_fingerprint("blake2b-128/v2/u32le")


def test_frozen_vectors():
    assert root_hash(NS).hex() == ROOT_HEX
    assert [h.hex() for h in hash_blocks(NS, TOKENS)] == CHAIN_HEX
    assert hash_block(root_hash(NS), [1, 2, 3, 4], b"lora:7").hex() == EXTRA_HEX


def test_vectors_follow_the_documented_byte_layout():
    # An independent reimplementation from the module docstring, so the prose spec stays true.
    def u32(n):
        return struct.pack("<I", n)

    def lp(raw):
        return u32(len(raw)) + raw

    def h(data):
        return hashlib.blake2b(data, digest_size=16).digest()

    root = h(b"splitserve-kv" + u32(1) + u32(4) + lp(b"test-model@v1") + lp(b"tenant-a"))
    first = h(root + u32(4) + b"".join(u32(t) for t in [1, 2, 3, 4]) + lp(b""))
    second = h(first + u32(4) + b"".join(u32(t) for t in [5, 6, 7, 8]) + lp(b""))
    assert [root.hex(), first.hex(), second.hex()] == [ROOT_HEX, *CHAIN_HEX]


def test_hash_type_is_16_raw_bytes():
    digest = root_hash(NS)
    assert isinstance(digest, bytes) and len(digest) == BLOCK_HASH_BYTES == 16
    assert as_block_hash(bytearray(digest)) == digest
    with pytest.raises(ValueError):
        as_block_hash(b"short")


@pytest.mark.parametrize("changed", [
    HashNamespace("test-model@v2", block_size=4, tenant_salt="tenant-a"),
    HashNamespace("test-model@v1", block_size=8, tenant_salt="tenant-a"),
    HashNamespace("test-model@v1", block_size=4, tenant_salt="tenant-b"),
    HashNamespace("test-model@v1", block_size=4),
])
def test_every_namespace_field_changes_the_root(changed):
    assert root_hash(changed) != root_hash(NS)
    assert hash_blocks(changed, TOKENS[:8])[0] != hash_blocks(NS, TOKENS[:8])[0]


def test_field_boundaries_are_unambiguous():
    # Length prefixes keep "ab" + "c" apart from "a" + "bc".
    assert root_hash(HashNamespace("ab", 4, "c")) != root_hash(HashNamespace("a", 4, "bc"))
    # The token count keeps a trailing token apart from the length of `extra`.
    parent = root_hash(NS)
    assert hash_block(parent, [4], b"") != hash_block(parent, [], b"\x00\x00\x00\x00")


def test_same_tokens_under_different_parents_differ():
    first, second = hash_blocks(NS, TOKENS)
    assert hash_block(first, [9, 10, 11, 12]) != hash_block(second, [9, 10, 11, 12])
    assert hash_blocks(NS, [5, 6, 7, 8])[0] != second  # same tokens as block 2, but chained from the root


def test_extra_changes_the_hash():
    parent = root_hash(NS)
    assert hash_block(parent, [1, 2, 3, 4]) != hash_block(parent, [1, 2, 3, 4], b"lora:7")


def test_partial_block_is_not_hashed():
    assert hash_blocks(NS, TOKENS[:3]) == []
    assert len(hash_blocks(NS, TOKENS[:7])) == 1
    assert [h.hex() for h in hash_blocks(NS, TOKENS[:8])] == CHAIN_HEX
    assert hash_blocks(NS, []) == []


def test_incremental_extension_equals_full_computation():
    tokens = list(range(100, 137))
    full = hash_blocks(NS, tokens)
    grown: list = []
    for length in range(len(tokens) + 1):
        grown = extend_block_hashes(NS, tokens[:length], grown)
        assert grown == full[:length // NS.block_size]
    assert len(grown) == 9


def test_start_parent_continues_a_chain():
    first = hash_blocks(NS, TOKENS[:4])
    assert hash_blocks(NS, TOKENS[4:8], start_parent=first[0]) == hash_blocks(NS, TOKENS[:8])[1:]


def test_extension_rejects_more_hashes_than_full_blocks():
    with pytest.raises(ValueError, match="existing hashes"):
        extend_block_hashes(NS, TOKENS[:7], hash_blocks(NS, TOKENS[:8]))


def test_identical_in_a_fresh_process():
    repo_root = Path(__file__).resolve().parents[2]
    script = (
        "from engine.block_hash import HashNamespace, hash_blocks, root_hash\n"
        "ns = HashNamespace('test-model@v1', block_size=4, tenant_salt='tenant-a')\n"
        "print(root_hash(ns).hex(), *[h.hex() for h in hash_blocks(ns, list(range(1, 11)))])\n"
    )
    # A different PYTHONHASHSEED proves Python's salted hash() plays no part.
    result = subprocess.run([sys.executable, "-c", script], cwd=repo_root, capture_output=True, text=True,
                            check=True, timeout=60, env={"PYTHONHASHSEED": "12345", "PYTHONPATH": str(repo_root)})
    assert result.stdout.split() == [ROOT_HEX, *CHAIN_HEX]


@pytest.mark.parametrize("bad", [[1, 2, 3, -1], [1, 2, 3, 2**32], [1, 2, 3, 1.5]])
def test_token_ids_must_fit_u32(bad):
    with pytest.raises(ValueError, match=r"\[0, 2\*\*32\)"):
        hash_blocks(NS, bad)
    assert hash_blocks(NS, [0, 1, 2, 2**32 - 1])  # the bounds themselves are fine


@pytest.mark.parametrize("kwargs", [
    {"model_identity": "m", "block_size": 0},
    {"model_identity": "m", "block_size": 2**32},
    {"model_identity": "m", "block_size": True},
    {"model_identity": "", "block_size": 4},
    {"model_identity": "m", "block_size": 4, "tenant_salt": None},
])
def test_namespace_validation(kwargs):
    with pytest.raises(ValueError):
        HashNamespace(**kwargs)


def test_parent_must_be_a_block_hash():
    with pytest.raises(ValueError, match="parent"):
        hash_block(b"not-a-hash", [1, 2, 3, 4])
