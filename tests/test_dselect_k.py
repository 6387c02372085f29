"""The DSelect-k gate: its definition checked against a by-hand computation, its edge cases, and expert recovery."""

from __future__ import annotations

import math

import pytest
import torch

from peft_smear.dselect_k import (
    dselect_k_entropy,
    dselect_k_gate,
    dselect_k_num_bits,
    init_dselect_k_,
    smooth_step,
)


def expected_expert(code: int, num_experts: int) -> int:
    """Where a code lands: itself, or with its top bit dropped when it names no expert."""
    return code if code < num_experts else code - 2 ** (dselect_k_num_bits(num_experts) - 1)


def selector_by_hand(z: torch.Tensor, num_experts: int, gamma: float) -> torch.Tensor:
    """One selector's weights from ``z [m]``, looping over experts, codes and bits."""
    bits = [smooth_step(z_j, gamma).item() for z_j in z]
    weights = torch.zeros(num_experts, dtype=torch.float64)
    for code in range(2 ** len(bits)):
        product = 1.0
        for j, s in enumerate(bits):
            product *= s if (code >> j) & 1 else 1 - s
        weights[expected_expert(code, num_experts)] += product
    return weights


def random_logits(batch: int, k: int, num_experts: int, gamma: float, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    m = dselect_k_num_bits(num_experts)
    z = (torch.rand(batch, k, m, generator=generator) - 0.5) * 1.5 * gamma  # some bits saturated, most not
    alpha = torch.randn(batch, k, generator=generator)
    return z, alpha


# --- the pieces ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_experts", "bits"), [(2, 1), (3, 2), (4, 2), (5, 3), (6, 3), (8, 3), (9, 4), (16, 4), (17, 5)]
)
def test_num_bits_is_enough_to_address_every_expert(num_experts, bits):
    assert dselect_k_num_bits(num_experts) == bits
    assert 2 ** (bits - 1) < num_experts <= 2**bits


@pytest.mark.parametrize("gamma", [0.5, 1.0, 10.0])
def test_smooth_step_matches_the_cubic_and_is_exactly_flat_outside(gamma):
    t = torch.linspace(-gamma, gamma, 201, dtype=torch.float64)
    inside = t.abs() < gamma / 2
    cubic = -2 * t**3 / gamma**3 + 3 * t / (2 * gamma) + 0.5
    s = smooth_step(t, gamma)
    assert s.dtype == torch.float32
    torch.testing.assert_close(s[inside], cubic[inside].float())
    assert torch.equal(s[t <= -gamma / 2], torch.zeros_like(s[t <= -gamma / 2]))
    assert torch.equal(s[t >= gamma / 2], torch.ones_like(s[t >= gamma / 2]))
    assert smooth_step(torch.tensor(0.0), gamma).item() == 0.5
    assert torch.equal(smooth_step(torch.tensor([-1e30, 1e30]), gamma), torch.tensor([0.0, 1.0]))


def test_smooth_step_slope_vanishes_at_the_edges_and_never_becomes_nan():
    gamma = 2.0
    t = torch.tensor([-1e30, -1.0, 0.0, 1.0, 1e30], requires_grad=True)
    smooth_step(t, gamma).sum().backward()
    torch.testing.assert_close(t.grad, torch.tensor([0.0, 0.0, 1.5 / gamma, 0.0, 0.0]))


