"""The DSelect-k gate (Hazimeh et al., 2021): a sparse yet differentiable choice of k experts among N.

Each of the k *selectors* picks one expert through a binary code: ``m = ceil(log2 N)`` pre-activations ``z`` pass
through a smooth step ``S`` into ``[0, 1]``, and the weight of the expert with code ``c`` is the product over bits
``j`` of ``S(z_j)`` where bit ``j`` of ``c`` is set and ``1 - S(z_j)`` where it is not. Once every ``z`` has left the
smooth region the selector is exactly one-hot, so the gate becomes sparse in a finite number of steps while staying
trainable by backpropagation until then. A softmax over k further logits ``alpha`` mixes the selectors.

The functions take the pre-activations rather than owning parameters, because per-adapter parameters live in the
layer's flat ``ParameterDict``s. For the per-example gate both are linear in a summary ``v`` of the example,
``z = W_z v`` and ``alpha = W_alpha v``; a static gate is the same with a constant ``v``.
"""

from __future__ import annotations

import math

import torch


def dselect_k_num_bits(num_experts: int) -> int:
    """Bits of each selector's code: ``ceil(log2 N)``, enough to address every expert (so at least 1)."""
    if num_experts < 2:
        raise ValueError(f"DSelect-k needs at least 2 experts, got num_experts={num_experts}.")
    return (num_experts - 1).bit_length()


def smooth_step(t: torch.Tensor, gamma: float) -> torch.Tensor:
    """The cubic smooth step: 0 for ``t <= -gamma/2``, 1 for ``t >= gamma/2``, and in between
    ``-2 t^3 / gamma^3 + 3 t / (2 gamma) + 1/2``, whose slope vanishes at both ends (continuously differentiable).

    Unlike a sigmoid it reaches 0 and 1 exactly, which is what makes the selectors exactly one-hot. The plateaus
    are set with ``where`` so they are exact in floating point, and the cubic is evaluated on the clamped input so
    a huge ``t`` cannot overflow into a NaN gradient. Computed in fp32.
    """
    if gamma <= 0:
        raise ValueError(f"The smooth step's gamma must be positive, got {gamma}.")
    u = (t.float() / gamma).clamp(-0.5, 0.5)
    inner = -2.0 * u**3 + 1.5 * u + 0.5
    return torch.where(u <= -0.5, 0.0, torch.where(u >= 0.5, 1.0, inner))


def _code_weights(bits: torch.Tensor) -> torch.Tensor:
    """Smoothed bits ``[..., m]`` -> weights of the ``2^m`` codes, bit ``j`` of a code read from ``bits[..., j]``.

    Built one bit at a time: appending bit ``j`` halves each code's weight into ``1 - S(z_j)`` (bit clear, first
    half) and ``S(z_j)`` (bit set, second half), so the weights stay a distribution at every step.
    """
    weights = torch.ones_like(bits[..., :1])
    for j in range(bits.shape[-1]):
        bit = bits[..., j : j + 1]
        weights = torch.cat((weights * (1 - bit), weights * bit), dim=-1)
    return weights


