#!/usr/bin/env python3
"""Train the small qwen4_exp model bundled as jaxflash's default, with jaxflash's own functional model and
gradients, on English text from the Debian archive and on chat conversations made from that text.

    apt-get install bible-kjv python3.11-doc        # the data (any python3.X-doc works)
    python scripts/train_tiny.py                    # <= 50 minutes of training on 2 cores; writes jaxflash/assets/default_model
    python scripts/eval_chat.py --report jaxflash/assets/default_model/training_report.json   # the chat figures

Data: the King James Bible (`bible "Gen1:1-Rev22:21"`, one document per chapter, verse numbers removed) and
the reStructuredText sources of the Python documentation (one document per file). Documents are joined with
<|endoftext|> (EOS), so PLE sees EOS segments. Held out: every 20th document in name order (`heldout.txt` in
the work directory, their names in the report); the tokenizer (byte-level BPE, `tokenizers`) is trained on the
rest, and only the rest feeds the chat data.

Chat: conversations made from the training documents (a verse asked for by its reference and answered with it,
a documentation heading or API entry asked about and answered with its first paragraph, short multi-turn
exchanges, tool calls in the template's <tool_call> format whose results are answered in the next turn, a few
<think> blocks, greetings), rendered by the chat template the checkpoint ships. Each step trains on windows of
document text and one window of conversations starting at a conversation's start.

Model: every block of qwen4_exp at small width (docs/model.md): 6 GDN + 2 attention layers with QSA (a 64-token
budget, so the 256-token training windows select blocks), 16 experts top-4 plus a shared expert, PLE at
layer 1, the 4-stream gated residual and one MTP layer. Loss: next-token cross-entropy + 0.3 x the MTP head's
cross-entropy (token t+2) + 0.01 x a load-balancing term (Switch Transformer's) per MoE layer, text and chat
windows weighted by their tokens. AdamW; the learning rate warms up, then follows a cosine over the run's
progress, the larger of steps done / --steps and time used / --minutes, so the run ends on time on a slow or
shared machine.

Export: the real NVFP4 MIXED_PRECISION layout (experts NVFP4, n-gram table FP8, MTP experts FP8 blocks), with
the tokenizer and a Qwen chat template. The script then measures held-out perplexity (bf16 and NVFP4 experts),
MTP draft acceptance and the expert-cache hit rate, prints samples, and writes it all to training_report.json
beside the model.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxflash import presets  # noqa: E402
from jaxflash.checkpoint import expected_tensors  # noqa: E402
from jaxflash.config import ModelConfig  # noqa: E402
from jaxflash.model import hyper_connection as hc  # noqa: E402
from jaxflash.model import ple as ple_mod  # noqa: E402
from jaxflash.model import transformer  # noqa: E402
from jaxflash.model.mtp import mtp_forward  # noqa: E402
from jaxflash.model.weights import DictSource, load_params  # noqa: E402
from jaxflash.synthetic import TOKEN_IDS, _init, _rng, build_tokenizer  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EOS = TOKEN_IDS["<|endoftext|>"]
MTP_WEIGHT, BALANCE_WEIGHT = 0.3, 0.01


# ---------------------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------------------
def kjv_documents() -> dict[str, str]:
    """One document per chapter: its title line, then one verse per line without the verse number."""
    try:
        text = subprocess.run(["bible", "Gen1:1-Rev22:21"], capture_output=True, text=True, check=True).stdout
    except (FileNotFoundError, subprocess.CalledProcessError) as e:
        raise SystemExit(f"the King James Bible is not installed ({e}); run: apt-get install bible-kjv") from None
    docs, title, verses = {}, None, []
    for line in text.splitlines():
        if re.fullmatch(r"[1-3]?\s?[A-Z][A-Za-z ]+ \d+", line.strip()) and not line.startswith(" "):
            if title:
                docs[f"kjv/{len(docs):04d} {title}"] = title + "\n\n" + "\n".join(verses) + "\n"
            title, verses = line.strip(), []
        elif m := re.match(r"\s+\d+ (.*)", line):
            verses.append(m.group(1))
        elif line.strip() and verses:
            verses[-1] += " " + line.strip()
    if title:
        docs[f"kjv/{len(docs):04d} {title}"] = title + "\n\n" + "\n".join(verses) + "\n"
    return docs


def python_doc_documents() -> dict[str, str]:
    roots = sorted(glob.glob("/usr/share/doc/python3*/html/_sources"))
    if not roots:
        raise SystemExit("the Python documentation is not installed; run: apt-get install python3.11-doc")
    files = sorted(glob.glob(os.path.join(roots[-1], "**", "*.rst.txt"), recursive=True))
    return {"pydoc/" + os.path.relpath(f, roots[-1]): open(f, encoding="utf-8").read() for f in files}


def split_documents(docs: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """(train, held out), by name: every 20th document in name order is held out."""
    names = sorted(docs)
    held = {n: docs[n] for i, n in enumerate(names) if i % 20 == 19}
    train = {n: docs[n] for i, n in enumerate(names) if i % 20 != 19}
    return train, held


def token_stream(tok, docs: list[str]) -> np.ndarray:
    """The documents' tokens, each followed by EOS."""
    out = []
    for d in docs:
        out.extend(tok.encode(d).ids)
        out.append(EOS)
    return np.asarray(out, np.int32)


