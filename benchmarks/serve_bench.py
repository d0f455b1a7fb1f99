#!/usr/bin/env python3
"""The server as a user runs it: start `scripts/serve.py` on a checkpoint, wait for /health, and drive it through
the official openai SDK.

Each start is timed from launch to the first /health 200 (load + compile, or load + the compilation cache);
the server's peak host RSS is read from /proc while it runs. After the last start the script sends
  * 1 stream, then `--concurrency` streams at once (greedy chat completions of `--max-tokens` tokens), and
  * one long prompt (`--long-prompt` tokens of text, 16 new tokens): its TTFT is the prefill,
and reports TTFT and tok/s per stream and aggregate (client side), the server's /metrics (tokens, TTFT
histogram, expert cache hit rate), the planner's log lines and the checkpoint's size on disk.

    python3 benchmarks/serve_bench.py --model DIR --vram-budget 32GiB --starts 2 --out $OUT     # the H200
    python3 benchmarks/serve_bench.py --max-tokens 16 --long-prompt 400                         # bundled, CPU
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = ("In the beginning God created the heaven and the earth. And the earth was without form, and void; and "
        "darkness was upon the face of the deep. And the Spirit of God moved upon the face of the waters. ")


def log(msg=""):
    print(msg, flush=True)


def rss_kib(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of a process in KiB, from /proc (0, 0 where there is no /proc)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return int(fields["VmRSS"].split()[0]), int(fields["VmHWM"].split()[0])
    except (OSError, KeyError, ValueError):
        return 0, 0


def get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except OSError:
        return 0, ""


def metrics(base: str) -> dict[str, float]:
    """The jaxflash:* samples of /metrics (name{labels} -> value)."""
    status, text = get(base + "/metrics")
    out = {}
    for line in text.splitlines() if status == 200 else []:
        m = re.match(r"^(jaxflash:[^\s{]+(?:\{[^}]*\})?)\s+([-+0-9.eEinfNa]+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


class Server:
    def __init__(self, args, log_path: str):
        cmd = [sys.executable, os.path.join(ROOT, "scripts", "serve.py"), "--port", str(args.port),
               "--log-level", "info", "--compile-cache", args.compile_cache]
        if args.model:
            cmd += ["--model", args.model]
        if args.vram_budget:
            cmd += ["--vram-budget", args.vram_budget]
        cmd += ["--max-batch", str(args.concurrency)] + args.serve_args
        self.cmd, self.log_path = cmd, log_path
        self.log = open(log_path, "w")
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT)
        self.peak_kib = 0
        self._stop = threading.Event()
        self._watch = threading.Thread(target=self._sample, daemon=True)
        self._watch.start()

    def _sample(self):
        while not self._stop.is_set():
            rss, hwm = rss_kib(self.proc.pid)
            self.peak_kib = max(self.peak_kib, rss, hwm)
            self._stop.wait(0.2)

    def wait_ready(self, base: str, timeout: float) -> float:
        while time.perf_counter() - self.t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with status {self.proc.returncode}: see {self.log_path}")
            if get(base + "/health", timeout=2.0)[0] == 200:
                return time.perf_counter() - self.t0
            time.sleep(0.25)
        raise TimeoutError(f"the server was not ready in {timeout:.0f} s: see {self.log_path}")

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGINT)
        try:
            rc = self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        self._stop.set()
        self._watch.join()
        self.log.close()
        return rc

    def lines(self, pattern: str) -> list[str]:
        with open(self.log_path) as f:
            return [ln.rstrip() for ln in f if re.search(pattern, ln)]


def stream_one(client, model: str, prompt: str, max_tokens: int, logprobs: bool = False) -> dict:
    """One greedy streamed chat completion: TTFT, tokens, decode tok/s (after the first token). A token is seen
    when a chunk carries its text, or (logprobs) its logprob: tokens without text send no chunk otherwise."""
    t0 = time.perf_counter()
    first = last = None
    pieces = 0
    usage = None
    extra = {"logprobs": True} if logprobs else {}
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0.0,
        stream=True, stream_options={"include_usage": True}, **extra)
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        choice = chunk.choices[0] if chunk.choices else None
        delta = choice.delta if choice is not None else None
        seen = delta is not None and ((delta.content or "") + (getattr(delta, "reasoning_content", None) or ""))
        if seen or (choice is not None and choice.logprobs is not None):
            now = time.perf_counter()
            first = first or now
            last = now
            pieces += 1
    end = time.perf_counter()
    tokens = usage.completion_tokens if usage is not None else pieces
    out = {"ttft_s": (first or end) - t0, "tokens": tokens, "prompt_tokens": getattr(usage, "prompt_tokens", None),
           "wall_s": end - t0}
    if first is not None and last is not None and tokens > 1 and last > first:
        out["tok_s"] = (tokens - 1) / (last - first)
    return out


def concurrent(client, model: str, prompts: list[str], max_tokens: int, logprobs: bool = False) -> dict:
    results: list[dict | None] = [None] * len(prompts)

    def run(i):
        results[i] = stream_one(client, model, prompts[i], max_tokens, logprobs)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    done = [r for r in results if r is not None]
    total = sum(r["tokens"] for r in done)
    rates = [r["tok_s"] for r in done if "tok_s" in r]
    return {"streams": len(prompts), "completed": len(done), "wall_s": wall, "tokens": total,
            "aggregate_tok_s": total / wall if wall > 0 else None,
            "per_stream_tok_s_median": statistics.median(rates) if rates else None,
            "ttft_s_median": statistics.median(r["ttft_s"] for r in done) if done else None,
            "ttft_s_max": max((r["ttft_s"] for r in done), default=None), "each": done}


def fmt(v, digits: int = 1) -> str:
    return "n/a (no token was seen on its own: try --logprobs)" if v is None else f"{v:.{digits}f}"


def dir_bytes(path: str | None) -> int | None:
    if not path or not os.path.isdir(path):
        return None
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the bundled model)")
    ap.add_argument("--vram-budget", default=None)
    ap.add_argument("--port", type=int, default=8799)
    ap.add_argument("--starts", type=int, default=2, help="server starts (the later ones use the compile cache)")
    ap.add_argument("--concurrency", type=int, default=8, help="streams at once (and the server's --max-batch)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--long-prompt", type=int, default=3000, help="approximate tokens of the long prompt")
    ap.add_argument("--ready-timeout", type=float, default=1800)
    ap.add_argument("--compile-cache", default=None, help="default: a fresh directory (first start compiles)")
    ap.add_argument("--logprobs", action="store_true",
                    help="ask for logprobs, so that every token arrives in its own chunk (a random-weight model's "
                         "tokens mostly have no text, and send none otherwise); the server then runs its "
                         "logprobs programs")
    ap.add_argument("--out", default=None)
    ap.add_argument("serve_args", nargs="*", help="more arguments for scripts/serve.py (after --)")
    args = ap.parse_args(argv)
    if args.starts < 1 or args.concurrency < 1 or args.max_tokens < 2 or args.long_prompt < 1:
        ap.error("--starts, --concurrency, --long-prompt must be >= 1 and --max-tokens >= 2")
    try:
        import openai
    except ImportError:
        ap.error("needs the openai package (pip install openai, or carry its wheel)")

    out_dir = args.out or tempfile.mkdtemp(prefix="jaxflash_serve_bench_")
    os.makedirs(out_dir, exist_ok=True)
    args.compile_cache = args.compile_cache or tempfile.mkdtemp(prefix="jaxflash_cc_")
    base = f"http://127.0.0.1:{args.port}"
    res = {"model": args.model or "bundled", "checkpoint_bytes": dir_bytes(args.model), "vram_budget": args.vram_budget,
           "concurrency": args.concurrency, "max_tokens": args.max_tokens, "logprobs": args.logprobs, "starts": []}
    for n in range(args.starts):
        srv = Server(args, os.path.join(out_dir, f"server{n + 1}.log"))
        start = {}
        try:
            ready = srv.wait_ready(base, args.ready_timeout)
            start = {"ready_s": ready, "peak_rss_gib_at_ready": srv.peak_kib / 2**20}
            log(f"start {n + 1}: ready in {ready:.1f} s, peak RSS {start['peak_rss_gib_at_ready']:.2f} GiB")
            if n == args.starts - 1:
                client = openai.OpenAI(base_url=base + "/v1", api_key="any", max_retries=0, timeout=3600)
                model = client.models.list().data[0].id
                before = metrics(base)
                one = stream_one(client, model, "Tell me about the beginning of the world.", args.max_tokens,
                                 args.logprobs)
                log(f"1 stream: TTFT {one['ttft_s']:.3f} s, {one['tokens']} tokens, "
                    f"{fmt(one.get('tok_s'))} tok/s")
                prompts = [f"Question {i}: what happened on day {i + 1} of creation?" for i in range(args.concurrency)]
                many = concurrent(client, model, prompts, args.max_tokens, args.logprobs)
                log(f"{args.concurrency} streams: aggregate {many['aggregate_tok_s']:.1f} tok/s, per stream "
                    f"{fmt(many['per_stream_tok_s_median'])} tok/s (median), TTFT median "
                    f"{many['ttft_s_median']:.3f} s, max {many['ttft_s_max']:.3f} s")
                words = TEXT.split()
                long_text = " ".join(words[i % len(words)] for i in range(int(args.long_prompt * 0.8)))
                long = stream_one(client, model, "Summarise: " + long_text, 16, args.logprobs)
                log(f"long prompt ({long['prompt_tokens']} tokens): TTFT {long['ttft_s']:.2f} s")
                after = metrics(base)
                start.update(one_stream=one, concurrent=many, long_prompt=long, metrics_before=before,
                             metrics_after=after, peak_rss_gib=srv.peak_kib / 2**20)
                hit = after.get("jaxflash:expert_cache_hit_rate")
                log(f"server: /metrics hit rate {hit}, peak RSS {start['peak_rss_gib']:.2f} GiB")
        finally:
            start_rc = srv.stop()
        shown = ["scripts/serve.py" if a.endswith("serve.py") else "DIR" if a == args.compile_cache else a
                 for a in srv.cmd[1:]]
        start.update(exit_status=start_rc, plan=srv.lines(r"plan|budget|cache|compil"), command=shown)
        res["starts"].append(start)
        with open(os.path.join(out_dir, "serve_bench.json"), "w") as f:
            json.dump(res, f, indent=1)
    log(f"results: {out_dir}/serve_bench.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
