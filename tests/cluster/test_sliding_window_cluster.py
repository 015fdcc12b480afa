"""Sliding-window attention served disaggregated: a 1P1D cluster on real Ray actors, the prompt's KV
blocks moving over gloo, a checkpoint mixing full and sliding layers (Qwen2, a 12-token window under
prompts and generations several times longer). Greedy tokens equal HF's, before and after prefix
hits on the prefill worker, and both pools end with every block free."""
from __future__ import annotations

from cluster.launcher import launch
from common.config import ClusterConfig
from engine import SamplingParams
from tests.cluster.conftest import run
from tests.cluster.test_disaggregated import SMALL_POOL, _generate_all, _wait_clean
from tests.engine.test_sliding_window import windowed_checkpoint
from tests.factories import hf_greedy_generate, random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def test_windowed_model_served_disaggregated_equals_hf(ray_session, tmp_path_factory):
    model_dir = windowed_checkpoint(tmp_path_factory.mktemp("window-cluster"), "qwen2")
    system = random_prompts(1, 40, 40, 512, seed=71)[0]  # longer than the window; 2.5 blocks of 16
    prompts = [system + user for user in random_prompts(3, 5, 30, 512, seed=72)]
    expected = hf_greedy_generate(model_dir, prompts, GREEDY.max_tokens)
    cluster = launch(ClusterConfig(prefill=SMALL_POOL, decode=SMALL_POOL, ready_timeout_s=90.0), str(model_dir))
    try:
        assert run(_generate_all(cluster, prompts[:1], GREEDY, prefix="cold")) == expected[:1]
        assert run(_generate_all(cluster, prompts, GREEDY, prefix="hit")) == expected
        _wait_clean(cluster, timeout_s=30)
    finally:
        cluster.shutdown()
