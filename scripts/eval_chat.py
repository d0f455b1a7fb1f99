#!/usr/bin/env python3
"""Measure how the bundled model chats, through a real server process and the openai SDK, on prompts made from
the held-out documents (train_tiny's split: every 20th document in name order, never trained on).

    python scripts/eval_chat.py                         # starts scripts/serve.py on the bundled model
    python scripts/eval_chat.py --greedy                # temperature 0 instead of the model's sampling defaults
    python scripts/eval_chat.py --url http://127.0.0.1:8000 --model-name default_model   # a running server

- end of turn: chat prompts (a verse request, a documentation question, a short multi-turn exchange), no tools;
  a reply ends by itself when the request finishes with finish_reason "stop" (the model emitted <|im_end|>)
  within --max-tokens.
- tool calls: a question that needs a tool, with that tool's definition (sometimes beside another tool), no
  tool_choice and no grammar; a call counts when the server parsed it into `tool_calls`. Stricter figures: the
  call names the right tool, and its arguments are exactly the expected ones. Each parsed call's expected
  result is then sent back, and the answer must end by itself too.

Sampling: the checkpoint's generation_config.json (temperature 0.6, top-p 0.95, top-k 20) with seed = the
prompt's index, or greedy. With --report, the figures are written into training_report.json under
"chat_eval" (one entry per sampling setting).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402

import train_tiny as tt  # noqa: E402  (the data, the split and the conversation makers)


def heldout_prompts(n_chat: int, n_tool: int, seed: int):
    """(chat prompts, tool prompts) from the held-out documents only. A chat prompt is (kind, messages); a tool
    prompt is (family, messages, tools, expected call, tool result)."""
    _, held = tt.split_documents(tt.kjv_documents() | tt.python_doc_documents())
    src = tt.chat_sources(held)
    rng = np.random.default_rng(seed)
    chat = []
    for i in range(n_chat):
        kind = ("verse", "doc", "multi")[i % 5 % 3]  # 2 : 2 : 1
        msgs, _ = tt.conversation(kind, src, rng, tt.EVAL_CITIES)
        if msgs[-2]["content"] in dict(tt.GREETINGS):
            msgs = msgs[:-2]  # a canned "Thanks!" at the end: ask the held-out question before it instead
        chat.append((kind, msgs[:-1]))  # up to the last user turn: the reply is the model's
    tool = []
    for i in range(n_tool):
        family = tt.TOOL_FAMILIES[i % len(tt.TOOL_FAMILIES)]
        t, question, args, result, _ = tt.tool_case(family, src, rng, tt.EVAL_CITIES)
        tools = [t]
        if rng.random() < 0.3:  # beside another tool, as in training
            other = tt.TOOL_FAMILIES[(i + 1 + rng.integers(len(tt.TOOL_FAMILIES) - 1)) % len(tt.TOOL_FAMILIES)]
            tools.insert(int(rng.integers(2)), tt.tool_case(other, src, rng, tt.EVAL_CITIES)[0])
        tool.append((family, [{"role": "user", "content": question}], tools, {"name": t["name"], "arguments": args},
                     result))
    return chat, tool


def start_server(model: str | None, port: int) -> subprocess.Popen:
    cmd = [sys.executable, os.path.join(HERE, "serve.py"), "--port", str(port), "--log-level", "warning"]
    return subprocess.Popen(cmd + (["--model", model] if model else []), stdout=subprocess.DEVNULL)


def wait_healthy(url: str, proc: subprocess.Popen | None, timeout: float = 900) -> None:
    import httpx

    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"the server exited ({proc.returncode})")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit("the server did not become healthy")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the bundled model)")
    ap.add_argument("--url", default=None, help="a running server instead of starting one")
    ap.add_argument("--model-name", default=None, help="model id to send (default: the directory's name)")
    ap.add_argument("--chat", type=int, default=100, help="chat prompts")
    ap.add_argument("--tools", type=int, default=100, help="tool prompts")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--greedy", action="store_true", help="temperature 0 (default: generation_config.json)")
    ap.add_argument("--seed", type=int, default=0, help="which held-out prompts (and the sampling seeds)")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--report", default=None, help="training_report.json to add the figures to")
    ap.add_argument("--samples", type=int, default=6, help="replies of each kind kept in the report")
    args = ap.parse_args(argv)

    import openai

    import jaxflash

    model_dir = args.model or str(jaxflash.DEFAULT_MODEL)
    name = args.model_name or os.path.basename(os.path.normpath(model_dir))
    gen = json.load(open(os.path.join(model_dir, "generation_config.json")))
    if args.greedy:
        sampling, label = {"temperature": 0.0}, "greedy"
    else:
        sampling = {"temperature": gen["temperature"], "top_p": gen["top_p"], "extra_body": {"top_k": gen["top_k"]}}
        label = f"temperature {gen['temperature']}, top-p {gen['top_p']}, top-k {gen['top_k']}, seed = prompt index"

    chat, tool = heldout_prompts(args.chat, args.tools, args.seed)
    proc = None
    url = args.url
    if url is None:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        proc = start_server(args.model, port)
        url = f"http://127.0.0.1:{port}"
    try:
        t0 = time.perf_counter()
        wait_healthy(url, proc)
        print(f"server ready at {url} in {time.perf_counter() - t0:.0f} s; sampling: {label}", flush=True)
        client = openai.OpenAI(base_url=url + "/v1", api_key=os.environ.get("JAXFLASH_API_KEY", "none"),
                               max_retries=0, timeout=1800)

        def ask(i, messages, tools=None):
            kw = dict(sampling, extra_body=dict(sampling.get("extra_body", {})))
            if "temperature" in kw and kw["temperature"] > 0:
                kw["seed"] = args.seed * 100_000 + i
            r = client.chat.completions.create(model=name, messages=messages, max_tokens=args.max_tokens,
                                               **({"tools": [{"type": "function", "function": t} for t in tools]}
                                                  if tools else {}), **kw)
            return r.choices[0], r.usage.completion_tokens

        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            replies = list(pool.map(lambda x: ask(x[0], x[1][1]), enumerate(chat)))
            calls = list(pool.map(lambda x: ask(10_000 + x[0], x[1][1], x[1][2]), enumerate(tool)))
            # each parsed call's result goes back; the answer must end by itself too
            followups = []
            for i, ((family, msgs, tools, want, result), (c, _)) in enumerate(zip(tool, calls)):
                if c.message.tool_calls:
                    tc = c.message.tool_calls[0]
                    followups.append((i, msgs + [
                        {"role": "assistant", "content": c.message.content,
                         "tool_calls": [t.model_dump() for t in c.message.tool_calls]},
                        {"role": "tool", "tool_call_id": tc.id, "content": result}], tools))
            answers = list(pool.map(lambda x: ask(20_000 + x[0], x[1], x[2]), followups))
        minutes = (time.perf_counter() - t0) / 60
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)

    ended = [c.finish_reason == "stop" for c, _ in replies]
    by_kind = {k: float(np.mean([e for (kk, _), e in zip(chat, ended) if kk == k])) for k in ("verse", "doc", "multi")}
    parsed, right, exact = [], [], []
    for (family, msgs, tools, want, _), (c, _) in zip(tool, calls):
        tcs = c.message.tool_calls or []
        parsed.append(bool(tcs))
        right.append(bool(tcs) and tcs[0].function.name == want["name"])
        try:
            exact.append(right[-1] and json.loads(tcs[0].function.arguments) == want["arguments"])
        except ValueError:
            exact.append(False)
    by_family = {f: float(np.mean([p for (ff, *_), p in zip(tool, parsed) if ff == f])) for f in tt.TOOL_FAMILIES}
    answered = [c.finish_reason == "stop" and bool((c.message.content or "").strip()) and not c.message.tool_calls
                for c, _ in answers]
    result = {
        "sampling": label, "max_tokens": args.max_tokens, "prompt_seed": args.seed, "minutes": minutes,
        "end_of_turn": {"n": len(chat), "rate": float(np.mean(ended)), "by_kind": by_kind,
                        "mean_completion_tokens": float(np.mean([n for _, n in replies]))},
        "tool_call": {"n": len(tool), "parsed_rate": float(np.mean(parsed)), "right_tool_rate": float(np.mean(right)),
                      "exact_arguments_rate": float(np.mean(exact)), "parsed_by_family": by_family},
        "answer_after_tool_result": {"n": len(answers), "ended_rate": float(np.mean(answered)) if answers else None},
        "samples": {
            "chat": [{"messages": m, "reply": c.message.content, "finish_reason": c.finish_reason}
                     for (_, m), (c, _) in list(zip(chat, replies))[: args.samples]],
            "tool": [{"question": msgs[-1]["content"], "tools": [t["name"] for t in tools],
                      "call": [{"name": t.function.name, "arguments": t.function.arguments}
                               for t in c.message.tool_calls or []] or c.message.content}
                     for (_, msgs, tools, *_), (c, _) in list(zip(tool, calls))[: args.samples]],
            "answer_after_tool_result": [{"question": m[0]["content"], "result": m[-1]["content"],
                                          "reply": c.message.content, "finish_reason": c.finish_reason}
                                         for (_, m, _), (c, _) in list(zip(followups, answers))[: args.samples]]},
    }
    print(f"end of turn within {args.max_tokens} tokens: {result['end_of_turn']['rate']:.0%} of {len(chat)} "
          f"({', '.join(f'{k} {v:.0%}' for k, v in by_kind.items())}); mean "
          f"{result['end_of_turn']['mean_completion_tokens']:.0f} tokens")
    print(f"tool calls parsed: {result['tool_call']['parsed_rate']:.0%} of {len(tool)} "
          f"({', '.join(f'{k} {v:.0%}' for k, v in by_family.items())}); right tool "
          f"{result['tool_call']['right_tool_rate']:.0%}, exact arguments {result['tool_call']['exact_arguments_rate']:.0%}")
    if answers:
        print(f"answers after the tool result that end by themselves: {np.mean(answered):.0%} of {len(answers)}")
    print(f"({minutes:.1f} min of requests; sampling: {label})")
    if args.report:
        report = json.load(open(args.report))
        report.setdefault("chat_eval", {})["greedy" if args.greedy else "default_sampling"] = result
        with open(args.report, "w") as f:
            json.dump(report, f, indent=1)
        print(f"added to {args.report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
