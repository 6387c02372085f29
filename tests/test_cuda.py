"""What only a GPU shows: a model on CUDA routes, trains in bf16 and exports (the routing distributions on the CPU, the
experts on the GPU). Skipped without CUDA; ``benchmarks/gpu.py`` is the larger check."""

import pytest
import torch
from peft import PeftModel, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from peft_smear import SmearConfig, export_merged_adapter


pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def tiny_llama() -> LlamaForCausalLM:
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def smear_model(dtype: torch.dtype) -> torch.nn.Module:
    config = SmearConfig(r=4, num_experts=3, target_modules=["q_proj", "v_proj"], init_weights=False)
    return get_peft_model(tiny_llama().to(device="cuda", dtype=dtype), config)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_cuda_model_trains_with_finite_gradients(dtype):
    model = smear_model(dtype)
    input_ids = torch.randint(1, 128, (2, 12), device="cuda")
    labels = input_ids.clone()
    labels[:, :4] = -100  # the prompt the routers read
    loss = model(input_ids=input_ids, labels=labels).loss
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert torch.isfinite(loss)
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


def test_export_from_a_cuda_model_matches_its_routed_expert(tmp_path):
    model = smear_model(torch.float32).eval()
    input_ids = torch.randint(1, 128, (1, 12), device="cuda")
    export_merged_adapter(model, tmp_path / "task", routing=[{"input_ids": input_ids}])
    with torch.no_grad():
        routed = model(input_ids=input_ids).logits
    exported = PeftModel.from_pretrained(tiny_llama().cuda(), tmp_path / "task").eval()
    with torch.no_grad():
        plain = exported(input_ids=input_ids).logits
    torch.testing.assert_close(plain, routed, atol=1e-4, rtol=1e-4)
