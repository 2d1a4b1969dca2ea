"""`specjax serve`: the OpenAI-compatible API through the official `openai` client, answers equal
to `specjax generate` alone under concurrency, streaming, usage figures, bad requests, a full
queue, clients that leave, a bounded load test and SIGTERM."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from specjax.cli import main  # noqa: E402
from specjax.generate import Engine  # noqa: E402
from specjax.loading import load_model  # noqa: E402
from specjax.methods import make_proposer  # noqa: E402
from specjax.random_heads import random_head_checkpoint  # noqa: E402
from specjax.serving.scheduler import Scheduler  # noqa: E402
from specjax.serving.server import TextStream, create_app, running_in_thread  # noqa: E402

PROMPTS = [
    "Hello! How are you",
    "def add(a, b):",
    "1 + 1 = 2, 2 + 2",
    "The quick brown fox",
    "Hello! How are you today?",
    "3 * 3 = 9, and",
    "thank you, I am",
    "def fib(n):",
]


@contextlib.contextmanager
def serving(model, method="vanilla", heads=None, exit_on_failure=False, app_options=None, **scheduler_options):
    """A server on a free local port in this process; yields (base url, scheduler)."""
    options = {} if heads is None else {"heads": str(heads)}
    proposer, pparams = make_proposer(method, model, **options)
    engine = Engine(model.params, model.config, num_pages=scheduler_options.pop("num_pages", 128), page_size=16)
    sched = Scheduler(engine, proposer, pparams, **scheduler_options)
    app = create_app(sched, model.tokenizer, "tiny", exit_on_failure=exit_on_failure, **(app_options or {}))
    with running_in_thread(app) as url:
        yield url, sched


@pytest.fixture(scope="module")
def tiny(tiny_llama, tmp_path_factory):
    d = tiny_llama[0]
    heads = random_head_checkpoint("eagle", load_model(str(d)), tmp_path_factory.mktemp("eagle"))
    return d, load_model(str(d)), heads


def _generate_alone(capsys, d, method, heads, prompt, n, raw=False):
    args = [
        "generate",
        "--model",
        str(d),
        "--method",
        method,
        "--json",
        "--max-new-tokens",
        str(n),
        "--prompt",
        prompt,
    ] + (["--heads", str(heads)] if method == "eagle2" else [])
    assert main(args + (["--raw"] if raw else [])) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.parametrize("method", ["vanilla", "pld", "eagle2"])
def test_concurrent_answers_equal_specjax_generate_alone(tiny, capsys, method):
    d, model, heads = tiny
    alone = [_generate_alone(capsys, d, method, heads, p, 12) for p in PROMPTS]
    raw = _generate_alone(capsys, d, method, heads, PROMPTS[1], 12, raw=True)
    # budget=False: every step verifies the whole tree, so target passes compare too
    with serving(model, method, heads if method == "eagle2" else None, max_batch=4, budget=False) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        got = [None] * len(PROMPTS)

        def ask(i):
            got[i] = client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": PROMPTS[i]}], temperature=0, max_tokens=12
            )

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for want, answer in zip(alone, got):
            assert answer.choices[0].message.content == want["text"]
            u = answer.usage
            assert u.completion_tokens == want["new_tokens"]
            assert u.total_tokens == u.prompt_tokens + u.completion_tokens
            assert u.model_extra["steps"] == want["steps"]  # the same target passes as alone
            if method != "vanilla":
                # verified drafts; a step cut by max_tokens keeps fewer than it accepted
                accepted = u.model_extra["accepted_draft_tokens"]
                assert want["new_tokens"] - want["steps"] <= accepted <= want["new_tokens"]
                assert 0 <= u.model_extra["acceptance_rate"] <= 1
        stream = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": PROMPTS[0]}], temperature=0, max_tokens=12, stream=True
        )
        chunks = list(stream)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == alone[0]["text"]
        assert chunks[-1].usage.completion_tokens == alone[0]["new_tokens"]
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")
        text = client.completions.create(model="tiny", prompt=PROMPTS[1], temperature=0, max_tokens=12)
        assert text.choices[0].text == raw["text"]
        pieces = [
            c.choices[0].text
            for c in client.completions.create(
                model="tiny", prompt=PROMPTS[1], temperature=0, max_tokens=12, stream=True
            )
        ]
        assert "".join(pieces) == raw["text"]


def test_sampled_answers_reproduce_for_a_seed_whatever_runs_beside(tiny):
    d, model, _ = tiny
    with serving(model, max_batch=4) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")

        def ask(seed, prompt=PROMPTS[3]):
            return (
                client.completions.create(
                    model="tiny", prompt=prompt, temperature=0.9, top_p=0.95, max_tokens=16, seed=seed
                )
                .choices[0]
                .text
            )

        alone = ask(7)
        others = [threading.Thread(target=ask, args=(s, PROMPTS[s % 8])) for s in range(6)]
        for t in others:
            t.start()
        beside = ask(7)
        for t in others:
            t.join()
        assert beside == alone
        assert len({ask(s) for s in range(4)}) > 1  # the seed matters


@pytest.mark.parametrize(
    "body,field",
    [
        (b"{not json", "body"),
        (b"[1, 2]", "body"),
        ({"prompt": "hi", "temperature": -1}, "temperature"),
        ({"prompt": "hi", "temperature": "hot"}, "temperature"),
        ({"prompt": "hi", "top_p": 0}, "top_p"),
        ({"prompt": "hi", "top_k": 1.5}, "top_k"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "hi", "n": 2}, "n"),
        ({"prompt": "hi", "stop": 5}, "stop"),
        ({"prompt": "hi", "stream": "yes"}, "stream"),
        ({"prompt": ""}, "prompt"),
        ({}, "prompt"),
        ({"prompt": "hi " * 400, "max_tokens": 200}, "context"),
        ({"messages": "hi"}, "messages"),
        (b'{"prompt": "hi", "temperature": NaN}', "temperature"),
        (b'{"prompt": "hi", "top_p": Infinity}', "top_p"),
        ({"prompt": "hi", "seed": 2**64}, "seed"),
        ({"prompt": "hi", "seed": 10**400}, "seed"),
        (b'{"prompt": "\\ud800 hi"}', "prompt"),
        (b'{"messages": [{"role": "user", "content": "\\udfff"}]}', "messages"),
        ({"prompt": "hi", "logprobs": True}, "logprobs"),
        ({"prompt": "hi", "presence_penalty": 0.5}, "presence_penalty"),
        ({"prompt": "hi", "logit_bias": {"5": 1}}, "logit_bias"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ],
)
def test_bad_requests_get_400_naming_the_field(tiny, body, field):
    _, model, _ = tiny
    path = "/v1/chat/completions" if "messages" in str(body) else "/v1/completions"
    with serving(model, max_batch=1) as (url, sched):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = httpx.post(url + path, content=data, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert field in message and "\n" not in message
        ok = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert ok.status_code == 200  # the server keeps serving


def test_any_64_bit_seed_has_a_key_of_its_own(tiny):
    """Seeds past int32 (a random uint64) are accepted and reproduce; 2**32 + 5 is not 5."""
    _, model, _ = tiny
    with serving(model, max_batch=2) as (url, sched):

        def ask(seed):
            body = {"prompt": "The quick brown fox", "max_tokens": 8, "temperature": 1.0, "seed": seed}
            r = httpx.post(url + "/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        big = ask(2**64 - 1)
        assert ask(2**64 - 1) == big
        assert len({ask(2**32 + 5), ask(5), ask(2**63)}) > 1
        assert sched.error is None


def test_a_failed_step_fails_its_requests_and_the_server_goes_on(tiny, monkeypatch):
    """A round that raises ends its requests with a 500 that holds no internal text; the next
    request is answered as before. Rounds that keep failing stop the loop for good: waiting
    and new requests get 503 at once and /health says so."""
    import specjax.serving.scheduler as scheduler_module
    import specjax.serving.server as server_module

    _, model, _ = tiny
    real = scheduler_module.advance
    signals = []  # `specjax serve` signals itself to exit once the loop has stopped for good
    monkeypatch.setattr(server_module.os, "kill", lambda pid, sig: signals.append((pid, sig)))
    with serving(model, max_batch=1, exit_on_failure=True) as (url, sched):
        want = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=120).json()
        calls = {"n": 0}

        def broken(*args, **kwargs):
            calls["n"] += 1
            raise RuntimeError("internal detail 12345")

        monkeypatch.setattr(scheduler_module, "advance", broken)
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=120)
        assert r.status_code == 500 and "12345" not in r.text and "failed" in r.json()["error"]["message"]
        monkeypatch.setattr(scheduler_module, "advance", real)
        again = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=120)
        assert again.status_code == 200 and again.json()["choices"] == want["choices"]
        assert sched.error is None and sched.engine.allocator.num_free == sched.engine.allocator.num_pages

        monkeypatch.setattr(scheduler_module, "advance", broken)
        codes = [
            httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=120).status_code
            for _ in range(scheduler_module.MAX_FAILED_ROUNDS)
        ]
        assert codes[:-1] == [500] * (len(codes) - 1) and codes[-1] == 503
        assert sched.error is not None
        t = time.perf_counter()
        late = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=120)
        assert late.status_code == 503 and time.perf_counter() - t < 5
        health = httpx.get(url + "/health")
        assert health.status_code == 503 and "12345" not in health.text
        deadline = time.time() + 10
        while not signals and time.time() < deadline:
            time.sleep(0.1)
        assert signals == [(os.getpid(), signal.SIGTERM)]


def test_limits_model_names_api_keys_and_fields_as_clients_expect(tiny):
    """413 past --max-request-bytes, 400 past --max-input-tokens, 404 for a model not served,
    401 without the API key; an omitted max_tokens answers what fits, top_k -1 is off,
    neutral values of unsupported fields and text-part content are accepted."""
    _, model, _ = tiny
    options = dict(api_key="sekrit", max_request_bytes=2000, max_input_tokens=40, aliases=("tiny-alias",))
    key = {"authorization": "Bearer sekrit"}
    with serving(model, max_batch=2, num_pages=4, app_options=options) as (url, sched):

        def post(path, body, headers=key):
            return httpx.post(url + path, json=body, headers=headers, timeout=120)

        assert post("/v1/completions", {"prompt": "hi", "max_tokens": 2}, {}).status_code == 401
        assert (
            post("/v1/completions", {"prompt": "hi", "max_tokens": 2}, {"authorization": "Bearer no"}).status_code
            == 401
        )
        assert httpx.get(url + "/v1/models").status_code == 401 and httpx.get(url + "/health").status_code == 200
        assert httpx.get(url + "/v1/models", headers=key).json()["data"][0]["id"] == "tiny"
        big = post("/v1/completions", {"prompt": "x" * 3000, "max_tokens": 2})
        assert big.status_code == 413
        long = post("/v1/completions", {"prompt": "hello " * 60, "max_tokens": 2})
        assert long.status_code == 400 and long.json()["error"]["param"] == "prompt"
        other = post("/v1/completions", {"model": "gpt-4", "prompt": "hi", "max_tokens": 2})
        assert other.status_code == 404 and other.json()["error"]["param"] == "model"
        for name in ("tiny", "tiny-alias"):
            assert post("/v1/completions", {"model": name, "prompt": "hi", "max_tokens": 2}).status_code == 200
        fits = post("/v1/completions", {"prompt": "The quick brown fox", "temperature": 0})
        usage = fits.json()["usage"]
        assert fits.status_code == 200 and 0 < usage["completion_tokens"]
        assert usage["prompt_tokens"] + usage["completion_tokens"] <= 4 * 16  # the pool's room
        neutral = {"top_k": -1, "logprobs": False, "presence_penalty": 0, "logit_bias": {}, "temperature": 0}
        assert post("/v1/completions", {"prompt": "hi", "max_tokens": 3, **neutral}).status_code == 200
        text = {"role": "user", "content": "Hello! How are you"}
        parts = {
            "role": "user",
            "content": [{"type": "text", "text": "Hello!"}, {"type": "text", "text": "How are you"}],
        }
        joined = {"role": "user", "content": "Hello!\nHow are you"}
        answers = [
            post("/v1/chat/completions", {"messages": [m], "max_tokens": 4, "temperature": 0}).json()["choices"]
            for m in (parts, joined, text)
        ]
        assert answers[0] == answers[1]


def test_queue_full_gets_429_with_retry_after(tiny):
    _, model, _ = tiny
    with serving(model, max_batch=1, max_queue=1) as (url, sched):
        running = sched.submit([5, 6, 7], 400)
        running.events.get(timeout=120)  # it holds the one slot
        queued = sched.submit([5, 6, 7], 4)  # and this one the one queue place
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert "queued" in r.json()["error"]["message"]
        running.cancel()
        assert len(queued.result(timeout=120)) <= 4


def test_a_client_that_leaves_mid_stream_frees_its_slot(tiny):
    _, model, _ = tiny
    with serving(model, max_batch=1, sync_steps=1) as (url, sched):
        with httpx.stream(
            "POST", url + "/v1/completions", json={"prompt": "hi", "max_tokens": 400, "stream": True}
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break  # one chunk, then hang up
        deadline = time.time() + 60
        while (
            sched.busy() or sched.engine.allocator.num_free != sched.engine.allocator.num_pages
        ) and time.time() < deadline:
            time.sleep(0.05)
        assert sched.busy() == 0 and sched.stats["cancelled"] == 1
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3


def test_a_client_that_leaves_a_non_streaming_request_cancels_it(tiny, monkeypatch):
    """The server notices a waiting client has gone within a poll and the request stops there,
    long before its max_tokens (no EOS: it would run to the context's end)."""
    import specjax.serving.server as server_module

    _, model, _ = tiny
    monkeypatch.setattr(server_module, "DISCONNECT_POLL", 0.05)
    with serving(model, max_batch=1, sync_steps=1, eos_token_ids=()) as (url, sched):
        body = {"prompt": "hi", "max_tokens": 400, "temperature": 1.0}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", json=body, timeout=0.2)
        deadline = time.time() + 60
        while (sched.busy() or sched.stats["cancelled"] == 0) and time.time() < deadline:
            time.sleep(0.05)
        assert sched.busy() == 0 and sched.stats["cancelled"] == 1 and sched.stats["disconnected"] == 1
        assert sched.stats["new_tokens"] < 400
        assert sched.engine.allocator.num_free == sched.engine.allocator.num_pages


def test_models_health_and_metrics(tiny):
    _, model, _ = tiny
    with serving(model, max_batch=2) as (url, _):
        assert httpx.get(url + "/health").json() == {"status": "ok"}
        assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]] == ["tiny"]
        httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3})
        httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 0})
        text = httpx.get(url + "/metrics").text
        for name in (
            "specjax_requests_total 1",
            "specjax_queue_depth 0",
            "specjax_kv_pages_total 128",
            'specjax_http_responses_total{status="200"} 1',
            'specjax_http_responses_total{status="400"} 1',
            "specjax_generated_tokens_total",
            "specjax_steps_total",
            "specjax_tokens_per_step",
        ):
            assert name in text, text


