#!/bin/bash
# one call (about 250 s of device time left): the HC mix kernels alone, the one-launch form against the pair (with
# their error against XLA's mix), then the compiled one-launch tests of the HC mix
export JAX_PLATFORMS=cuda,cpu
L=$OUT/log.txt
keep() { echo "#### $1" >> $L; grep -v "WARNING\|Warning\|warn(" $2 >> $L; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $L 2>&1
python3 -c "import jax; d=jax.devices()[0]; print(d.device_kind, getattr(d,'core_count',None), jax.__version__)" >> $L 2>&1
cat $L
V="4:8:4:1:2:64,4:8:4:1:4:64:one:2,4:8:4:1:4:64:one:3"
timeout 80 python3 benchmarks/hc_kernel.py --mixes 24 --rows 1 --fused-only --reps 8 --variants $V --out $OUT > /tmp/hc.log 2>&1
echo "hc rc $?" >> /tmp/hc.log; keep hc /tmp/hc.log; grep -v "WARNING\|Warning\|warn(" /tmp/hc.log | tail -8
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_hc_kernel.py tests/test_expert_kernel.py -k "one_launch" > /tmp/tests.txt 2>&1
echo "tests rc $?" >> /tmp/tests.txt; keep tests /tmp/tests.txt; tail -4 /tmp/tests.txt
ls $OUT
