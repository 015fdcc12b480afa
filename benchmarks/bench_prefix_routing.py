"""Prefix-cache hit rate of the routing policies on the Mooncake conversation trace.

    python -m benchmarks.bench_prefix_routing [--trace FILE] [--requests N] [--workers 4]
        [--blocks-per-worker 16384] [--block-size 16] [--tokens-per-hash-id 64] [--max-prompt-tokens 2000]
        [--prefill-tokens-per-s 20000] [--offered-load 0.8 | --speedup S] [--spread-s 3] [--seed 0]
        [--policies ...] [--prefix-pull auto|always|never]

Trace to requests: the first N rows (`loadtest.trace_rows.read_trace`); each 512-token trace block
becomes `tokens-per-hash-id` tokens, so a prompt is round(input_length * tokens_per_hash_id / 512)
tokens, clipped to `max-prompt-tokens` (the demo model's max_model_len is 2048; the rest is left to
the output). Hash id h maps to a deterministic block of token ids (`loadtest.tokens.TokenSource`,
stream TRACE_BLOCK, seeded by (seed, h)), a prompt is concat(block(h))[:length], and its block
hashes are the real `engine.block_hash.hash_blocks`. The trace's ~3 s arrival buckets are spread
uniformly over `spread-s` (seeded), then time is divided by a speed-up: given, or chosen so that
prompt tokens per second = `offered-load` x the fleet's modelled prefill rate (before any hit).

Each policy replays the same requests through the fleet simulator (`sim/`: the router's own policy
objects, its in-process prefix index fed by the workers' real `BlockPool` events, each worker's
prefix cache in a real `BlockPool`) on prefill workers of `blocks-per-worker` blocks that prefill
one prompt at a time at `prefill-tokens-per-s` (modelled compute), then hand the prompt's KV off
over the modelled link below to one decode instance for a second output token. One more arm,
"cache_aware with pulls", adds the router's prefix pulls (`--prefix-pull`, the router's
`PullPlanner` in that mode): the chosen worker copies the prefix a busier worker holds instead of
recomputing it, over a modelled link (demo-model KV, 24,576 bytes per token, at 2.5 GB/s after 5 ms:
in proportion to the modelled prefill rate); a pulled token counts as a hit, as the engine counts
it, and the share of prompt tokens pulled is reported beside the table. The oracle is one infinite
cache (a set of block hashes) fed in arrival order, with the engine's rule that the last prompt
token is always computed; no placement can beat it. A second reference, "pooled", replays the
requests in arrival order through one real pool holding the whole fleet's blocks with instant
compute: what capacity alone allows when every prefix is where it is needed (LRU, so a reference
rather than a bound). Hit rate = cached prompt tokens / prompt tokens over all requests.

Pool size: the default 16384 blocks a worker is where capacity stops being the whole story: on the
conversation trace the pooled reference reaches ~88% of the oracle, against ~44% at 4096 blocks (all
policies starve there) and ~96% at 24576. State the size with every figure.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.block_hash import HashNamespace, hash_blocks
from loadtest import tokens
from loadtest.plan import ModelLimits
from loadtest.trace_rows import MOONCAKE_BLOCK_TOKENS, read_trace
from sim import EngineLimits, ModelFacts, Profile, SimConfig, SimRequest, SimResult, StepCost, Transfer, simulate
from sim.kv import PrefixPool
from sim.seq import block_hashes

# A 300-row slice of the Mooncake conversation trace ships with the tests; pass the full trace with --trace.
DEFAULT_TRACE = Path(__file__).resolve().parents[1] / "tests/data/traces/mooncake-fast25/conversation_trace.jsonl"
POLICIES = ("round_robin", "least_loaded", "prefix_hash", "cache_aware")
# Two output tokens: the prompt's KV is handed off to decode, as a served conversation's is, so the
# router's pull planner learns the link from hand-offs (its first token, the TTFT, is the prefill's).
OUTPUT_TOKENS = 2
PULL_ARM = "cache_aware with pulls"
PULL_MODES = ("auto", "always", "never")
DEMO_MAX_MODEL_LEN = 2048
DEMO_SPECIAL_TOKEN_IDS = (0, 1, 2, 3)  # the demo tokenizer puts its specials first; prompts avoid them
MODEL_IDENTITY = "bench-prefix-routing"
TARGET_OF_ORACLE = 0.9
TARGET_X_ROUND_ROBIN = 2.0


@dataclass(frozen=True)
class Fleet:
    """The prefill workers a replay runs on: finite prefix caches, modelled compute."""

    num_workers: int = 4
    blocks_per_worker: int = 16_384  # 262k tokens of 16: see the module's note on sizing
    block_size: int = 16
    prefill_tokens_per_s: float = 20_000.0  # modelled compute rate of one worker
    # The modelled KV link prefix pulls move blocks over: see the module's note.
    kv_bytes_per_token: int = 24_576
    pull_latency_s: float = 0.005
    pull_bytes_per_s: float = 2.5e9

    def __post_init__(self):
        for name in ("num_workers", "blocks_per_worker", "block_size", "kv_bytes_per_token"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("prefill_tokens_per_s", "pull_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not self.pull_latency_s >= 0:
            raise ValueError(f"pull_latency_s must be >= 0, got {self.pull_latency_s}")

    @property
    def tokens_per_worker(self) -> int:
        return self.blocks_per_worker * self.block_size

    def config(self, policy: str, prefix_pull: str = "never") -> SimConfig:
        """One prompt at a time per worker, whole (no chunking); one decode instance for the second token."""
        whole = max(self.tokens_per_worker, 1)
        return SimConfig(
            prefill=self.num_workers,
            decode=1,
            limits=EngineLimits(max_num_seqs=1, max_num_batched_tokens=whole, prefill_chunk_tokens=whole),
            prefill_kv_tokens=self.tokens_per_worker,
            cache_block_tokens=self.block_size,
            policy=policy,
            prefix_pull=prefix_pull,
        )

    def profile(self) -> Profile:
        """A step computes its tokens at `prefill_tokens_per_s`; a prefix pull takes the modelled link's
        time; nothing else costs time."""
        per_token_s = 1 / self.prefill_tokens_per_s
        model = ModelFacts(MODEL_IDENTITY, 0, self.kv_bytes_per_token, DEMO_MAX_MODEL_LEN, 1, self.block_size)
        return Profile(
            "measured",
            "bench_prefix_routing: modelled prefill",
            "none",
            model,
            {1: StepCost((1, 2), (per_token_s, 2 * per_token_s))},
            {1: self.tokens_per_worker},
            Transfer(self.pull_latency_s, self.pull_bytes_per_s),
        )


@dataclass(frozen=True)
class PolicyResult:
    policy: str
    num_requests: int
    prompt_tokens: int
    cached_tokens: int  # found by the worker's prefix lookup when its prefill started (pulled ones included)
    ttfts_s: tuple[float, ...]  # arrival to prefill done: queueing, the pull's wait, the uncached compute
    pulled_tokens: int = 0  # of cached_tokens, those a prefix pull brought
    pulled_requests: int = 0  # requests that pulled a prefix

    @classmethod
    def of(cls, policy: str, result: SimResult) -> PolicyResult:
        records = result.records
        ttfts_s = tuple(r.ttft_s for r in records if r.ttft_s is not None)
        prompt_tokens = sum(r.prompt_tokens for r in records)
        return cls(
            policy,
            len(records),
            prompt_tokens,
            sum(r.cached_tokens for r in records),
            ttfts_s,
            sum(r.pulled_tokens for r in records),
            sum(r.pulled_tokens > 0 for r in records),
        )

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def pulled_rate(self) -> float:
        return self.pulled_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def mean_ttft_s(self) -> float:
        return sum(self.ttfts_s) / len(self.ttfts_s) if self.ttfts_s else 0.0


def load_requests(args: argparse.Namespace) -> tuple[list[SimRequest], dict]:
    """The replayed requests, arrival-sorted, and notes on how the trace was fitted and timed."""
    trace = read_trace(args.trace, "mooncake")
    rows = trace.rows[: args.requests]
    lengths = [round(r.input_length * args.tokens_per_hash_id / MOONCAKE_BLOCK_TOKENS) for r in rows]
    clipped = sum(n > args.max_prompt_tokens for n in lengths)
    lengths = [max(1, min(n, args.max_prompt_tokens)) for n in lengths]
    rng = np.random.default_rng([args.seed, 1])
    arrivals_s = np.array([r.arrival_s for r in rows]) + rng.uniform(0.0, args.spread_s, len(rows))
    order = np.argsort(arrivals_s, kind="stable")
    arrivals_s = arrivals_s[order] - arrivals_s[order[0]]
    speedup = args.speedup or _speedup_for_load(args, sum(lengths), float(arrivals_s[-1]))
    limits = ModelLimits(DEMO_MAX_MODEL_LEN, args.vocab_size, args.block_size, DEMO_SPECIAL_TOKEN_IDS)
    source = tokens.TokenSource(limits, args.seed)
    namespace = HashNamespace(MODEL_IDENTITY, args.block_size)
    requests = []
    for k, i in enumerate(order):
        n = lengths[i]
        ids = rows[i].hash_ids[: -(-n // args.tokens_per_hash_id)]  # only the blocks the prompt keeps
        token_ids = source.blocks(tokens.TRACE_BLOCK, ids, args.tokens_per_hash_id).reshape(-1)[:n]
        keys = tuple(hash_blocks(namespace, token_ids.tolist()))
        requests.append(SimRequest(float(arrivals_s[k]) / speedup, n, OUTPUT_TOKENS, keys))
    notes = {
        "rows_read": trace.rows_read,
        "rows_used": len(rows),
        "rows_dropped": trace.dropped,
        "rows_clipped": clipped,
        "speedup": speedup,
        "span_s": requests[-1].arrival_s if requests else 0.0,
        "prompt_tokens": sum(lengths),
        "max_prompt_tokens": args.max_prompt_tokens,
    }
    return requests, notes


def _speedup_for_load(args: argparse.Namespace, prompt_tokens: int, span_s: float) -> float:
    if span_s <= 0:
        return 1.0  # every row arrives at once: no speed-up changes that
    fleet_tokens_per_s = args.workers * args.prefill_tokens_per_s
    return args.offered_load * fleet_tokens_per_s * span_s / prompt_tokens


def oracle_cached_tokens(requests: list[SimRequest], block_size: int) -> int:
    """Cached tokens with one infinite cache seeing every request in arrival order, as soon as it arrives."""
    seen: set = set()
    cached_tokens = 0
    for request in requests:
        limit = (request.prompt_tokens - 1) // block_size  # the last token is always computed
        hits = 0
        while hits < min(limit, len(request.block_keys)) and request.block_keys[hits] in seen:
            hits += 1
        cached_tokens += hits * block_size
        seen.update(request.block_keys)
    return cached_tokens


def pooled_cached_tokens(requests: list[SimRequest], num_blocks: int, block_size: int) -> int:
    """Cached tokens of one real pool of `num_blocks` fed in arrival order, each prefill instant."""
    pool = PrefixPool(num_blocks, block_size)
    cached_tokens = 0
    for request in requests:
        keys = block_hashes(request.block_keys)  # the real hashes load_requests made, as they are
        hits = pool.match(keys, request.prompt_tokens)
        table = pool.take(hits, -(-request.prompt_tokens // block_size))
        pool.mark(table, keys, len(hits), len(table))
        pool.release(table)
        cached_tokens += len(hits) * block_size
    pool.check_integrity()
    return cached_tokens


def replay(policy: str, requests: list[SimRequest], fleet: Fleet, prefix_pull: str = "never") -> PolicyResult:
    """One arm: `policy` routing, with prefix pulls in mode `prefix_pull` (the name then says so)."""
    name = policy if prefix_pull == "never" else f"{policy} with pulls"
    return PolicyResult.of(name, simulate(fleet.config(policy, prefix_pull), fleet.profile(), requests))


def percentile(values: list[float] | tuple[float, ...], q: float) -> float:
    """Nearest rank, as the trace README's statistics use."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)] if ordered else float("nan")


