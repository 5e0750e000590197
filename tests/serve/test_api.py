"""The OpenAI API of a live server (a child process on 127.0.0.1), through the official `openai`
client and plain HTTP: answers equal to LLM.generate's, streams, batching, and every error."""
from __future__ import annotations

import http.client
import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from flexgen_sparpr.api.llm import LLM

from tests.serve.live import API_KEY, Server, kv_files

pytestmark = pytest.mark.slow  # the prepared SmolLM2's tokenizer (tests/serve/conftest.py)
openai = pytest.importorskip("openai", reason="the server's tests need the openai client (requirements.txt)")

# cache half on disk (offload files to free), blocks of 16 tokens (a KV policy has blocks to choose from)
FLAGS = ["--gpu-batch-size", "4", "--percent", "100", "0", "50", "0", "100", "0", "--block-size", "16"]


@pytest.fixture(scope="module")
def server(tiny_chat_dir, tmp_path_factory):
    s = Server(["--model", str(tiny_chat_dir), *FLAGS, "--api-key", API_KEY, "--max-queue", "4",
                "--batch-window", "0.3"], tmp_path_factory.mktemp("offload"))
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def llm(tiny_chat_dir, tmp_path_factory):
    with LLM(str(tiny_chat_dir), gpu_batch_size=4, percent=[100, 0, 50, 0, 100, 0], block_size=16, quiet=True,
             offload_dir=str(tmp_path_factory.mktemp("ref-offload"))) as m:
        yield m


