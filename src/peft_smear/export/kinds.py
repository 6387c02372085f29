"""How the merged expert of each expert kind is written as an adapter with one expert: the export's own knowledge of
the kinds, kept here rather than on the kinds. A kind registered from outside becomes exportable with
:func:`register_kind_export`.

* LoRA experts: for a fixed ``p`` the merged expert *is* a LoRA, ``A = sum_n p_n A_n``, ``B = sum_n p_n B_n``, at the
  same rank and scaling, which vanilla PEFT, vLLM, TGI and LoRAX load; a task's mean update is one LoRA of rank
  ``N * r``, or its SVD truncation;
* IA3 experts: a PEFT IA3 adapter with ``l = sum_n p_n l_n`` (linear in ``l``, so the mean routing's merged expert
  is the mean update);
* bottleneck adapter experts: no PEFT method is one, so a SMEAR adapter with one expert and ``routing="single"``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from peft import IA3Config, LoraConfig, PeftConfig

from ..core.experts import ExpertKind
from ..core.smear import merge_parameters
from ..core.types import Params


class KindExport:
    """How one expert kind's merged expert is exported."""

    exported_as: ClassVar[str]
    """What :meth:`weights` and :meth:`config` make, for messages (``"a LoRA adapter"``)."""

    mean_update: ClassVar[str | None] = None
    """How a task's *mean update* (the average of its examples' own merged experts, ``form="mean_update"``) is
    written: ``"low_rank"``, by :meth:`mean_update_weights`; ``"mean_routing"``, as the merged expert of the task's
    mean routing, which is the mean update exactly for a kind linear in its parameters; ``None``: no adapter with one
    expert is the mean update (a nonlinear expert), and that form is refused."""

    def weights(self, kind: ExpertKind, params: Params, distribution: torch.Tensor) -> dict[str, torch.Tensor]:
        """The merged expert of one fixed ``distribution [N]`` as the exported adapter's weights of this module, by
        key suffix (the exported model's key is ``base_model.model.<module>.<suffix>``)."""
        raise NotImplementedError

    def config(
        self, config: Any, modules: Mapping[str, ExpertKind], fan_in_fan_out: bool, rank: int | None = None
    ) -> PeftConfig:
        """The config of the adapter :meth:`weights` writes, for these wrapped ``modules`` (by name);
        ``fan_in_fan_out``: some of them are GPT-2 style ``Conv1D``; ``rank``: the rank of what
        :meth:`mean_update_weights` wrote, when it wrote the weights."""
        raise NotImplementedError

    def mean_update_weights(
        self, params: Params, second_moment: torch.Tensor, rank: int | None
    ) -> tuple[dict[str, torch.Tensor], float]:
        """For ``"low_rank"`` kinds: a task's mean update from the second moment of its routing ``E[p p^T] [N, N]``
        (exact when ``rank`` is ``None``, else truncated to ``rank``), and the share of its energy kept."""
        raise NotImplementedError

    def mean_routing_gap(self, params: Params, mean: torch.Tensor, second_moment: torch.Tensor) -> float:
        """How far the mean routing's merged expert is from the task's mean update (0 where they coincide)."""
        return 0.0

    def delta_weight(self, kind: ExpertKind, params: Params, distribution: torch.Tensor) -> torch.Tensor | None:
        """The merged expert of one fixed ``distribution [N]`` as an update of the wrapped module's weight,
        ``[out, in]`` (what PEFT's ``convert_to_lora`` factorises), or ``None`` for a kind that is no weight update."""
        return None


def exported_config_fields(config: Any, modules: Mapping[str, Any]) -> dict[str, Any]:
    """What every exported adapter's config shares: exactly the wrapped modules, the head, the task and base model."""
    return {
        "target_modules": sorted(modules),
        "modules_to_save": config.modules_to_save,
        "task_type": config.task_type,
        "base_model_name_or_path": config.base_model_name_or_path,
        "revision": config.revision,
    }