# ---------------------------------------------------------------------------------------------------------------
# Chat data: conversations made from the training documents only, rendered by the checkpoint's own chat template
# ---------------------------------------------------------------------------------------------------------------
_UNDERLINE = re.compile(r"([=\-~^*+#\"'`])\1{2,}\s*$")
_ROLE = re.compile(r":[\w:.+-]+:`!?~?([^`<]*?)\s*(?:<[^>]*>)?`")  # :mod:`json`, :ref:`text <target>` -> json, text
_API = re.compile(r"(\s*)\.\. (function|method|classmethod|staticmethod|class|exception|data|attribute|decorator)"
                  r":: ([\w.]+)")


def plain(s: str) -> str:
    """reStructuredText inline markup removed, for questions made from headings and signatures."""
    return re.sub(r"\s+", " ", _ROLE.sub(r"\1", s).replace("``", "").replace("**", "")).strip()


def _first_paragraph(lines: list[str], i: int, indent: int, max_chars: int = 400) -> str | None:
    """The first plain paragraph at `indent` from line i (directives, option fields and deeper blocks skipped),
    cut at a sentence end to at most max_chars; None if a heading or a dedent comes first."""
    j, n = i, min(len(lines), i + 60)
    while j < n:
        line = lines[j]
        if not line.strip():
            j += 1
            continue
        lead = len(line) - len(line.lstrip())
        if lead < indent:
            return None
        body = line.strip()
        if (lead > indent or body.startswith((".. ", "**Source code:**", "|")) or _UNDERLINE.fullmatch(body)
                or re.match(r":[\w -]+:(\s|$)", body)):
            j += 1  # a directive, a field, a nested block: skip it
            continue
        if j + 1 < len(lines) and _UNDERLINE.fullmatch(lines[j + 1].strip()):
            return None  # the next heading
        para = []
        while j < len(lines) and lines[j].strip() and len(lines[j]) - len(lines[j].lstrip()) == indent:
            para.append(lines[j].strip())
            j += 1
        text = "\n".join(para)
        if text.endswith("::") or len(text) < 40:
            return None  # it introduces a code block, or says too little to answer with
        if len(text) > max_chars:
            cut = text.rfind(". ", 0, max_chars)
            if cut < 80:
                return None
            text = text[: cut + 1]
        return text
    return None


def doc_topics(text: str) -> list[tuple[str, str, str]]:
    """(kind, name, answer) for each section heading and API entry (function, class, ...) of one .rst file whose
    first paragraph can serve as the answer."""
    lines, out, module, cls = text.splitlines(), [], None, None
    for i, line in enumerate(lines):
        if m := re.match(r"\.\. (?:current)?module:: ([\w.]+)", line):
            module = m.group(1)
        if m := _API.match(line):
            indent, kind, name = len(m.group(1)), m.group(2), m.group(3)
            if kind in ("class", "exception") and not indent:
                cls = name
            if "." not in name:  # qualify it as the docs' index does
                name = f"{cls}.{name}" if indent and cls else f"{module}.{name}" if module else name
            k = i + 1
            while k < len(lines) and lines[k - 1].rstrip().endswith("\\"):
                k += 1  # a signature continued over several lines
            body = next((len(s) - len(s.lstrip()) for s in lines[k : k + 6] if s.strip()), 0)
            if body > indent and (answer := _first_paragraph(lines, k, body)):
                out.append(("callable" if kind in ("function", "method", "classmethod", "staticmethod", "decorator")
                            else kind, name, answer))
        elif (i + 1 < len(lines) and line.strip() and not line.startswith((" ", ".. "))
              and _UNDERLINE.fullmatch(lines[i + 1].strip()) and len(lines[i + 1].strip()) >= len(line.strip())
              and not _UNDERLINE.fullmatch(line.strip())):
            title = plain(line)
            if 3 <= len(title) <= 80 and (answer := _first_paragraph(lines, i + 2, 0)):
                out.append(("heading", title, answer))
    return out