def test_stop_strings_end_the_answer_before_them(tiny):
    _, model, _ = tiny
    with serving(model, max_batch=2) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        full = client.completions.create(model="tiny", prompt=PROMPTS[2], temperature=0, max_tokens=16).choices[0].text
        # the first two characters after the third that are not all blank
        stop = next((full[i : i + 2] for i in range(3, len(full) - 1) if full[i : i + 2].strip()), None)
        assert stop, f"the tiny model's answer {full!r} has no stop string to cut at"
        cut = client.completions.create(model="tiny", prompt=PROMPTS[2], temperature=0, max_tokens=16, stop=[stop])
        assert cut.choices[0].text == full[: full.index(stop)]
        assert cut.choices[0].finish_reason == "stop"
        streamed = "".join(
            c.choices[0].text
            for c in client.completions.create(
                model="tiny", prompt=PROMPTS[2], temperature=0, max_tokens=16, stop=[stop], stream=True
            )
        )
        assert streamed == cut.choices[0].text


def test_text_stream_holds_back_what_may_become_a_stop_string():
    class Chars:  # token i is chr(i)
        def decode(self, ids, skip_special_tokens=True):
            return "".join(map(chr, ids))

    s = TextStream(Chars(), ["END"])
    assert s.push([ord("a"), ord("E")]) == "a"  # "E" may start "END"
    assert s.push([ord("x")]) == "Ex"
    assert s.push([ord("E"), ord("N")]) == ""
    assert s.push([ord("D"), ord("z")]) == "" and s.stopped and s.text == "aEx"


