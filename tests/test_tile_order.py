"""The persistent forward kernels' tile orders (csrc/flash3/scheduler.h, scheduler_tail.h:
the snake, pairs, the dealt tail) on the host: every tile visited once, and pairs where
the host's model finds the snake unbalanced. tests/cpp/tile_order_check.cu, compiled with
nvcc (no GPU needed)."""
from host_check import needs_nvcc, run_host_check


@needs_nvcc
def test_tile_orders_visit_every_tile_once(tmp_path):
    run_host_check("tile_order_check.cu", tmp_path, "1000")
