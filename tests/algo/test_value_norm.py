"""Running value normalisation, by hand (the 2-rank case is in test_aggregation.py)."""

import pytest
import torch

from realrl.algo.value_norm import ValueNormalizer


def test_ema_normaliser_by_hand_with_debiasing():
    normaliser = ValueNormalizer("ema", beta=0.5)
    assert normaliser.normalize(torch.tensor([3.0])).item() == 3.0  # identity before updates
    # batch [1, 3]: mean 2, mean_sq 5; m = 0.5*2 = 1, m_sq = 2.5, debias 0.5 -> mean 2, var 5-4 = 1
    normaliser.update(torch.tensor([1.0, 3.0]))
    mean, std = normaliser.mean_std()
    assert (mean.item(), std.item()) == (2.0, 1.0)
    # batch [5]: m = 0.5*1 + 0.5*5 = 3, m_sq = 0.5*2.5 + 0.5*25 = 13.75, debias 0.75
    # mean 4, mean_sq 18.3333, var 2.3333, std 1.527525
    normaliser.update(torch.tensor([5.0]))
    mean, std = normaliser.mean_std()
    assert mean.item() == pytest.approx(4.0)
    assert std.item() == pytest.approx(1.527525)
    torch.testing.assert_close(
        normaliser.normalize(torch.tensor([4.0, 5.527525])), torch.tensor([0.0, 1.0])
    )


def test_moving_average_is_the_exact_statistic_of_all_masked_values():
    # values seen [1, 3] then [5] (100 masked out): mean 3, population var 8/3, std 1.632993
    normaliser = ValueNormalizer("moving_average")
    normaliser.update(torch.tensor([1.0, 3.0]))
    normaliser.update(torch.tensor([5.0, 100.0]), mask=torch.tensor([True, False]))
    mean, std = normaliser.mean_std()
    assert mean.item() == pytest.approx(3.0)
    assert std.item() == pytest.approx(1.632993)


def test_constant_values_use_the_variance_floor():
    normaliser = ValueNormalizer("moving_average")
    normaliser.update(torch.tensor([2.0, 2.0]))
    assert normaliser.mean_std()[1].item() == pytest.approx(0.1)  # sqrt(1e-2)


def test_state_dict_round_trip_and_denormalize_inverts_normalize():
    normaliser = ValueNormalizer("ema", beta=0.9)
    normaliser.update(torch.randn(50) * 3 + 1)
    restored = ValueNormalizer("ema", beta=0.9)
    restored.load_state_dict(normaliser.state_dict())
    values = torch.randn(10)
    torch.testing.assert_close(restored.normalize(values), normaliser.normalize(values))
    torch.testing.assert_close(normaliser.denormalize(normaliser.normalize(values)), values)
    with pytest.raises(ValueError, match="value_norm_type=ema"):
        ValueNormalizer("moving_average").load_state_dict(normaliser.state_dict())


def test_invalid_mode_lists_the_valid_ones():
    with pytest.raises(ValueError, match="ema, moving_average"):
        ValueNormalizer("popart")