def chapter_verses(text: str) -> tuple[str, int, list[str]]:
    """(book, chapter, verses) of a KJV document (kjv_documents' format)."""
    title, _, body = text.partition("\n\n")
    book, chapter = title.rsplit(" ", 1)
    return book, int(chapter), body.strip("\n").split("\n")


def chat_sources(docs: dict[str, str]) -> dict[str, list]:
    """What conversations are made of, from these documents only: verses (reference, text, next verse or None),
    chapters (book, chapter, verse count) and documentation topics (kind, name, answer)."""
    src = {"verses": [], "chapters": [], "topics": []}
    for name in sorted(docs):
        if name.startswith("kjv/"):
            book, ch, verses = chapter_verses(docs[name])
            src["chapters"].append((book, ch, len(verses)))
            for v, text in enumerate(verses):
                src["verses"].append((f"{book} {ch}:{v + 1}", text, verses[v + 1] if v + 1 < len(verses) else None))
        else:
            src["topics"].extend(doc_topics(docs[name]))
    return src


CITIES = ["Paris", "London", "Berlin", "Madrid", "Rome", "Vienna", "Oslo", "Stockholm", "Helsinki", "Dublin",
          "Lisbon", "Athens", "Prague", "Warsaw", "Budapest", "Amsterdam", "Brussels", "Copenhagen", "Zurich",
          "Geneva", "Tokyo", "Osaka", "Seoul", "Beijing", "Shanghai", "Delhi", "Mumbai", "Cairo", "Nairobi",
          "Lagos", "Sydney", "Melbourne", "Toronto", "Montreal", "Chicago", "Boston", "Denver", "Seattle",
          "Lima", "Santiago", "Jerusalem", "Damascus", "Corinth", "Ephesus", "Babylon", "Nineveh"]
EVAL_CITIES = CITIES[4::5]  # never in training conversations: the evaluation asks about these
TRAIN_CITIES = [c for c in CITIES if c not in EVAL_CITIES]
SYSTEMS = ["You are a helpful assistant.", "You are a helpful assistant. Answer briefly.", "Be concise.",
           "You answer questions about the King James Bible and the Python documentation."]
GREETINGS = [("Hello", "Hello! Ask me for a verse of the King James Bible or about the Python documentation."),
             ("Hi!", "Hi! What would you like to know?"),
             ("Who are you?", "I am a small language model trained on the King James Bible and the Python "
                              "documentation."),
             ("What can you do?", "I can quote verses of the King James Bible, explain parts of the Python "
                                  "documentation, and call the tools you give me."),
             ("Thanks!", "You are welcome."), ("Thank you.", "You are welcome.")]
VERSE_ASK = ["What does {r} say?", "Quote {r}.", "Read {r} to me.", "{r}", "Give me {r}, please.",
             "What is written in {r}?", "Recite {r} from the King James Bible.", "Can you quote {r}?"]
NEXT_ASK = ["And the next verse?", "Go on.", "What comes next?", "And the verse after that?"]
TOPIC_ASK = {"callable": ["What does {n}() do?", "What is {n}() for?", "Explain {n}().", "How does {n}() work?"],
             "class": ["What is the {n} class?", "What is {n}?", "Explain the class {n}."],
             "exception": ["When is {n} raised?", "What is the {n} exception?", "What is {n}?"],
             "data": ["What is {n}?", "What does {n} hold?"], "attribute": ["What is {n}?", "What is {n} for?"],
             "heading": ["What is {n}?", "Tell me about {n}.", "Explain {n}.", "{n}?",
                         "What does the Python documentation say about {n}?"]}


def ask(kind: str, name: str, template: str) -> str:
    """A question about a documentation topic; a heading that is a question already (the FAQs) is asked as is."""
    return name if kind == "heading" and name.endswith("?") else template.format(n=name)


def _tool(name: str, description: str, params: dict[str, tuple[str, str]]) -> dict:
    """A function definition as a client sends it (name, description, JSON-schema parameters)."""
    return {"name": name, "description": description, "parameters": {
        "type": "object", "properties": {p: {"type": t, "description": d} for p, (t, d) in params.items()},
        "required": list(params)}}


def _weather(city: str) -> tuple[int, str]:
    h = sum(map(ord, city))  # a made-up but fixed forecast per city
    return 5 + h % 25, ["sunny", "cloudy", "raining", "windy", "snowing"][h % 5]


