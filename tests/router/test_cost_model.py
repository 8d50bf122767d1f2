import random

import pytest

from halfmoon.router.cost_model import CostModel
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
