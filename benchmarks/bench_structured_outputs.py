"""Structured outputs: what the grammar mask costs, and which library computes it.

`python -m benchmarks.bench_structured_outputs --json docs/perf/structured_outputs/cpu.json` (no Ray,
no sandbox needed). Everything runs on the demo checkpoint's tokenizer and model (or `--model`).

1. Library comparison (xgrammar, llguidance, outlines-core), each driven directly through its own API on
   the same tokenizer and the same JSON schemas: compile time of a 50-property schema (cold: a fresh
   compiler, median of `--repeats`), and the time to fill the next-token bitmask per token at batch 1
   and 64 (batch b: b matchers each fill their row every step, as the engine does; each matcher walks
   its grammar by picking a seeded random allowed token, so every library fills masks along a valid
   output of its own grammar).
2. The product's compile path (`engine/structured/`, the chosen library): the 50-property schema cold
   and again from the compiled-grammar LRU.
3. The engine's sampling step, with vs without the schema, at batch 1 and 64 (rows with masks, the
   sampler applying them, the matchers advancing; random logits of the model's width, interleaved):
   what a schema adds to every decode step outside the model, measured apart from the model's noise.
4. TPOT on the engine, with vs without a JSON schema, at batch 1 and 64: the same prompts, temperature
   1 seeded, `--tokens` output tokens (the schema is long enough that no output completes early, and
   the baseline ignores EOS). TPOT is (time of a `--tokens` run - time of a 1-token run) / (tokens - 1),
   the arms alternate, `--repeats` medians; the figure is the ratio with / without.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from engine import LLM, SamplingParams
from engine.sampling_rows import step_rows
from engine.structured.backend import bitmask_words
from engine.structured.spec import StructuredOutputSpec
from engine.structured.xgrammar_backend import XGrammarBackend
from engine.tokenizer import load_tokenizer

WALK_TOKENS = 48  # mask fills timed per matcher walk


def schema_with_properties(count: int) -> dict:
    """An object of `count` required properties cycling through bounded strings, integer ranges,
    booleans, enums and small arrays: every output is finite and none can end early."""
    kinds = [
        {"type": "string", "maxLength": 8},
        {"type": "integer", "minimum": 0, "maximum": 999},
        {"type": "boolean"},
        {"enum": ["red", "green", "blue"]},
        {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3},
    ]
    properties = {f"field_{i}": kinds[i % len(kinds)] for i in range(count)}
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


# ---- 1. the libraries, each behind (compile(schema_text) -> grammar, matcher(grammar) -> Walker) --------
class Walker:
    """One matcher of some library: fill(row) writes the int32 bitmask row, accept(token) advances."""

    def __init__(self, fill: Callable[[torch.Tensor], object], accept: Callable[[int], object]):
        self.fill, self.accept = fill, accept


def _xgrammar(tokenizer, vocab_size: int, eos: int):
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=[eos])

    def compile_schema(text: str):
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return compiler.compile_json_schema(text, any_whitespace=False)

    def matcher(grammar) -> Walker:
        m = xgr.GrammarMatcher(grammar)
        return Walker(lambda row: m.fill_next_token_bitmask(row.view(1, -1), 0), m.accept_token)

    return compile_schema, matcher


def _llguidance(tokenizer, vocab_size: int, eos: int):
    import llguidance
    import llguidance.hf
    import llguidance.torch

    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)

    def compile_schema(text: str):
        grammar = llguidance.LLMatcher.grammar_from_json_schema(text, defaults={"whitespace_flexible": False})
        llguidance.LLMatcher(lltok, grammar)  # llguidance compiles lazily: building a matcher is the compile
        return grammar

    def matcher(grammar) -> Walker:
        m = llguidance.LLMatcher(lltok, grammar)
        return Walker(lambda row: llguidance.torch.fill_next_token_bitmask(m, row.view(1, -1), 0), m.consume_token)

    return compile_schema, matcher


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, char -> byte (outlines-core takes token bytes)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


def _outlines_core(tokenizer, vocab_size: int, eos: int):
    import outlines_core  # type: ignore[import-untyped]

    decoder = _byte_level_decoder()
    vocab: dict[bytes, list[int]] = {}
    for token, token_id in tokenizer.get_vocab().items():
        if token_id != eos and token not in tokenizer.all_special_tokens:
            vocab.setdefault(bytes(decoder[c] for c in token), []).append(token_id)
    vocabulary = outlines_core.Vocabulary(eos, vocab)

    def compile_schema(text: str):
        return outlines_core.Index(outlines_core.json_schema.build_regex_from_schema(text), vocabulary)

    def matcher(index) -> Walker:
        guide = outlines_core.Guide(index)
        return Walker(lambda row: guide.write_mask_into(row.data_ptr(), row.numel(), 4), guide.advance)

    return compile_schema, matcher


LIBRARIES = {"xgrammar": _xgrammar, "llguidance": _llguidance, "outlines-core": _outlines_core}


def _allowed(row: torch.Tensor, vocab_size: int) -> list[int]:
    bits = ((row.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:vocab_size]
    return bits.nonzero().flatten().tolist()


def _mask_cost_us(make_matcher, grammar, batch: int, vocab_size: int, eos: int, seed: int) -> float:
    """Microseconds of mask filling per token (per row per step) for `batch` matchers walking together."""
    walkers = [make_matcher(grammar) for _ in range(batch)]
    rngs = [random.Random(seed + i) for i in range(batch)]
    masks = torch.zeros(batch, bitmask_words(vocab_size), dtype=torch.int32)
    elapsed_s = 0.0
    for _ in range(WALK_TOKENS):
        start = time.perf_counter()
        for row, walker in enumerate(walkers):
            walker.fill(masks[row])
        elapsed_s += time.perf_counter() - start
        for row, walker in enumerate(walkers):
            allowed = [t for t in _allowed(masks[row], vocab_size) if t != eos]
            walker.accept(rngs[row].choice(allowed))
    return elapsed_s / (WALK_TOKENS * batch) * 1e6


def compare_libraries(tokenizer, vocab_size: int, eos: int, repeats: int, seed: int) -> dict:
    big = json.dumps(schema_with_properties(50))
    out = {}
    for name, build in LIBRARIES.items():
        compile_schema, make_matcher = build(tokenizer, vocab_size, eos)
        compile_ms = []
        for _ in range(repeats):
            start = time.perf_counter()
            grammar = compile_schema(big)
            compile_ms.append((time.perf_counter() - start) * 1e3)
        out[name] = {
            "compile_50_properties_cold_ms": statistics.median(compile_ms),
            "mask_us_per_token_batch_1": _mask_cost_us(make_matcher, grammar, 1, vocab_size, eos, seed),
            "mask_us_per_token_batch_64": _mask_cost_us(make_matcher, grammar, 64, vocab_size, eos, seed),
        }
        print(name, json.dumps(out[name]), flush=True)
    return out


# ---- 2. the product's compile path ---------------------------------------------------------------------
def product_compile(tokenizer, vocab_size: int, eos: int, repeats: int) -> dict:
    cold, cached = [], []
    for _ in range(repeats):
        backend = XGrammarBackend(tokenizer, vocab_size, (eos,))
        spec = StructuredOutputSpec.json_schema(schema_with_properties(50))
        start = time.perf_counter()
        backend.compile(spec)
        cold.append((time.perf_counter() - start) * 1e3)
        start = time.perf_counter()
        backend.compile(StructuredOutputSpec.json_schema(schema_with_properties(50)))
        cached.append((time.perf_counter() - start) * 1e3)
    return {
        "compile_50_properties_cold_ms": statistics.median(cold),
        "compile_50_properties_cached_ms": statistics.median(cached),
    }


# ---- 3. the engine's sampling step with and without a schema ----------------------------------------
def sampling_step(llm: LLM, batch: int, steps: int, seed: int) -> dict:
    """Milliseconds per step of what a schema adds to the engine's step outside the model: building the
    rows (masks filled), sampling (mask applied) and advancing the matchers; both arms sample random
    logits at temperature 1 for `batch` sequences, interleaved step by step, medians."""
    engine = llm.engine
    spec = StructuredOutputSpec.json_schema(schema_with_properties(50))
    eos, vocab_size = engine.model_config.eos_token_ids, engine.model_config.vocab_size
    generator = torch.Generator().manual_seed(seed)
    arms: dict[bool, list] = {}
    for structured in (False, True):
        params = SamplingParams(temperature=1.0, max_tokens=steps + 1, structured_output=spec if structured else None)
        arms[structured] = [engine.add_request(f"step-{structured}-{i}", [5, 6, 7], params) for i in range(batch)]
    times_ms: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(steps):
        logits = torch.randn(batch, vocab_size, generator=generator)
        for structured, seqs in arms.items():
            start = time.perf_counter()
            rows = step_rows([(seq, (), 1) for seq in seqs], eos, engine.structured.masks)
            tokens = engine.sampler(logits, rows).token_ids
            for seq, token in zip(seqs, tokens, strict=True):
                engine.structured.advance(seq.seq_id, token)
                seq.token_ids.append(token)
            times_ms[structured].append((time.perf_counter() - start) * 1e3)
    for seqs in arms.values():
        for seq in seqs:
            engine.abort_request(seq.seq_id)
    without, with_schema = statistics.median(times_ms[False]), statistics.median(times_ms[True])
    # Each step ran both arms back to back: the median of those differences is steadier on a busy host.
    added = statistics.median(w - wo for w, wo in zip(times_ms[True], times_ms[False], strict=True))
    return {"step_ms_without": without, "step_ms_with_schema": with_schema, "added_ms_paired": added}


# ---- 4. TPOT with and without a schema -----------------------------------------------------------------
def tpot(llm: LLM, batch: int, tokens: int, repeats: int, seed: int) -> dict:
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, 4000) for _ in range(16)] for _ in range(batch)]
    spec = StructuredOutputSpec.json_schema(schema_with_properties(50))

    def run(structured: bool, max_tokens: int) -> float:
        params = [
            SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0,
                seed=seed + i,
                ignore_eos=not structured,
                structured_output=spec if structured else None,
            )
            for i in range(batch)
        ]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed_s = time.perf_counter() - start
        assert all(len(o.outputs[0].token_ids) == max_tokens for o in outputs), "an output ended early"
        return elapsed_s

    samples: dict[bool, list[float]] = {False: [], True: []}
    run(True, 2)  # compiles the schema and warms both paths
    for _ in range(repeats):
        for structured in (False, True):
            full, first = run(structured, tokens), run(structured, 1)
            samples[structured].append((full - first) / (tokens - 1) * 1e3)
    without, with_schema = statistics.median(samples[False]), statistics.median(samples[True])
    paired = statistics.median(w / wo for w, wo in zip(samples[True], samples[False], strict=True))
    return {
        "tpot_ms_without": without,
        "tpot_ms_with_schema": with_schema,
        "ratio": with_schema / without,
        "ratio_paired": paired,  # the median of each round's ratio (the arms alternate)
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint folder (default: the demo checkpoint)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=24, help="output tokens of each TPOT run")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-tpot", action="store_true")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    llm = LLM(args.model, progress=False, num_threads=args.threads, max_num_seqs=64)
    tokenizer = load_tokenizer(llm.config.model_dir)
    vocab_size, eos = llm.engine.model_config.vocab_size, llm.engine.model_config.eos_token_ids[0]
    result = {
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads",
        "vocab_size": vocab_size,
        "repeats": args.repeats,
        "libraries": compare_libraries(tokenizer, vocab_size, eos, args.repeats, args.seed),
        "product_compile": product_compile(tokenizer, vocab_size, eos, args.repeats),
    }
    print(json.dumps(result["product_compile"]), flush=True)
    result["sampling_step"] = {}
    for batch in (1, 64):
        result["sampling_step"][f"batch_{batch}"] = sampling_step(llm, batch, WALK_TOKENS, args.seed)
        print(batch, json.dumps(result["sampling_step"][f"batch_{batch}"]), flush=True)
    if not args.skip_tpot:
        result["tpot"] = {}
        for batch in (1, 64):
            result["tpot"][f"batch_{batch}"] = tpot(llm, batch, args.tokens, args.repeats, args.seed)
            print(batch, json.dumps(result["tpot"][f"batch_{batch}"]), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
