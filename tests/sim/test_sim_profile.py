"""Profiles: the step-cost model and its fit, the JSON round trip, validation, roofline labels."""

from __future__ import annotations

import json

import numpy as np
import pytest

from policies.admission import AdmissionConfig
from sim import SimConfig
from sim.profile import Profile
from sim.roofline import roofline_profile
from sim.step_cost import StepCost, StepSample, fit_step_cost, nnls, prefill_pairs
from tests.sim.sim_factories import linear_profile


def test_dense_is_piecewise_linear_and_extrapolates():
    cost = StepCost((1, 11, 111), (0.001, 0.002, 0.012))
    assert cost.dense(6) == pytest.approx(0.0015)
    assert cost.dense(61) == pytest.approx(0.007)
    assert cost.dense(211) == pytest.approx(0.022)  # past the last knot: the last slope
    assert cost.seconds(0, 0) == 0.0


def test_prefill_pairs_counts_causal_attention():
    assert prefill_pairs(0, 4) == 1 + 2 + 3 + 4
    assert prefill_pairs(10, 2) == 11 + 12


def test_fit_recovers_exact_coefficients():
    truth = StepCost((1, 64, 512), (0.002, 0.004, 0.02), 0.0003, 2e-8, 5e-7)
    samples = [
        StepSample(
            t,
            s,
            prefill_pairs(start, t) if s == 1 else 0.0,
            ctx,
            truth.seconds(t, s, prefill_pairs(start, t) if s == 1 else 0.0, ctx),
        )
        for t, s, start, ctx in [
            (8, 1, 0, 0),
            (64, 1, 0, 0),
            (256, 1, 128, 0),
            (512, 1, 0, 0),
            (512, 1, 256, 0),
            (1, 1, 0, 100),
            (4, 4, 0, 800),
            (16, 16, 0, 1600),
            (32, 32, 0, 9000),
            (128, 1, 0, 0),
            (64, 64, 0, 4000),
        ]
    ]
    cost, rms = fit_step_cost(samples, truth.knots_tokens)
    assert rms < 1e-9
    assert cost.dense_s == pytest.approx(truth.dense_s, rel=1e-6)
    assert (cost.per_seq_s, cost.prefill_pair_s, cost.decode_context_s) == pytest.approx(
        (truth.per_seq_s, truth.prefill_pair_s, truth.decode_context_s), rel=1e-6
    )


def test_fit_separates_graph_decode_steps_from_eager_prefill_steps():
    """A GPU's shape (H200, 1B model, as measured in docs/perf/profile/h200.json): decode steps replay
    CUDA graphs (~1.7 ms), any step with a prompt chunk runs eagerly (~10 ms flat, host-bound). At the
    token counts both reach (16-64) dense(T) alone cannot be both; the prefill-step term holds it, as
    the profiler's grid samples it (decode: pairs 0; prefill: one sequence's chunk)."""
    truth = StepCost((1, 64, 2048), (0.0016, 0.0025, 0.0060), 0.0, 3e-10, 2e-9, 0.008)
    shapes = [(c, 1, prefill_pairs(start, c), 0) for c in (16, 32, 64, 128, 512, 2048) for start in (0, 1024)]
    shapes += [(b, b, 0.0, b * ctx) for b in (1, 2, 4, 8, 16, 32, 64) for ctx in (64, 1024)]
    samples = [StepSample(t, n, pairs, ctx, truth.seconds(t, n, pairs, ctx)) for t, n, pairs, ctx in shapes]
    cost, rms = fit_step_cost(samples, truth.knots_tokens)
    assert rms < 1e-6 and cost.prefill_step_s == pytest.approx(0.008, rel=1e-4)
    assert cost.seconds(32, 32, 0.0, 32 * 64) == pytest.approx(truth.seconds(32, 32, 0.0, 32 * 64), rel=1e-4)
    # Profiles written before the term load with it at 0.
    old = {k: v for k, v in cost.to_dict().items() if k != "prefill_step_ms"}
    assert StepCost.from_dict(old, "steps").prefill_step_s == 0.0
    assert StepCost.from_dict(cost.to_dict(), "steps").prefill_step_s == pytest.approx(cost.prefill_step_s)


