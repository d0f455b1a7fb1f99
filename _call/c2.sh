#!/bin/bash
# call 2: the decode step at 48 layers with the one-launch forms (b1), and main's at batch 8.
# $1: the runs, from: both hc ex b8 (default: "both hc b8")
export JAX_PLATFORMS=cuda,cpu XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
# the full 48 layers with every expert on the device need an H200; an H100 runs the first 24
MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
LAYERS=$([ "${MIB:-0}" -gt 100000 ] && echo 48 || echo 24)
L=$OUT/log2.txt; T0=$(date +%s)
stamp() { echo "#### $(( $(date +%s) - T0 ))s $1" >> $L; }
keep() { grep -v "WARNING\|Warning\|warn(" $1 | tail -${2:-40} >> $L; }
nvidia-smi --query-gpu=name,driver_version --format=csv > $L 2>&1
python3 -c "import jaxflash.ffi._ext" >> $L 2>&1 || { CUDAARCHS=90-real python3 -m pip install -q \
  --no-build-isolation --no-deps . > /tmp/build.log 2>&1; echo "build rc $?" >> $L; stamp built; }
ONE=32:256:4:32:64:4:0:auto:chunk:one:2
A="--modes device --steps 32 --trace-steps 4 --keep-trace --layers $LAYERS"
run() {  # name expert hc batch
  timeout $5 python3 _call/decode_variant.py $2 $3 $A --batch $4 --max-batch $4 --out /tmp/d_$1 > /tmp/d_$1.log 2>&1
  echo "== $1 ($2 $3 b$4) rc $?" >> $L; keep /tmp/d_$1.log 24
  cp /tmp/d_$1/results.json $OUT/decode_$1.json 2>/dev/null
  T=/tmp/d_$1/trace_device-b$4-model.json.gz; H=/tmp/d_$1/decode_hlo_device-b$4-model.txt.gz
  for p in "routed experts" "hyper-connections"; do
    [ -f $T ] && python3 benchmarks/trace_parts.py $T --steps 4 --hlo $H --list "$p" >> $OUT/parts_$1.txt 2>&1
  done
  stamp $1
}
for r in ${1:-both hc b8}; do
  case $r in
    both) run both $ONE one:3 1 190;;
    hc) run hc pair one:3 1 180;;
    ex) run ex $ONE pair 1 180;;
    b8) run b8 pair pair 8 200;;
  esac
done
ls -la $OUT >> $L
