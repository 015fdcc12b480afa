"""llama.cpp's side of `bench_llamacpp`: run by the python of a separate venv that has `llama-cpp-python`.

Never imported by the repository (its venv has no llama_cpp); `bench_llamacpp` starts it as a subprocess:

- `python llamacpp_worker.py quantize IN.gguf OUT.gguf Q8_0|Q4_0 THREADS` quantizes with llama.cpp's own
  `llama_model_quantize`;
- `python llamacpp_worker.py serve THREADS SEQS CELLS_PER_SEQ NAME=PATH...` loads each GGUF once into a
  context with SEQS parallel sequences, prints one JSON line about itself, then answers one JSON line per
  request line `{"arm": NAME, "prompts": [[ids]], "output": N}` with `{"decode_tok_s", "output_tok_s",
  "tokens"}`. Prompts are token ids (no tokenizer on this path, no BOS added), all sequences decode
  together in one batch per step (llama.cpp's batch API, as its server's parallel slots do), greedy with
  llama.cpp's own greedy sampler, no stop at EOS.
"""

from __future__ import annotations

import ctypes
import json
import platform
import sys
import time
from typing import Any

QUANT_TYPES = {"Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "Q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0"}


def _lib() -> Any:
    """llama_cpp, imported on use: this module must import where it is absent (the repository's venv)."""
    try:
        import llama_cpp  # type: ignore[import-not-found]  # only in the benchmark venv
    except ImportError as error:
        raise SystemExit(
            f"llama_cpp: not importable by {sys.executable} ({error}); use the llama-cpp-python venv"
        ) from None
    return llama_cpp


def _quiet() -> None:
    """Drop llama.cpp's load chatter from stderr (stdout carries the protocol)."""
    llama_cpp = _lib()

    @llama_cpp.llama_log_callback
    def _drop(level, text, user_data):
        return None

    llama_cpp.llama_log_set(_drop, ctypes.c_void_p(0))
    _quiet.callback = _drop  # type: ignore[attr-defined]  # keep the callback alive


def quantize(source: str, target: str, kind: str, threads: int) -> None:
    llama_cpp = _lib()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, QUANT_TYPES[kind])
    params.nthread = threads
    if llama_cpp.llama_model_quantize(source.encode(), target.encode(), ctypes.byref(params)) != 0:
        raise SystemExit(f"llama_model_quantize failed for {kind}")


class Arm:
    """One GGUF loaded with a context sized for `seqs` sequences of up to `cells` tokens each."""

    def __init__(self, path: str, threads: int, seqs: int, cells: int) -> None:
        self.lib = llama_cpp = _lib()
        model_params = llama_cpp.llama_model_default_params()
        model_params.n_gpu_layers = 0
        self.model = llama_cpp.llama_model_load_from_file(path.encode(), model_params)
        if not self.model:
            raise SystemExit(f"cannot load {path}")
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = seqs * cells
        params.n_batch = params.n_ubatch = 512
        params.n_seq_max = seqs
        params.n_threads = params.n_threads_batch = threads
        params.kv_unified = False  # one KV stream per sequence: what its server gives `--parallel N` slots
        params.no_perf = True
        self.ctx = llama_cpp.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise SystemExit(f"cannot create a context for {path}")
        self.batch = llama_cpp.llama_batch_init(params.n_batch, 0, 1)
        self.capacity = params.n_batch
        self.sampler = llama_cpp.llama_sampler_init_greedy()

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """entries: (token, position, sequence, wants logits)."""
        batch = self.batch
        for index, (token, pos, seq, logits) in enumerate(entries):
            batch.token[index] = token
            batch.pos[index] = pos
            batch.n_seq_id[index] = 1
            batch.seq_id[index][0] = seq
            batch.logits[index] = logits
        batch.n_tokens = len(entries)
        if self.lib.llama_decode(self.ctx, batch) != 0:
            raise SystemExit("llama_decode failed")

    def run(self, prompts: list[list[int]], output: int) -> dict:
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)
        tokens: list[list[int]] = [[] for _ in prompts]
        started_s = time.perf_counter()
        # Prefill: prompts packed into batches of up to n_batch tokens, logits only at each prompt's end.
        pending: list[tuple[int, int, int, bool]] = []
        owners: list[tuple[int, int]] = []  # (sequence, index in the batch) of each prompt's last token
        for seq, prompt in enumerate(prompts):
            if len(pending) + len(prompt) > self.capacity:
                self._prefill(pending, owners, tokens)
                pending, owners = [], []
            owners.append((seq, len(pending) + len(prompt) - 1))
            pending.extend((t, pos, seq, pos == len(prompt) - 1) for pos, t in enumerate(prompt))
        self._prefill(pending, owners, tokens)
        decode_s = 0.0
        for _ in range(output - 1):
            step_started_s = time.perf_counter()
            self._decode(
                [
                    (toks[-1], len(p) + len(toks) - 1, seq, True)
                    for seq, (p, toks) in enumerate(zip(prompts, tokens, strict=True))
                ]
            )
            for seq in range(len(prompts)):
                tokens[seq].append(self.lib.llama_sampler_sample(self.sampler, self.ctx, seq))
            decode_s += time.perf_counter() - step_started_s
        wall_s = time.perf_counter() - started_s
        return {
            "decode_tok_s": len(prompts) * (output - 1) / max(decode_s, 1e-9),
            "output_tok_s": len(prompts) * output / wall_s,
            "tokens": tokens,
        }

    def _prefill(self, pending: list, owners: list[tuple[int, int]], tokens: list[list[int]]) -> None:
        if not pending:
            return
        self._decode(pending)
        for seq, index in owners:
            tokens[seq].append(self.lib.llama_sampler_sample(self.sampler, self.ctx, index))


def serve(threads: int, seqs: int, cells: int, specs: list[str]) -> None:
    llama_cpp = _lib()
    llama_cpp.llama_backend_init()
    arms = {name: Arm(path, threads, seqs, cells) for name, path in (spec.split("=", 1) for spec in specs)}
    about = {
        "llama_cpp_python": llama_cpp.__version__,
        "system_info": llama_cpp.llama_print_system_info().decode().strip(),
        "python": platform.python_version(),
    }
    print(json.dumps(about), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        print(json.dumps(arms[request["arm"]].run(request["prompts"], request["output"])), flush=True)


def main() -> None:
    command, *rest = sys.argv[1:] or [""]
    if command not in ("quantize", "serve"):
        raise SystemExit(f"command: expected quantize or serve, got {command!r}")
    _quiet()
    if command == "quantize":
        quantize(rest[0], rest[1], rest[2], int(rest[3]))
    else:
        serve(int(rest[0]), int(rest[1]), int(rest[2]), rest[3:])


if __name__ == "__main__":
    main()