class LoraExport(KindExport):
    exported_as = "a LoRA adapter"
    mean_update = "low_rank"

    def weights(self, kind: ExpertKind, params: Params, distribution: torch.Tensor) -> dict[str, torch.Tensor]:
        lora_A, lora_B = params["smear_lora_A"], params["smear_lora_B"]
        merged_A, merged_B = merge_parameters((lora_A, lora_B), distribution[None], lora_A.dtype)
        return {"lora_A.weight": merged_A[0], "lora_B.weight": merged_B[0]}

    def config(
        self, config: Any, modules: Mapping[str, ExpertKind], fan_in_fan_out: bool, rank: int | None = None
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

    def mean_update_weights(
        self, params: Params, second_moment: torch.Tensor, rank: int | None
    ) -> tuple[dict[str, torch.Tensor], float]:
        A, B, energy = mean_update_lora(params["smear_lora_A"], params["smear_lora_B"], second_moment, rank)
        return {"lora_A.weight": A, "lora_B.weight": B}, energy

    def mean_routing_gap(self, params: Params, mean: torch.Tensor, second_moment: torch.Tensor) -> float:
        return mean_routing_gap(params["smear_lora_A"], params["smear_lora_B"], mean, second_moment)

    def delta_weight(self, kind: ExpertKind, params: Params, distribution: torch.Tensor) -> torch.Tensor:
        merged = self.weights(kind, params, distribution)
        return merged["lora_B.weight"] @ merged["lora_A.weight"] * kind.scaling


class IA3Export(KindExport):
    exported_as = "an IA3 adapter"
    mean_update = "mean_routing"  # E_b[l(p_b)] = l(E_b[p_b]): the mean routing's merged expert is the mean update

    def weights(self, kind: ExpertKind, params: Params, distribution: torch.Tensor) -> dict[str, torch.Tensor]:
        """PEFT IA3's ``ia3_l``: ``[1, in]`` for an input-scaling (feed-forward) module, ``[out, 1]`` otherwise."""
        (merged,) = merge_parameters([params["smear_ia3_l"]], distribution[None], params["smear_ia3_l"].dtype)
        vector = merged[0]
        return {"ia3_l": vector[None] if kind.scales_input else vector[:, None]}

    def config(
        self, config: Any, modules: Mapping[str, ExpertKind], fan_in_fan_out: bool, rank: int | None = None
    ) -> IA3Config:
        return IA3Config(
            feedforward_modules=sorted(name for name, kind in modules.items() if kind.scales_input),
            fan_in_fan_out=fan_in_fan_out,
            **exported_config_fields(config, modules),
        )


class AdapterExport(KindExport):
    exported_as = "a single-expert SMEAR adapter"

    def weights(self, kind: ExpertKind, params: Params, distribution: torch.Tensor) -> dict[str, torch.Tensor]:
        """One expert of a single-expert SMEAR adapter: the merged parameters, with an expert dimension of 1."""
        parameters = [params[name] for name in kind.names]
        merged = merge_parameters(parameters, distribution[None], parameters[0].dtype)
        return dict(zip(kind.names, merged, strict=True))

    def config(
        self, config: Any, modules: Mapping[str, ExpertKind], fan_in_fan_out: bool, rank: int | None = None
    ) -> PeftConfig:
        """No PEFT method is a bottleneck adapter, so the export is a SMEAR adapter with one expert and
        ``routing="single"``: no router, the cost of one adapter, loadable wherever ``peft_smear`` is imported."""
        options = ("adapter_width", "adapter_reduction_factor", "adapter_activation", "adapter_layer_norm")
        return type(config)(
            expert_type="adapter",
            routing="single",
            **{option: getattr(config, option) for option in options},
            **exported_config_fields(config, modules),
        )


KIND_EXPORTS: dict[str, KindExport] = {"lora": LoraExport(), "ia3": IA3Export(), "adapter": AdapterExport()}
"""How each exportable expert kind is written, by ``SmearConfig.expert_type``."""


def register_kind_export(expert_type: str, export: KindExport) -> None:
    """Make the merged experts of ``expert_type`` (a registered expert kind) exportable by ``export``."""
    KIND_EXPORTS[expert_type] = export


def kind_export(expert_type: str) -> KindExport:
    """How ``expert_type``'s merged expert is exported; a kind without one is refused, naming what to do."""
    if expert_type not in KIND_EXPORTS:
        raise ValueError(
            f"expert_type={expert_type!r} has no export: peft_smear.export.kinds.register_kind_export(expert_type, "
            "export) says how its merged expert is written as an adapter."
        )
    return KIND_EXPORTS[expert_type]


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
    LoRA's scaling is the experts' own (the exported config keeps ``lora_alpha / r``, see :meth:`LoraExport.config`).
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
