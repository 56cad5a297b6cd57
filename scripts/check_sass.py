"""Dumps the SASS of flash3's compiled module and checks that each forward and backward
kernel holds the instructions the design promises:

  HGMMA        warpgroup MMA (WGMMA) for every GEMM
  UTMALDG      TMA loads of Q, K, V (backward: also dO, lse, dPsum)
  USETMAXREG   setmaxnreg register reallocation between producer and consumers
  SYNCS        mbarrier waits and arrivals of the TMA pipelines
  BAR.SYNC / BAR.ARV   named barriers: forward, pingpong scheduling of the consumer
               warpgroups; backward, the P/dS hand-over between them (BAR.SYNC only)

The FP8 kernels (flash_fwd_kernel with KernelTraitsFp8) need QGMMA (FP8 WGMMA) instead of HGMMA, and the
in-shared-memory V transpose: LDSM.16.MT88 (ldmatrix .trans) and STSM.16.M88 (stmatrix).
Kernels built without pingpong (NO_PINGPONG, NO_PINGPONG_FP8) need no named barriers.

and no local-memory traffic (LDL/STL: register spills or a register array indexed at run
time), except the few known ones listed in KNOWN_BWD_SPILLS / KNOWN_FP8_SPILLS. Exits
non-zero when a kernel misses one. Uses cuobjdump from the CUDA toolkit or from Triton's
wheel.

EX2|GEMM (shown, not required): the most exponentials (MUFU.EX2) between a wait that
leaves one WGMMA group in flight (WARPGROUP.DEPBAR.LE gsb0, 0x1) and the next wait, i.e.
softmax work that runs under a GEMM (forward: under the warpgroup's own O += P V;
backward: under dP = dO V^T). ptxas hoists such waits above independent math, so it is 0-4
in the forward kernels that leave it to ptxas and a tile's worth or half of one (18-50) in
those that run the softmax under the GEMM on purpose (kSoftmaxUnderPv in
csrc/flash3/traits.h and traits_fp8.h; csrc/flash3/utils.h run_in_own_block).
"""
import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

REQUIRED = ["HGMMA", "UTMALDG", "USETMAXREG", "SYNCS", "BAR.SYNC", "BAR.ARV"]
REQUIRED_BWD = ["HGMMA", "UTMALDG", "USETMAXREG", "SYNCS", "BAR.SYNC"]
FORBIDDEN = ["LDL", "STL"]
# Shown, not required: TMA stores of O (the forward kernels with TileConfig::kTmaStoreO in csrc/flash3/traits.h).
INFO = ["UTMASTG"]
NAMED_BARRIERS = ["BAR.SYNC", "BAR.ARV"]
# (head dim, causal, short-sequence tile) of the 16-bit forward kernels built without
# pingpong (TileConfig::kPingpong in csrc/flash3/traits.h): they have no named barriers.
NO_PINGPONG = {(64, False, True), (64, True, True), (128, False, False), (128, False, True), (256, True, True)}
REQUIRED_FP8 = ["QGMMA", "UTMALDG", "USETMAXREG", "SYNCS", "BAR.SYNC", "BAR.ARV", "LDSM.16.MT88", "STSM.16.M88"]
# The same for the FP8 kernels (TileConfigFp8::kPingpong in csrc/flash3/traits_fp8.h).
NO_PINGPONG_FP8 = {(64, False)}
# Kernels allowed some local-memory instructions: (head dim, causal) -> the most LDL + STL
# accepted, so that the check still fails on any new spill or a larger one. The backward
# reads each CTA's sequence extent at run time (packed batches run the dense kernels):
# the hdim 64 non-causal kernel, at the register limit, kept one value in local memory
# (one store, one load). With the masked query tiles in a loop of their own
# (traits_bwd.h kSeparateMaskedTiles) the hdim 64 kernels keep 5 (non-causal) and 17
# (causal) local-memory instructions and run 1.00-1.05x faster than with one loop (H100,
# docs/performance.md).
KNOWN_BWD_SPILLS = {(64, False): 5, (64, True): 17}
# The FP8 hdim 256 kernels (128-key tiles) need all 240 registers per consumer thread for
# O, S and P. Since the consumers slice their shared-memory descriptors from a warp-uniform
# warpgroup index (mainloop_fwd.h) the causal ones keep nothing in local memory (13 and 9
# LDL + STL before, 26 and 26 earlier still); the persistent short-sequence non-causal
# kernel keeps 11 (4 before), in the producer warpgroup's V transpose (H100 A/B against the
# previous build: 1.03x at 4 x 4096). The spill-free 96-key tile measured 4-21% slower
# (docs/performance.md).
KNOWN_FP8_SPILLS = {(256, False): 11}
# The forward kernels for packed (variable-length) batches, (head dim, causal, short tile)
# -> the most LDL + STL. None: they read each tile's sequence extent at run time, and
# until the masks divided rows by rows_per_query without a branch (mask.h RowsPerQuery)
# the persistent hdim 256 short non-causal kernel and the hdim 64 non-causal kernel kept
# 16 and 34 values' loads and stores in local memory; a new spill there fails the check.
KNOWN_VARLEN_SPILLS: dict = {}
# The local-mask kernels (mask.h LocalMask: windows, softcap, sinks), (kind, head dim) ->
# the most LDL + STL: the hdim 64 backward (128-row query tiles, at the register limit)
# keeps a few values in local memory for softcap's dS factor (0 without that code): 7 + 7.
# (The hdim 256 forward for packed batches kept 3 + 3 until the branch-free division.)
# The persistent FP8 hdim 256 local kernel keeps one 4-byte value there (1 + 1); it ran
# 1.03-1.17x the spill-free one CTA per tile kernel on windows (docs/performance.md).
KNOWN_LOCAL_SPILLS = {("bwd", 64): 16, ("fp8", 256): 2}


