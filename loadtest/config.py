"""`BenchConfig`: everything one `splitserve bench` invocation does, validated once here.

Every check names the flag it concerns; the CLI turns the ValueError into a usage error.
"""

from __future__ import annotations

import importlib.util
import math
import re
from dataclasses import dataclass
from pathlib import Path

from loadtest.chat_formats import CHAT_FORMATS
from loadtest.driver import DriverConfig
from loadtest.plan import RequestDefaults
from loadtest.poisson import PoissonSpec
from loadtest.shared_prefix import SharedPrefixSpec
from loadtest.sharegpt import ShareGptSpec
from loadtest.trace import TraceSpec
from splitserve_client import channel
from splitserve_client.channel import ClientTls
from splitserve_client.cli_args import read_token

WorkloadSpec = PoissonSpec | SharedPrefixSpec | TraceSpec | ShareGptSpec


DEFAULT_TARGETS = {
    "splitserve": "127.0.0.1:50051",
    "openai": "http://127.0.0.1:8000",
    "openai-chat": "http://127.0.0.1:8000",
}
HTTP_BACKENDS = ("openai", "openai-chat")


def check_target(target: str, backend: str = "splitserve") -> str:
    """splitserve: one of the SDK's target forms (`splitserve_client/channel.py`: HOST:PORT, [IPV6]:PORT, unix:PATH,
    a gRPC URI); openai: an http(s)://HOST[:PORT][/v1] URL. Returns it unchanged, else ValueError naming
    --target."""
    if backend in HTTP_BACKENDS:
        if not re.fullmatch(r"https?://[^/\s]+(/v1)?/?", target):
            raise ValueError(f"--target must be an http(s)://HOST:PORT URL for --backend {backend}, got {target!r}")
        return target
    try:
        return channel.check_target(target)
    except ValueError as err:
        raise ValueError(f"--target: {err}") from None


def _check_http_tls(target: str, tls: ClientTls) -> None:
    """The HTTP backend verifies https:// servers against --tls-ca-file (else the system's roots);
    client certificates and --tls-server-name are gRPC-only here."""
    if tls.certificate_chain is not None or tls.server_name is not None:
        raise ValueError("--tls-cert-file, --tls-key-file and --tls-server-name apply to --backend splitserve")
    if tls.on and not target.startswith("https://"):
        raise ValueError(f"TLS flags need an https:// --target with --backend openai, got {target!r}")


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
    backend: str = "splitserve"  # one of loadtest.backends.BACKENDS
    model: str | None = None  # openai: the served model to ask for (default: the first listed)
    tokenizer: str | None = None  # openai: the model's tokenizer, for servers whose card has no vocabulary
    tls: ClientTls = ClientTls()  # plaintext unless a TLS flag was given
    chat_format: str | None = None  # openai-chat: one of loadtest.chat_formats.CHAT_FORMATS (None: plain)

    def __post_init__(self):
        if self.backend not in DEFAULT_TARGETS:
            raise ValueError(f"--backend must be one of {sorted(DEFAULT_TARGETS)}, got {self.backend!r}")
        check_target(self.target, self.backend)
        if self.backend not in HTTP_BACKENDS and (self.model or self.tokenizer):
            raise ValueError("--model and --tokenizer apply to --backend openai / openai-chat")
        if self.chat_format is not None and self.backend != "openai-chat":
            raise ValueError("--chat-format applies to --backend openai-chat")
        if self.chat_format is not None and self.chat_format not in CHAT_FORMATS:
            raise ValueError(f"--chat-format must be one of {', '.join(CHAT_FORMATS)}, got {self.chat_format!r}")
        if self.backend in HTTP_BACKENDS:
            _check_http_tls(self.target, self.tls)
        if self.tokenizer is not None and not (Path(self.tokenizer) / "tokenizer.json").is_file():
            raise ValueError(f"--tokenizer {self.tokenizer}: no tokenizer.json there")
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"--seed must be in [0, 2^63), got {self.seed}")
        read_token(self.auth_token_file)
        if self.plot_dir is not None and importlib.util.find_spec("matplotlib") is None:
            raise ValueError(
                "--plot needs matplotlib, which the runtime install leaves out: pip install 'splitserve[plot]'"
            )
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
