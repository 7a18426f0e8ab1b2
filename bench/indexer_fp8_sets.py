"""How often the FP8 index-K cache changes the top-16 *set*: naive reference (float64) on bf16 keys vs the
same keys in the authority's e4m3 (scale 1), N(0, 1) data, CPU only: ``python3 bench/indexer_fp8_sets.py``."""

import torch

from mm3_compile import platform
from mm3_compile.kernels.indexer.naive import index_topk_ref

torch.manual_seed(0)
fp8 = platform.platform_for(torch.device("cpu")).kv_e4m3_dtype
for B, q_len, seq, H in ((32, 1, 32768, 4), (32, 1, 32768, 1), (1, 512, 8192, 4)):
    nb = seq // 128
    k = torch.randn(B * nb, 128, 128).to(torch.bfloat16)
    q = torch.randn(B * q_len, H, 128).to(torch.bfloat16)
    table = torch.randperm(B * nb).to(torch.int32).view(B, nb)
    cu = torch.arange(B + 1, dtype=torch.int32) * q_len
    sl = torch.full((B,), seq, dtype=torch.int32)
    a = index_topk_ref(q, k, table, cu, sl, 16, 0, 1)
    b = index_topk_ref(q, k.to(fp8), table, cu, sl, 16, 0, 1)
    rows = (a.sort(-1).values != b.sort(-1).values).any(-1)
    missing = (b[..., :, None] != a[..., None, :]).all(-1).sum().item()
    print(
        f"B{B} q{q_len} s{seq} Hidx{H}: {int(rows.sum())}/{rows.numel()} rows differ ({100 * rows.float().mean():.1f}%), "
        f"{missing / rows.numel():.2f} of 16 ids differ per row"
    )
