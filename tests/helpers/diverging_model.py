"""A GPT whose ranks take different paths: rank ``skip_rank`` leaves block 1 out at step
``skip_step`` (diagnosis/test_debug_mode.py; HSDP's debug case in runtime/test_hsdp.py)."""

from __future__ import annotations

import torch

from matrixfsdp.train.models import GPT, GPTConfig

CFG = GPTConfig(d_model=16, n_heads=2, n_layers=3, d_mlp=24, seq_len=8)


class SkippingGPT(GPT):
    """Rank ``skip_rank`` leaves block 1 out at step ``skip_step``: divergent control flow."""

    skip_rank, skip_step, step = -1, -1, 0

    def forward(self, idx):
        x = self.embed(idx) + self.pos(torch.arange(idx.shape[1]))
        for i, block in enumerate(self.layers):
            skip = i == 1 and self.step == self.skip_step and \
                torch.distributed.get_rank() == self.skip_rank
            if not skip:
                x = block(x)
        return self.head(self.norm(x))


def train_until_error(model, opt, steps=4) -> str:
    """Train ``model`` (a :class:`SkippingGPT`) on one batch; the error message, or "no error"."""
    x = torch.randint(0, 256, (2, 9))
    try:
        for step in range(steps):
            model.step = step
            model.loss(x[:, :-1], x[:, 1:]).backward()
            opt.step()
            opt.zero_grad()
    except RuntimeError as e:
        return str(e)
    return "no error"
