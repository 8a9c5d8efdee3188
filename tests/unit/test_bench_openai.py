"""The openai backend of `pdmesh bench serve` (services/bench/openai_backend.py) against a
real local HTTP server started here (aiohttp.web on port 0) that streams completions the
way vLLM does (SSE, return_token_ids, a usage chunk, [DONE]) at known times: the request
body, the SSE decoding across arbitrary TCP pieces, TTFT/ITL/TPOT/E2E, token ids and every
error path, then a whole run at a rate through the same runner and summary as grpc."""
from __future__ import annotations

import asyncio
import json

import pytest

aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402

from services.bench.base import ServerUnreachable, create_backend  # noqa: E402
from services.bench.datasets import BenchRequest  # noqa: E402
from services.bench.metrics import summarize  # noqa: E402
from services.bench.openai_backend import SSEDecoder, completion_body  # noqa: E402
from services.bench.runner import run_at_rate  # noqa: E402

FIRST_S, GAP_S = 0.15, 0.05      # the fake server's time to first chunk, and between chunks
HANG_GUARD_S = 30.0              # FakeServer's hold_until at most: only catches a hang


def _chunk(token_ids, text="x", finish=None, with_ids=True) -> dict:
    choice = {"index": 0, "text": text, "finish_reason": finish}
    if with_ids:
        choice["token_ids"] = token_ids
    return {"id": "cmpl-1", "object": "text_completion", "model": "m", "choices": [choice], "usage": None}


class FakeServer:
    """Streams max_tokens tokens: the first after FIRST_S, then one chunk a GAP_S, each
    token id = 100 + its position + the prompt's first id. `mode` picks a misbehaviour.
    With hold_until = n, no stream starts before n requests have arrived (HANG_GUARD_S at
    most); max_in_flight: the most requests it was answering at once."""

    def __init__(self):
        self.bodies: list[dict] = []
        self.mode = "ok"
        self.hold_until = 0
        self.in_flight = self.max_in_flight = 0
        self._arrived: asyncio.Event | None = None

    async def models(self, request):
        return web.json_response({"object": "list", "data": [
            {"id": "bench-model", "object": "model", "max_model_len": 2048},
            {"id": "other", "object": "model"}]})

    async def completions(self, request):
        body = await request.json()
        self.bodies.append(body)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.hold_until:
                self._arrived = self._arrived or asyncio.Event()
                if len(self.bodies) >= self.hold_until:
                    self._arrived.set()
                try:
                    await asyncio.wait_for(self._arrived.wait(), HANG_GUARD_S)
                except asyncio.TimeoutError:
                    pass                          # sent one after another: max_in_flight tells
            return await self._answer(request, body)
        finally:
            self.in_flight -= 1

    async def _answer(self, request, body):
        if self.mode == "http_error":
            return web.json_response({"error": {"message": "no"}}, status=400)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        base = 100 + (body["prompt"][0] if isinstance(body["prompt"], list) else 0)
        events = [_chunk([base + i], finish="length" if i == body["max_tokens"] - 1 else None,
                         with_ids=self.mode != "no_ids") for i in range(body["max_tokens"])]
        if self.mode == "id_without_text":
            events[1]["choices"][0]["text"] = ""       # held back by the detokenizer: still a token
        events.append({"id": "cmpl-1", "choices": [], "usage": {"prompt_tokens": len(body["prompt"]),
                                                                "completion_tokens": body["max_tokens"]}})
        await asyncio.sleep(FIRST_S)
        for i, event in enumerate(events):
            if self.mode == "stream_error" and i == 2:
                await resp.write(b'data: {"error": {"message": "engine died", "code": 500}}\n\n')
                return resp
            if self.mode == "truncated" and i == 2:
                return resp                               # ends cleanly, no [DONE]
            raw = f"data: {json.dumps(event)}\r\n\r\n".encode()
            if i == 0:   # an event split across TCP writes, mid-line and mid-CRLF
                for piece in (raw[:7], raw[7:-3], raw[-3:]):
                    await resp.write(piece)
                    await asyncio.sleep(0.01)
            else:
                await resp.write(b": keep-alive comment\n" + raw if i == 1 else raw)
            if i + 1 < body["max_tokens"]:
                await asyncio.sleep(GAP_S)
        await resp.write(b"data: [DONE]\n\n")
        return resp


