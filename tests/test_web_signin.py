"""The bridge's sign-in, without a server: a key checked once buys a short-lived token cookie; past its expiry the
token opens no websocket and starts no session; sign-ins cannot grow the bridge without bound."""
from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer

from backend.api import contract as c
from backend.api.refusal import Refusal
from client.web import app as web_app
from client.web.app import Access, make_app
from client.web.signin import COOKIE, MAX_TOKENS, Tokens


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_token_stands_for_its_key_until_its_expiry_and_the_table_is_bounded() -> None:
    clock = Clock()
    tokens = Tokens(ttl_s=60.0, clock=clock)
    token, grant = tokens.issue("lbk_alice")
    assert tokens.grant(token).key == "lbk_alice" and grant.expires_s == 1060.0
    assert tokens.grant("forged") is None and tokens.grant(None) is None
    clock.now = 1060.0
    assert tokens.grant(token) is None
    for _ in range(MAX_TOKENS + 5):
        tokens.issue("lbk_x")
    assert len(tokens._grants) == MAX_TOKENS


def test_a_token_past_its_expiry_opens_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    checked = []

    def check_key(url, model, connection, timeout_s=30.0):
        checked.append(connection.key)
        return None if connection.key == "lbk_good" else Refusal(c.AUTH_INVALID, "the key is not valid here")

    monkeypatch.setattr(web_app, "check_key", check_key)
    clock = Clock()
    access = Access(frozenset({"http://127.0.0.1"}), host_origin=True)

    async def scenario() -> None:
        app = make_app("127.0.0.1:1", c.MODEL_NAME, 10.0, access, tokens=Tokens(ttl_s=30.0, clock=clock))
        async with TestClient(TestServer(app)) as client:
            origin = {"Origin": str(client.make_url("")).rstrip("/")}
            assert (await (await client.get("/whoami")).json())["signed_in"] is False
            bad = await client.post("/signin", json={"key": "lbk_bad"}, headers=origin)
            assert bad.status == 403 and "not valid" in await bad.text()
            with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                await client.ws_connect("/ws", headers=origin)
            assert refused.value.status == 403
            good = await client.post("/signin", json={"key": "lbk_good"}, headers=origin)
            cookie = good.headers["Set-Cookie"]
            assert good.status == 200 and "HttpOnly" in cookie and "SameSite=Strict" in cookie
            assert "lbk_good" not in cookie + await good.text()
            assert (await (await client.get("/whoami")).json())["signed_in"] is True
            ws = await client.ws_connect("/ws", headers=origin)
            assert (await ws.receive_json())["type"] == "session"
            clock.now += 31  # past the expiry: the open socket starts nothing, a new one is refused
            await ws.send_json({"type": "start", "prompt": "a castle"})
            error = await ws.receive_json()
            assert error["type"] == "error" and "sign-in expired" in error["message"]
            await ws.close()
            with pytest.raises(aiohttp.WSServerHandshakeError):
                await client.ws_connect("/ws", headers=origin)
            assert client.session.cookie_jar.filter_cookies(client.make_url("/")).get(COOKIE) is not None

    asyncio.run(scenario())
    assert checked == ["lbk_bad", "lbk_good"]  # each sign-in checked once, with the server
