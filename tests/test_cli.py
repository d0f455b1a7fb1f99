"""The command-line tools as a user meets them: bad arguments and models that cannot be loaded end with one
`error:` line and a non-zero status (the server too: it does not stay up answering 503), and the
compilation cache fills on a first start so that the next one reads it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(script, *args, cache=None, timeout=300):
    env = dict(os.environ, JAXFLASH_COMPILE_CACHE=str(cache) if cache else "off")
    return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", script), *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


def start(script, *args, cache, sigint=signal.SIG_DFL):
    """`run`'s twin for a tool to interrupt: started with SIGINT's given action, not whatever pytest's own process
    has (a background job of a script inherits it ignored)."""
    env = dict(os.environ, JAXFLASH_COMPILE_CACHE=str(cache))
    return subprocess.Popen([sys.executable, os.path.join(ROOT, "scripts", script), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, sigint))


def interrupt(p) -> tuple[str, str]:
    """SIGINT to `p`: its (stdout, stderr) once it has ended, which must take less than 30 s."""
    t = time.time()
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert time.time() - t < 30
    return out, err


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.mark.parametrize("script,args,says", [
    ("serve.py", ["--port", "99999"], "a TCP port is 1..65535"),
    ("serve.py", ["--max-batch", "0"], "must be at least 1"),
    ("serve.py", ["--prefill-chunk", "0"], "must be at least 1"),
    ("serve.py", ["--vram-budget", "lots"], "cannot read 'lots' as a memory size"),
    ("serve.py", ["--model", "/nonexistent"], "/nonexistent: no such directory"),
    ("generate.py", ["--model", "/nonexistent", "--prompt", "x"], "/nonexistent: no such directory"),
    ("generate.py", ["--prompt", "x", "--top-p", "0"], "top_p must be in (0, 1]"),
    ("perplexity.py", ["--model", "/nonexistent", "-f", __file__], "/nonexistent: no such directory"),
    ("perplexity.py", ["-f", "/nonexistent/text.txt"], "cannot read /nonexistent/text.txt: No such file"),
    ("perplexity.py", ["-f", __file__, "--batch", "0"], "must be at least 1"),
])
def test_bad_arguments_end_in_one_line(script, args, says):
    r = run(script, *args, timeout=120)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert says in r.stderr and "Traceback" not in r.stderr
    assert len([l for l in r.stderr.splitlines() if l.startswith("error:") or ": error:" in l]) == 1, r.stderr


def test_a_directory_that_is_no_checkpoint(tmp_path):
    r = run("serve.py", "--model", str(tmp_path), timeout=120)
    assert r.returncode == 2 and "not a checkpoint directory (it has no config.json)" in r.stderr


def test_the_server_exits_when_the_model_cannot_be_planned():
    r = run("serve.py", "--vram-budget", "1MiB", "--expert-residency", "host", "--port", str(free_port()),
            timeout=300)
    assert r.returncode == 1, r.stderr[-2000:]
    assert "error: PlanError" in r.stderr and "Traceback" not in r.stderr


@pytest.fixture(scope="module")
def first_start(tmp_path_factory):
    """generate.py's first start on an empty compilation cache: (the cache, the run, the cache's entries and the
    program store's files right after it)."""
    cache = tmp_path_factory.mktemp("first_start") / "xla"
    r = run("generate.py", "--prompt", "And God said", "-n", "3", "--ignore-eos", cache=cache)
    listed = (lambda d: set(os.listdir(d)) if d.is_dir() else set())  # noqa: E731
    return cache, r, listed(cache), listed(cache / "jaxflash_programs")


@pytest.mark.parametrize("when", ["loading", "ready", "loading, SIGINT ignored"])
def test_ctrl_c_stops_the_server_quietly(when, tmp_path, request):
    """SIGINT while the model loads and compiles, or once it serves: the server is gone within seconds (it does
    not wait for the compilation to end), with status 130 and no traceback. The server that gets ready starts on
    generate.py's cache (first_start), which holds the programs they share (admit, release, prefill, decode@1):
    it compiles only its others; the one stopped while loading starts on an empty cache, so it is compiling.
    A server that inherits SIGINT as ignored (a background job of a script) still stops on it, through uvicorn's
    own handler, with status 0: uvicorn's re-raised signal is ignored, so no KeyboardInterrupt comes."""
    import urllib.error
    import urllib.request

    port = free_port()
    cache = request.getfixturevalue("first_start")[0] if when == "ready" else tmp_path / "xla"
    p = start("serve.py", "--port", str(port), "--max-batch", "1", cache=cache,
              sigint=signal.SIG_IGN if "ignored" in when else signal.SIG_DFL)
    want = 200 if when == "ready" else 503
    deadline = time.time() + 600
    code = 0
    while code != want and time.time() < deadline and p.poll() is None:
        try:
            code = urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status
        except urllib.error.HTTPError as e:
            code = e.code
        except OSError:
            code = 0
        time.sleep(0.1)
    assert code == want, (code, p.poll())
    _, err = interrupt(p)
    assert p.returncode == (0 if "ignored" in when else 130), err[-2000:]
    assert "Traceback" not in err


def test_ctrl_c_stops_generate_quietly(tmp_path):
    """SIGINT while generate.py compiles (an empty compilation cache): status 130 within seconds, no traceback."""
    p = start("generate.py", "--prompt", "And God said", cache=tmp_path / "xla")
    err = ""
    deadline = time.time() + 300
    while "[compiling" not in err and time.time() < deadline and p.poll() is None:
        err += p.stderr.readline()
    assert "[compiling" in err, err[-2000:]
    time.sleep(1)
    out, rest = interrupt(p)
    assert p.returncode == 130, rest[-2000:]
    assert "Traceback" not in rest and out == ""


def test_a_second_start_reads_the_compilation_cache(first_start):
    cache, r, entries, stored = first_start
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() and "3 generated" in r.stderr
    assert any(e.startswith("jit_decode") for e in entries) and any(e.startswith("jit_prefill") for e in entries)
    assert len(stored) == 4  # admit, release, prefill, decode@1 (engine/program_store.py: found without tracing)
    before = set(os.listdir(cache)), set(os.listdir(cache / "jaxflash_programs"))  # a server may have added its own
    again = run("generate.py", "--prompt", "And God said", "-n", "3", "--ignore-eos", cache=cache)
    assert again.returncode == 0  # and nothing new compiled and stored:
    assert (set(os.listdir(cache)), set(os.listdir(cache / "jaxflash_programs"))) == before
    assert again.stdout == r.stdout