@pytest.fixture(scope="module")
def chat_llm(tiny_chat_dir, tmp_path_factory):
    with LLM(str(tiny_chat_dir), gpu_batch_size=4, block_size=16, chat=True, quiet=True,
             offload_dir=str(tmp_path_factory.mktemp("ref-offload"))) as m:
        yield m


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def sse(server, path: str, body: dict, key: str = API_KEY) -> list[str]:
    """The `data:` payloads of a streamed answer, over plain HTTP."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json",
                                                  "Authorization": f"Bearer {key}"})
    r = conn.getresponse()
    assert r.status == 200 and r.getheader("content-type").startswith("text/event-stream")
    out = [line[6:] for line in r.read().decode().splitlines() if line.startswith("data: ")]
    conn.close()
    return out


def test_models_and_health(server, client, tiny_chat_dir):
    status, body = server.get("/health")
    health = json.loads(body)
    assert status == 200 and health["status"] == "ok"
    # the engine's settings as it resolved the server's flags (api/resolved.py): what bench_serve records
    assert {"device", "compute_dtype", "kv_dtype", "block_size", "weight_format", "kv_policy"} <= set(health["resolved"])
    assert [m.id for m in client.models.list().data] == [str(tiny_chat_dir)]


def test_greedy_completion_and_chat_equal_llm_generate(client, llm, chat_llm):
    model = client.models.list().data[0].id
    prompt = "The capital of France is"
    want = llm.generate(prompt, 12)[0]
    got = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
    assert got.choices[0].text == want.text and got.choices[0].finish_reason == want.finish_reason
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    assert got.usage.completion_tokens == len(want.token_ids)
    question = "What is a KV cache?"
    want = chat_llm.generate(question, 10)[0]
    got = client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                         max_tokens=10, temperature=0)
    assert got.choices[0].message.content == want.text and got.choices[0].message.role == "assistant"
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)


def test_streams_join_to_the_whole_answer(server, client):
    model = client.models.list().data[0].id
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 9, "temperature": 0}
    whole = server.post("/v1/completions", body)[1]["choices"][0]["text"]
    events = sse(server, "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == whole
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 9
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=7, temperature=0, stream=True)
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    whole = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=7, temperature=0).choices[0].message.content
    assert "".join(pieces) == whole and whole


def test_four_concurrent_requests_share_one_batch_each_with_its_own_answer(server, llm):
    prompts = ["Red apples grow on", "Blue whales swim in", "Green grass needs some", "The cat sat on"]
    assert len({len(llm.encode(p)[0]) for p in prompts}) == 1  # one length: no padding, the same batch shape
    want = [o.text for o in llm.generate(prompts, 8)]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda p: server.post("/v1/completions", {"prompt": p, "max_tokens": 8,
                                                                       "temperature": 0})[1], prompts))
    assert [g["choices"][0]["text"] for g in got] == want and len(set(want)) == 4
    assert len({g["flexgen"]["batch_id"] for g in got}) == 1 and got[0]["flexgen"]["batch_rows"] == 4


def test_a_bad_request_does_not_disturb_its_batch(server, llm):
    prompts = ["Red apples grow on", "Blue whales swim in", "Green grass needs some"]
    want = [o.text for o in llm.generate(prompts, 6)]
    bodies = [{"prompt": p, "max_tokens": 6, "temperature": 0} for p in prompts] + [{"prompt": "x", "max_tokens": 0}]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda b: server.post("/v1/completions", b), bodies))
    assert [s for s, _ in got] == [200, 200, 200, 400]
    assert [g["choices"][0]["text"] for _, g in got[:3]] == want
    assert len({g["flexgen"]["batch_id"] for _, g in got[:3]}) == 1 and got[0][1]["flexgen"]["batch_rows"] == 3


def test_stop_strings_logprobs_and_seeds(client):
    model = client.models.list().data[0].id
    base = dict(model=model, prompt="Numbers: one two three", max_tokens=12, temperature=0)
    text = client.completions.create(**base).choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    cut = client.completions.create(**base, stop=[stop, "never-there"]).choices[0]
    assert cut.text == text[:text.find(stop)] and cut.finish_reason == "stop"
    lp = client.completions.create(**base, logprobs=3).choices[0].logprobs
    assert len(lp.tokens) == 12 and all(len(t) <= 3 for t in lp.top_logprobs)
    assert all(abs(v - max(t.values())) < 1e-5 for v, t in zip(lp.token_logprobs, lp.top_logprobs))  # greedy
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2).choices[0].logprobs
    assert len(chat.content) == 4 and all(len(c.top_logprobs) == 2 for c in chat.content)
    sample = dict(model=model, prompt="Tell me", max_tokens=10, temperature=1.0, top_p=0.9)
    a, b, c = (client.completions.create(**sample, seed=s).choices[0].text for s in (7, 7, 8))
    assert a == b and a != c


def test_per_request_kv_policy(server):
    prompt = list(range(100, 300))  # token ids: 200 tokens, 13 blocks of 16
    dense = server.post("/v1/completions", {"prompt": prompt, "max_tokens": 4, "temperature": 0})[1]
    sparse = server.post("/v1/completions", {"prompt": prompt, "max_tokens": 4, "temperature": 0,
                                            "kv_policy": "sparpr", "keep_ratio": 0.25, "min_keep_tokens": 0})[1]
    assert dense["flexgen"]["kv_read_share"] == 1.0 and sparse["flexgen"]["kv_read_share"] < 0.6
    assert sparse["flexgen"]["kv_policy"] == {"keep_ratio": 0.25, "kv_policy": "sparpr", "min_keep_tokens": 0}
    status, err = server.post("/v1/completions", {"prompt": "x", "max_tokens": 2, "kv_policy": "dkv"})
    assert status == 400 and "dkv" in err["error"]["message"] and err["error"]["param"] == "kv_policy"  # its why
    assert server.metric("flexgen_sparpr_kv_blocks_total") > 0
    assert server.metric("flexgen_sparpr_bytes_moved_total") > 0  # half the cache lives on disk


def test_a_conversation_sent_again_prefills_only_its_new_turn(server, client, chat_llm):
    """Prefix reuse: turn 2 repeats turn 1 and its answer; the kept cache (half on disk here) holds
    them, so only the new turn is prefilled, and the answer is generate()'s for the same messages."""
    model = client.models.list().data[0].id
    hits = server.metric("flexgen_sparpr_prefix_cache_tokens_total")
    msgs = [{"role": "user", "content": "Tell me about the sea, the sky and the mountains."}]
    one = server.post("/v1/chat/completions", {"model": model, "messages": msgs, "max_tokens": 12,
                                               "temperature": 0})[1]
    msgs += [{"role": "assistant", "content": one["choices"][0]["message"]["content"]},
             {"role": "user", "content": "And the rivers?"}]
    two = server.post("/v1/chat/completions", {"model": model, "messages": msgs, "max_tokens": 12,
                                               "temperature": 0})[1]
    prompt_tokens = two["usage"]["prompt_tokens"]
    reused = two["flexgen"]["prefix_reused_tokens"]
    assert one["usage"]["prompt_tokens"] < reused < prompt_tokens  # turn 1 and (most of) its answer
    assert server.metric("flexgen_sparpr_prefix_cache_tokens_total") > hits
    assert server.metric("flexgen_sparpr_prefix_cache_hits_total") >= 1
    assert server.metric("flexgen_sparpr_prefix_cache_bytes") > 0
    text = chat_llm.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    ids = chat_llm.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == prompt_tokens
    want = chat_llm.generate([ids], 12)[0]
    assert two["choices"][0]["message"]["content"] == want.text


@pytest.mark.parametrize("body, status, param", [
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 600}, 400, "max_tokens"),  # past the tiny model's 512 positions
    ({"prompt": list(range(5, 510)), "max_tokens": 10}, 400, "max_tokens"),
    ({"prompt": 5}, 400, "prompt"),
    ({"prompt": "hi", "n": 2}, 400, "n"),
    ({"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": "hi", "stop": 5}, 400, "stop"),
    ({"prompt": "hi", "min_keep_tokens": -1}, 400, "min_keep_tokens"),
    ({"prompt": "hi", "logprobs": 99}, 400, "logprobs"),
    ({"prompt": "hi", "kv_policy": "no-such"}, 400, "kv_policy"),
    ({"prompt": "hi", "model": "gpt-4"}, 404, "model"),
])
def test_bad_completion_requests(server, body, status, param):
    got, err = server.post("/v1/completions", body)
    assert got == status and err["error"]["param"] == param and err["error"]["message"]


