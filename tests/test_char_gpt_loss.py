"""The demo models' loss: cross-entropy over the logits in fp32 at least, whatever dtype the model computes in."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from het_strategy.demo.char_gpt import CharGPT  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_logits_give_the_fp32_loss_of_their_values(dtype):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(4, 8, 256, generator=g) * 4).to(dtype).requires_grad_()
    y = torch.randint(0, 256, (4, 8), generator=g)
    loss = CharGPT.pipeline_loss(logits, y)
    assert loss.dtype == torch.float32
    want = torch.nn.functional.cross_entropy(logits.detach().float().reshape(-1, 256), y.reshape(-1))
    assert float(loss.detach()) == float(want)
    half = torch.nn.functional.cross_entropy(logits.detach().reshape(-1, 256), y.reshape(-1))
    assert float(half) != float(want)  # taken in the logits' own dtype it rounds
    loss.backward()
    assert logits.grad is not None and logits.grad.dtype == dtype


def test_float64_logits_stay_float64():
    logits = torch.randn(2, 3, 16, dtype=torch.float64)
    assert CharGPT.pipeline_loss(logits, torch.zeros(2, 3, dtype=torch.long)).dtype == torch.float64
