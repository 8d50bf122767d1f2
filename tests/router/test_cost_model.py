import dataclasses
import random

import pytest

from halfmoon.engine.llm_engine import StepTiming
from halfmoon.router.cost_model import CostModel, chunk_spans
from halfmoon.router.errors import ProfileError
from halfmoon.router.online_fit import OnlineRefit
from halfmoon.router.profile import DEFAULT_PROFILE, PROFILE_DIR, load_profile, save_profile

TRUE = CostModel((0.02, 1.4e-4, 1.3e-9, 2.6e-9), (0.019, 5e-5, 3.3e-8))


def samples(model: CostModel, rng: random.Random):
    prefill = []
    for _ in range(60):
        new, cached = rng.randint(1, 30_000), rng.randint(0, 30_000)
        prefill.append((new, cached, model.prefill_time(new, cached)))
    decode = []
    for _ in range(60):
        batch, kv = rng.randint(1, 128), rng.randint(0, 1_000_000)
        decode.append((batch, kv, model.decode_step_time(batch, kv)))
    return prefill, decode


def test_fit_recovers_known_coefficients():
    prefill, decode = samples(TRUE, random.Random(0))
    fitted = CostModel.fit(prefill, decode)
    assert fitted.prefill_coef == pytest.approx(TRUE.prefill_coef, rel=1e-6)
    assert fitted.decode_coef == pytest.approx(TRUE.decode_coef, rel=1e-6)


def test_fit_with_too_few_shapes_is_a_profile_error():
    with pytest.raises(ProfileError, match="samples span only 2 of 4 terms"):
        CostModel.fit(
            [(100, 0, 1.0)] * 5 + [(200, 0, 2.0)] * 5, [(1, 1, 1.0), (2, 1, 1.0), (3, 5, 2.0)]
        )


def test_online_refit_follows_a_slower_worker():
    model = CostModel(TRUE.prefill_coef, TRUE.decode_coef)
    slower = CostModel(tuple(2 * c for c in TRUE.prefill_coef), TRUE.decode_coef)
    refit = OnlineRefit(model, window=128, every=32)
    prefill, _ = samples(slower, random.Random(1))
    for new, cached, seconds in prefill * 3:
        refit.observe_prefill(new, cached, seconds)
    assert model.prefill_time(8000, 4000) == pytest.approx(
        slower.prefill_time(8000, 4000), rel=1e-6
    )


def test_profile_round_trips_through_yaml(tmp_path):
    profile = load_profile(DEFAULT_PROFILE)
    save_profile(profile, tmp_path / "copy.yaml")
    again = load_profile(tmp_path / "copy.yaml")
    assert again == profile


def test_shipped_profiles_load_and_state_their_assumptions():
    for path in sorted(PROFILE_DIR.glob("*.yaml")):
        profile = load_profile(path)
        assert profile.assumptions, path
        assert profile.cost.prefill_time(1000, 0) > 0


def test_a800_profile_prefills_12k_tokens_in_about_two_seconds():
    profile = load_profile(DEFAULT_PROFILE)
    assert profile.cost.prefill_time(12_000, 0) == pytest.approx(1.88, abs=0.05)
    assert profile.kv_bytes_per_token == 80 * 8 * 128 * 2 * 2


