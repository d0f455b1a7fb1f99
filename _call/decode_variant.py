"""decode.py with the kernels' defaults replaced. argv[1]: the expert tiles, 'pair' (main's) or a sweep string
rows_gu:chunk_gu:warps_gu:rows_down:chunk_down:warps_down:unroll:math:x_scale:launch:per_sm; argv[2]: the HC mix
launch, 'pair' or 'one:PER_SM'; the rest go to decode.py."""
import sys
sys.path.insert(0, "benchmarks"); sys.path.insert(0, ".")
from jaxflash.kernels import hc_mix, nvfp4_experts as K
spec, hc = sys.argv[1], sys.argv[2]
if spec != "pair":
    g = [int(v) if v.isdigit() else v for v in spec.split(":")]
    t = K.Tiles(rows_gu=g[0], chunk_gu=g[1], warps_gu=g[2], rows_down=g[3], chunk_down=g[4], warps_down=g[5],
                unroll=g[6], math=g[7], x_scale=g[8], launch=g[9], per_sm=g[10])
    d = list(K.routed_experts.__defaults__); d[0] = t; K.routed_experts.__defaults__ = tuple(d)
    print("expert tiles", t, flush=True)
if hc != "pair":
    hc_mix.mix.__kwdefaults__["launch"] = "one"
    hc_mix.mix.__kwdefaults__["per_sm"] = int(hc.split(":")[1])
    print("hc mix", hc_mix.mix.__kwdefaults__, flush=True)
import decode
sys.exit(decode.main(sys.argv[3:]))