def tool_case(family: str, src: dict, rng, cities) -> tuple[dict, str, dict, str, str]:
    """(tool definition, question, call arguments, tool result, answer) for one question that needs the tool."""
    pick = lambda xs: xs[rng.integers(len(xs))]  # noqa: E731
    if family == "verse":
        ref, text, _ = pick(src["verses"])
        tool = _tool(pick(["get_verse", "lookup_verse", "bible_lookup", "read_verse"]), "Look up a verse of the "
                     "King James Bible", {"reference": ("string", "book chapter:verse, e.g. John 3:16")})
        return tool, pick(VERSE_ASK).format(r=ref), {"reference": ref}, text, pick(["{t}", "{r}: {t}"]).format(
            r=ref, t=text)
    if family == "docs":
        kind, name, answer = pick(src["topics"])
        tool = _tool(pick(["search_docs", "python_docs", "lookup_docs", "docs_search"]),
                     "Search the Python documentation", {"query": ("string", "what to look up")})
        q = pick(["Look up {n} in the Python docs.", "Search the documentation for {n}.", *TOPIC_ASK[kind]])
        first = answer.split(". ")[0].rstrip(".") + "."  # the answer repeats the result's first sentence
        return tool, ask(kind, name, q), {"query": name}, answer, first
    if family == "chapter":
        book, ch, n = pick(src["chapters"])
        tool = _tool(pick(["count_verses", "chapter_length", "verse_count"]), "Count the verses of a chapter of the "
                     "Bible", {"book": ("string", "the book"), "chapter": ("integer", "the chapter number")})
        q = pick(["How many verses are in {b} {c}?", "How long is {b} {c}?", "Count the verses of {b} {c}."])
        return (tool, q.format(b=book, c=ch), {"book": book, "chapter": ch}, json.dumps({"verses": n}),
                f"{book} {ch} has {n} verses.")
    if family == "weather":
        city = pick(cities)
        t, sky = _weather(city)
        tool = _tool(pick(["get_weather", "weather", "current_weather"]), "Get the current weather of a city",
                     {"city": ("string", "the city")})
        q = pick(["What is the weather in {c}?", "What's the weather like in {c}?", "Is it raining in {c}?",
                  "How warm is it in {c} today?", "Weather in {c}?"])
        return (tool, q.format(c=city), {"city": city}, json.dumps({"temperature": t, "condition": sky}),
                f"It is {sky} in {city}, {t} degrees.")
    a, b = int(rng.integers(2, 1000)), int(rng.integers(2, 100))  # calculator
    op = pick(["+", "-", "*"])
    r = {"+": a + b, "-": a - b, "*": a * b}[op]
    tool = _tool(pick(["calculator", "calculate", "evaluate"]), "Evaluate an arithmetic expression",
                 {"expression": ("string", "the expression")})
    q = pick(["What is {a} {o} {b}?", "Calculate {a} {o} {b}.", "How much is {a} {o} {b}?"])
    return tool, q.format(a=a, o=op, b=b), {"expression": f"{a} {op} {b}"}, str(r), f"{a} {op} {b} = {r}."


TOOL_FAMILIES = ("verse", "docs", "chapter", "weather", "calculator")
CHAT_MIX = {"verse": 0.17, "doc": 0.22, "multi": 0.12, "tool": 0.34, "tool_unneeded": 0.05, "think": 0.06,
            "greeting": 0.04}


def conversation(kind: str, src: dict, rng, cities=TRAIN_CITIES) -> tuple[list[dict], list[dict] | None]:
    """One conversation (OpenAI-style messages, with the tools it was given) of the given kind."""
    pick = lambda xs: xs[rng.integers(len(xs))]  # noqa: E731
    msgs = [{"role": "system", "content": pick(SYSTEMS)}] if rng.random() < 0.25 else []

    def direct(think=False):
        if rng.random() < 0.45:
            ref, text, nxt = pick(src["verses"])
            q, a, why = pick(VERSE_ASK).format(r=ref), text, f"The user wants {ref}; I quote the verse."
        else:
            k, name, a = pick(src["topics"])
            q, why = ask(k, name, pick(TOPIC_ASK[k])), f"The user asks about {name}; the documentation explains it."
        return [{"role": "user", "content": q},
                {"role": "assistant", "content": a, **({"reasoning_content": why} if think else {})}]

    if kind == "verse":
        ref, text, _ = pick(src["verses"])
        return msgs + [{"role": "user", "content": pick(VERSE_ASK).format(r=ref)},
                       {"role": "assistant", "content": text}], None
    if kind == "doc":
        k, name, answer = pick(src["topics"])
        return msgs + [{"role": "user", "content": ask(k, name, pick(TOPIC_ASK[k]))},
                       {"role": "assistant", "content": answer}], None
    if kind == "multi":  # two or three short exchanges
        ref, text, nxt = pick(src["verses"])
        turns = [{"role": "user", "content": pick(VERSE_ASK).format(r=ref)}, {"role": "assistant", "content": text}]
        if nxt and rng.random() < 0.5:
            turns += [{"role": "user", "content": pick(NEXT_ASK)}, {"role": "assistant", "content": nxt}]
        else:
            other = direct()
            turns = turns + other if rng.random() < 0.5 else other + turns
        if rng.random() < 0.3:
            g = pick(GREETINGS[4:])
            turns += [{"role": "user", "content": g[0]}, {"role": "assistant", "content": g[1]}]
        return msgs + turns, None
    if kind == "greeting":
        g = pick(GREETINGS[:4])
        return msgs + [{"role": "user", "content": g[0]}, {"role": "assistant", "content": g[1]}], None
    if kind == "think":
        return msgs + direct(think=True), None
    families = list(TOOL_FAMILIES)
    if kind == "tool_unneeded":  # tools that do not fit the question: answer it directly
        tools = [tool_case(f, src, rng, cities)[0] for f in ("weather", "calculator", "chapter")[: rng.integers(1, 3)]]
        return msgs + direct(), tools
    family = pick(families)
    tool, q, args, result, answer = tool_case(family, src, rng, cities)
    tools = [tool]
    if rng.random() < 0.3:  # another tool beside it: the model must pick the right one
        other = pick([f for f in families if f != family])
        tools.insert(int(rng.integers(2)), tool_case(other, src, rng, cities)[0])
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": tool["name"], "arguments": args}}]}
    if rng.random() < 0.15:
        call["reasoning_content"] = f"I need {tool['name']} for this."
    return msgs + [{"role": "user", "content": q}, call, {"role": "tool", "content": result},
                   {"role": "assistant", "content": answer}], tools


