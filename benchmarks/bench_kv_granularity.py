"""Where an int8 / fp8 KV scale should live: per (token, KV head), or per (block, KV head)?

`python -m benchmarks.bench_kv_granularity [--model DIR] [--prompts N]`. Real keys and values: the
prompts are prefilled by the fp32 engine and its cache read back (every layer, K and V, each head
vector of `head_dim` values). Each scheme quantizes them as the engine would have to:

- `token`: one fp32 scale per token and head, fixed when the token is written (what the engine does);
- `block-offline`: one scale per block and head from all of the block's tokens at once: the best a
  per-block scale can do, but only possible for a prefill that fills whole blocks;
- `block-online`: the same scale, grown token by token as decode appends into a block: when a louder
  token arrives the block's earlier tokens are re-quantized to the new scale (rounded twice).

Reported per scheme: relative RMS error of K and V, the worst head vector's relative error, the error
of decode attention outputs (softmax(q·Kᵀ/√d)·V with the cached keys as queries, against fp32), and
bytes per token relative to fp32.
"""

from __future__ import annotations

import argparse
import random

import torch

from engine.config import EngineConfig
from engine.demo_model import ensure_demo_model
from engine.kv_storage import LayerKV
from engine.llm_engine import LLMEngine
from engine.model_loader import load_model_config
from engine.sampling_params import SamplingParams

QMAX = {"int8": 127.0, "fp8": 448.0}


def _round(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Values already divided by their scale → the stored grid, back in fp32."""
    if fmt == "int8":
        return x.round().clamp(-127, 127)
    return x.clamp(-448, 448).to(torch.float8_e4m3fn).float()


def per_token(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """x [blocks, block_size, dim] → dequantized."""
    scale = x.abs().amax(-1, keepdim=True).clamp_min(1e-30) / QMAX[fmt]
    return _round(x / scale, fmt) * scale


def per_block_offline(x: torch.Tensor, fmt: str) -> torch.Tensor:
    scale = x.abs().amax(dim=(-1, -2), keepdim=True).clamp_min(1e-30) / QMAX[fmt]
    return _round(x / scale, fmt) * scale


def per_block_online(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Tokens arrive one by one; a larger scale re-quantizes what the block already stores."""
    out = torch.empty_like(x)
    scale = torch.full((*x.shape[:1], 1, 1), 1e-30)
    for t in range(x.shape[1]):
        new_scale = torch.maximum(scale, x[:, t : t + 1].abs().amax(-1, keepdim=True) / QMAX[fmt])
        if t:
            out[:, :t] = _round(out[:, :t] / new_scale, fmt) * new_scale  # stored values, rescaled
        out[:, t : t + 1] = _round(x[:, t : t + 1] / new_scale, fmt) * new_scale
        scale = new_scale
    return out


SCHEMES = {"token": per_token, "block-offline": per_block_offline, "block-online": per_block_online}


def _captured_kv(model_dir: str, num_prompts: int, seed: int) -> tuple[torch.Tensor, int]:
    """The K/V the fp32 engine writes while prefilling the prompts (whole blocks only: prompt lengths
    are multiples of the block size), as [layers, 2, heads, blocks, block_size, dim]."""
    engine = LLMEngine(EngineConfig(model_dir=model_dir, num_kv_blocks=1024, enable_prefix_caching=False))
    model, block_size = load_model_config(model_dir), engine.config.block_size
    writes: list[tuple[torch.Tensor, torch.Tensor]] = []
    original = LayerKV.write

    def recording_write(layer: LayerKV, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        writes.append((k.clone(), v.clone()))
        original(layer, k, v, slots)

    LayerKV.write = recording_write  # type: ignore[method-assign,assignment]  # records the writes; restored below
    try:
        rng = random.Random(seed)
        vocab = [t for t in range(model.vocab_size) if t not in {*model.eos_token_ids, model.bos_token_id}]
        for index in range(num_prompts):
            engine.add_request(
                f"p{index}",
                rng.choices(vocab, k=block_size * rng.randint(16, 64)),
                SamplingParams(temperature=0.0, max_tokens=1),
            )
            while engine.has_unfinished():
                engine.step()
            engine.pop_finished(f"p{index}")
    finally:
        LayerKV.write = original  # type: ignore[method-assign]
    layers = model.num_layers  # calls come layer by layer within each step
    per_layer = [
        torch.stack([torch.cat([w[i] for w in writes[layer::layers]]) for i in (0, 1)]) for layer in range(layers)
    ]  # [2, tokens, heads, dim]
    kv = torch.stack(per_layer)  # [layers, 2, tokens, heads, dim]
    tokens, heads, dim = kv.shape[2:]
    return kv.view(layers, 2, tokens // block_size, block_size, heads, dim).permute(0, 1, 4, 2, 3, 5), block_size


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    kv, block_size = _captured_kv(args.model or str(ensure_demo_model()), args.prompts, args.seed)
    layers, _, heads, blocks, _, dim = kv.shape
    print(f"{layers} layers x {heads} KV heads x {blocks} full blocks of {block_size} tokens, head_dim {dim}")
    print(
        f"{'format':>7}{'scale per':>15}{'K rel RMS':>11}{'V rel RMS':>11}{'worst vector':>14}"
        f"{'attn rel err':>14}{'bytes x fp32':>14}"
    )
    report = {}
    for fmt in QMAX:
        for name, scheme in SCHEMES.items():
            row = _measure(kv, fmt, scheme)
            scale_bytes = 4 / (1 if name == "token" else block_size)
            row["bytes_x_fp32"] = (dim + scale_bytes) / (4 * dim)
            report[(fmt, name)] = row
            print(
                f"{fmt:>7}{name:>15}{row['k_rel_rms']:>11.5f}{row['v_rel_rms']:>11.5f}{row['worst']:>14.4f}"
                f"{row['attn_rel_err']:>14.5f}{row['bytes_x_fp32']:>14.4f}"
            )
    return report


def _measure(kv: torch.Tensor, fmt: str, scheme) -> dict:
    layers, _, heads, blocks, block_size, dim = kv.shape
    flat = kv.reshape(layers * 2 * heads, blocks, block_size, dim)
    approx = torch.stack([scheme(flat[i], fmt) for i in range(flat.shape[0])]).view_as(kv)
    error = approx - kv
    rel = lambda e, x: (e.pow(2).mean() / x.pow(2).mean()).sqrt().item()  # noqa: E731
    vector_rel = error.norm(dim=-1) / kv.norm(dim=-1).clamp_min(1e-30)
    keys, values = kv[:, 0].reshape(layers, heads, -1, dim), kv[:, 1].reshape(layers, heads, -1, dim)
    keys_q, values_q = approx[:, 0].reshape_as(keys), approx[:, 1].reshape_as(values)
    queries = keys[:, :, ::7]  # real key vectors as queries: realistic directions and norms
    exact = torch.softmax(queries @ keys.transpose(-1, -2) / dim**0.5, -1) @ values
    quantized = torch.softmax(queries @ keys_q.transpose(-1, -2) / dim**0.5, -1) @ values_q
    return {
        "k_rel_rms": rel(error[:, 0], kv[:, 0]),
        "v_rel_rms": rel(error[:, 1], kv[:, 1]),
        "worst": vector_rel.max().item(),
        "attn_rel_err": rel(quantized - exact, exact),
    }


if __name__ == "__main__":
    main()
