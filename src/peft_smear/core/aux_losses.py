"""Auxiliary losses that train under reentrant gradient checkpointing.

A router's auxiliary loss (SMEAR's load balancing, DSelect-k's entropy) is computed inside its layer. Reentrant
checkpointing (torch's default, used by PEFT's ``prepare_model_for_kbit_training`` unless told otherwise) runs the
layer without autograd in the forward pass and again, with autograd, during backward: the loss computed in the
forward has no graph, so adding it to the model's loss would train nothing. As Megatron-LM does for its MoE layers
(``MoEAuxLossAutoScaler``), each layer therefore also hangs its auxiliary loss on its own output with an identity
function whose backward hands the loss a gradient: that function is rebuilt when the layer is recomputed, so the
loss trains there too.

Its gradient must be what the model's loss passes on to any term added to it (1, divided by gradient accumulation,
multiplied by a mixed-precision loss scale). So the tuner adds the losses' values to the model's loss through a
probe (:class:`LossGradientProbe`), whose backward, the first to run, records that gradient for the layers' hooks
(:class:`AuxLossHook`). Without checkpointing the losses join the model's loss with their graph as usual and the
probe is left out: the hooks then give the losses no gradient of their own.
"""

from __future__ import annotations

import torch


class AuxLossHook(torch.autograd.Function):
    """``output`` unchanged; in backward, the auxiliary loss ``aux_loss`` gets the gradient held in ``scale`` (a 0-d
    tensor the probe fills; zero unless the probe ran)."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.scale = scale  # read in backward, once the probe has filled it: never saved, so its version is free
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        return grad_output, ctx.scale.detach().clone(), None


class LossGradientProbe(torch.autograd.Function):
    """``value`` (the auxiliary losses' sum, without a graph) as a term of the model's loss; in backward, the gradient
    that term receives is written into ``scale`` for the layers' hooks. ``anchor`` is a fresh leaf that requires
    grad, so that backward runs at all."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, value: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.scale = scale
        return value.detach().clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[None, None, None]:
        ctx.scale.copy_(grad.reshape(()).to(ctx.scale.device, ctx.scale.dtype))
        return None, None, None


def in_backward() -> bool:
    """Whether autograd is running a backward pass now: gradient checkpointing re-runs layer forwards there."""
    return torch._C._current_graph_task_id() != -1


def hook_aux_loss(output: torch.Tensor, aux_loss: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``output``, carrying ``aux_loss`` into backward (see :class:`AuxLossHook`)."""
    return AuxLossHook.apply(output, aux_loss, scale.to(aux_loss.device))


def probe_for(loss: torch.Tensor, aux_value: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The term to add to ``loss`` for the auxiliary losses whose value is ``aux_value`` (see
    :class:`LossGradientProbe`)."""
    anchor = torch.zeros((), device=loss.device, requires_grad=True)
    return LossGradientProbe.apply(anchor, aux_value.to(loss.device, loss.dtype), scale)