def chat_conversations(src: dict, n: int, seed: int) -> list[tuple[list[dict], list[dict] | None]]:
    rng = np.random.default_rng(seed)
    kinds = rng.choice(list(CHAT_MIX), size=n, p=np.array(list(CHAT_MIX.values())) / sum(CHAT_MIX.values()))
    return [conversation(k, src, rng) for k in kinds]


def chat_stream(template_tok, tok, convs, span: int) -> tuple[np.ndarray, np.ndarray]:
    """The rendered conversations' tokens, each followed by EOS, and the window starts to sample from: each
    conversation's start, and for one longer than a window also the window that ends with it (so its last
    answer is trained too)."""
    out, starts = [], []
    for msgs, tools in convs:
        text = template_tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=False)
        ids = tok.encode(text).ids
        starts.append(len(out))
        if len(ids) + 1 > span:
            starts.append(len(out) + len(ids) + 1 - span)
        out.extend(ids)
        out.append(EOS)
    stream = np.asarray(out, np.int32)
    starts = np.asarray([s for s in starts if s + span <= len(stream)], np.int64)
    return stream, starts


# ---------------------------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------------------------
def model_config(vocab_size: int) -> ModelConfig:
    c = presets.tiny(vocab_size=vocab_size, eos_token_id=EOS)
    return c.replace(
        hidden_size=128, num_hidden_layers=8, layer_types=presets._layer_types(8), eos_token_ids=(EOS, TOKEN_IDS["<|im_end|>"]),
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
        num_experts=16, num_experts_per_tok=4, moe_intermediate_size=64, shared_expert_intermediate_size=64,
        hc_lowrank=32, ple_embed_dim=128, ngram_vocab_size_base=4096,
        indexer_n_heads=4, indexer_head_dim=32, indexer_budget=64, indexer_compress_ratio=4,
        max_position_embeddings=4096, mtp_num_hidden_layers=1)


def init_params(cfg: ModelConfig, seed: int):
    """Random float32 parameters by the synthetic writer's initialisation rules (the table on the device)."""
    specs = expected_tensors(cfg, None, mtp=True)
    tensors = {n: _init(n, s, cfg, _rng(seed, n)) for n, (s, _) in specs.items()
               if ".ple_embedding." not in n}  # the n-gram table below; the hash buffers are not parameters
    table = np.concatenate([_init(n, s, cfg, _rng(seed, n)) for n, (s, _) in specs.items()
                            if ".ngram_embedding.shard_" in n])
    # start near-uniform over the vocabulary (the writer's lm_head gives logits of std ~3: a loss of ~12)
    tensors["lm_head.weight"] = tensors["lm_head.weight"] * 0.1
    return load_params(DictSource(tensors), cfg, "float32", ple_table=(table, None))