def is_local(name: str) -> bool:
    """Kernels of the local mask (FlashFwdKernel / FlashBwdKernel<Traits, LocalMask>)."""
    return "9LocalMask" in name


def is_varlen(name: str) -> bool:
    """flash_fwd_kernel<FlashFwdKernel<Traits, Mask, kVarlen = true>>."""
    return re.search(r"MaskELb1E", name) is not None


def kernel_config(name: str):
    """(head dim, causal) from the mangled name of flash_{fwd,bwd}_kernel<...KernelTraits<E, D, causal>...>
    or flash_fwd_kernel<...KernelTraitsFp8<D, causal, N>...>."""
    match = re.search(r"KernelTraits(?:Fp8I|IN7cutlass\w+?E)Li(\d+)ELb([01])E", name)
    return (int(match.group(1)), match.group(2) == "1") if match else None


def fwd_config(name: str):
    """(head dim, causal, short-sequence tile) from flash_fwd_kernel<...KernelTraits<E, D, causal, short>...>."""
    match = re.search(r"KernelTraitsIN7cutlass\w+?ELi(\d+)ELb([01])ELb([01])E", name)
    return (int(match.group(1)), match.group(2) == "1", match.group(3) == "1") if match else None


def find_cuobjdump():
    found = shutil.which("cuobjdump")
    if found:
        return found
    for candidate in (Path("/usr/local/cuda/bin/cuobjdump"),):
        if candidate.exists():
            return str(candidate)
    try:
        import triton

        candidate = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        if candidate.exists():
            return str(candidate)
    except ImportError:
        pass
    sys.exit("check_sass: no cuobjdump found (CUDA toolkit or Triton's wheel)")


def find_module():
    here = Path(__file__).resolve().parent.parent / "flash3"
    modules = sorted(here.glob("_C*.so"))
    if not modules:
        sys.exit("check_sass: flash3/_C*.so not found; build first (make install)")
    return modules[0]


def split_functions(sass: str):
    """Yields (mangled kernel name, SASS text) per function."""
    parts = re.split(r"^\s+Function : (\S+)\s*$", sass, flags=re.M)
    for i in range(1, len(parts) - 1, 2):
        yield parts[i], parts[i + 1]


