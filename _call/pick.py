"""Print the decode variants to run from the kernel benchmarks' results: '<expert spec> <hc spec>' for the
one-launch forms that beat the pair (else 'pair')."""
import json, sys, os
out = sys.argv[1]
ex, hc = "pair", "pair"
try:
    r = json.load(open(os.path.join(out, "expert_kernel.json")))
    rows = {t["impl"]: t for t in r["table"] if t.get("case") == "b1" and "error" not in t and not t.get("gave_up")}
    if "pallas-one" in rows and rows["pallas-one"]["kernels_us"] < rows["pallas"]["kernels_us"]:
        t = r["chosen_one_launch_tiles"]
        ex = ":".join(str(t[k]) for k in ("rows_gu", "chunk_gu", "warps_gu", "rows_down", "chunk_down", "warps_down",
                                          "unroll", "math", "x_scale", "launch", "per_sm"))
except Exception as e:
    print("expert pick failed", e, file=sys.stderr)
try:
    r = json.load(open(os.path.join(out, "hc_kernel.json")))
    runs = [x for x in r["runs"] if "kernel_us_per_mix" in x and x["variant"].startswith("kernel")]
    pair = min((x for x in runs if "-one" not in x["variant"]), key=lambda x: x["kernel_us_per_mix"])
    one = min((x for x in runs if "-one" in x["variant"]), key=lambda x: x["kernel_us_per_mix"])
    if one["kernel_us_per_mix"] < pair["kernel_us_per_mix"]:
        hc = "one:" + one["variant"].split("-one")[1].split("-")[0]
except Exception as e:
    print("hc pick failed", e, file=sys.stderr)
print(ex, hc)