@pytest.fixture
def server():
    """A FakeServer; _run serves it on 127.0.0.1:0 inside the test's own event loop."""
    return FakeServer()


async def _serve(fake: FakeServer) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_get("/v1/models", fake.models)
    app.router.add_post("/v1/completions", fake.completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}"


def _run(fake: FakeServer, body, **backend_options):
    async def main():
        runner, url = await _serve(fake)
        try:
            async with create_backend("openai", base_url=url, **backend_options) as backend:
                return await body(backend)
        finally:
            await runner.cleanup()
    return asyncio.run(main())


def test_sse_decoder_joins_pieces_and_data_lines_drops_comments():
    decoder = SSEDecoder()
    stream = b': hi\r\ndata: {"a":\r\ndata:  1}\r\n\r\nevent: x\nid: 3\ndata:[DONE]\n\ndata: tail'
    events = []
    for i in range(len(stream)):           # one byte at a time: every split point
        events += decoder.feed(stream[i:i + 1])
    assert events == ['{"a":\n 1}', "[DONE]"]
    assert decoder.close() == ["tail"] and decoder.close() == []
    assert SSEDecoder().feed(b"data: a\r\rdata: b\r") == ["a"]      # CR alone ends a line too


def test_request_body_is_greedy_token_ids_with_ignore_eos_only_when_asked():
    body = completion_body(BenchRequest(7, prompt_token_ids=(5, 6)), "m")
    assert body == {"model": "m", "prompt": [5, 6], "max_tokens": 7, "temperature": 0.0, "stream": True,
                    "stream_options": {"include_usage": True}, "return_token_ids": True, "ignore_eos": True}
    assert "ignore_eos" not in completion_body(BenchRequest(7, prompt="hi", ignore_eos=False), "m")
    assert completion_body(BenchRequest(7, prompt="hi"), "m")["prompt"] == "hi"


def test_one_request_times_the_stream_and_keeps_its_token_ids(server):
    async def body(backend):
        info = await backend.model_info()
        return info, await backend.one_request(BenchRequest(5, prompt_token_ids=(7, 8, 9)))

    info, r = _run(server, body)
    assert (info.id, info.max_model_len, info.vocab_size) == ("bench-model", 2048, 0)
    assert server.bodies[0]["model"] == "bench-model" and server.bodies[0]["prompt"] == [7, 8, 9]
    assert r.ok and r.output_token_ids == [107, 108, 109, 110, 111]
    assert (r.num_output_tokens, r.num_prompt_tokens) == (5, 3)
    print(f"ttft {r.ttft_s:.3f} s, itl {[round(g, 3) for g in r.itl_s]}, e2e {r.e2e_s:.3f} s")
    # No upper bounds: a loaded host delays any chunk. Lower ones hold on any host: no
    # token arrives before the server sent it.
    assert r.ttft_s >= FIRST_S
    assert len(r.itl_s) == 4 and all(gap > 0 for gap in r.itl_s)
    assert r.ttft_s + sum(r.itl_s) >= FIRST_S + 4 * GAP_S    # the last token's arrival
    assert r.ttft_s + sum(r.itl_s) <= r.e2e_s     # the gaps run from the first token to the last
    assert r.tpot_s == pytest.approx((r.e2e_s - r.ttft_s) / 4)


def test_chunks_without_ids_count_by_usage_and_ids_without_text_still_count(server):
    server.mode = "no_ids"
    r = _run(server, lambda b: b.one_request(BenchRequest(4, prompt_token_ids=(1,))))
    assert r.ok and (r.num_output_tokens, r.output_token_ids, len(r.itl_s)) == (4, [], 3)
    server.mode = "id_without_text"
    r = _run(server, lambda b: b.one_request(BenchRequest(4, prompt_token_ids=(1,))))
    assert r.ok and (r.output_token_ids, len(r.itl_s)) == ([101, 102, 103, 104], 3)


@pytest.mark.parametrize("mode, error", [("http_error", "HTTP_400"), ("stream_error", "STREAM_ERROR"),
                                         ("truncated", "INCOMPLETE")])
def test_a_failed_request_is_a_result_with_its_error(server, mode, error):
    server.mode = mode
    r = _run(server, lambda b: b.one_request(BenchRequest(4, prompt_token_ids=(1,))))
    assert (r.ok, r.error, r.e2e_s) == (False, error, 0.0)