def print_report(results: list[PolicyResult], references: dict[str, float], notes: dict, fleet: Fleet) -> None:
    """The setup, the table (references first, then the policies) and the targets."""
    print(
        f"rows read {notes['rows_read']}, used {notes['rows_used']}, clipped to {notes['max_prompt_tokens']} "
        f"tokens {notes['rows_clipped']}, dropped {sum(notes['rows_dropped'].values())} "
        f"{notes['rows_dropped'] or ''}"
    )
    print(
        f"{fleet.num_workers} workers x {fleet.blocks_per_worker} blocks of {fleet.block_size} tokens "
        f"({fleet.tokens_per_worker} tokens each); modelled prefill {fleet.prefill_tokens_per_s:g} tokens/s "
        f"per worker; speed-up {notes['speedup']:.2f} (replay span {notes['span_s']:.1f} s, "
        f"{notes['prompt_tokens']} prompt tokens)"
    )
    by_name = {r.policy: r for r in results}
    baseline, oracle_rate = by_name.get("round_robin"), references["oracle (infinite cache)"]
    print("policy | hit rate | % of oracle | x round_robin | mean TTFT s | p99 TTFT s")
    print("--- | ---: | ---: | ---: | ---: | ---:")
    for name, rate in references.items():
        print(f"{name} | {rate:.3f} | {_percent(rate, oracle_rate)} | {_ratio(rate, baseline)} | - | -")
    for r in results:
        print(
            f"{r.policy} | {r.hit_rate:.3f} | {_percent(r.hit_rate, oracle_rate)} | {_ratio(r.hit_rate, baseline)} | "
            f"{r.mean_ttft_s:.3f} | {percentile(r.ttfts_s, 0.99):.3f}"
        )
    pulled = by_name.get(PULL_ARM)
    if pulled is not None:
        print(
            f"{PULL_ARM} ({notes['prefix_pull']}): pulls served {pulled.pulled_rate:.3f} of prompt tokens "
            f"({pulled.pulled_requests} of {pulled.num_requests} requests pulled); modelled link "
            f"{fleet.pull_latency_s * 1e3:g} ms + {fleet.kv_bytes_per_token} bytes per token at "
            f"{fleet.pull_bytes_per_s / 1e9:g} GB/s"
        )
    for line in target_lines(by_name, oracle_rate):
        print(line)


