# Sourced by the device_run*.sh scripts: the environment both set up on the GPU machine
# before their own steps. $OUT is where results go (copied back to the workstation);
# tests and benchmarks import flash3 from the working directory; gpu.txt starts with the
# GPU's name, driver, clocks, temperature and power, for reading the numbers later.
OUT="${OUT:-/tmp/flash3-out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv \
  | tee "$OUT/gpu.txt"
