"""The zoo's truncated-normal initialiser: the law it promises, the same draws on every torch release."""

import math

import pytest
import torch

from efficient.models.weight_init import trunc_normal_


def test_wide_range_is_the_normal_draws_themselves():
    """std 0.02 in [-2, 2] (the zoo's Linear weights): nothing lands outside, so the values are the
    seed's normal draws, one per element, as the newer `nn.init.trunc_normal_` gives them."""
    torch.manual_seed(0)
    got = trunc_normal_(torch.empty(384, 96), std=0.02)
    torch.manual_seed(0)
    want = torch.empty(384, 96).normal_(0.0, 0.02)
    assert torch.equal(got, want)


def test_draws_outside_are_drawn_again_and_the_rest_kept():
    """[-2 std, 2 std] (STATA's anchor): about 5 % of the first draws land outside and are replaced
    by later draws; every value ends inside, and those inside from the start are kept."""
    std = 0.02
    torch.manual_seed(1)
    first = torch.empty(4000).normal_(0.0, std)
    torch.manual_seed(1)
    got = trunc_normal_(torch.empty(4000), std=std, a=-2 * std, b=2 * std)
    inside = first.abs() <= 2 * std
    assert 100 < int((~inside).sum()) < 300
    assert torch.equal(got[inside], first[inside])
    assert not torch.equal(got[~inside], first[~inside])
    assert float(got.abs().max()) <= 2 * std


def test_narrow_range_is_the_inverse_cdf_of_uniform_draws():
    """[0.5, 0.7] of N(0, 1) holds 6 % of the mass: each value is the inverse CDF of one uniform draw,
    and a large sample has the truncated law's mean and standard deviation."""
    a, b = 0.5, 0.7
    cdf = lambda x: 0.5 * (1 + math.erf(x / math.sqrt(2)))  # noqa: E731
    pdf = lambda x: math.exp(-x * x / 2) / math.sqrt(2 * math.pi)  # noqa: E731
    torch.manual_seed(2)
    got = trunc_normal_(torch.empty(50_000), a=a, b=b)
    torch.manual_seed(2)
    u = torch.empty(50_000).uniform_(2 * cdf(a) - 1, 2 * cdf(b) - 1)
    assert torch.equal(got, (u.erfinv() * math.sqrt(2.0)).clamp(a, b))
    z = cdf(b) - cdf(a)
    mean = (pdf(a) - pdf(b)) / z
    var = 1 + (a * pdf(a) - b * pdf(b)) / z - mean ** 2
    assert float(got.min()) >= a and float(got.max()) <= b
    assert abs(float(got.double().mean()) - mean) < 5 * math.sqrt(var / got.numel())
    assert float(got.double().std()) == pytest.approx(math.sqrt(var), rel=0.02)


@pytest.mark.parametrize("kw,want", [
    ({"std": 0.02}, [0.030819923, -0.005868578, -0.043575786, 0.011368626,
                     -0.021690447, -0.027971908, 0.008066937, 0.016760526]),
    ({"std": 1.0, "a": 0.5, "b": 0.7}, [0.59626287, 0.65140039, 0.51680177, 0.52512610,
                                        0.55902827, 0.62396753, 0.59503472, 0.67808867]),
], ids=["wide", "narrow"])
def test_the_same_seed_gives_the_same_values_on_every_release(kw, want):
    """Seed 0's first values, as torch 2.11 and 2.14 both give them (nn.init.trunc_normal_ gives other
    values on each of the two): a model's initial weights follow the seed, not the torch release."""
    torch.manual_seed(0)
    got = trunc_normal_(torch.empty(8), **kw)
    assert got.tolist() == pytest.approx(want, rel=1e-6, abs=1e-9)


def test_a_generator_is_used_and_the_global_stream_left_alone():
    g = torch.Generator().manual_seed(3)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    got = trunc_normal_(torch.empty(64), std=0.5, generator=g)
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.equal(got, torch.empty(64).normal_(0.0, 0.5, generator=torch.Generator().manual_seed(3)))


@pytest.mark.parametrize("kw,match", [
    ({"std": 0.0}, "std must be > 0"),
    ({"std": -1.0}, "std must be > 0"),
    ({"a": 1.0, "b": 1.0}, r"\[a, b\] = \[1.0, 1.0\] is empty"),
    ({"a": 2.0, "b": -2.0}, "a must be below b"),
])
def test_bad_arguments_are_named(kw, match):
    with pytest.raises(ValueError, match=match):
        trunc_normal_(torch.empty(4), **kw)