def ex2_under_gemm(body: str) -> int:
    """The most MUFU.EX2 between a WARPGROUP.DEPBAR.LE gsb0, 0x1 and the next WARPGROUP.DEPBAR."""
    best, count, inside = 0, 0, False
    for line in body.splitlines():
        if "WARPGROUP.DEPBAR" in line:
            if inside:
                best = max(best, count)
            inside, count = bool(re.search(r"gsb0,\s*0x1\b", line)), 0
        elif inside and "MUFU.EX2" in line:
            count += 1
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--module", type=Path, default=None, help="the .so to check (default: flash3/_C*.so)")
    parser.add_argument("--dump", type=Path, default=None, help="also write the full SASS here")
    args = parser.parse_args()
    module = args.module or find_module()
    sass = subprocess.run([find_cuobjdump(), "--dump-sass", str(module)], check=True, capture_output=True,
                          text=True).stdout
    if args.dump:
        args.dump.parent.mkdir(parents=True, exist_ok=True)
        args.dump.write_text(sass)
    functions = list(split_functions(sass))
    failed = False
    print(f"{'kernel':<60} " + " ".join(f"{r:>10}" for r in REQUIRED + FORBIDDEN + INFO) + "   EX2|GEMM"
          + "  (fp8: LDSM.T STSM)")
    kinds = (("fwd", REQUIRED, lambda n: "flash_fwd_kernel" in n and "KernelTraitsFp8" not in n),
             ("bwd", REQUIRED_BWD, lambda n: "flash_bwd_kernel" in n),
             ("fp8", REQUIRED_FP8, lambda n: "flash_fwd_kernel" in n and "KernelTraitsFp8" in n))
    for kind, required_all, belongs in kinds:
        kernels = [(name, body) for name, body in functions if belongs(name)]
        kind_failed = False
        for name, body in kernels:
            counts = {r: len(re.findall(rf"\b{re.escape(r)}", body)) for r in REQUIRED + REQUIRED_FP8 + FORBIDDEN + INFO}
            if kind == "fp8":
                counts["HGMMA"] = counts["QGMMA"]  # shown in the HGMMA column
            if kind == "fwd":
                without_pingpong = fwd_config(name) in NO_PINGPONG
            else:
                without_pingpong = kind == "fp8" and kernel_config(name) in NO_PINGPONG_FP8
            required = [r for r in required_all if not (r in NAMED_BARRIERS and without_pingpong)]
            local = sum(counts[f] for f in FORBIDDEN)
            allowed = {"bwd": KNOWN_BWD_SPILLS, "fp8": KNOWN_FP8_SPILLS}.get(kind, {}).get(kernel_config(name), 0)
            varlen = kind == "fwd" and is_varlen(name)
            if varlen:
                allowed = KNOWN_VARLEN_SPILLS.get(fwd_config(name), 0)
            if is_local(name):
                allowed = KNOWN_LOCAL_SPILLS.get((kind, kernel_config(name)[0]), 0)
            under_gemm = ex2_under_gemm(body)
            ok = all(counts[r] > 0 for r in required) and local <= allowed
            kind_failed |= not ok
            if kind == "fp8":
                short = "fp8:" + re.sub(r"^_ZN6flash316flash_fwd_kernelINS_14FlashFwdKernelINS_15KernelTraitsFp8I",
                                        "", name)[:54]
            else:
                short = kind + ":" + re.sub(r"^_ZN6flash316flash_\w+?_kernelINS_\d+Flash\w+?KernelINS_\d+\w*?KernelTraitsIN7cutlass",
                                            "", name)[:54]
            extra = f"  {counts['LDSM.16.MT88']} {counts['STSM.16.M88']}" if kind == "fp8" else ""
            note = ("  varlen" if varlen else "") + ("  local" if is_local(name) else "") + ("" if ok else "  FAIL")
            if ok and local:
                note += f"  known spill (<= {allowed})"
            print(f"{short:<60} " + " ".join(f"{counts[r]:>10}" for r in REQUIRED + FORBIDDEN + INFO)
                  + f" {under_gemm:>10}" + extra + note)
        print(f"{len(kernels)} {kind} kernels checked: {'FAIL' if kind_failed else 'ok'}")
        failed |= kind_failed
    if not any(belongs(name) for name, _ in functions for _k, _r, belongs in kinds):
        sys.exit(f"check_sass: no flash3 kernel in {module}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
