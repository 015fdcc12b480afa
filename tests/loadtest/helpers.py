"""Small shared values for the load-test tests."""
from __future__ import annotations

from loadtest.plan import ModelLimits

LIMITS = ModelLimits(max_model_len=512, vocab_size=300, block_size=16, eos_token_ids=(2, 7))


def all_tokens_valid(plan, limits: ModelLimits = LIMITS) -> bool:
    """Every prompt id in [0, vocab) and not EOS; every prompt + max_tokens within max_model_len."""
    eos = set(limits.eos_token_ids)
    return all(0 <= t < limits.vocab_size and t not in eos for r in plan.requests for t in r.prompt_token_ids) \
        and all(1 <= r.num_prompt_tokens and 1 <= r.max_tokens and r.num_prompt_tokens + r.max_tokens
                <= limits.max_model_len for r in plan.requests)