def _percent(rate: float, oracle_rate: float) -> str:
    return f"{100 * rate / oracle_rate:.1f}" if oracle_rate else "-"


def _ratio(rate: float, baseline: PolicyResult | None) -> str:
    return f"{rate / baseline.hit_rate:.2f}" if baseline is not None and baseline.hit_rate else "-"


def target_lines(by_name: dict[str, PolicyResult], oracle_rate: float) -> list[str]:
    """One line per target, judging cache_aware without pulls and, when that arm ran, with them."""
    aware, baseline = by_name.get("cache_aware"), by_name.get("round_robin")
    if aware is None or baseline is None:
        return ["targets: need both cache_aware and round_robin"]
    arms = [("no pulls", aware)] + ([("with pulls", by_name[PULL_ARM])] if PULL_ARM in by_name else [])
    of_oracle, x_rr = [], []
    for label, r in arms:
        share = r.hit_rate / oracle_rate if oracle_rate else 0.0
        times = r.hit_rate / baseline.hit_rate if baseline.hit_rate else math.inf
        of_oracle.append(f"{label} {share:.1%} -> {'met' if share >= TARGET_OF_ORACLE else 'NOT met'}")
        x_rr.append(f"{label} {times:.2f}x -> {'met' if times >= TARGET_X_ROUND_ROBIN else 'NOT met'}")
    return [
        f"target cache_aware >= {TARGET_OF_ORACLE:.0%} of oracle: " + "; ".join(of_oracle),
        f"target cache_aware >= {TARGET_X_ROUND_ROBIN:g}x round_robin: " + "; ".join(x_rr),
    ]


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, Fleet]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", default=str(DEFAULT_TRACE), help="a Mooncake JSON Lines trace")
    p.add_argument("--requests", type=int, default=None, help="replay the first N rows (default: all)")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--blocks-per-worker", type=int, default=Fleet.blocks_per_worker)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--tokens-per-hash-id", type=int, default=64, help="tokens standing for one 512-token trace block")
    p.add_argument("--max-prompt-tokens", type=int, default=2000, help="clip longer prompts to this")
    p.add_argument("--vocab-size", type=int, default=4000)
    p.add_argument("--prefill-tokens-per-s", type=float, default=Fleet.prefill_tokens_per_s)
    p.add_argument(
        "--offered-load",
        type=float,
        default=0.8,
        help="prompt tokens/s over the fleet's prefill tokens/s, before hits (sets the speed-up)",
    )
    p.add_argument("--speedup", type=float, default=None, help="divide trace time by this (overrides --offered-load)")
    p.add_argument(
        "--spread-s",
        type=float,
        default=3.0,
        help="spread each ~3 s trace bucket uniformly over this many trace seconds (0: as recorded)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    p.add_argument(
        "--prefix-pull",
        default="auto",
        choices=PULL_MODES,
        help=f'mode of the "{PULL_ARM}" arm (router.prefix_pull; replayed when cache_aware is; never: no such arm)',
    )
    args = p.parse_args(argv)
    _validate(p, args)
    return args, Fleet(args.workers, args.blocks_per_worker, args.block_size, args.prefill_tokens_per_s)


