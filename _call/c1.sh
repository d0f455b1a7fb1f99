#!/bin/bash
# one call: build; the HC mix one-launch vs pair; the decode step with main's kernels and with the HC mix in one
# launch; the compiled one-launch tests (48 layers on an H200, 24 on an H100); the expert kernels if time is left
export JAX_PLATFORMS=cuda,cpu XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
LAYERS=$([ "${MIB:-0}" -gt 100000 ] && echo 48 || echo 24)  # every expert on the device at 48 layers needs an H200
L=$OUT/log.txt; T0=$(date +%s); END=$((T0 + ${BUDGET:-585}))
stamp() { echo "#### $(( $(date +%s) - T0 ))s $1" >> $L; }
keep() { grep -v "WARNING\|Warning\|warn(" $1 | tail -${2:-40} >> $L; }
left() { local r=$((END - $(date +%s))); [ $r -gt $1 ] && echo $1 || echo $((r > 5 ? r : 5)); }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $L 2>&1
python3 -c "import jax; d=jax.devices()[0]; print(d.device_kind, jax.__version__)" >> $L 2>&1
CUDAARCHS=90-real python3 -m pip install -q --no-build-isolation --no-deps . > /tmp/build.log 2>&1
echo "build rc $?" >> $L; tail -3 /tmp/build.log >> $L; stamp built
V="4:8:4:1:2:64,4:8:4:1:4:64:one:2,4:8:4:1:4:64:one:3"
timeout $(left 75) python3 benchmarks/hc_kernel.py --mixes 24 --rows 1 --fused-only --reps 8 --variants $V \
  --out $OUT > /tmp/hc.log 2>&1
echo "hc rc $?" >> $L; keep /tmp/hc.log 30; stamp hc
A="--modes device --batch 1 --max-batch 1 --steps 32 --trace-steps 4 --keep-trace --layers $LAYERS"
run() {  # name expert hc
  timeout $(left 175) python3 _call/decode_variant.py $2 $3 $A --out /tmp/d_$1 > /tmp/d_$1.log 2>&1
  echo "== decode $1 ($2 $3, $LAYERS layers) rc $?" >> $L; keep /tmp/d_$1.log 24
  cp /tmp/d_$1/results.json $OUT/decode_$1.json 2>/dev/null
  T=/tmp/d_$1/trace_device-b1-model.json.gz; H=/tmp/d_$1/decode_hlo_device-b1-model.txt.gz
  for p in "routed experts" "hyper-connections"; do
    [ -f $T ] && python3 benchmarks/trace_parts.py $T --steps 4 --hlo $H --list "$p" >> $OUT/parts_$1.txt 2>&1
  done
  stamp "decode $1"
}
run main pair pair
run hcone pair one:3
timeout $(left 110) python3 -m pytest -q -p no:cacheprovider tests/test_hc_kernel.py tests/test_expert_kernel.py \
  -k "one_launch" > /tmp/tests.txt 2>&1
echo "tests rc $?" >> $L; keep /tmp/tests.txt 30; stamp tests
S="32:256:4:32:64:4:0:auto:chunk:one:2;32:256:4:32:64:4:0:auto:chunk:one:3"
[ $((END - $(date +%s))) -gt 60 ] && { timeout $(left 120) python3 benchmarks/expert_kernel.py --impls pallas,pallas-one \
  --cases b1 --layers 12 --reps 10 --cuda-sweep none --sweep "$S" --sweep-cases b1 --out $OUT > /tmp/ek.log 2>&1
  echo "expert rc $?" >> $L; keep /tmp/ek.log 30; stamp expert; }
ls -la $OUT >> $L