# --- the gate --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_experts", [2, 3, 5, 6, 8, 16])
def test_gate_matches_the_product_over_bits_computed_by_hand(num_experts):
    gamma, k = 1.0, 3
    z, alpha = random_logits(4, k, num_experts, gamma)
    weights, selectors = dselect_k_gate(z, alpha, num_experts, gamma)
    assert weights.shape == (4, num_experts)
    assert selectors.shape == (4, k, num_experts)
    for b in range(4):
        by_hand = torch.stack([selector_by_hand(z[b, i], num_experts, gamma) for i in range(k)])
        torch.testing.assert_close(selectors[b].double(), by_hand, atol=1e-6, rtol=1e-5)
        mixed = (
            sum(math.exp(a) * row for a, row in zip(alpha[b].tolist(), by_hand, strict=True)) / alpha[b].exp().sum()
        )
        torch.testing.assert_close(weights[b].double(), mixed, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("num_experts", [3, 5, 6, 8, 16])
def test_weights_are_a_distribution_over_the_real_experts(num_experts):
    z, alpha = random_logits(64, 4, num_experts, gamma=1.0, seed=num_experts)
    weights, selectors = dselect_k_gate(z, alpha, num_experts, gamma=1.0)
    assert (weights >= 0).all() and (selectors >= 0).all()
    torch.testing.assert_close(selectors.sum(dim=-1), torch.ones(64, 4))
    torch.testing.assert_close(weights.sum(dim=-1), torch.ones(64))


@pytest.mark.parametrize("num_experts", [2, 3, 5, 6, 8, 16])
def test_saturated_selectors_are_exactly_one_hot_on_a_real_expert(num_experts):
    """Every sign pattern of ``z`` outside the smooth region (all ``2^m`` codes, the unused ones included)."""
    gamma = 1.0
    m = dselect_k_num_bits(num_experts)
    codes = torch.arange(2**m)
    code_bits = (codes.unsqueeze(-1) >> torch.arange(m)) & 1
    z = torch.where(code_bits.bool(), 0.5, -0.5) * gamma * torch.linspace(1, 3, m)  # |z| >= gamma/2, edge included
    alpha = torch.zeros(2**m, 1)
    weights, selectors = dselect_k_gate(z.unsqueeze(1), alpha, num_experts, gamma)
    targets = torch.tensor([expected_expert(c, num_experts) for c in codes.tolist()])
    one_hot = torch.nn.functional.one_hot(targets, num_experts).float()
    assert torch.equal(selectors[:, 0], one_hot)
    assert torch.equal(weights, one_hot)
    assert set(targets.tolist()) == set(range(num_experts))  # every expert can be selected


def test_k_saturated_selectors_give_at_most_k_nonzero_weights():
    gamma, num_experts = 1.0, 16
    z = torch.tensor([[[1, -1, 1, -1], [-1, -1, -1, -1], [1, -1, 1, -1]]]) * gamma  # codes 5, 0 and 5 again
    alpha = torch.tensor([[0.0, math.log(2), 0.0]])
    weights, _ = dselect_k_gate(z, alpha, num_experts, gamma)
    expected = torch.zeros(1, num_experts)
    expected[0, 5], expected[0, 0] = 0.5, 0.5
    torch.testing.assert_close(weights, expected)
    assert torch.equal(weights > 0, expected > 0)


def test_gradient_reaches_both_logits_inside_the_smooth_region_and_stops_outside():
    gamma, num_experts = 2.0, 6
    z, alpha = random_logits(8, 3, num_experts, gamma)
    z = (z / 2).requires_grad_()  # all strictly inside (-gamma/2, gamma/2)
    alpha.requires_grad_()
    target = torch.randn(8, num_experts)
    weights, _ = dselect_k_gate(z, alpha, num_experts, gamma)
    (weights * target).sum().backward()
    assert (z.grad != 0).all() and (alpha.grad.abs().sum(dim=-1) > 0).all()

    saturated = (torch.sign(z.detach()) * gamma).requires_grad_()
    weights, selectors = dselect_k_gate(saturated, alpha, num_experts, gamma)
    ((weights * target).sum() + dselect_k_entropy(selectors)).backward()
    assert torch.equal(saturated.grad, torch.zeros_like(saturated))  # finite: no NaN from 0 * log 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_computed_in_fp32_whatever_the_input_dtype(dtype):
    z, alpha = random_logits(4, 2, 5, gamma=1.0)
    weights, selectors = dselect_k_gate(z.to(dtype), alpha.to(dtype), 5, gamma=1.0)
    assert weights.dtype == selectors.dtype == torch.float32
    assert dselect_k_entropy(selectors.to(dtype)).dtype == torch.float32
    reference, _ = dselect_k_gate(z.to(dtype).float(), alpha.to(dtype).float(), 5, gamma=1.0)
    torch.testing.assert_close(weights, reference)


# --- the entropy regulariser -----------------------------------------------------------------------------------------


def test_entropy_sums_selectors_and_averages_examples():
    z, alpha = random_logits(5, 3, 6, gamma=1.0)
    _, selectors = dselect_k_gate(z, alpha, 6, gamma=1.0)
    by_hand = sum(-p * math.log(p) for p in selectors.flatten().tolist() if p > 0) / 5
    assert dselect_k_entropy(selectors).item() == pytest.approx(by_hand, rel=1e-5)


def test_entropy_is_zero_when_one_hot_and_maximal_when_uniform():
    k, m = 3, 3
    _, one_hot = dselect_k_gate(torch.full((2, k, m), 5.0), torch.zeros(2, k), 8, gamma=1.0)
    assert dselect_k_entropy(one_hot).item() == 0.0
    _, uniform = dselect_k_gate(torch.zeros(2, k, m), torch.zeros(2, k), 8, gamma=1.0)
    assert dselect_k_entropy(uniform).item() == pytest.approx(k * math.log(8))


# --- initialisation -------------------------------------------------------------------------------------------------


def test_init_starts_inside_the_smooth_region_with_equal_selector_weights():
    gamma, spread, k, features = 4.0, 0.5, 4, 256
    m = dselect_k_num_bits(16)
    selector_weight, selector_weights_weight = torch.empty(k * m, features), torch.ones(k, features)
    torch.manual_seed(0)
    init_dselect_k_(selector_weight, selector_weights_weight, gamma, spread)
    assert torch.equal(selector_weights_weight, torch.zeros(k, features))

    v = torch.nn.functional.layer_norm(torch.randn(512, features), (features,))
    z = (v @ selector_weight.T).view(512, k, m)
    assert z.std().item() == pytest.approx(spread * gamma / 2, rel=0.1)
    assert (z.abs() < gamma / 2).float().mean() > 0.9
    weights, _ = dselect_k_gate(z, v @ selector_weights_weight.T, 16, gamma)
    assert (weights > 0).all()  # every expert gets gradient at the start


def test_init_of_a_static_gate_is_uniform_on_the_smooth_region():
    gamma = 3.0
    selector_weight, selector_weights_weight = torch.empty(10_000, 1), torch.empty(1, 1)
    init_dselect_k_(selector_weight, selector_weights_weight, gamma, spread=1 / math.sqrt(3))
    assert selector_weight.abs().max() <= gamma / 2
    assert selector_weight.abs().max() > 0.99 * gamma / 2


# --- argument checks -------------------------------------------------------------------------------------------------


def test_invalid_arguments_are_refused_with_the_shapes_named():
    z, alpha = torch.zeros(2, 3, 3), torch.zeros(2, 3)
    with pytest.raises(ValueError, match="at least 2 experts"):
        dselect_k_gate(z, alpha, 1, gamma=1.0)
    with pytest.raises(ValueError, match="gamma must be positive"):
        dselect_k_gate(z, alpha, 8, gamma=0.0)
    with pytest.raises(ValueError, match="gamma must be positive"):
        smooth_step(z, gamma=-1.0)
    with pytest.raises(ValueError, match=r"k >= 1.*\(2, 0, 3\)"):
        dselect_k_gate(torch.zeros(2, 0, 3), torch.zeros(2, 0), 8, gamma=1.0)
    with pytest.raises(ValueError, match=r"\[batch, k >= 1, 4\] for 16 experts, got shape \(2, 3, 3\)"):
        dselect_k_gate(z, alpha, 16, gamma=1.0)
    with pytest.raises(ValueError, match=r"\(2, 3\).*\(2, 3, 3\).*got shape \(2, 4\)"):
        dselect_k_gate(z, torch.zeros(2, 4), 8, gamma=1.0)
    with pytest.raises(ValueError, match=r"got shape \(3, 3\)"):
        dselect_k_gate(torch.zeros(3, 3), alpha, 8, gamma=1.0)
    with pytest.raises(ValueError, match="spread must be positive"):
        init_dselect_k_(torch.empty(4, 2), torch.empty(1, 2), gamma=1.0, spread=0.0)