def _validate(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if not Path(args.trace).is_file():
        p.error(f"--trace {args.trace}: no such file")
    if args.requests is not None and args.requests < 1:
        p.error("--requests must be >= 1")
    if args.tokens_per_hash_id < 1 or args.tokens_per_hash_id % args.block_size:
        p.error("--tokens-per-hash-id must be a positive multiple of --block-size (keeps blocks aligned)")
    if not 1 <= args.max_prompt_tokens < DEMO_MAX_MODEL_LEN:
        p.error(f"--max-prompt-tokens must be in [1, {DEMO_MAX_MODEL_LEN}) (max_model_len)")
    if args.blocks_per_worker * args.block_size < args.max_prompt_tokens:
        p.error("--blocks-per-worker x --block-size must hold the longest (clipped) prompt")
    if not (args.offered_load > 0 and (args.speedup is None or args.speedup > 0) and args.spread_s >= 0):
        p.error("--offered-load and --speedup must be > 0, --spread-s >= 0")


def main(argv: list[str] | None = None) -> None:
    args, fleet = parse_args(argv)
    started_s = time.perf_counter()
    requests, notes = load_requests(args)
    prompt_tokens = max(notes["prompt_tokens"], 1)
    fleet_blocks = fleet.num_workers * fleet.blocks_per_worker
    references = {
        "oracle (infinite cache)": oracle_cached_tokens(requests, fleet.block_size) / prompt_tokens,
        f"pooled ({fleet_blocks} blocks, one LRU)": pooled_cached_tokens(requests, fleet_blocks, fleet.block_size)
        / prompt_tokens,
    }
    results = [replay(policy, requests, fleet) for policy in args.policies]
    if args.prefix_pull != "never" and "cache_aware" in args.policies:
        results.append(replay("cache_aware", requests, fleet, args.prefix_pull))
    print_report(results, references, {**notes, "prefix_pull": args.prefix_pull}, fleet)
    print(f"wall time {time.perf_counter() - started_s:.1f} s")


if __name__ == "__main__":
    main()
