"""The mask policies' tile arithmetic (csrc/flash3/mask.h) against brute force, on the
host: tests/cpp/mask_policy_check.cu, compiled with nvcc (no GPU needed)."""
from host_check import needs_nvcc, run_host_check


@needs_nvcc
def test_mask_policy_tile_ranges(tmp_path):
    run_host_check("mask_policy_check.cu", tmp_path, "1500")
