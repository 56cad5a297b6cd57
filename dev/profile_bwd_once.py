"""One forward + backward of flash3 at (hdim, causal, seqlen) on the paper grid's shape, for ncu:
  ncu --clock-control none --kernel-name regex:flash_bwd_kernel --launch-skip 1 --launch-count 1 \
      --metrics lts__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sectors_op_red.sum,... \
      python dev/profile_bwd_once.py 256 0 16384"""
import sys
sys.path.insert(0, "benchmarks")
import torch, flash3, bench_attention as B
hdim, causal, s = int(sys.argv[1]), bool(int(sys.argv[2])), int(sys.argv[3])
b, nh = B.config_shape(hdim, s)
q, k, v, g = B.make_inputs(b, s, nh, hdim, torch.bfloat16, requires_grad=True)
for _ in range(2):
    out = flash3.attention(q, k, v, causal=causal)
    torch.autograd.grad(out, (q, k, v), g)
torch.cuda.synchronize()
