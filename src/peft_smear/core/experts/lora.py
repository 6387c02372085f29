"""LoRA experts, the default kind: N rank-r LoRAs per wrapped module, merged per example by averaging A and B."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from peft import LoraConfig

from .base import Expert, ExpertKind, Params, exported_config_fields, merge_parameter, per_token, scaled


if TYPE_CHECKING:
    from ..config import SmearConfig


def init_lora_experts(lora_A: torch.Tensor, lora_B: torch.Tensor, scheme: bool | str) -> None:
    """Initialise ``lora_A [N, r, in]`` and ``lora_B [N, out, r]`` in place, each expert independently so that the
    experts differ (SMEAR needs distinct experts to break symmetry). See ``SmearConfig.init_weights``."""
    with torch.no_grad():
        for expert_A, expert_B in zip(lora_A, lora_B, strict=True):
            if scheme == "gaussian":
                torch.nn.init.normal_(expert_A, std=1 / lora_A.shape[1])
            elif scheme == "smear":
                torch.nn.init.normal_(expert_A, std=1e-2)
            else:
                torch.nn.init.kaiming_uniform_(expert_A, a=math.sqrt(5))

            if scheme == "smear":
                torch.nn.init.normal_(expert_B, std=1e-2)
            elif scheme is False:
                torch.nn.init.kaiming_uniform_(expert_B, a=math.sqrt(5))
            else:
                torch.nn.init.zeros_(expert_B)


def merge_lora_experts(
    lora_A: torch.Tensor, lora_B: torch.Tensor, probs: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """SMEAR's merged expert of each example: ``sum_n p_n A_n`` as ``[batch, r, in]`` and ``(sum_n p_n B_n)^T`` as
    ``[batch, r, out]``, from ``probs [batch, N]``, cast to ``dtype`` (the activations').

    A and B are averaged separately: that is SMEAR's merged expert, not the ensemble ``sum_n p_n B_n A_n``. B is
    merged already transposed so that applying it needs no copy.
    """
    return merge_parameter(lora_A, probs, dtype), merge_parameter(lora_B.transpose(1, 2), probs, dtype)


def gather_lora_experts(
    lora_A: torch.Tensor,
    lora_B: torch.Tensor,
    expert_index: torch.Tensor,
    dtype: torch.dtype,
    up_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The one chosen expert of each example (``expert_index [batch]``; B from ``up_index`` when given), laid out like
    :func:`merge_lora_experts`'s result: gathered, not merged, so discrete routing costs exactly one rank-r LoRA."""
    up_index = expert_index if up_index is None else up_index
    return lora_A[expert_index].to(dtype), lora_B[up_index].transpose(1, 2).to(dtype)


def mean_update_lora(
    lora_A: torch.Tensor, lora_B: torch.Tensor, second_moment: torch.Tensor, rank: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """One plain LoRA ``(A', B')`` whose update ``B' A'`` is the mean of a task's examples' own merged experts, and
    the share of that mean's energy it keeps.

    With ``S = E_b[p_b p_b^T]`` (``second_moment [N, N]``, the second moment of the task's routing), the mean update is
    ``E_b[B(p_b) A(p_b)] = sum_ij S_ij B_i A_j = [B_1 ... B_N] (S ⊗ I_r) [A_1; ...; A_N]``, of rank at most ``N * r``.

    * ``rank=None``: exactly that, as one LoRA of rank ``N * r``: ``B' = [B_1 ... B_N]``,
      ``A' = (S ⊗ I_r) [A_1; ...; A_N]``; the energy kept is 1.
    * ``rank=k``: its best rank-``k`` approximation (Eckart-Young), from the SVD of the small core left by a QR of
      both factors, so the ``out x in`` matrix is never formed: ``B' = U_k sqrt(Σ_k)``, ``A' = sqrt(Σ_k) V_k^T``
      (zero-padded to ``k`` when the update's rank is lower). The energy kept is ``sum_kept σ² / sum σ²``
      (Frobenius; 1 for a zero update): the relative error of the truncation is its complement's square root.

    ``A' [rank, in]`` and ``B' [out, rank]`` are computed in float64 and returned in the parameters' dtype; the
    LoRA's scaling is the experts' own (the exported config keeps ``lora_alpha / r``, see ``export_config``).
    """
    n, r, in_features = lora_A.shape
    out_features = lora_B.shape[1]
    A, B = lora_A.detach().double(), lora_B.detach().double()
    S = second_moment.detach().to(device=A.device, dtype=torch.float64)
    stacked_B = B.permute(1, 0, 2).reshape(out_features, n * r)  # [B_1 ... B_N]
    mixed_A = (S @ A.reshape(n, r * in_features)).reshape(n * r, in_features)  # (S ⊗ I_r) [A_1; ...; A_N]
    if rank is None:
        return mixed_A.to(lora_A.dtype), stacked_B.to(lora_B.dtype), 1.0
    q_B, r_B = torch.linalg.qr(stacked_B)  # stacked_B = q_B r_B
    q_A, r_A = torch.linalg.qr(mixed_A.T)  # mixed_A = r_A^T q_A^T
    U, sigma, Vh = torch.linalg.svd(r_B @ r_A.T)  # the update is q_B U diag(sigma) Vh q_A^T
    kept = sigma[:rank]
    total = sigma.square().sum()
    energy = 1.0 if total == 0 else float(kept.square().sum() / total)
    root = kept.sqrt()
    new_B = torch.zeros(out_features, rank, dtype=torch.float64, device=A.device)
    new_A = torch.zeros(rank, in_features, dtype=torch.float64, device=A.device)
    new_B[:, : len(kept)] = q_B @ (U[:, : len(kept)] * root)
    new_A[: len(kept)] = (root[:, None] * Vh[: len(kept)]) @ q_A.T
    return new_A.to(lora_A.dtype), new_B.to(lora_B.dtype), energy


def mean_routing_gap(
    lora_A: torch.Tensor, lora_B: torch.Tensor, mean: torch.Tensor, second_moment: torch.Tensor
) -> float:
    """How far the merged expert of a task's mean routing, ``B(p̄) A(p̄)``, is from the task's mean update
    ``E_b[B(p_b) A(p_b)]`` (see :func:`mean_update_lora`): ``||B(p̄) A(p̄) - E_b[B(p_b) A(p_b)]|| / ||E_b[...]||``
    (Frobenius), computed from the factors (``||U V||² = tr(UᵀU VVᵀ)``), never forming an ``out x in`` matrix."""
    n, r, in_features = lora_A.shape
    A, B = lora_A.detach().double(), lora_B.detach().double()
    p, S = mean.detach().to(A.device, torch.float64), second_moment.detach().to(A.device, torch.float64)
    stacked_B = B.permute(1, 0, 2).reshape(-1, n * r)
    mixed_A = (S @ A.reshape(n, r * in_features)).reshape(n * r, in_features)
    merged_B, merged_A = torch.einsum("n,nor->or", p, B), torch.einsum("n,nri->ri", p, A)

    def squared_norm(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
        return torch.trace((left.T @ left) @ (right @ right.T))

    exact = squared_norm(stacked_B, mixed_A)
    difference = squared_norm(torch.cat([merged_B, -stacked_B], dim=1), torch.cat([merged_A, mixed_A], dim=0))
    return 0.0 if exact == 0 else float((difference.clamp(min=0) / exact).sqrt())


def add_per_example_experts(
    y: torch.Tensor,
    tokens: torch.Tensor,
    expert_A: torch.Tensor,
    expert_B_t: torch.Tensor,
    scaling: float,
    output_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``y [batch, seq, out]`` plus ``tokens [batch, seq, in]`` through each example's own expert (``[batch, r, in]``,
    ``[batch, r, out]``, from :func:`merge_lora_experts` or :func:`gather_lora_experts`), times ``scaling`` and each
    example's ``output_scale``: the cost of one rank-r LoRA.

    ``y`` is updated in place: it is the wrapped module's fresh output, which nothing else holds (a linear layer
    keeps its input for backward, not its output). The per-example scale goes on the rank-r hidden units and the
    second matmul accumulates into ``y`` with the scaling as its ``alpha``, so no pass over the output is left (a
    LoRA forward makes two, the scaling and the addition; an out-of-place ``baddbmm`` would copy ``y``)."""
    hidden = scaled(torch.bmm(tokens, expert_A.transpose(1, 2)), output_scale)
    if hidden.dtype != y.dtype:  # e.g. an fp32 base output under autocast
        return y.add_((torch.bmm(hidden, expert_B_t) * scaling).to(y.dtype))
    return y.baddbmm_(hidden, expert_B_t, alpha=scaling)


def add_lora_mixture(
    y: torch.Tensor,
    tokens: torch.Tensor,
    lora_A: torch.Tensor,
    lora_B: torch.Tensor,
    weights: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """``y`` plus the experts' *outputs* mixed per example, ``sum_n w_n B_n A_n x`` (ensemble, Top-k with k > 1,
    DSelect-k), or per token when ``weights`` is ``[batch, tokens, N]`` (Arrow, PHATGOOSE, GLIDER).

    All experts run as one rank ``N * r`` LoRA whose rank dimensions are weighted by their expert's ``w_n``: one
    dense matmul pair instead of N, but still N times the work of one expert. The second matmul accumulates into
    ``y`` in place, as in :func:`add_per_example_experts`.
    """
    n, r, _ = lora_A.shape
    stacked_A = lora_A.reshape(n * r, -1).to(tokens.dtype)
    stacked_B = lora_B.permute(1, 0, 2).reshape(-1, n * r).to(tokens.dtype)
    hidden = tokens @ stacked_A.T * per_token(weights).repeat_interleave(r, dim=-1).to(tokens.dtype)
    if hidden.dtype != y.dtype:
        return y.add_((hidden @ stacked_B.T * scaling).to(y.dtype))
    y.view(-1, y.shape[-1]).addmm_(hidden.reshape(-1, n * r), stacked_B.T, alpha=scaling)
    return y


class LoraExperts(ExpertKind):
    """N LoRA experts ``B_n A_n`` of rank ``r``, added to the module's output: ``y + (B_b A_b x) * scaling``.

    The merged expert averages A and B separately, ``(sum_n p_n B_n)(sum_n p_n A_n)``, as the paper merges every
    parameter of an expert; that is not the ensemble ``sum_n p_n B_n A_n``.
    """

    name = "lora"
    title = "LoRA"
    exported_as = "a LoRA adapter"
    mean_update = "low_rank"
    parameter_names = ("smear_lora_A", "smear_lora_B")
    options = ("r", "lora_alpha", "use_rslora")
    init_schemes = (True, False, "gaussian", "smear")

    def __init__(self, in_features: int, out_features: int, config: SmearConfig, module_name: str) -> None:
        super().__init__(in_features, out_features, config, module_name)
        self.r = config.r
        self.scaling = config.lora_alpha / (math.sqrt(config.r) if config.use_rslora else config.r)

    def create_parameters(self, num_experts: int, init: bool | str) -> dict[str, torch.Tensor]:
        lora_A = torch.empty(num_experts, self.r, self.in_features)
        lora_B = torch.empty(num_experts, self.out_features, self.r)
        init_lora_experts(lora_A, lora_B, init)
        return {"smear_lora_A": lora_A, "smear_lora_B": lora_B}

    def merge(self, params: Params, probs: torch.Tensor, dtype: torch.dtype) -> Expert:
        return merge_lora_experts(params["smear_lora_A"], params["smear_lora_B"], probs, dtype)

    def gather(
        self, params: Params, expert_index: torch.Tensor, dtype: torch.dtype, up_index: torch.Tensor | None = None
    ) -> Expert:
        return gather_lora_experts(params["smear_lora_A"], params["smear_lora_B"], expert_index, dtype, up_index)

    def apply(
        self, x: torch.Tensor, y: torch.Tensor, expert: Expert, output_scale: torch.Tensor | None
    ) -> torch.Tensor:
        return add_per_example_experts(y, x, *expert, self.scaling, output_scale)

    def mix(self, x: torch.Tensor, y: torch.Tensor, params: Params, weights: torch.Tensor) -> torch.Tensor:
        return add_lora_mixture(y, x, params["smear_lora_A"], params["smear_lora_B"], weights, self.scaling)

    def export_weights(self, params: Params, distribution: torch.Tensor) -> dict[str, torch.Tensor]:
        """A plain LoRA: for a fixed ``p`` the merged expert *is* ``A = sum_n p_n A_n``, ``B = sum_n p_n B_n``."""
        lora_A, lora_B = params["smear_lora_A"], params["smear_lora_B"]
        return {
            "lora_A.weight": merge_parameter(lora_A, distribution[None], lora_A.dtype)[0],
            "lora_B.weight": merge_parameter(lora_B, distribution[None], lora_B.dtype)[0],
        }

    def mean_routing_gap(self, params: Params, mean: torch.Tensor, second_moment: torch.Tensor) -> float:
        return mean_routing_gap(params["smear_lora_A"], params["smear_lora_B"], mean, second_moment)

    def export_mean_update(
        self, params: Params, second_moment: torch.Tensor, rank: int | None
    ) -> tuple[dict[str, torch.Tensor], float]:
        """The task's mean update as one plain LoRA, exact (rank ``N * r``) or truncated to ``rank``: see
        :func:`mean_update_lora`."""
        A, B, energy = mean_update_lora(params["smear_lora_A"], params["smear_lora_B"], second_moment, rank)
        return {"lora_A.weight": A, "lora_B.weight": B}, energy

    @classmethod
    def export_config(
        cls,
        config: SmearConfig,
        modules: Mapping[str, ExpertKind],
        fan_in_fan_out: bool,
        rank: int | None = None,
    ) -> LoraConfig:
        """At the experts' rank and alpha, or at ``rank`` (a mean update's) with the alpha that keeps PEFT's scaling
        ``lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA) the experts' own."""
        alpha = config.lora_alpha
        if rank is not None and rank != config.r:
            ratio = rank / config.r
            alpha = config.lora_alpha * (math.sqrt(ratio) if config.use_rslora else ratio)
        return LoraConfig(
            r=config.r if rank is None else rank,
            lora_alpha=alpha,
            use_rslora=config.use_rslora,
            fan_in_fan_out=fan_in_fan_out,
            lora_dropout=0.0,
            bias="none",
            **exported_config_fields(config, modules),
        )
