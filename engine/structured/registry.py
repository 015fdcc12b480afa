"""Grammar backends by name, and one backend per vocabulary per process.

A backend is built once per vocabulary identity (the checkpoint's identity, the LM head's width and its
stop tokens) and shared by every engine of the process, so its compiled-grammar LRU serves them all.
Unknown names fail listing the known ones.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from engine.structured.backend import GrammarBackend

DEFAULT_BACKEND = "xgrammar"


def _xgrammar(tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...]) -> GrammarBackend:
    from engine.structured.xgrammar_backend import XGrammarBackend  # native library: loaded on first use

    return XGrammarBackend(tokenizer, vocab_size, stop_token_ids)


BACKENDS: dict[str, Callable[..., GrammarBackend]] = {"xgrammar": _xgrammar}

_built: dict[tuple, GrammarBackend] = {}
_lock = threading.Lock()  # a decode worker's engine thread and its caller may both compile


def grammar_backend(
    vocab_key: str,
    load_tokenizer: Callable[[], object],
    vocab_size: int,
    stop_token_ids: tuple[int, ...],
    name: str = DEFAULT_BACKEND,
) -> GrammarBackend:
    """The process's backend `name` for the vocabulary `vocab_key` (built on first use)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown grammar backend {name!r}; known: {sorted(BACKENDS)}")
    key = (name, vocab_key, vocab_size, stop_token_ids)
    with _lock:
        if key not in _built:
            _built[key] = BACKENDS[name](load_tokenizer(), vocab_size, stop_token_ids)
        return _built[key]
