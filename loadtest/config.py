"""`BenchConfig`: everything one `splitserve bench` invocation does, validated once here.

Every check names the flag it concerns; the CLI turns the ValueError into a usage error.
"""
from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from pathlib import Path

from loadtest.driver import DriverConfig
from loadtest.plan import RequestDefaults
from loadtest.poisson import PoissonSpec
from loadtest.shared_prefix import SharedPrefixSpec
from loadtest.trace import TraceSpec
from router import channel
from router.channel import ClientTls
from router.cli_args import read_token

WorkloadSpec = PoissonSpec | SharedPrefixSpec | TraceSpec


def check_target(target: str) -> str:
    """One of the SDK's target forms (`router/channel.py`: HOST:PORT, [IPV6]:PORT, unix:PATH, a gRPC
    URI); returns it unchanged, else ValueError naming --target."""
    try:
        return channel.check_target(target)
    except ValueError as err:
        raise ValueError(f"--target: {err}") from None


def parse_rates(text: str) -> tuple[float, ...]:
    """'1,2,4' -> (1.0, 2.0, 4.0): finite, > 0, distinct."""
    try:
        rates = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"--sweep must be comma-separated request rates like 1,2,4; got {text!r}") from None
    if not all(r > 0 and math.isfinite(r) for r in rates):
        raise ValueError(f"--sweep rates must be finite numbers > 0, got {text!r}")
    if len(set(rates)) != len(rates):
        raise ValueError(f"--sweep rates must be distinct, got {text!r}")
    return rates


@dataclass(frozen=True)
class BenchConfig:
    target: str
    workload: str
    spec: WorkloadSpec
    driver: DriverConfig = DriverConfig()
    defaults: RequestDefaults = RequestDefaults()
    seed: int = 0
    auth_token_file: str | None = None
    out_dir: str | None = None  # records.jsonl + summary.json (per rate under rate-R/ in a sweep)
    plot_dir: str | None = None
    sweep_rates: tuple[float, ...] = ()
    attainment_target: float = 0.9
    warmup_s: float = 0.0
    tls: ClientTls = ClientTls()  # plaintext unless a TLS flag was given

    def __post_init__(self):
        check_target(self.target)
        if not 0 <= self.seed < 2 ** 63:
            raise ValueError(f"--seed must be in [0, 2^63), got {self.seed}")
        read_token(self.auth_token_file)
        if self.plot_dir is not None and importlib.util.find_spec("matplotlib") is None:
            raise ValueError("--plot needs matplotlib, which the runtime install leaves out: "
                             "pip install 'splitserve[plot]'")
        for flag, folder in (("--out", self.out_dir), ("--plot", self.plot_dir)):
            if folder is not None and Path(folder).exists() and not Path(folder).is_dir():
                raise ValueError(f"{flag} {folder} exists and is not a directory")
        if not 0 < self.attainment_target <= 1:
            raise ValueError(f"--attainment-target must be in (0, 1], got {self.attainment_target}")
        if not (self.warmup_s >= 0 and math.isfinite(self.warmup_s)):
            raise ValueError(f"--warmup-s must be a finite number >= 0, got {self.warmup_s}")
        slo = self.defaults.slo
        for flag, value in (("--ttft-ms", slo.ttft_ms), ("--tpot-ms", slo.tpot_ms)):
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{flag} must be a finite number > 0, got {value}")
        if not -1000 <= self.defaults.priority <= 1000:
            raise ValueError(f"--priority must be in [-1000, 1000], got {self.defaults.priority}")
        if len(self.defaults.tenant) > 128:
            raise ValueError("--tenant must be at most 128 characters")
        if not (self.driver.temperature >= 0 and math.isfinite(self.driver.temperature)):
            raise ValueError(f"--temperature must be a finite number >= 0, got {self.driver.temperature}")
