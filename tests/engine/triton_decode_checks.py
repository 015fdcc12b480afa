"""Checks of the Triton paged decode kernel, shared by the CPU (interpreted) and CUDA tests.

`python -m tests.engine.triton_decode_checks` with `TRITON_INTERPRET=1` runs them on the CPU under
Triton's interpreter: in a fresh process, because the interpreter needs triton imported with the
variable already set (a process that imported triton compiled cannot interpret).
"""
from __future__ import annotations

import torch

from engine.kv_quant import kv_format
from engine.kv_storage import KVCacheStorage
from engine.quantized_attention import quantized_decode_attention

# heads, kv_heads, head_dim, block_size, batch, forced split plan (None: the kernel's own)
SHAPES = [(4, 2, 16, 4, 3, None), (8, 1, 32, 16, 2, (3, 2)), (4, 4, 24, 16, 4, None), (6, 2, 64, 32, 2, (2, 4))]


def _case(shape, dtype, device, seed):
    heads, kv_heads, head_dim, block_size, batch, _ = shape
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 48
    k, v = (torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=gen) for _ in range(2))
    q = torch.randn(batch, heads, head_dim, generator=gen)
    lens = torch.randint(1, 9 * block_size, (batch,), generator=gen)
    lens[0] = 1
    width = int(-(-lens.max() // block_size)) + 1  # one spare column: tables are padded
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:width] for _ in range(batch)])
    to = dict(device=device)
    return q.to(dtype=dtype, **to), k.to(dtype=dtype, **to), v.to(dtype=dtype, **to), tables.to(**to), lens.to(**to)


def _reference(q, k, v, tables, lens, scale):
    """Exact softmax attention in fp64 over each sequence's gathered tokens."""
    batch, heads, dim = q.shape
    kv_heads, _, block_size, _ = k.shape
    out = []
    for b in range(batch):
        positions = torch.arange(int(lens[b]), device=q.device)
        slots = tables[b, positions // block_size] * block_size + positions % block_size
        keys = k.reshape(kv_heads, -1, dim)[:, slots].double()
        values = v.reshape(kv_heads, -1, dim)[:, slots].double()
        queries = q[b].view(kv_heads, heads // kv_heads, dim).double()
        probs = (queries @ keys.transpose(-1, -2) * scale).softmax(-1)
        out.append((probs @ values).reshape(-1))
    return torch.stack(out)


def _plan(module, shape):
    return None if shape[-1] is None else module.SplitPlan(*shape[-1])


def check_exact(module, device, dtype, tolerance):
    for index, shape in enumerate(SHAPES):
        q, k, v, tables, lens = _case(shape, dtype, device, seed=index)
        scale = shape[2] ** -0.5
        out = module.paged_decode_attention(q, k, v, None, None, tables, lens, scale, plan=_plan(module, shape))
        error = (out.double() - _reference(q, k, v, tables, lens, scale)).abs().max().item()
        assert error <= tolerance, (shape, dtype, error)


def check_quantized(module, device, formats):
    for index, shape in enumerate(SHAPES):
        heads, kv_heads, head_dim, block_size, batch, _ = shape
        q, k, v, tables, lens = _case(shape, torch.float32, device, seed=10 + index)
        for name in formats:
            storage = KVCacheStorage(kv_format(name, torch.float32), 1, kv_heads, k.shape[1], block_size, head_dim,
                                     device)
            layer = storage.layer(0)
            slots = torch.arange(k.shape[1] * block_size, device=device)
            layer.write(k.reshape(kv_heads, -1, head_dim).transpose(0, 1), v.reshape(kv_heads, -1, head_dim).transpose(0, 1),
                        slots)
            out = module.paged_decode_attention(q, layer.k, layer.v, layer.k_scale, layer.v_scale, tables, lens,
                                                head_dim ** -0.5, plan=_plan(module, shape))
            reference = quantized_decode_attention(q, layer, tables, lens, head_dim ** -0.5)
            assert (out - reference).abs().max().item() <= 1e-5, (shape, name)



def check_fused(device: str, dtype: torch.dtype, tolerance: float) -> None:
    """The fused elementwise kernels against the PyTorch code they replace, on strided inputs."""
    from engine.kernels import triton_fused
    from engine.layers.norm import RMSNorm
    from engine.layers.rotary import RotaryEmbedding

    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(7, 3 * 4 * 24, generator=gen).to(device=device, dtype=dtype)
    q = qkv[:, :4 * 24].view(7, 4, 24)  # a strided view, as the attention layer has it
    norm = RMSNorm(24, 1e-6, dtype).to(device)
    norm.weight.data.normal_(1.0, 0.2, generator=torch.Generator(device=device).manual_seed(1))
    cpu_norm = RMSNorm(24, 1e-6, dtype)
    cpu_norm.weight.data.copy_(norm.weight.data.cpu())
    _close(triton_fused.rms_norm(q, norm.weight, 1e-6), cpu_norm(q.cpu()), tolerance)
    angles = torch.rand(7, 1, 12, generator=gen) * 6
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1).to(device=device, dtype=dtype) for f in (torch.cos, torch.sin))
    _close(triton_fused.rope(q, cos, sin), RotaryEmbedding.rotate(q.cpu(), cos.cpu(), sin.cpu()), tolerance)
    gate_up = qkv[:, :2 * 96].contiguous()
    gate, up = gate_up.cpu().chunk(2, dim=-1)
    _close(triton_fused.silu_mul(gate_up), torch.nn.functional.silu(gate) * up, tolerance)


def _close(got: torch.Tensor, want: torch.Tensor, tolerance: float) -> None:
    error = (got.cpu().float() - want.float()).abs().max().item()
    assert got.shape == want.shape and error <= tolerance, (got.shape, want.shape, error)


def main() -> None:
    from engine.kernels import triton_decode

    check_fused("cpu", torch.float32, 1e-5)
    check_exact(triton_decode, "cpu", torch.float32, 1e-5)
    check_quantized(triton_decode, "cpu", ["int8"])  # numpy has no fp8: fp8 runs on the GPU only
    print("interpreted kernel checks passed")


if __name__ == "__main__":
    main()
