"""ShortcutSchedule against closed-form float64 formulas (the decay paper, section 3.1)."""
import math

import numpy as np
import pytest

from lightning_mods.backbone.shortcut import ShortcutSchedule, transformer_sublayer_types


def linear_reference(K: int, alpha_min: float) -> np.ndarray:
    k = np.arange(K, dtype=np.float64)
    return 1.0 - k / (K - 1) * (1.0 - alpha_min)


def cosine_reference(K: int, alpha_min: float) -> np.ndarray:
    k = np.arange(K, dtype=np.float64)
    return alpha_min + (1.0 - alpha_min) * 0.5 * (1.0 + np.cos(np.pi * k / (K - 1)))


@pytest.mark.parametrize("K", [2, 3, 8, 24, 26, 48])
@pytest.mark.parametrize("alpha_min", [0.0, 0.5, 0.6, 0.7, 1.0])
def test_linear_and_cosine_equal_closed_form(K, alpha_min):
    lin = np.array(ShortcutSchedule("linear", alpha_min).alphas(K))
    cos = np.array(ShortcutSchedule("cosine", alpha_min).alphas(K))
    np.testing.assert_allclose(lin, linear_reference(K, alpha_min), rtol=0, atol=1e-15)
    np.testing.assert_allclose(cos, cosine_reference(K, alpha_min), rtol=0, atol=1e-15)
    assert lin[0] == 1.0 and lin[-1] == alpha_min  # exactly, not approximately
    assert cos[0] == 1.0


@pytest.mark.parametrize("depth,alpha_min,expected", [(12, 0.6, 3.6e-3), (12, 0.7, 1.8e-2),
                                                      (18, 0.7, 2.4e-3), (24, 0.8, 5.7e-3)])
def test_alpha_eff_matches_spec_numbers(depth, alpha_min, expected):
    s = ShortcutSchedule("linear", alpha_min)
    K = 2 * depth
    eff = s.alpha_eff(K, transformer_sublayer_types(depth))
    assert eff == pytest.approx(float(np.prod(linear_reference(K, alpha_min))), rel=1e-12)
    assert eff == pytest.approx(expected, rel=0.06)  # the paper quotes two significant digits


def test_other_kinds():
    K = 6
    assert ShortcutSchedule("none", 0.3).weights(K) == [(1.0, 1.0)] * K
    assert ShortcutSchedule("constant", 0.9).alphas(K) == [0.9] * K
    assert ShortcutSchedule("constant", 0.9).alpha_eff(K) == pytest.approx(0.9 ** 6, rel=1e-14)
    c = math.sqrt(0.5)
    assert ShortcutSchedule("scaled_branch").weights(K) == [(1.0, c)] * K
    assert ShortcutSchedule("scaled_sum").weights(K) == [(c, c)] * K
    assert ShortcutSchedule("learnable", 0.2).alphas(K) == [1.0] * K  # initialised at 1


@pytest.mark.parametrize("branches,decayed", [("attn", 0), ("mlp", 1)])
def test_branch_choice_keeps_other_sublayers_standard(branches, decayed):
    depth = 4
    types = transformer_sublayer_types(depth)
    full = linear_reference(2 * depth, 0.5)
    got = ShortcutSchedule("linear", 0.5, branches=branches).alphas(2 * depth, types)
    for k, a in enumerate(got):
        assert a == (full[k] if k % 2 == decayed else 1.0)


def test_branch_choice_counts_in_alpha_eff_and_solve_needs_the_sublayer_types():
    types = transformer_sublayer_types(12)
    attn_only = ShortcutSchedule("linear", 0.6, branches="attn")
    expected = float(np.prod(linear_reference(24, 0.6)[0::2]))  # the attention sub-layers only
    assert attn_only.alpha_eff(24, types) == pytest.approx(expected, rel=1e-12)
    assert expected == pytest.approx(0.0684, abs=1e-4)  # vs 0.0036 when both branches decay
    solved = attn_only.solve_alpha_min(expected, 24, types)
    assert solved == pytest.approx(0.6, abs=1e-9)
    for call in (lambda: attn_only.alpha_eff(24), lambda: attn_only.solve_alpha_min(5e-3, 24)):
        with pytest.raises(ValueError, match="sublayer_types"):
            call()


@pytest.mark.parametrize("kind", ["linear", "cosine", "constant"])
@pytest.mark.parametrize("K,target", [(24, 3.6e-3), (36, 1e-3), (48, 5.7e-3), (8, 0.5)])
def test_solve_alpha_min_reaches_target(kind, K, target):
    alpha_min = ShortcutSchedule(kind).solve_alpha_min(target, K)
    assert 0.0 <= alpha_min <= 1.0
    if kind == "linear":
        reference = float(np.prod(linear_reference(K, alpha_min)))
    elif kind == "cosine":
        reference = float(np.prod(cosine_reference(K, alpha_min)))
    else:
        reference = alpha_min ** K
    assert reference == pytest.approx(target, rel=1e-9)


def test_solve_recovers_spec_value():
    # depth 12 ViT, alpha_min 0.6 -> alpha_eff 3.6e-3 (the paper); solving back gives 0.6
    eff = ShortcutSchedule("linear", 0.6).alpha_eff(24)
    assert ShortcutSchedule("linear").solve_alpha_min(eff, 24) == pytest.approx(0.6, abs=1e-12)


@pytest.mark.parametrize("kwargs,field", [
    ({"alpha_min": -0.1}, "alpha_min"), ({"alpha_min": 1.5}, "alpha_min"),
    ({"alpha_min": float("nan")}, "alpha_min"), ({"alpha_min": float("inf")}, "alpha_min"),
    ({"kind": "exponential"}, "kind"), ({"branches": "norm"}, "branches"), ({"scale": 2.0}, "scale"),
])
def test_invalid_settings_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ShortcutSchedule(**kwargs)


@pytest.mark.parametrize("K", [0, -3, 2.5])
def test_invalid_depth(K):
    with pytest.raises(ValueError, match="num_sublayers"):
        ShortcutSchedule("linear").alphas(K)


@pytest.mark.parametrize("kind", ["learnable", "none", "scaled_branch", "scaled_sum"])
def test_solve_refused_for_kinds_without_alpha_min(kind):
    with pytest.raises(ValueError, match="kind"):
        ShortcutSchedule(kind).solve_alpha_min(1e-2, 24)


def test_solve_rejects_bad_target():
    with pytest.raises(ValueError, match="target_alpha_eff"):
        ShortcutSchedule("linear").solve_alpha_min(0.0, 24)