def test_load_64_requests_at_concurrency_16(tiny):
    """Every request answered, none lost or mixed up: each equals its prompt's answer alone."""
    _, model, _ = tiny
    engine = Engine(model.params, model.config, num_pages=64, page_size=16)
    tok = model.tokenizer
    lengths = [4 + (i % 5) * 3 for i in range(8)]
    want = {
        i: tok.decode(engine.generate([tok(PROMPTS[i]).input_ids], lengths[i]).token_ids[0], skip_special_tokens=True)
        for i in range(8)
    }
    with serving(model, max_batch=8, num_pages=256) as (url, sched):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        got = {}
        lock = threading.Lock()
        jobs = list(range(64))

        def worker():
            while True:
                with lock:
                    if not jobs:
                        return
                    j = jobs.pop()
                i = j % 8
                out = (
                    client.completions.create(model="tiny", prompt=PROMPTS[i], temperature=0, max_tokens=lengths[i])
                    .choices[0]
                    .text
                )
                with lock:
                    got[j] = out

        threads = [threading.Thread(target=worker) for _ in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        assert sorted(got) == list(range(64))
        assert all(got[j] == want[j % 8] for j in got)
        assert sched.stats["finished"] == 64 and sched.queue_depth() == 0


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_finishes_in_flight_requests_then_exits(tiny):
    d, _, _ = tiny
    port = _free_port()
    env = {**os.environ, "SPECJAX_COMPILE_CACHE": "0"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "specjax.cli",
            "serve",
            "--model",
            str(d),
            "--port",
            str(port),
            "--max-batch",
            "2",
            "--cache-pages",
            "64",
        ],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline and proc.poll() is None, proc.stderr.read()
            time.sleep(0.2)
        lines = []
        with httpx.stream(
            "POST",
            url + "/v1/completions",
            timeout=120,
            json={"prompt": "hi", "max_tokens": 48, "stream": True, "temperature": 0},
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and not lines:
                    proc.send_signal(signal.SIGTERM)  # mid-answer
                if line:
                    lines.append(line)
        assert lines[-1] == "data: [DONE]"
        # uvicorn re-raises the signal once it has drained, so the exit status is the signal's
        assert proc.wait(60) in (0, -signal.SIGTERM)
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
