"""Checks that need CUDA (skipped without a GPU): the compiled chunked-logprob math that only GPUs run."""

import pytest
import torch

import policy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("with_entropy", [False, True])
def test_compiled_chunk_math_equals_eager_in_bf16(with_entropy):
    torch.manual_seed(0)
    rows, vocab, temperature = 300, 151936, 0.8
    logits = (torch.randn(rows, vocab, device="cuda") * 4).bfloat16()
    targets = torch.randint(0, vocab, (rows,), device="cuda")
    banned = torch.tensor([vocab - 2, vocab - 1], device="cuda")  # a vision model's placeholders; no target is one
    targets[targets >= vocab - 2] = 0
    eager = policy._chunk_forward(logits.clone(), targets, temperature, with_entropy, banned)
    compiled = policy._compiled(policy._chunk_forward)(logits.clone(), targets, temperature, with_entropy, banned)
    for name, a, b in zip(["logprob", "lse", "entropy"], eager, compiled):
        if a is not None:
            torch.testing.assert_close(b, a, atol=5e-4, rtol=1e-5, msg=name)
    entropy = eager[2]
    grad_logprob = torch.randn(rows, 1, device="cuda")
    grad_entropy = torch.randn(rows, 1, device="cuda") if with_entropy else None
    g_eager = policy._chunk_grad(logits.clone(), targets, eager[1], entropy, grad_logprob, grad_entropy, temperature,
                                 banned)
    g_compiled = policy._compiled(policy._chunk_grad)(logits.clone(), targets, eager[1], entropy, grad_logprob,
                                                      grad_entropy, temperature, banned)
    assert g_compiled.dtype == torch.bfloat16
    assert not g_compiled[:, banned].any()
    torch.testing.assert_close(g_compiled.float(), g_eager.float(), atol=1e-3, rtol=1e-2)


def test_chunked_head_bf16_on_gpu_matches_fp32_reference():
    """The whole chunked head on a GPU (compiled math, bf16 matmuls): values and gradients against log_softmax of
    fp32 logits."""
    torch.manual_seed(0)
    hidden = torch.randn(1000, 256, device="cuda").bfloat16().requires_grad_()
    weight = (torch.randn(50000, 256, device="cuda") * 0.05).bfloat16().requires_grad_()
    targets = torch.randint(0, 50000, (1000,), device="cuda")
    no_banned = torch.empty(0, dtype=torch.long, device="cuda")
    out = policy._ChunkedChosenLogprobs.apply(hidden, weight, targets, 1.0, 256, False, no_banned)
    out[:, 0].sum().backward()
    hidden32, weight32 = hidden.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    ref = torch.log_softmax(hidden32 @ weight32.T, -1).gather(1, targets[:, None]).squeeze(1)
    ref.sum().backward()
    torch.testing.assert_close(out[:, 0], ref, atol=2e-2, rtol=1e-2)  # bf16 logits
    torch.testing.assert_close(hidden.grad.float(), hidden32.grad, atol=1e-2, rtol=2e-2)
    torch.testing.assert_close(weight.grad.float(), weight32.grad, atol=1e-2, rtol=2e-2)
