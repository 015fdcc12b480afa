"""A hardware profile: what the simulator needs to know about one model on one kind of machine.

Written by `splitserve profile` (the real engine timed over a grid of batch shapes on this machine,
`kind: measured`) or from a roofline model of a named GPU (`sim/roofline.py`, `kind:
roofline`), and always labelled: a figure predicted from a roofline profile says so.

JSON layout (`format: splitserve-profile/v1`, times in ms, rates in bytes/s):
- `kind`, `label`, `hardware`, `source` (how it was made);
- `model`: name, params, kv_bytes_per_token, max_model_len, vocab_size, block_size, eos_token_ids;
- `steps`: one `StepCost` per tensor-parallel size ("1", "2", ...): the engine's step time;
- `kv_capacity_tokens`: KV tokens one worker (decode: one TP instance) holds, per TP size;
- `transfer`: KV hand-off cost, latency_ms + bytes / bytes_per_s, one sender per prefill worker;
- `threads_per_worker`: CPU threads one engine stepped with when it was timed (measured profiles;
  1 for a roofline one); what a busy worker asks of a shared host (sim/contention.py);
- `overheads`: the cluster's fixed costs around the engine (router, Ray calls, streaming), measured
  against a running cluster (`splitserve profile --calibrate`) or set by hand:
  route_ms (arrival at the router -> queued on the prefill worker), first_token_ms (sampled -> client),
  adopt_ms (KV moved -> decode instance steps it), token_ms (decode step -> client), step_ms (what a
  cluster worker's loop adds to every engine step: the actor's loop, streaming the step's tokens),
  prefill_step_scale (how many times its profiled time a prefill worker's engine step takes in the
  cluster, where the worker's own threads share its process and its GIL; 1 when absent) plus
  prefill_step_ms (a fixed cost on each of those steps: the worker's threads cost an engine step per
  operator it runs, not per token; 0 when absent) and
  decode_step_scale (the same for a decode instance's steps, measured from its own step timings by the
  calibration; 1 when absent) and idle_wake_ms (a request that finds the whole cluster idle for t
  seconds waits idle_wake_ms * ln(1 + t / IDLE_WAKE_TAU_S) longer to be routed: the host's and the
  processes' wake-up after idle, measured by the calibration's probes at several idle times; 0 when
  absent).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from sim.step_cost import StepCost

FORMAT = "splitserve-profile/v1"
KINDS = ("measured", "roofline")


@dataclass(frozen=True)
class ModelFacts:
    name: str
    params: int
    kv_bytes_per_token: int
    max_model_len: int
    vocab_size: int
    block_size: int = 16
    eos_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class Overheads:
    route_s: float = 0.0
    first_token_s: float = 0.0
    adopt_s: float = 0.0
    token_s: float = 0.0
    step_s: float = 0.0
    prefill_step_scale: float = 1.0
    decode_step_scale: float = 1.0
    idle_wake_s: float = 0.0
    prefill_step_s: float = 0.0  # a prefill worker's fixed cost per engine step, beside the scale
    # The host's jitter around route and adopt: the calibration probes' own deviations from the fitted
    # fixed parts (seconds, either sign; entry i of both is probe i's). A request draws one index
    # (`jitter_s`, by its own index), so the simulated tails carry the stalls the probes met (50-80 ms
    # for a lone request on a busy day) instead of every request paying exactly the median. Empty: none.
    route_jitter_s: tuple[float, ...] = ()
    adopt_jitter_s: tuple[float, ...] = ()

    def __post_init__(self):
        for key in ("prefill_step_scale", "decode_step_scale"):
            value = getattr(self, key)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{key}: must be a number > 0, got {value}")
        if not (self.prefill_step_s >= 0 and math.isfinite(self.prefill_step_s)):
            raise ValueError(f"prefill_step_s: must be a number >= 0, got {self.prefill_step_s}")
        for key in ("route_jitter_s", "adopt_jitter_s"):
            object.__setattr__(self, key, tuple(float(v) for v in getattr(self, key)))
            if not all(math.isfinite(v) for v in getattr(self, key)):
                raise ValueError(f"{key}: every value must be a finite number")

    def to_dict(self) -> dict:
        return {
            "route_ms": self.route_s * 1e3,
            "first_token_ms": self.first_token_s * 1e3,
            "adopt_ms": self.adopt_s * 1e3,
            "token_ms": self.token_s * 1e3,
            "step_ms": self.step_s * 1e3,
            "prefill_step_scale": self.prefill_step_scale,
            "decode_step_scale": self.decode_step_scale,
            "idle_wake_ms": self.idle_wake_s * 1e3,
            "prefill_step_ms": self.prefill_step_s * 1e3,
            "route_jitter_ms": [v * 1e3 for v in self.route_jitter_s],
            "adopt_jitter_ms": [v * 1e3 for v in self.adopt_jitter_s],
        }

    def wake_s(self, idle_s: float) -> float:
        """The extra wait of a request sent after the cluster idled `idle_s` seconds."""
        return self.idle_wake_s * math.log1p(max(idle_s, 0.0) / IDLE_WAKE_TAU_S) if self.idle_wake_s else 0.0

    def fixed(self) -> Overheads:
        """These overheads without their jitter: what the calibration's own fits simulate with."""
        return replace(self, route_jitter_s=(), adopt_jitter_s=())

    def jitter_s(self, samples: tuple[float, ...], key: int) -> float:
        """The draw of request (or hand-off) `key` from `samples`: one sample, picked by a hash of the key,
        so a request's draw does not depend on the order events happen in (0 with no samples)."""
        if not samples:
            return 0.0
        mixed = (key * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & 0xFFFFFFFFFFFFFFFF
        mixed = ((mixed ^ (mixed >> 31)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        return samples[(mixed ^ (mixed >> 29)) % len(samples)]


IDLE_WAKE_TAU_S = 0.1  # the idle time over which the wake-up cost grows logarithmically


@dataclass(frozen=True)
class Transfer:
    latency_s: float
    bytes_per_s: float

    def seconds(self, num_bytes: int) -> float:
        return self.latency_s + num_bytes / self.bytes_per_s


@dataclass(frozen=True)
class Profile:
    kind: str
    label: str
    hardware: str
    model: ModelFacts
    steps: dict[int, StepCost]  # by tensor-parallel size
    kv_capacity_tokens: dict[int, int]  # one worker / TP instance, by tensor-parallel size
    transfer: Transfer
    overheads: Overheads = Overheads()
    source: dict[str, Any] = field(default_factory=dict)
    threads_per_worker: int = 1

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind: must be one of {list(KINDS)}, got {self.kind!r}")
        if 1 not in self.steps:
            raise ValueError("steps: a profile needs the step cost of tensor-parallel size 1")
        if set(self.kv_capacity_tokens) != set(self.steps):
            raise ValueError("kv_capacity_tokens: needs one entry per tensor-parallel size in steps")
        if any(v < self.model.block_size for v in self.kv_capacity_tokens.values()):
            raise ValueError("kv_capacity_tokens: every worker must hold at least one block")
        if not (self.transfer.bytes_per_s > 0 and self.transfer.latency_s >= 0):
            raise ValueError("transfer: bytes_per_s must be > 0 and latency_ms >= 0")
        if not (isinstance(self.threads_per_worker, int) and self.threads_per_worker >= 1):
            raise ValueError(f"threads_per_worker: must be an integer >= 1, got {self.threads_per_worker!r}")
        fixed = (v for v in vars(self.overheads).values() if not isinstance(v, tuple))  # jitter may be < 0
        if not all(v >= 0 and math.isfinite(v) for v in fixed):
            raise ValueError("overheads: every overhead must be a finite number >= 0")

    @property
    def tp_sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self.steps))

    def step_cost(self, tp: int) -> StepCost:
        if tp not in self.steps:
            raise ValueError(
                f"the profile has no step cost for tensor-parallel size {tp}; it has {list(self.tp_sizes)}"
            )
        return self.steps[tp]

    def with_overheads(self, overheads: Overheads) -> Profile:
        return replace(self, overheads=overheads)

    def to_dict(self) -> dict:
        return {
            "format": FORMAT,
            "kind": self.kind,
            "label": self.label,
            "hardware": self.hardware,
            "model": {**vars(self.model), "eos_token_ids": list(self.model.eos_token_ids)},
            "steps": {str(tp): cost.to_dict() for tp, cost in sorted(self.steps.items())},
            "kv_capacity_tokens": {str(tp): v for tp, v in sorted(self.kv_capacity_tokens.items())},
            "transfer": {"latency_ms": self.transfer.latency_s * 1e3, "bytes_per_s": self.transfer.bytes_per_s},
            "overheads": self.overheads.to_dict(),
            "threads_per_worker": self.threads_per_worker,
            "source": dict(self.source),
        }

    @staticmethod
    def from_dict(raw: dict) -> Profile:
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise ValueError(f"format: not a splitserve profile (expected format {FORMAT!r})")
        try:
            model = dict(raw["model"])
            model["eos_token_ids"] = tuple(model.get("eos_token_ids", ()))
            steps = {int(tp): StepCost.from_dict(cost, f"steps.{tp}") for tp, cost in raw["steps"].items()}
            over = raw.get("overheads", {})
            return Profile(
                raw["kind"],
                raw["label"],
                raw["hardware"],
                ModelFacts(**model),
                steps,
                {int(tp): int(v) for tp, v in raw["kv_capacity_tokens"].items()},
                Transfer(raw["transfer"]["latency_ms"] / 1e3, float(raw["transfer"]["bytes_per_s"])),
                Overheads(
                    route_s=over.get("route_ms", 0.0) / 1e3,
                    first_token_s=over.get("first_token_ms", 0.0) / 1e3,
                    adopt_s=over.get("adopt_ms", 0.0) / 1e3,
                    token_s=over.get("token_ms", 0.0) / 1e3,
                    step_s=over.get("step_ms", 0.0) / 1e3,
                    prefill_step_scale=over.get("prefill_step_scale", 1.0),
                    decode_step_scale=over.get("decode_step_scale", 1.0),
                    idle_wake_s=over.get("idle_wake_ms", 0.0) / 1e3,
                    prefill_step_s=over.get("prefill_step_ms", 0.0) / 1e3,
                    route_jitter_s=tuple(v / 1e3 for v in over.get("route_jitter_ms", ())),
                    adopt_jitter_s=tuple(v / 1e3 for v in over.get("adopt_jitter_ms", ())),
                ),
                dict(raw.get("source", {})),
                raw.get("threads_per_worker", 1),
            )
        except KeyError as err:
            raise ValueError(f"profile: missing key {err.args[0]!r}") from None
        except TypeError as err:
            raise ValueError(f"profile: {err}") from None

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @staticmethod
    def load(path: str | Path) -> Profile:
        try:
            raw = json.loads(Path(path).read_text())
        except OSError as err:
            raise ValueError(f"--profile {path}: {err.strerror or err}") from None
        except json.JSONDecodeError as err:
            raise ValueError(f"--profile {path}: not JSON ({err})") from None
        try:
            return Profile.from_dict(raw)
        except ValueError as err:
            raise ValueError(f"--profile {path}: {err}") from None