def losses(params, cfg: ModelConfig, toks, ids):
    """(total, (next-token CE, MTP CE, balance)) for windows toks [B, T+2] with n-gram ids [B, T+2, 16]."""
    t = toks.shape[1] - 2
    h, routing = transformer.forward_hidden(params, cfg, toks[:, :t], ngram_ids=ids[:, :t], return_routing=True)
    x, _ = hc.mix(params.mixer, h, cfg.hc_count, cfg.rms_norm_eps)

    def ce(logits, target):
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, target[..., None], axis=-1))

    main = ce(transformer.lm_logits(params, x), toks[:, 1 : t + 1])
    mtp_logits, _, mtp_routing = mtp_forward(params, cfg, h, toks[:, 1 : t + 1], return_routing=True)
    mtp = ce(mtp_logits, toks[:, 2 : t + 2])
    e = cfg.num_experts
    balance = jnp.mean(jnp.stack([
        e * jnp.sum(jnp.mean(jax.nn.one_hot(r.ids, e).sum(1), 0) / cfg.num_experts_per_tok * jnp.mean(r.probs, 0))
        for r in (*routing, mtp_routing)]))
    return main + MTP_WEIGHT * mtp + BALANCE_WEIGHT * balance, (main, mtp, balance)


def windows(stream: np.ndarray, starts, length: int) -> np.ndarray:
    return np.stack([stream[s : s + length] for s in starts])


# ---------------------------------------------------------------------------------------------------------------
# Evaluation of the exported model
# ---------------------------------------------------------------------------------------------------------------
def mtp_acceptance(engine, seqs) -> float:
    """Greedy draft acceptance: the MTP head's top token for t+2 equals the main model's top token there."""
    hits = total = 0
    for s in seqs:
        main = engine.logits(s).argmax(-1)  # row t predicts token t+1
        draft = engine.mtp_logits(s).argmax(-1)  # row t predicts token t+2
        hits += int((draft[:-1] == main[1:-1]).sum())
        total += len(draft) - 1
    return hits / total


def cache_hit_rates(engine, seqs, slot_counts) -> dict[int, float]:
    """LRU expert-cache hit rate per slot count, replaying the held-out text token by token through each
    layer's cache (jaxflash.ffi.reference.LruModel: the FFI cache's rules)."""
    from jaxflash.ffi.reference import LruModel

    cfg = engine.config

    @jax.jit
    def route_ids(params, toks, rows):
        _, routing = transformer.forward_hidden(params, cfg, toks, ple_rows=rows, return_routing=True)
        return [r.ids for r in routing]

    traces = [[] for _ in range(cfg.num_hidden_layers)]
    for s in seqs:
        batch, _, _ = engine._batch(s)
        ids = route_ids(engine.params, jnp.asarray(batch), engine.ple_rows(batch))
        for layer, idx in enumerate(ids):
            traces[layer].append(np.asarray(idx)[: len(s)])
    rates = {}
    for slots in slot_counts:
        hits = misses = 0
        for trace in traces:
            lru = LruModel(slots, cfg.num_experts)
            for step in np.concatenate(trace):
                lru.resolve(step)
            hits, misses = hits + lru.hits, misses + lru.misses
        rates[slots] = hits / (hits + misses)
    return rates


def sample(engine, tok, prompt: str, n: int, temperature: float, top_k: int, seed: int) -> str:
    """Temperature / top-k sampling by re-running the full sequence per token (fine for a model this small)."""
    rng = np.random.default_rng(seed)
    ids = tok.encode(prompt).ids
    for _ in range(n):
        logits = engine.logits(ids)[-1] / temperature
        top = np.argsort(logits)[-top_k:]
        p = np.exp(logits[top] - logits[top].max())
        nxt = int(rng.choice(top, p=p / p.sum()))
        if nxt == EOS:
            break
        ids.append(nxt)
    return tok.decode(ids)


