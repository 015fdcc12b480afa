"""benchmarks/step_timer.py: every step of a round is timed with its shape and the switch's decision,
the wrapper comes off afterwards (also from under another one), and stalls are the steps far above the
round's median."""
from __future__ import annotations

from benchmarks.step_timer import StepTimer, TimedStep
from engine import LLM, SamplingParams
from tests.factories import TinySpec


def test_every_step_is_timed_and_the_engine_is_left_as_it_was(checkpoint):
    model_dir = checkpoint(TinySpec(num_layers=2))
    llm = LLM(model_dir, progress=False, num_kv_blocks=64,
              speculative_config={"method": "ngram", "num_speculative_tokens": 2, "adaptive": False})
    engine = llm.engine
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with StepTimer(engine) as outer, StepTimer(engine) as inner:
        out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert "step" not in engine.__dict__  # both wrappers are gone
    assert len(inner.steps) == len(outer.steps) >= 2
    assert inner.steps[0].shape == (len(prompt), 1, len(prompt))  # the prefill step
    assert all(step.speculated for step in inner.steps[1:])  # forced: every decode step speculates
    assert inner.pattern() == f"S{len(inner.steps) - 1}"
    assert sum(1 for _ in out.token_ids) == 6


def test_stalls_are_the_steps_far_above_the_median():
    timer = StepTimer(engine=None)
    timer.steps = [TimedStep(0.010, (1, 1, 10), False, False)] * 9 + [TimedStep(0.080, (5, 1, 90), True, True)]
    assert timer.stalls() == [timer.steps[-1]]
    assert abs(timer.stall_seconds() - 0.070) < 1e-12
    assert timer.pattern() == "P9 S1"