def _fold_unused_codes(code_weights: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Map the ``2^m`` codes onto the N experts: a code ``c >= N`` names no expert and counts as ``c - 2^(m-1)``.

    This is the supplement's alternative to its penalty (appendix B.2: give each unused code to one of the
    experts), made deterministic by dropping the top bit. Since ``2^(m-1) < N``, ``c - 2^(m-1)`` is always a real
    expert, and the experts that receive a second code are exactly those whose code with the top bit set is
    missing: they are addressed by their low ``m - 1`` bits alone. The weights therefore sum to 1 over the real
    experts whatever ``z`` is, and a saturated selector is one-hot on a real expert. The price, as for any such
    fold, is an uneven start: at ``S(z) = 1/2`` those ``2^m - N`` experts weigh twice as much as the others.
    """
    num_codes = code_weights.shape[-1]
    if num_codes == num_experts:
        return code_weights
    half = num_codes // 2
    shared = code_weights[..., num_experts - half : half] + code_weights[..., num_experts:]
    return torch.cat((code_weights[..., : num_experts - half], shared, code_weights[..., half:num_experts]), dim=-1)


def dselect_k_gate(
    selector_logits: torch.Tensor, selector_weights_logits: torch.Tensor, num_experts: int, gamma: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The DSelect-k distribution over experts, per example, in fp32.

    ``selector_logits [batch, k, m]`` are the code pre-activations ``z`` of the k selectors (``m`` from
    ``dselect_k_num_bits``), ``selector_weights_logits [batch, k]`` the logits ``alpha`` that weigh them. Returns
    ``(expert_weights [batch, N], selector_outputs [batch, k, N])``: ``selector_outputs[:, i]`` is selector i's
    distribution ``r(S(z_i))`` and ``expert_weights = sum_i softmax(alpha)_i * selector_outputs[:, i]``, so at most
    k experts have non-zero weight once the selectors have saturated.

    N need not be a power of two: the ``2^m - N`` codes beyond the last expert are folded onto real experts (see
    ``_fold_unused_codes``) rather than penalised as in the supplement's appendix B.2. With a penalty, weight left
    on the unused codes would shrink the merged expert during training, and a selector that saturated on one would
    have no weight on any expert and no gradient to leave it. With ``k = 1`` (SMEAR's setting) ``alpha`` has no
    effect.
    """
    num_bits = dselect_k_num_bits(num_experts)
    z_shape, alpha_shape = tuple(selector_logits.shape), tuple(selector_weights_logits.shape)
    if len(z_shape) != 3 or z_shape[1] < 1 or z_shape[2] != num_bits:
        raise ValueError(
            f"selector_logits must be [batch, k >= 1, {num_bits}] for {num_experts} experts, got shape {z_shape}."
        )
    if alpha_shape != z_shape[:2]:
        raise ValueError(
            f"selector_weights_logits must be [batch, k] = {z_shape[:2]} to match selector_logits of shape "
            f"{z_shape}, got shape {alpha_shape}."
        )
    code_weights = _code_weights(smooth_step(selector_logits, gamma))
    selector_outputs = _fold_unused_codes(code_weights, num_experts)
    mix = selector_weights_logits.float().softmax(dim=-1)
    return torch.einsum("bk,bkn->bn", mix, selector_outputs), selector_outputs


def dselect_k_entropy(selector_outputs: torch.Tensor) -> torch.Tensor:
    """The entropy regulariser: each selector's entropy (nats), summed over the k selectors, averaged over examples.

    Minimising it (weighted by the user's lambda) pushes every selector to one-hot, i.e. every ``z`` out of the
    smooth region, which is how the gate becomes sparse. The sum over selectors follows the paper's
    ``Omega(Z) = sum_i h(r(S(z_i)))``, so its lambdas carry over. ``0 log 0`` is taken as 0, with a finite gradient.
    """
    probs = selector_outputs.float()
    tiny = torch.finfo(probs.dtype).tiny
    return -(probs * probs.clamp(min=tiny).log()).sum(dim=-1).sum(dim=-1).mean()


def init_dselect_k_(
    selector_weight: torch.Tensor, selector_weights_weight: torch.Tensor, gamma: float, spread: float = 0.5
) -> None:
    """Initialise a per-example gate ``z = selector_weight @ v``, ``alpha = selector_weights_weight @ v`` in place.

    ``z`` must start inside the smooth region: a saturated bit has zero gradient and would never move. Its weights
    are drawn uniformly and scaled by the fan-in so that, for inputs of unit variance (e.g. a LayerNorm'd summary),
    the standard deviation of ``z`` is ``spread * gamma / 2``; they are random so the k selectors start apart and do
    not all follow the same gradient to the same expert. The ``alpha`` weights start at zero, giving every selector
    the same weight. The supplement prescribes no initialisation; these choices are ours. For a static gate (a
    constant input ``v = 1``) the default puts ``z`` uniformly within ``0.43 gamma`` of 0, and ``spread = 1/sqrt(3)``
    would spread it over the whole smooth region; starting much wider freezes bits from the first step.
    """
    if gamma <= 0:
        raise ValueError(f"DSelect-k's gamma must be positive, got {gamma}.")
    if spread <= 0:
        raise ValueError(f"spread must be positive, got {spread}.")
    bound = spread * gamma / 2 * math.sqrt(3 / selector_weight.shape[-1])
    with torch.no_grad():
        selector_weight.uniform_(-bound, bound)
        selector_weights_weight.zero_()