# ---------------------------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(ROOT, "jaxflash", "assets", "default_model"))
    ap.add_argument("--work", default=os.path.join(ROOT, "build", "train_tiny"), help="held-out text, bf16 export")
    ap.add_argument("--steps", type=int, default=2000, help="optimizer steps (the LR schedule spans them)")
    ap.add_argument("--minutes", type=float, default=50.0,
                    help="training time limit: the LR schedule follows whichever of steps and time runs out first")
    ap.add_argument("--batch", type=int, default=8, help="windows of document text per step")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--chat-windows", type=int, default=1, help="windows of chat conversations per step")
    ap.add_argument("--chat-seq", type=int, default=384, help="their length: most conversations with tools fit")
    ap.add_argument("--conversations", type=int, default=24000, help="chat conversations to make")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-every", type=int, default=100)
    args = ap.parse_args(argv)

    import optax

    from jaxflash.engine import load
    from jaxflash.export import save_checkpoint
    from jaxflash.perplexity import perplexity
    from jaxflash.synthetic import tokenizer_config_json
    from jaxflash.tokenizer import Tokenizer

    t_start = time.perf_counter()
    docs = kjv_documents() | python_doc_documents()
    train_docs, held_docs = split_documents(docs)
    os.makedirs(args.work, exist_ok=True)
    held_path = os.path.join(args.work, "heldout.txt")
    with open(held_path, "w", encoding="utf-8") as f:
        f.write("\n".join(held_docs.values()))
    tok = build_tokenizer(args.vocab, list(train_docs.values()))  # on the documents: chat adds no vocabulary
    train = token_stream(tok, list(train_docs.values()))
    held = token_stream(tok, list(held_docs.values()))
    print(f"data: {len(train_docs)} training documents ({len(train):,} tokens), {len(held_docs)} held out "
          f"({len(held):,} tokens); vocab {tok.get_vocab_size()}", flush=True)

    cfg = model_config(args.vocab)
    # Conversations are rendered by the chat template the checkpoint ships, so training sees what the server sends.
    tok_dir = os.path.join(args.work, "tokenizer")
    os.makedirs(tok_dir, exist_ok=True)
    tok.save(os.path.join(tok_dir, "tokenizer.json"))
    with open(os.path.join(tok_dir, "tokenizer_config.json"), "w") as f:
        json.dump(tokenizer_config_json(cfg), f)
    template = Tokenizer(tok_dir)
    span, chat_span = args.seq + 2, args.chat_seq + 2
    train_src = chat_sources(train_docs)
    chat, chat_starts = chat_stream(template, tok, chat_conversations(train_src, args.conversations, args.seed),
                                    chat_span)
    held_chat, held_chat_starts = chat_stream(template, tok, chat_conversations(chat_sources(held_docs), 400,
                                                                                args.seed + 1), chat_span)
    print(f"chat: {args.conversations} conversations ({len(chat):,} tokens) from {len(train_src['verses'])} verses, "
          f"{len(train_src['chapters'])} chapters, {len(train_src['topics'])} documentation topics; "
          f"{args.chat_windows} window(s) of {args.chat_seq} tokens per step", flush=True)

    params = init_params(cfg, args.seed)
    n_params = sum(x.size for x in jax.tree.leaves(params) if jnp.issubdtype(x.dtype, jnp.floating))
    print(f"model: {n_params / 1e6:.2f} M parameters (n-gram table included)", flush=True)

    # AdamW with the learning rate passed in per step: warmup, then a cosine over the run's progress, which is
    # the larger of steps done and time used, so a slow (shared) machine still ends the schedule on time.
    warmup = 100
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.scale_by_adam(b2=0.95), optax.add_decayed_weights(0.01))
    opt_state = opt.init(params)

    def learning_rate(step: int, progress: float) -> float:
        return args.lr * min(1.0, step / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(progress, 1.0))))

    # Text and chat windows differ in length, so each is its own forward; the losses are weighted by tokens.
    text_tokens, chat_tokens = args.batch * args.seq, args.chat_windows * args.chat_seq
    chat_weight = chat_tokens / (text_tokens + chat_tokens)

    def mixed_losses(p, text, text_ids, chat, chat_ids):
        loss, parts = losses(p, cfg, text, text_ids)
        chat_loss, chat_parts = losses(p, cfg, chat, chat_ids)
        return (1 - chat_weight) * loss + chat_weight * chat_loss, (parts[0], chat_parts[0])

    @jax.jit
    def train_step(params, opt_state, text, text_ids, chat, chat_ids, lr):
        (loss, parts), grads = jax.value_and_grad(mixed_losses, has_aux=True)(params, text, text_ids, chat, chat_ids)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, jax.tree.map(lambda u: -lr * u, updates)), opt_state, loss, parts

    eval_loss = jax.jit(lambda p, toks, ids: losses(p, cfg, toks, ids)[1])
    rng = np.random.default_rng(args.seed)
    eval_toks = windows(held, rng.integers(0, len(held) - span, 16), span)
    eval_ids = ple_mod.ngram_ids(cfg, eval_toks)[0]
    chat_eval_toks = windows(held_chat, rng.choice(held_chat_starts, 8, replace=False), chat_span)
    chat_eval_ids = ple_mod.ngram_ids(cfg, chat_eval_toks)[0]

    step, history, progress = 0, [], 0.0
    t0 = time.perf_counter()
    while progress < 1.0:
        text = windows(train, rng.integers(0, len(train) - span, args.batch), span)
        convs = windows(chat, rng.choice(chat_starts, args.chat_windows), chat_span)
        lr = learning_rate(step + 1, progress)
        params, opt_state, loss, (main, main_chat) = train_step(
            params, opt_state, text, ple_mod.ngram_ids(cfg, text)[0], convs, ple_mod.ngram_ids(cfg, convs)[0],
            jnp.float32(lr))
        step += 1
        progress = max(step / args.steps, (time.perf_counter() - t0) / (args.minutes * 60))
        if step % args.eval_every == 0 or step == 1 or progress >= 1.0:
            ev = [float(x) for x in eval_loss(params, eval_toks, eval_ids)]
            ev_chat = float(eval_loss(params, chat_eval_toks, chat_eval_ids)[0])
            rate = step * (text_tokens + chat_tokens) / (time.perf_counter() - t0)
            history.append({"step": step, "train_loss": float(main), "train_chat_loss": float(main_chat),
                            "heldout_loss": ev[0], "heldout_mtp": ev[1], "balance": ev[2],
                            "heldout_chat_loss": ev_chat, "lr": lr, "minutes": (time.perf_counter() - t0) / 60})
            print(f"step {step:5d}  train {float(main):.3f}  held-out {ev[0]:.3f} (ppl {math.exp(ev[0]):.1f})  "
                  f"chat {float(main_chat):.3f} held-out {ev_chat:.3f}  mtp {ev[1]:.3f}  balance {ev[2]:.3f}  "
                  f"lr {lr:.2e}  {rate:.0f} tok/s", flush=True)
    tokens_seen = step * (text_tokens + chat_tokens)
    train_minutes = (time.perf_counter() - t0) / 60
    print(f"trained {step} steps, {tokens_seen:,} tokens ({step * chat_tokens:,} of chat), in {train_minutes:.1f} "
          f"min", flush=True)

    # ----- export and evaluate -----
    bf16_dir = os.path.join(args.work, "bf16")
    save_checkpoint(bf16_dir, cfg, params, quant="bf16", tokenizer=tok, seed=args.seed)
    save_checkpoint(args.out, cfg, params, quant="nvfp4", tokenizer=tok, seed=args.seed)
    size = os.path.getsize(os.path.join(args.out, "model.safetensors"))
    report = {"command": "python scripts/train_tiny.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "steps": step, "tokens": tokens_seen, "chat_tokens": step * chat_tokens, "batch": args.batch,
              "seq": args.seq, "chat_windows": args.chat_windows, "chat_seq": args.chat_seq, "lr": args.lr,
              "parameters": int(n_params), "checkpoint_bytes": size, "train_minutes": train_minutes,
              "cpu_cores": os.cpu_count(), "history": history,
              "data": {"train_documents": len(train_docs), "heldout_documents": len(held_docs),
                       "train_tokens": int(len(train)), "heldout_tokens": int(len(held)),
                       "chat_conversations": args.conversations, "chat_stream_tokens": int(len(chat)),
                       "chat_mix": CHAT_MIX, "chat_sources": {k: len(v) for k, v in train_src.items()},
                       "heldout_rule": "every 20th document in name order (kjv/NNNN chapters and pydoc/ files "
                                       "sorted together); neither the tokenizer nor the chat data sees them",
                       "heldout_names": list(held_docs)}}
    ctx = 256
    for name, path in (("bf16", bf16_dir), ("nvfp4", args.out)):
        eng = load(path, dtype="bfloat16", progress=False)
        with open(os.devnull, "w") as quiet:
            r = perplexity(eng, held, ctx=ctx, chunks=200, batch=8, out=quiet)
        report[f"heldout_ppl_{name}"] = {"ppl": r.ppl, "stderr": r.stderr, "tokens_scored": r.tokens_scored,
                                         "ctx": ctx}
        print(f"held-out PPL ({name} checkpoint, bf16 compute, ctx {ctx}): {r.ppl:.3f} +/- {r.stderr:.3f} "
              f"over {r.tokens_scored} tokens", flush=True)
    eng = load(args.out, dtype="float32", progress=False)
    seqs = [held[s : s + 256] for s in range(0, min(len(held) - 256, 256 * 16), 256)]
    report["mtp_acceptance"] = mtp_acceptance(eng, seqs)
    report["cache_hit_rate"] = cache_hit_rates(eng, seqs, (4, 6, 8, 12))
    print(f"MTP greedy draft acceptance: {report['mtp_acceptance']:.3f}", flush=True)
    print(f"expert LRU cache hit rate by slots/layer ({cfg.num_experts} experts, top-{cfg.num_experts_per_tok}): "
          f"{report['cache_hit_rate']}", flush=True)
    prompts = ["In the beginning", "And Jesus said unto them,", "The Python interpreter", "A list is"]
    report["samples"] = {p: sample(eng, tok, p, 48, 0.8, 40, args.seed) for p in prompts}
    report["samples_sampling"] = f"temperature 0.8, top-k 40, numpy seed {args.seed}, at most 48 tokens"
    for p, s in report["samples"].items():
        print(f"--- {p!r}\n{s}", flush=True)
    report["minutes_total"] = (time.perf_counter() - t_start) / 60
    with open(os.path.join(args.out, "training_report.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.out} ({size / 2**20:.2f} MiB of weights)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
