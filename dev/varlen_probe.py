"""Where a packed-batch forward differs from the dense call: per sequence, per 16-row block."""
import sys
import torch
import flash3

torch.manual_seed(0)
for (b, s, causal, d) in [(1, 200, True, 128), (3, 200, True, 128), (3, 200, False, 128), (2, 3000, True, 128),
                          (2, 3000, False, 128), (3, 256, True, 128), (3, 256, False, 128)]:
    h, hk = 4, 2
    q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, s, hk, d, device="cuda", dtype=torch.bfloat16)
    out_d, lse_d = flash3.attention(q, k, v, causal=causal, return_lse=True)
    cu = torch.arange(0, b * s + 1, s, dtype=torch.int32, device="cuda")
    out_v, lse_v = flash3.attention_varlen(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu, s, s,
                                           causal=causal, return_lse=True)
    out_v = out_v.view(b, s, h, d)
    lse_v = lse_v.view(h, b, s).transpose(0, 1)
    err = (out_v.float() - out_d.float()).abs().amax(dim=(2, 3))  # (b, s)
    lerr = (lse_v - lse_d).abs().amax(dim=1)  # (b, s)
    print(f"b{b} s{s} causal={causal}: max out err {err.max().item():.3e}, lse err {lerr.max().item():.3e}")
    for bi in range(b):
        blocks = [f"{err[bi, r:r + 16].max().item():.1e}" for r in range(0, s, 16)]
        lb = [f"{lerr[bi, r:r + 16].max().item():.1e}" for r in range(0, s, 16)]
        print(f"  seq {bi} out per 16 rows: {' '.join(blocks[:20])}")
        print(f"  seq {bi} lse per 16 rows: {' '.join(lb[:20])}")
    sys.stdout.flush()