def test_a_request_past_its_timeout_is_deadline_exceeded(server):
    r = _run(server, lambda b: b.one_request(BenchRequest(4, prompt_token_ids=(1,))), timeout_s=FIRST_S / 2)
    assert r.error == "DEADLINE_EXCEEDED"


def test_unreachable_server_and_unknown_model_are_named(server):
    async def down():
        async with create_backend("openai", base_url="http://127.0.0.1:9") as backend:
            r = await backend.one_request(BenchRequest(2, prompt_token_ids=(1,)))
            with pytest.raises(ServerUnreachable, match="GET http://127.0.0.1:9/v1/models"):
                await backend.model_info()
            return r
    assert asyncio.run(down()).error == "UNAVAILABLE"
    with pytest.raises(ValueError, match="serves no model 'nope'; it serves bench-model, other"):
        _run(server, lambda b: b.model_info(), model="nope")
    with pytest.raises(ValueError, match="http:// or https://"):
        create_backend("openai", base_url="127.0.0.1:8000")
    with pytest.raises(ValueError, match="allowed: grpc, openai"):
        create_backend("vllm")


def test_a_run_at_a_rate_summarizes_like_the_grpc_backend(server):
    requests = [BenchRequest(n, prompt_token_ids=(i,)) for i, n in enumerate((3, 1, 4))]
    server.hold_until = len(requests)      # sent one after another, the first would wait HANG_GUARD_S

    async def body(backend):
        await backend.model_info()
        return await run_at_rate(backend, requests, float("inf"))

    results, duration = _run(server, body)
    assert [r.output_token_ids for r in results] == [[100, 101, 102], [101], [102, 103, 104, 105]]
    s = summarize(results, duration)
    assert (s["completed"], s["total_output_tokens"], s["total_input_tokens"]) == (3, 8, 3)
    print(f"ttft median {s['ttft']['median_ms']:.1f} ms, itl median {s['itl']['median_ms']:.1f} ms, "
          f"run {duration:.3f} s")
    assert server.max_in_flight == 3                    # all at once, not one after another
    assert [len(r.itl_s) for r in results] == [2, 0, 3]
    assert s["ttft"]["median_ms"] >= FIRST_S * 1e3
    assert s["itl"]["median_ms"] > 0
    assert max(r.e2e_s for r in results) <= duration


def test_bench_serve_with_the_openai_backend_writes_the_json(server, tmp_path):
    from services.bench.serve import ServeConfig, run_serve_benchmark
    out = tmp_path / "serve.json"

    async def main():
        runner, url = await _serve(server)
        try:
            cfg = ServeConfig(gateway="", rates=(float("inf"),), backend="openai", base_url=url, num_prompts=3,
                              random_input_len=6, random_output_len=3, random_sigma=0.0, vocab_size=50,
                              warmup=1, out=str(out), plot="none", save_detailed=True)
            return await run_serve_benchmark(cfg, argv=["/x/bin/pdmesh", "bench", "serve", "--backend", "openai"])
        finally:
            await runner.cleanup()

    assert asyncio.run(main()) == 0
    report = json.loads(out.read_text())
    assert report["command"] == "pdmesh bench serve --backend openai"
    assert (report["backend"], report["model"]) == ("openai", "bench-model")
    assert report["target"] == report["config"]["base_url"]
    assert set(report["machine"]) >= {"python", "cpu", "cpus", "load_avg"}
    assert len(server.bodies) == 4 and all(b["ignore_eos"] and len(b["prompt"]) == 6 for b in server.bodies)
    run = report["runs"][0]
    assert (run["completed"], run["total_output_tokens"]) == (3, 9)
    assert [r["output_token_ids"] for r in run["requests"]] == [[100 + b["prompt"][0] + i for i in range(3)]
                                                                 for b in server.bodies[1:]]
    assert not (tmp_path / "serve.png").exists()


def test_the_cli_names_a_missing_base_url_and_an_unreachable_server(tmp_path):
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "services.cli", "bench", "serve", "--backend", "openai",
                               "--out", str(tmp_path / "x.json"), *args], cwd=root, capture_output=True, text=True,
                              timeout=60)
    proc = cli()
    assert proc.returncode == 2 and "--backend openai needs --base-url" in proc.stderr
    proc = cli("--base-url", "http://127.0.0.1:9")
    assert proc.returncode == 1 and "error: GET http://127.0.0.1:9/v1/models: ClientConnectorError" in proc.stderr
