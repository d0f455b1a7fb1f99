#!/bin/bash
# call 2: the decode step (24 layers, device, b1): main's kernels, the one-launch expert kernel, both one-launch
export JAX_PLATFORMS=cuda,cpu
ONE=${1:-32:256:4:32:64:4:0:auto:chunk:one:2}
HC=${2:-one:3}
A="--modes device --layers 24 --batch 1 --max-batch 1 --steps 32 --trace-steps 4 --keep-trace"
run() {  # name expert hc
  timeout 180 python3 _call/decode_variant.py $2 $3 $A --out /tmp/d_$1 > /tmp/d_$1.log 2>&1
  echo "== $1 ($2 $3) rc $?" >> $OUT/decode.txt
  grep -v "WARNING\|Warning" /tmp/d_$1.log | tail -22 >> $OUT/decode.txt
  cp /tmp/d_$1/results.json $OUT/decode_$1.json 2>/dev/null
  T=/tmp/d_$1/trace_device-b1-model.json.gz; H=/tmp/d_$1/decode_hlo_device-b1-model.txt.gz
  for p in "routed experts" "hyper-connections"; do
    [ -f $T ] && python3 benchmarks/trace_parts.py $T --steps 4 --hlo $H --list "$p" >> $OUT/parts_$1.txt 2>&1
  done
}
run pair pair pair
run one $ONE pair
run both $ONE $HC
grep -h "tok/s\|busy\|==" $OUT/decode.txt | head -40
