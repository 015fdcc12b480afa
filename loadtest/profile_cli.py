"""`splitserve profile`: write the hardware profile the simulator runs on.

    splitserve profile --out cpu.json [--model DIR] [--threads 1]          # time this machine's engine
    splitserve profile --out h200-1b.json --model DIR --device cuda --dtype bfloat16 --kv-cache-gib 100 \
        --transfer-latency-ms 1 --transfer-gbytes-per-s 40
    splitserve profile --roofline --model llama-3.2-1b --gpu h100 --out h100-1b.json
    splitserve profile --calibrate --profile cpu.json --target 127.0.0.1:50051 --out cpu.json

The first runs the engine in this process over a grid of step shapes (sim/profiler.py) with
the torch threads a pool worker gets; `--device cuda` times it on the GPU (then give the KV memory a
GPU worker gets and the hand-off's figures: the defaults describe CPU workers on loopback), with decode
and prefill points up to 16,384-token contexts by default (GPU_DECODE_CONTEXTS, GPU_PREFILL_STARTS, as far
as the model reaches): a GPU reads KV and computes attention so fast that shorter ones leave the cost of
context unmeasured (fitted as 0, which a long trace's late chunks then do not pay). The second
writes a roofline estimate for a named model on a named GPU, labelled as such
(sim/roofline.py). The third measures the cluster's own overheads (router, Ray calls, hand-off
fixed costs) against an idle running cluster and stores them in the profile
(loadtest/calibrate.py).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys

from sim.profile import Profile, Transfer
from sim.profiler import CPU_TRANSFER, Grid, measure_profile
from sim.roofline import GPUS, MODELS, roofline_profile

GPU_DECODE_CONTEXTS = (64, 1024, 4096, 16384)  # the decode points' contexts with --device cuda
GPU_PREFILL_STARTS = (0, 256, 1024, 4096, 16384)  # tokens before the prefill points' chunks, --device cuda


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="splitserve profile",
        description="Write a hardware profile for splitserve simulate / plan.",
        epilog=__doc__.split("\n\n")[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", required=True, metavar="FILE", help="where to write the profile (JSON)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--roofline", action="store_true", help="a roofline estimate for --model on --gpu")
    mode.add_argument("--calibrate", action="store_true", help="add the overheads of the cluster at --target")
    parser.add_argument(
        "--model", help="checkpoint directory (default: the demo model); with --roofline one of " + ", ".join(MODELS)
    )
    parser.add_argument("--gpu", choices=tuple(GPUS), help="with --roofline")
    parser.add_argument("--tp", default="1,2,4,8", help="with --roofline: tensor-parallel sizes (default 1,2,4,8)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads, as a pool worker's (default 1)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="cpu", help="where the engine is timed: cpu, cuda or cuda:N")
    parser.add_argument(
        "--kv-cache-gib", type=float, help="a worker's KV cache memory, for capacity (default: the pool config's)"
    )
    parser.add_argument("--quick", action="store_true", help="a small grid (seconds; for smoke tests)")
    parser.add_argument(
        "--decode-contexts",
        help="decode points' context lengths, comma-separated (default 64,256,1024; with --device cuda "
        "64,1024,4096,16384: a GPU reads KV so fast that short contexts leave its cost unmeasured)",
    )
    parser.add_argument(
        "--prefill-starts",
        help="tokens already computed before the prefill points' chunks, comma-separated (default 0,256,1024; "
        "with --device cuda 0,256,1024,4096,16384)",
    )
    parser.add_argument("--decode-batches", help="decode points' batch sizes, comma-separated (default 1,2,...,64)")
    parser.add_argument("--label", help="the profile's label (default: says what and where)")
    parser.add_argument(
        "--transfer-latency-ms", type=float, help=f"KV hand-off latency (default {CPU_TRANSFER.latency_s * 1e3:g})"
    )
    parser.add_argument(
        "--transfer-gbytes-per-s",
        type=float,
        help=f"KV hand-off bandwidth (default {CPU_TRANSFER.bytes_per_s / 1e9:g})",
    )
    parser.add_argument("--profile", metavar="FILE", help="with --calibrate: the profile to calibrate")
    parser.add_argument("--target", default="127.0.0.1:50051", help="with --calibrate: the router HOST:PORT")
    parser.add_argument(
        "--requests", type=int, default=12, help="with --calibrate: sequential requests (after 4 warm-up ones)"
    )
    return parser


def _transfer(args) -> Transfer:
    latency_ms = CPU_TRANSFER.latency_s * 1e3 if args.transfer_latency_ms is None else args.transfer_latency_ms
    rate = CPU_TRANSFER.bytes_per_s if args.transfer_gbytes_per_s is None else args.transfer_gbytes_per_s * 1e9
    if latency_ms < 0 or rate <= 0:
        raise ValueError("--transfer-latency-ms must be >= 0 and --transfer-gbytes-per-s > 0")
    return Transfer(latency_ms / 1e3, rate)


def _calibrate(args) -> Profile:
    from loadtest.calibrate import fit_overheads, format_rows
    from loadtest.probes import measure

    if args.profile is None:
        raise ValueError("--calibrate needs --profile FILE")
    profile = Profile.load(args.profile)
    lengths = [(64, 256)[i % 2] for i in range(max(args.requests, 2))]  # after 4 warm-up requests
    vocab = tuple(i for i in range(profile.model.vocab_size) if i not in profile.model.eos_token_ids)
    measured = asyncio.run(measure(args.target, lengths, vocab))
    overheads, rows = fit_overheads(profile, measured)  # `measure` discarded its warm-up requests
    print(format_rows(rows, overheads))
    return profile.with_overheads(overheads)


def make_profile(args) -> Profile:
    if args.roofline:
        if args.model is None or args.gpu is None:
            raise ValueError("--roofline needs --model NAME and --gpu NAME")
        tp_sizes = tuple(int(v) for v in args.tp.split(","))
        return roofline_profile(args.model, args.gpu, tp_sizes)
    if args.calibrate:
        return _calibrate(args)
    from engine.demo_model import ensure_demo_model

    model_dir = args.model or str(ensure_demo_model())
    return measure_profile(
        model_dir,
        threads=args.threads,
        dtype=args.dtype,
        grid=_grid(args),
        label=args.label,
        transfer=_transfer(args),
        say=lambda line: print(line, flush=True),
        device=args.device,
        kv_cache_memory_bytes=_kv_bytes(args.kv_cache_gib),
    )


def _grid(args) -> Grid:
    grid = Grid.quick() if args.quick else Grid()
    if args.device.startswith("cuda") and not args.quick:
        grid = dataclasses.replace(grid, contexts=GPU_DECODE_CONTEXTS, starts=GPU_PREFILL_STARTS)
    contexts = _positive_ints(args.decode_contexts, "--decode-contexts") or grid.contexts
    batches = _positive_ints(args.decode_batches, "--decode-batches") or grid.batches
    starts = _positive_ints(args.prefill_starts, "--prefill-starts", allow_zero=True) or grid.starts
    return dataclasses.replace(grid, contexts=contexts, batches=batches, starts=starts)


def _positive_ints(flag: str | None, name: str, allow_zero: bool = False) -> tuple[int, ...]:
    """The sorted distinct values of a comma-separated flag (each >= 1, or >= 0 with `allow_zero`);
    () when it was not given."""
    if flag is None:
        return ()
    try:
        values = {int(v) for v in flag.split(",")}
    except ValueError:
        raise ValueError(f"{name}: integers separated by commas, got {flag!r}") from None
    lowest = 0 if allow_zero else 1
    if min(values) < lowest:
        raise ValueError(f"{name}: every value must be >= {lowest}, got {flag!r}")
    return tuple(sorted(values))


def _kv_bytes(gib: float | None) -> int | None:
    if gib is not None and gib <= 0:
        raise ValueError("--kv-cache-gib must be > 0")
    return None if gib is None else int(gib * 2**30)


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        profile = make_profile(args)
    except ValueError as err:
        parser.error(str(err))
    path = profile.save(args.out)
    print(f"wrote {path}: {profile.label}")
