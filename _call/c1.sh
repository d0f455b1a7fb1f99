#!/bin/bash
# call 1: build; the decode step of main's kernels at 48 layers (b1); the HC mix one-launch vs pair; the
# compiled one-launch tests; the expert kernels one-launch vs pair
export JAX_PLATFORMS=cuda,cpu XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
# the full 48 layers with every expert on the device need an H200; an H100 runs the first 24
MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
LAYERS=$([ "${MIB:-0}" -gt 100000 ] && echo 48 || echo 24)
L=$OUT/log.txt; T0=$(date +%s)
stamp() { echo "#### $(( $(date +%s) - T0 ))s $1" >> $L; }
keep() { grep -v "WARNING\|Warning\|warn(" $1 | tail -${2:-40} >> $L; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $L 2>&1
python3 -c "import jax; d=jax.devices()[0]; print(d.device_kind, jax.__version__)" >> $L 2>&1
CUDAARCHS=90-real python3 -m pip install -q --no-build-isolation --no-deps . > /tmp/build.log 2>&1
echo "build rc $?" >> $L; tail -3 /tmp/build.log >> $L; stamp built
A="--modes device --batch 1 --max-batch 1 --steps 32 --trace-steps 4 --keep-trace --layers $LAYERS"
timeout 200 python3 _call/decode_variant.py pair pair $A --out /tmp/d_main > /tmp/d_main.log 2>&1
echo "decode main rc $?" >> $L; keep /tmp/d_main.log 30; cp /tmp/d_main/results.json $OUT/decode_main.json; stamp decode
for p in "routed experts" "hyper-connections"; do
  python3 benchmarks/trace_parts.py /tmp/d_main/trace_device-b1-model.json.gz --steps 4 \
    --hlo /tmp/d_main/decode_hlo_device-b1-model.txt.gz --list "$p" >> $OUT/parts_main.txt 2>&1
done
V="4:8:4:1:2:64,4:8:4:1:4:64:one:2,4:8:4:1:4:64:one:3"
timeout 80 python3 benchmarks/hc_kernel.py --mixes 24 --rows 1 --fused-only --reps 8 --variants $V --out $OUT \
  > /tmp/hc.log 2>&1
echo "hc rc $?" >> $L; keep /tmp/hc.log 30; stamp hc
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_hc_kernel.py tests/test_expert_kernel.py \
  -k "one_launch" > /tmp/tests.txt 2>&1
echo "tests rc $?" >> $L; keep /tmp/tests.txt 30; stamp tests
S="32:256:4:32:64:4:0:auto:chunk:one:2;32:256:4:32:64:4:0:auto:chunk:one:3;32:256:8:8:64:8:0:auto:chunk:one:1"
timeout 110 python3 benchmarks/expert_kernel.py --impls pallas,pallas-one --cases b1,b8 --cuda-sweep none \
  --sweep "$S" --sweep-cases b1 --out $OUT > /tmp/ek.log 2>&1
echo "expert rc $?" >> $L; keep /tmp/ek.log 40; stamp expert
ls -la $OUT >> $L
