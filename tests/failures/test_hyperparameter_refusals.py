"""Non-finite and out-of-range hyperparameters are refused wherever torch refuses them
(torch.optim.Muon's and torch.optim.AdamW's own checks, option by option)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import matrixfsdp as mf

NAN, INF = float("nan"), float("inf")
HYPER = [(True, dict(lr=v)) for v in (NAN, INF, -INF, -1.0)] \
    + [(True, dict(momentum=v)) for v in (NAN, INF, -1.0)] \
    + [(True, dict(weight_decay=v)) for v in (NAN, INF, -1.0)] \
    + [(False, dict(lr=v)) for v in (NAN, INF, -INF)] \
    + [(False, dict(eps=v)) for v in (NAN, INF, -1.0)] \
    + [(False, dict(weight_decay=v)) for v in (NAN, INF, -1.0)] \
    + [(False, dict(betas=b)) for b in ((NAN, 0.9), (0.9, NAN), (INF, 0.9), (0.9, 1.0))]


@pytest.mark.parametrize("use_muon,kw", HYPER, ids=[f"{'muon' if m else 'adamw'}-{kw}" for m, kw in HYPER])
def test_hyperparameters_refused_exactly_where_torch_refuses(use_muon, kw):
    def raises(build) -> bool:
        try:
            build()
        except ValueError:
            return True
        return False

    torch_cls = torch.optim.Muon if use_muon else torch.optim.AdamW
    shape = (4, 4) if use_muon else (4,)
    theirs = raises(lambda: torch_cls([nn.Parameter(torch.zeros(shape))], **kw))
    ours = raises(lambda: mf.Muon([dict(params=[nn.Parameter(torch.zeros(shape))],
                                        use_muon=use_muon, **kw)]))
    assert ours == theirs, f"torch {'refuses' if theirs else 'accepts'} {kw}, matrixfsdp does not"
    if any(isinstance(v, float) and math.isnan(v) for v in (*kw.values(), *kw.get("betas", ()))):
        assert theirs, f"torch accepts {kw}"  # the premise: torch refuses NaN
