"""The HTTP warm-up never holds more requests open than the daemon admits: a case with
several choices opens one request per choice, and is sent when nothing else is open, so a
daemon at its --max-pending-requests limit never answers the warm-up 429."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

from specd.daemon.http_warmup import Case, cases, warm_up_http


class CountingServer:
    """Answers each POST after a pause, 429 when its choices would pass `limit` open."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.open = 0
        self.most_open = 0

    async def handle(self, request: web.Request) -> web.Response:
        body = json.loads(await request.read() or b"{}")
        opens = int(body.get("n", 1))
        if self.open + opens > self.limit:
            return web.json_response({"error": {"message": "overloaded"}}, status=429)
        self.open += opens
        self.most_open = max(self.most_open, self.open)
        await asyncio.sleep(0.05)
        self.open -= opens
        return web.json_response({"ok": True})


def _ok(body: bytes) -> str | None:
    return None if json.loads(body) == {"ok": True} else "not ok"


async def _warm_up(limit: int, all_cases: list[Case]) -> CountingServer:
    server = CountingServer(limit)
    app = web.Application()
    app.router.add_post("/{tail:.*}", server.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        await warm_up_http("127.0.0.1", port, None, "token", all_cases, limit)
    finally:
        await runner.cleanup()
    return server


def _case(name: str, choices: int) -> Case:
    return Case(name, "POST", "/v1/completions", {"n": choices}, 200, _ok, opens=choices)


def test_a_case_of_several_choices_never_overfills_the_daemon() -> None:
    all_cases = [_case(f"single {i}", 1) for i in range(6)]
    all_cases.insert(2, _case("two choices", 2))
    server = asyncio.run(_warm_up(4, all_cases))  # raises HttpWarmUpFailed on a 429
    assert server.most_open == 4


def test_the_choices_case_asks_no_more_choices_than_the_daemon_admits() -> None:
    (several,) = [c for c in cases("m", True, 10, max_open=1) if c.opens != 1 or
                  (c.body or {}).get("n") is not None]
    assert several.body is not None and several.body["n"] == 1 and several.opens == 1
    (two,) = [c for c in cases("m", True, 10, max_open=4) if c.opens > 1]
    assert two.body is not None and two.body["n"] == 2
