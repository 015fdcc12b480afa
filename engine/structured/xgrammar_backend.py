"""The xgrammar grammar backend (the contract is in engine/structured/backend.py).

xgrammar was chosen by measurement against llguidance and outlines-core (mask cost per token at batch
1 and 64, compile time): see docs/performance.md#structured-outputs-cpu and
benchmarks/bench_structured_outputs.py.

JSON is compiled without free whitespace (`any_whitespace=False`: the separators are fixed), so a
sampled model cannot pad its output with whitespace until max_tokens and the output is compact JSON.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Callable

import torch
import xgrammar as xgr

from engine.errors import InvalidRequestError
from engine.structured.backend import MAX_ROLLBACK_TOKENS
from engine.structured.spec import StructuredOutputSpec

# The library prefixes its errors with a time and its own source location: not for the client.
_LOG_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")
COMPILED_CACHE_SIZE = 256  # compiled grammars kept per vocabulary (a 50-property schema is ~100 KiB)


class XGrammarMatcher:
    __slots__ = ("_matcher",)

    def __init__(self, compiled: xgr.CompiledGrammar):
        self._matcher = xgr.GrammarMatcher(compiled, max_rollback_tokens=MAX_ROLLBACK_TOKENS)

    def fill_bitmask(self, out: torch.Tensor) -> None:
        self._matcher.fill_next_token_bitmask(out.view(1, -1), 0)

    def accept(self, token_id: int) -> bool:
        return bool(self._matcher.accept_token(token_id))

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._matcher.rollback(num_tokens)

    @property
    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())


class XGrammarCompiled:
    __slots__ = ("_compiled",)

    def __init__(self, compiled: xgr.CompiledGrammar):
        self._compiled = compiled

    def matcher(self) -> XGrammarMatcher:
        return XGrammarMatcher(self._compiled)


# xgrammar 0.2.8 writes the characters of a JSON string as one of these classes. The first (strings with
# maxLength / minLength) lets raw control characters through, and both let UTF-16 surrogates through
# (bytes ED A0-BF xx): JSON forbids the first unescaped, the second is not UTF-8 at all (it decodes as
# three U+FFFD, breaking maxLength), and strict parsers (Python's json, pydantic) refuse either. Both are
# replaced by the class without them.
_XGRAMMAR_STRING_CHARS = (r"[^\"\\\r\n]", r"[^\0-\x1f\"\\\r\n]")
_JSON_STRING_CHAR = r"[^\0-\x1f\"\\\r\n\uD800-\uDFFF]"


def _strict_json(grammar: xgr.Grammar) -> str:
    ebnf = str(grammar)
    for loose in _XGRAMMAR_STRING_CHARS:
        ebnf = ebnf.replace(loose, _JSON_STRING_CHAR)
    return ebnf


def _json_schema(compiler: xgr.GrammarCompiler, spec: StructuredOutputSpec) -> xgr.CompiledGrammar:
    grammar = xgr.Grammar.from_json_schema(spec.value, any_whitespace=False, strict_mode=True)
    return compiler.compile_grammar(_strict_json(grammar))


def _json_object(compiler: xgr.GrammarCompiler, spec: StructuredOutputSpec) -> xgr.CompiledGrammar:
    grammar = xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
    return compiler.compile_grammar(_strict_json(grammar))


def _regex(compiler: xgr.GrammarCompiler, spec: StructuredOutputSpec) -> xgr.CompiledGrammar:
    return compiler.compile_regex(spec.value)


def _choice(compiler: xgr.GrammarCompiler, spec: StructuredOutputSpec) -> xgr.CompiledGrammar:
    # JSON string literals are valid EBNF string literals (same escapes).
    alternatives = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in spec.choices)
    return compiler.compile_grammar(f"root ::= {alternatives}")


def _grammar(compiler: xgr.GrammarCompiler, spec: StructuredOutputSpec) -> xgr.CompiledGrammar:
    return compiler.compile_grammar(spec.value)


COMPILERS: dict[str, Callable[[xgr.GrammarCompiler, StructuredOutputSpec], xgr.CompiledGrammar]] = {
    "json": _json_schema,
    "json_object": _json_object,
    "regex": _regex,
    "choice": _choice,
    "grammar": _grammar,
}


class XGrammarBackend:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...], max_threads: int = 1):
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids))
        # Our own LRU is the cache (keyed by spec, which carries the canonical schema text).
        self._compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)
        self._cache: OrderedDict[StructuredOutputSpec, XGrammarCompiled] = OrderedDict()

    def compile(self, spec: StructuredOutputSpec) -> XGrammarCompiled:
        cached = self._cache.get(spec)
        if cached is not None:
            self._cache.move_to_end(spec)
            return cached
        try:
            compiled = XGrammarCompiled(COMPILERS[spec.kind](self._compiler, spec))
        except Exception as error:  # noqa: BLE001 - the library raises RuntimeError, ValueError and its own kinds
            reason = _LOG_PREFIX.sub("", (str(error).strip().splitlines() or [type(error).__name__])[0])
            message = f"cannot be compiled into a {spec.kind} grammar: {reason}"
            raise InvalidRequestError(spec.field, message) from None
        self._cache[spec] = compiled
        if len(self._cache) > COMPILED_CACHE_SIZE:
            self._cache.popitem(last=False)
        return compiled

    @property
    def num_cached(self) -> int:
        return len(self._cache)
