from __future__ import annotations

import pytest
import torch

from moemesh.shared.kernels.v4_indexer import _index_scores_kernel, index_scores, index_scores_ref
from tests.kernels.cases import DEVICE_DTYPES, launches, randn


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("R,nh,width,per_block,nb", [(1, 16, 16, 4, 3), (7, 3, 20, 1, 40), (5, 64, 128, 32, 5)])
def test_matches_reference(force_triton, device, dtype, R, nh, width, per_block, nb):
    force_triton(device)
    g = torch.Generator().manual_seed(R)
    blocks = nb + 4
    q = randn(R, nh, width, dtype=torch.float32, device=device, seed=0)
    wts = randn(R, nh, dtype=torch.float32, device=device, seed=1) * nh ** -0.5
    main = randn(blocks, per_block * width + 9, dtype=dtype, device=device, seed=2)
    keys = main[:, 9:].view(blocks, per_block, width)  # a strided view, as the cache holds them
    table = torch.stack([torch.randperm(blocks, generator=g)[:nb] for _ in range(R)]).to(device)
    visible = torch.randint(0, nb * per_block + 1, (R,), generator=g).to(device)
    with launches(_index_scores_kernel):
        got = index_scores(q, wts, keys, table, visible, nb * per_block)
    want = index_scores_ref(q, wts, keys, table, visible, nb * per_block)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
