"""The `sharegpt` workload: real conversations from a ShareGPT-style file, arriving as a Poisson process.

The file is a JSON list of `{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", "value":
...}, ...]}` (the format `vllm bench serve --dataset-name sharegpt` reads). Each conversation gives one
request: its first human turn is the prompt (sent as text: `--backend openai-chat`), and the reply that
follows sets the output length, as vLLM's bench does, in tokens estimated at `CHARS_PER_TOKEN` (the server
is asked for the prompt's token count before the run; the reply is never sent). Conversations without a
human turn followed by a reply are skipped (counted in the notes). Requests take conversations in file
order, cycling when `--num-requests` is larger than the file.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from loadtest.arrivals import poisson_arrivals_s
from loadtest.plan import ModelLimits, Plan, PlannedRequest, RequestDefaults, rate_note

CHARS_PER_TOKEN = 4  # English text in BPE vocabularies; only the output length is estimated this way
MIN_OUTPUT_TOKENS = 4
_ARRIVALS = 1


@dataclass(frozen=True)
class ShareGptSpec:
    path: str
    rate_per_s: float
    num_requests: int | None = None  # None: one request per usable conversation

    def __post_init__(self):
        if not self.rate_per_s > 0:
            raise ValueError(f"--rate must be > 0 (or inf), got {self.rate_per_s}")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError(f"--num-requests must be >= 1, got {self.num_requests}")

    def with_rate(self, rate_per_s: float) -> ShareGptSpec:
        return dataclasses.replace(self, rate_per_s=rate_per_s)

    def build(self, limits: ModelLimits, defaults: RequestDefaults, seed: int, salt: int = 0) -> Plan:
        conversations, skipped = read_conversations(self.path)
        if not conversations:
            raise ValueError(f"--dataset {self.path}: no conversation with a human turn followed by a reply")
        n = self.num_requests or len(conversations)
        arrivals_s = poisson_arrivals_s(np.random.default_rng([seed, _ARRIVALS]), n, self.rate_per_s)
        requests = []
        for i in range(n):
            prompt, reply = conversations[i % len(conversations)]
            max_tokens = min(max(len(reply) // CHARS_PER_TOKEN, MIN_OUTPUT_TOKENS), limits.max_model_len // 2)
            requests.append(
                PlannedRequest(
                    i, float(arrivals_s[i]), (), max_tokens, defaults.slo, defaults.priority, defaults.tenant, prompt
                )
            )
        notes = {"rate_per_s": rate_note(self.rate_per_s), "conversations": len(conversations), "skipped": skipped}
        return Plan("sharegpt", tuple(requests), notes)


def read_conversations(path: str) -> tuple[list[tuple[str, str]], int]:
    """(first human turn, the reply to it) per usable conversation, and how many were skipped."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"--dataset {path}: {err}") from None
    if not isinstance(data, list):
        raise ValueError(f"--dataset {path}: must be a JSON list of {{'conversations': [...]}} objects")
    pairs, skipped = [], 0
    for entry in data:
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        pair = _first_exchange(turns) if isinstance(turns, list) else None
        if pair is None:
            skipped += 1
        else:
            pairs.append(pair)
    return pairs, skipped


def _first_exchange(turns: list) -> tuple[str, str] | None:
    for turn, reply in itertools.pairwise(turns):
        if not (isinstance(turn, dict) and isinstance(reply, dict)):
            return None
        if turn.get("from") == "human" and reply.get("from") == "gpt":
            prompt, answer = turn.get("value"), reply.get("value")
            if isinstance(prompt, str) and prompt and isinstance(answer, str):
                return prompt, answer
    return None
