"""The gated activation of one EMoE layer: avg-k gating of the FFN's neuron groups, per token.

:class:`EmoeGate` takes the place of the FFN's activation module. It receives the first layer's output ``h = x K^T
+ b`` (for Llama, ``gate_proj``'s), so the score of expert ``i`` is computed from it, not from a stored gate:
``mean_{j in E_i} (h_j - b_j) = x . mean_{j in E_i} K_j = x . G_i`` (the paper's eqs. 4 and 6). The gate is thus
tied to the *current* keys, with no parameter of its own: full fine-tuning moves it, and so does a LoRA (or SMEAR)
adapter on the FFN's first layer, whose update is part of ``h``. The activations of the neurons outside each
token's top-k experts are zeroed after the activation, so every activation function works, and for Llama the
masked ``act(gate) * up`` products are zero too. The base weights are never permuted: the partition is an index
buffer kept out of every ``state_dict``, which is why adapters move freely between the EMoE and the dense model.
"""

from __future__ import annotations

import torch
from torch import nn


class EmoeGate(nn.Module):
    """``activation(h)`` with the activations of each token's unselected experts set to zero.

    ``group_of[j]``: the expert of neuron ``j``; ``key_layer``: the FFN's first layer (its base layer, never an
    adapter wrapper), whose current bias is subtracted from ``h`` so that the score is ``x . G`` as in the paper; it
    is held in a list, not registered, so it stays out of this module's parameters but follows ``deepcopy``. With
    ``record=True`` the last selection is kept as ``last_selection`` (``[..., num_experts]`` bool) for analysis.

    ``learned_from_keys`` (``[d_ff, hidden]``) makes it the paper's EMoE-learn ablation: a trainable gate
    ``weight`` ``[N, hidden]``, initialised at the experts' mean keys, scores the FFN's input ``x`` (read by a
    pre-hook on the first layer); the selected experts' activations are scaled by ``k p_i / sum_selected p`` with
    ``p = softmax(x W^T)`` (fp32), as a learned top-k gate weighs its experts (the scale averages 1), so the gate
    gets a gradient.
    """

    def __init__(
        self,
        activation: nn.Module,
        group_of: torch.Tensor,
        num_experts: int,
        top_k: int,
        key_layer: nn.Module,
        ffn_name: str,
        learned_from_keys: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.activation = activation
        self.num_experts, self.top_k, self.ffn_name = num_experts, top_k, ffn_name
        self.register_buffer("group_of", group_of.to(torch.long), persistent=False)
        # Neurons sorted by expert: h[..., order] viewed as [..., N, d/N] gives each expert's neurons.
        self.register_buffer("order", torch.argsort(group_of, stable=True).to(torch.long), persistent=False)
        self._key_layer = [key_layer]
        self.record = False
        self.last_selection: torch.Tensor | None = None
        self.weight: nn.Parameter | None = None
        if learned_from_keys is not None:  # [d_ff, hidden]
            grouped = learned_from_keys.detach().float()[self.order].unflatten(0, (num_experts, self.expert_size))
            self.weight = nn.Parameter(grouped.mean(dim=1))
            self._input: torch.Tensor | None = None
            self._hook = key_layer.register_forward_pre_hook(self._keep_input)

    def detach_from_key_layer(self) -> None:
        """Remove the learned gate's input hook (when the gate is removed)."""
        if self.weight is not None:
            self._hook.remove()

    def _keep_input(self, module: nn.Module, args: tuple) -> None:
        self._input = args[0]

    @property
    def expert_size(self) -> int:
        return self.group_of.numel() // self.num_experts

    def scores(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., num_experts]`` avg-k gate scores ``x . G_i`` (fp32) from the first layer's output."""
        hidden = hidden.float()
        bias = getattr(self._key_layer[0], "bias", None)
        if bias is not None:
            hidden = hidden - bias.float()
        grouped = hidden[..., self.order].unflatten(-1, (self.num_experts, self.expert_size))
        return grouped.mean(dim=-1)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        activated = self.activation(hidden)
        if self.weight is not None:
            return activated * self._learned_scale(activated.dtype)
        with torch.no_grad():  # the selection is a hard 0/1 gate: no gradient flows through it (paper eq. 5)
            top = self.scores(hidden).topk(self.top_k, dim=-1).indices
            mask = self._select(top)[..., self.group_of].to(activated.dtype)
        return activated * mask

    def _select(self, top: torch.Tensor) -> torch.Tensor:
        selection = torch.zeros(*top.shape[:-1], self.num_experts, dtype=torch.bool, device=top.device)
        selection.scatter_(-1, top, True)
        if self.record:
            self.last_selection = selection
        return selection

    def _learned_scale(self, dtype: torch.dtype) -> torch.Tensor:
        """``[..., d_ff]``: ``k p_i / sum_selected p`` on the neurons of selected experts, 0 elsewhere."""
        x, self._input = self._input, None
        if x is None:
            raise RuntimeError(f"The learned EMoE gate of {self.ffn_name} did not see its FFN's input.")
        probabilities = torch.softmax(x.float() @ self.weight.float().T, dim=-1)
        top = probabilities.topk(self.top_k, dim=-1)
        kept = torch.zeros_like(probabilities).scatter(-1, top.indices, top.values)
        with torch.no_grad():
            self._select(top.indices)
        weights = self.top_k * kept / top.values.sum(dim=-1, keepdim=True)
        return weights[..., self.group_of].to(dtype)

    def extra_repr(self) -> str:
        learned = ", learned gate" if self.weight is not None else ""
        return f"ffn={self.ffn_name!r}, num_experts={self.num_experts}, top_k={self.top_k}{learned}"