def test_bad_chat_requests_and_other_errors(server):
    for body in ({"messages": []}, {"messages": [{"content": "no role"}]}, {"messages": "hi"}):
        got, err = server.post("/v1/chat/completions", body)
        assert got == 400 and err["error"]["param"] == "messages"
    got, err = server.post("/v1/completions", b"{not json")
    assert got == 400 and err["error"]["type"] == "invalid_request_error"
    got, err = server.post("/v1/completions", {"prompt": "hi", "max_tokens": 1}, key="wrong")
    assert got == 401 and err["error"]["type"] == "authentication_error"
    got, ok = server.post("/v1/completions", {"prompt": "hi", "max_tokens": 1, "temperature": 0, "frobnicate": [1]})
    assert got == 200 and ok["usage"]["completion_tokens"] == 1  # unknown fields are ignored
    assert server.metric('flexgen_sparpr_requests_total') >= 3


def test_disconnect_cancels_and_frees_the_kv(server):
    """The left request's own offload files go; earlier answered requests' kept caches (prefix
    reuse) stay until evicted or shutdown."""
    before = server.metric("flexgen_sparpr_requests_cancelled_total")
    kept = set(kv_files(server.offload_dir))
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": "Go on and on", "max_tokens": 480,
                                                        "stream": True}),
                 {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
    r = conn.getresponse()
    for _ in range(3):
        assert r.readline().startswith(b"data: ")
        r.readline()
    assert set(kv_files(server.offload_dir)) - kept  # the batch's disk blocks exist while it runs
    conn.sock.shutdown(2)
    conn.close()
    end = time.monotonic() + 30
    while (set(kv_files(server.offload_dir)) - kept or server.metric("flexgen_sparpr_running_requests")) \
            and time.monotonic() < end:
        time.sleep(0.2)
    assert not set(kv_files(server.offload_dir)) - kept
    assert server.metric("flexgen_sparpr_requests_cancelled_total") == before + 1
    assert server.metric("flexgen_sparpr_generation_tokens_total") < 480 * 10  # it did not run to the end
    # a whole (not streamed) answer's client leaving cancels it too
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": "Go on and on", "max_tokens": 480}),
                 {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
    time.sleep(1.5)
    conn.sock.shutdown(2)
    conn.close()
    end = time.monotonic() + 30
    while server.metric("flexgen_sparpr_requests_cancelled_total") < before + 2 and time.monotonic() < end:
        time.sleep(0.2)
    assert server.metric("flexgen_sparpr_requests_cancelled_total") == before + 2
    while (set(kv_files(server.offload_dir)) - kept or server.metric("flexgen_sparpr_running_requests")) \
            and time.monotonic() < end:
        time.sleep(0.2)
    assert not set(kv_files(server.offload_dir)) - kept


def test_queue_full_is_a_clean_429_and_queued_requests_still_answer(server):
    """4 long streams fill the batch, 4 requests fill the queue (--max-queue 4), the next gets 429;
    the long streams then leave and the queued four are answered."""
    conns = []
    for i in range(4):
        c = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        c.request("POST", "/v1/completions", json.dumps({"prompt": f"Long story {i}", "max_tokens": 480,
                                                         "stream": True}),
                  {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
        conns.append(c)
    responses = [c.getresponse() for c in conns]
    for r in responses:
        assert r.readline().startswith(b"data: ")
    queued = []
    pool = ThreadPoolExecutor(4)
    for i in range(4):
        queued.append(pool.submit(server.post, "/v1/completions", {"prompt": f"Short {i}", "max_tokens": 3, "temperature": 0}))
    end = time.monotonic() + 20
    while server.metric("flexgen_sparpr_queue_depth") < 4 and time.monotonic() < end:
        time.sleep(0.05)
    got, err = server.post("/v1/completions", {"prompt": "one too many", "max_tokens": 3})
    assert got == 429 and err["error"]["type"] == "rate_limit_error"
    for c in conns:
        c.sock.shutdown(2)
        c.close()
    answers = [f.result(timeout=60) for f in queued]
    pool.shutdown()
    assert [s for s, _ in answers] == [200] * 4
    assert all(a["usage"]["completion_tokens"] == 3 for _, a in answers)


def test_clients_within_the_queue_limit_never_see_a_429_and_nothing_is_lost(server):
    """4 clients (--max-queue 4: at most 4 requests can ever wait) sending back to back for 4 s:
    every request answered, counted once by the server as by the client (bench/serve_load.py)."""
    from flexgen_sparpr.bench.serve_load import mixed_prompts, run_level
    level = run_level(server.port, 4, 4.0, mixed_prompts([20, 80, 200], 16, seed=0), max_tokens=2, key=API_KEY)
    s = level.summary()
    assert s["answered"] >= 8 and s["by_status"] == {"200": s["requests"]}
    assert s["lost"] == 0 and s["duplicate_answers"] == 0