def test_fitted_dense_never_falls_as_tokens_grow():
    # Timer noise on a busy box: the 128-token steps came out faster than the 16-token ones. A free fit of
    # the knot values follows the noise down; the fitted step cost must not (more tokens never cost less).
    noisy = {1: 0.0010, 4: 0.0011, 16: 0.0016, 128: 0.0012, 512: 0.0040}
    samples = [StepSample(t, 1, 0.0, 0, d * f) for t, d in noisy.items() for f in (0.98, 1.0, 1.02)]
    cost, _ = fit_step_cost(samples, (1, 4, 16, 128, 512))
    values = [cost.seconds(t, 1) for t in range(1, 600, 7)]
    assert all(b >= a for a, b in zip(values, values[1:]))
    assert cost.seconds(1, 1) < cost.seconds(256, 1) < cost.seconds(512, 1)


def test_nnls_keeps_coefficients_non_negative():
    a = np.array([[1.0, 1.0], [1.0, 2.0], [1.0, 3.0]])
    b = np.array([3.0, 2.0, 1.0])  # the free fit has slope -1
    x = nnls(a, b)
    assert (x >= 0).all() and x[1] == 0.0 and x[0] == pytest.approx(2.0)


def test_profile_round_trips_through_json(tmp_path):
    profile = linear_profile(per_seq_s=1e-4, prefill_pair_s=1e-8, decode_context_s=1e-7)
    path = profile.save(tmp_path / "p.json")
    assert Profile.load(path) == profile


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda raw: raw.update(format="x"), "format"),
        (lambda raw: raw["steps"]["1"].pop("per_seq_ms"), "steps.1: missing key 'per_seq_ms'"),
        (lambda raw: raw.update(kind="guess"), "kind"),
        (lambda raw: raw["kv_capacity_tokens"].update({"1": 3}), "kv_capacity_tokens"),
        (lambda raw: raw.pop("transfer"), "missing key 'transfer'"),
    ],
)
def test_a_bad_profile_names_the_key(tmp_path, mutate, message):
    raw = linear_profile().to_dict()
    mutate(raw)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=message):
        Profile.load(path)


def test_roofline_profiles_are_labelled_and_ordered():
    profile = roofline_profile("llama-3.2-1b", "h100", (1, 2))
    assert profile.kind == "roofline" and "ROOFLINE" in profile.label
    one, two = profile.step_cost(1), profile.step_cost(2)
    # A 1B model's decode step is bandwidth-bound: 2.5 GB of weights at 80% of 3.35 TB/s + 2 ms.
    assert one.seconds(1, 1) == pytest.approx(0.002 + profile.model.params * 2 / (3.35e12 * 0.8), rel=0.01)
    assert two.seconds(1, 1) < one.seconds(1, 1)
    assert profile.kv_capacity_tokens[2] > 2 * profile.kv_capacity_tokens[1]
    with pytest.raises(ValueError, match="--gpu"):
        roofline_profile("llama-3.2-1b", "tpu")


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"prefill": 0}, "prefill"),
        ({"colocated": 1}, "colocated"),
        ({"tp": 3}, "tp"),
        ({"policy": "nearest"}, "policy"),
        ({"admission": "slo"}, "admission"),
        ({"admission": "threshold", "admission_config": AdmissionConfig("predictive")}, "admission_config"),
        ({"ttft_slo_s": -1.0}, "ttft_slo_s"),
        ({"decode_kv_tokens": 0}, "decode_kv_tokens"),
    ],
)
def test_sim_config_errors_name_the_key(kwargs, key):
    with pytest.raises(ValueError, match=f"^{key}:"):
        SimConfig(**kwargs)


def test_a_prefill_point_waits_for_the_device_before_its_timed_chunk(checkpoint, monkeypatch):
    """A step that samples nothing (a prompt's chunk short of its end) returns with its GPU work still
    queued: the profiler waits for the device after each point's untimed earlier chunk, before timing
    the chunk after it (without the wait, a long H200 profile times the earlier 16,384-token chunk instead)."""
    from sim import profiler
    from tests.factories import TinySpec

    events = []
    timed = profiler._timed_step
    monkeypatch.setattr(profiler, "_wait_for_device", lambda engine: events.append("wait"))
    monkeypatch.setattr(profiler, "_timed_step", lambda engine: (events.append("timed"), timed(engine))[1])
    grid = profiler.Grid(chunk_tokens=(8,), starts=(0, 16), batches=(1,), contexts=(32,), repeats=1, knots=(1, 8))
    engine = profiler._engine(str(checkpoint(TinySpec())), 1, "auto", grid)
    samples = profiler._prefill_samples(engine, grid, say=lambda line: None)
    assert events == ["timed"] * 2 + ["wait", "timed"] * 2  # repeats + 1 per point: the first warms up
    assert [(s.tokens, s.prefill_pairs) for s in samples] == [(8, prefill_pairs(0, 8)), (8, prefill_pairs(16, 8))]
