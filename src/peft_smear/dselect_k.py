# TEMPORARY STUB (not to be committed): replaced by the helper's module.
import math
import torch


def dselect_k_num_bits(n):
    return max(1, math.ceil(math.log2(n)))


def smooth_step(t, gamma):
    t = t.float()
    y = -2 / gamma**3 * t**3 + 3 / (2 * gamma) * t + 0.5
    return torch.where(t <= -gamma / 2, torch.zeros_like(y), torch.where(t >= gamma / 2, torch.ones_like(y), y))


def dselect_k_gate(selector_logits, selector_weights_logits, num_experts, gamma):
    b, k, m = selector_logits.shape
    z = smooth_step(selector_logits, gamma)
    codes = torch.tensor([[(i >> j) & 1 for j in range(m)] for i in range(num_experts)], dtype=torch.float32)
    r = torch.prod(torch.where(codes.bool(), z.unsqueeze(2), 1 - z.unsqueeze(2)), dim=-1)
    r = r / r.sum(-1, keepdim=True).clamp_min(1e-12)
    w = (selector_weights_logits.float().softmax(-1).unsqueeze(-1) * r).sum(1)
    return w, r


def dselect_k_entropy(r):
    return -(r * r.clamp_min(1e-12).log()).sum(-1).mean()
