"""What the test files share: every test starts from the same seed, parameters are counted one
way, and weight-copy tests randomise vector parameters so that a missed copy cannot pass.

The builders that put our weights into PyTorch's own modules live in the package
(`transformer_from_scratch.reference`), where the notebooks and the benchmarks use them too.
"""

import pytest
import torch
from torch import nn


@pytest.fixture(autouse=True)
def seeded():
    """Every test starts from torch.manual_seed(0), whatever ran before it."""
    torch.manual_seed(0)


@pytest.fixture
def num_params():
    """Count a module's parameters: num_params(module) -> int."""

    def count(module: nn.Module) -> int:
        return sum(p.numel() for p in module.parameters())

    return count


@pytest.fixture
def randomize_vectors():
    """Give every bias and norm parameter (fresh ones are 0 and 1) random values, in place."""

    def randomize(module: nn.Module, std: float = 0.3) -> nn.Module:
        with torch.no_grad():
            for p in module.parameters():
                if p.dim() == 1:
                    p.normal_(std=std)
        return module

    return randomize


@pytest.fixture
def assert_decoder_parity():
    """Run our decoder (block or stack) and PyTorch's on the same padded batch, float64, with a
    causal and padded target and a padded source; assert equal outputs, input gradients and
    parameter gradients."""
    from torch.testing import assert_close

    from transformer_from_scratch.masks import causal_mask
    from transformer_from_scratch.masks import padding_mask
    from transformer_from_scratch.reference import torch_parameter

    def check(ours: nn.Module, theirs: nn.Module, tgt_lengths, src_lengths, d_model: int):
        T, T_src, B = max(tgt_lengths), max(src_lengths), len(tgt_lengths)
        causal, tgt_pad = causal_mask(T), padding_mask(tgt_lengths, T)
        src_pad = padding_mask(src_lengths, T_src)
        x, enc_out, upstream = (
            torch.randn(B, t, d_model, dtype=torch.float64) for t in (T, T_src, T)
        )
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ea, eb = enc_out.clone().requires_grad_(), enc_out.clone().requires_grad_()
        ya = ours(xa, ea, self_mask=causal & tgt_pad, cross_mask=src_pad)
        yb = theirs(
            xb,
            eb,
            tgt_mask=~causal[0, 0],
            tgt_key_padding_mask=~tgt_pad[:, 0, 0],
            memory_key_padding_mask=~src_pad[:, 0, 0],
        )
        assert_close(ya, yb)
        (ya * upstream).sum().backward()
        (yb * upstream).sum().backward()
        assert_close(xa.grad, xb.grad)
        assert_close(ea.grad, eb.grad)
        for name, p in ours.named_parameters():
            param, rows = torch_parameter(theirs, name)
            assert_close(p.grad, param.grad[rows], msg=name)

    return check