def test_profile_missing_a_field_names_it(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("kv_bytes_per_token: 10\n")
    with pytest.raises(ProfileError, match="lacks `num_layers`"):
        load_profile(path)


CHUNKED = CostModel((0.004, 1e-4, 1e-7, 2e-8), (0.003, 4e-4, 2e-6), chunk_tokens=64)


def test_chunk_spans_end_on_multiples_of_the_chunk():
    assert chunk_spans(100, 0, 64) == [(64, 0), (36, 64)]
    assert chunk_spans(100, 48, 64) == [(16, 48), (64, 64), (20, 128)]
    assert chunk_spans(100, 0, 0) == [(100, 0)]
    assert chunk_spans(0, 10, 64) == []


def test_chunked_prefill_time_is_the_sum_of_its_steps():
    total = sum(CHUNKED.prefill_step_time((span,)) for span in chunk_spans(300, 20, 64))
    assert CHUNKED.prefill_time(300, 20) == pytest.approx(total)
    assert CHUNKED.prefill_time(30, 0) == pytest.approx(CHUNKED.prefill_step_time([(30, 0)]))
    # A step with two chunks pays the step constant once.
    two = CHUNKED.prefill_step_time([(64, 0), (32, 0)])
    assert two == pytest.approx(
        CHUNKED.prefill_step_time([(64, 0)]) + CHUNKED.prefill_step_time([(32, 0)]) - 0.004
    )


def test_mixed_step_pays_decode_plus_the_prefill_terms():
    mixed = CHUNKED.step_time([(64, 0)], 4, 1000)
    expected = CHUNKED.decode_step_time(4, 1000) + CHUNKED.prefill_step_time([(64, 0)]) - 0.004
    assert mixed == pytest.approx(expected)
    assert CHUNKED.step_time([], 4, 1000) == pytest.approx(CHUNKED.decode_step_time(4, 1000))


def test_fit_steps_recovers_per_step_coefficients():
    rng = random.Random(3)
    steps = []
    for _ in range(80):
        chunks = tuple((rng.randint(1, 64), rng.randint(0, 2000)) for _ in range(rng.randint(1, 4)))
        steps.append(StepTiming(chunks, 0, 0, CHUNKED.prefill_step_time(chunks), 0.0, 0.0))
    for _ in range(40):
        batch, kv = rng.randint(1, 32), rng.randint(1, 20_000)
        # Half of the time is spent waiting between steps: it counts.
        seconds = CHUNKED.decode_step_time(batch, kv)
        steps.append(StepTiming((), batch, kv, seconds / 2, 0.0, seconds / 2))
    steps.append(StepTiming(((5, 0),), 3, 300, 99.0, 0.0, 0.0))  # mixed: ignored
    fitted = CostModel.fit_steps(steps, chunk_tokens=64)
    assert fitted.prefill_coef == pytest.approx(CHUNKED.prefill_coef, rel=1e-6)
    assert fitted.decode_coef == pytest.approx(CHUNKED.decode_coef, rel=1e-6)
    assert fitted.chunk_tokens == 64


def test_online_refit_from_batched_prefill_steps():
    model = CostModel(CHUNKED.prefill_coef, CHUNKED.decode_coef, 64)
    slower = CostModel(tuple(3 * c for c in CHUNKED.prefill_coef), CHUNKED.decode_coef, 64)
    refit = OnlineRefit(model, window=128, every=16)
    rng = random.Random(4)
    for _ in range(64):
        chunks = [(rng.randint(1, 64), rng.randint(0, 1000)) for _ in range(rng.randint(1, 3))]
        refit.observe_prefill_step(chunks, slower.prefill_step_time(chunks))
    assert model.prefill_time(500, 100) == pytest.approx(slower.prefill_time(500, 100), rel=1e-6)


def test_chunk_tokens_round_trip_and_bad_values(tmp_path):
    profile = load_profile(DEFAULT_PROFILE)
    chunked = dataclasses.replace(profile, cost=CHUNKED)
    save_profile(chunked, tmp_path / "chunked.yaml")
    assert load_profile(tmp_path / "chunked.yaml").cost == CHUNKED
    text = (tmp_path / "chunked.yaml").read_text().replace("chunk_tokens: 64", "chunk_tokens: -1")
    (tmp_path / "bad.yaml").write_text(text)
    with pytest.raises(ProfileError, match="chunk_tokens"):
        load_profile(tmp_path / "bad.yaml")


def test_fit_steps_keeps_the_fallback_for_a_part_the_steps_do_not_span():
    rng = random.Random(5)
    steps = [StepTiming((), 1, 100 * i, 0.01, 0.0, 0.0) for i in range(1, 9)]  # batch 1 only
    for _ in range(20):
        chunks = ((rng.randint(1, 64), rng.randint(0, 500)), (rng.randint(1, 64), 0))
        steps.append(StepTiming(chunks, 0, 0, CHUNKED.prefill_step_time(chunks), 0.0, 0.0))
    with pytest.raises(ProfileError):
        CostModel.fit_steps(steps, 64)
    fallback = CostModel((1.0, 1.0, 1.0, 1.0), (0.5, 0.5, 0.5), 64)
    fitted = CostModel.fit_steps(steps, 64, fallback)
    assert fitted.prefill_coef == pytest.approx(CHUNKED.prefill_coef, rel=1e-6)
    assert fitted.decode_coef == fallback.decode_coef
