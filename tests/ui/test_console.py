"""The operator console over HTTP (docs/ui.md): its guard (loopback, token, CSRF, POST-only),
its pages on SQLite, PostgreSQL and Redis, its actions through the confirmation page, and the
bad input of issue 15 — every value escaped, every bad parameter a 400 naming it, a second
submit a no-op that says so, a store that fails a clear page with nothing half-applied."""

from __future__ import annotations

import logging
import re
import shutil
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest.mock import patch

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from retrysafe import Outbox, RetryPolicy, SQLiteStore
from retrysafe._exceptions import ConfigurationError, RetrysafeWarning
from retrysafe._serving import ServerThread
from retrysafe.client import JobState, outbox_store
from retrysafe.server import IdempotencyMiddleware
from retrysafe.ui import console_app

BASE = "http://127.0.0.1:8090"
TOKEN = "t0ken-for-the-console-tests"
HTML = {"accept": "text/html"}


class Client(TestClient):
    """A browser-like client: reads the CSRF token of the last page it got."""

    csrf = ""

    def page(self, path: str, **kw: Any) -> Any:
        r = self.get(path, headers=HTML, **kw)
        found = re.search(r'name="csrf_token" value="([0-9a-f]+)"', r.text)
        if found:
            self.csrf = found.group(1)
        return r

    def act(self, action: str, ids: list[str], queue: str = "default", **extra: str) -> Any:
        """Confirm then apply ``action`` as the pages' two forms do."""
        form: dict[str, Any] = {"csrf_token": self.csrf, "action": action, "queue": queue}
        form.update(extra)
        form["id"] = ids
        confirm = self.post("/actions/confirm", data=form)
        assert confirm.status_code == 200, confirm.text
        form["confirmed"] = "yes"
        return self.post("/actions/apply", data=form)


def client_for(app: Any) -> Client:
    c = Client(app, base_url=BASE)
    c.page("/keys")  # sets the session cookie and reads a CSRF token (the keys form)
    return c


@pytest.fixture
def store(sqlite_store: SQLiteStore) -> SQLiteStore:
    return sqlite_store


@pytest.fixture
def outbox(store: SQLiteStore) -> Iterator[Outbox]:
    with Outbox(store) as box:
        yield box


@pytest.fixture
def client(store: SQLiteStore) -> Client:
    return client_for(console_app(store))


def make(
    outbox: Outbox, state: JobState, n: int = 1, url: str = "http://127.0.0.1:9/x"
) -> list[str]:
    """``n`` jobs moved to ``state`` (as the worker would leave them)."""
    ids = []
    for _ in range(n):
        job = outbox.submit(url, json={"n": 1})
        if state is not JobState.PENDING:
            outbox_store(outbox.store).transition_job(
                job.id, from_states=[JobState.PENDING], state=state, now=job.created_at
            )
        ids.append(job.id)
    return ids


# ---------------------------------------------------------------------- the guard
def test_a_console_without_token_refuses_a_host_that_is_not_loopback(store: SQLiteStore) -> None:
    """DNS rebinding: a request naming another host gets 421, not the console."""
    c = TestClient(console_app(store), base_url="http://evil.example:8090")
    r = c.get("/", headers=HTML)
    assert r.status_code == 421
    assert "loopback" in r.text


@pytest.mark.parametrize(
    "host",
    [
        "127.0.0.1:8090, evil.example",
        "127.0.0.1:evil",
        "[::1]x",
        "[::1]:80:80",
        "[::1]:evil",
        "127.0.0.1:",
        "localhost:8090 ",
    ],
)
def test_a_host_whose_port_is_not_one_is_not_loopback(store: SQLiteStore, host: str) -> None:
    """A Host value with junk after the name names no host: 421 (was: read as 127.0.0.1)."""
    c = TestClient(console_app(store), base_url=BASE)
    assert c.get("/jobs", headers={**HTML, "host": host}).status_code == 421


@pytest.mark.parametrize("host", ["127.0.0.1:8090", "localhost:8090", "[::1]:8090", "127.0.0.1"])
def test_a_console_without_token_answers_every_loopback_name(store: SQLiteStore, host: str) -> None:
    """127.0.0.1, localhost and [::1] (with or without a port) reach the console."""
    c = TestClient(console_app(store), base_url=BASE)
    assert c.get("/jobs", headers={**HTML, "host": host}).status_code == 200


def test_a_token_console_needs_the_token(store: SQLiteStore) -> None:
    """With a token: no token → 401 (or the login page for a browser); Bearer works."""
    c = TestClient(console_app(store, token=TOKEN), base_url="http://console.example")
    assert c.get("/jobs").status_code == 401
    r = c.get("/jobs", headers=HTML, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/login?next=/jobs"
    assert (
        c.get("/jobs", headers={"authorization": "Bearer wrong-token-xxxxxxxx"}).status_code == 401
    )
    assert c.get("/jobs", headers={"authorization": f"Bearer {TOKEN}"}).status_code == 200


def test_the_login_form_sets_a_cookie_that_is_not_the_token(store: SQLiteStore) -> None:
    """The login form's cookie opens the pages; it is an HMAC, never the token itself; a
    wrong token is refused (403) and sets nothing."""
    c = Client(console_app(store, token=TOKEN), base_url="http://console.example")
    c.page("/login")
    bad = c.post("/login", data={"csrf_token": c.csrf, "token": "nope"}, follow_redirects=False)
    assert bad.status_code == 403 and "retrysafe_console_auth" not in bad.headers.get(
        "set-cookie", ""
    )
    ok = c.post(
        "/login?next=/jobs", data={"csrf_token": c.csrf, "token": TOKEN}, follow_redirects=False
    )
    assert ok.status_code == 303 and ok.headers["location"] == "/jobs"
    assert TOKEN not in ok.headers["set-cookie"]
    assert "httponly" in ok.headers["set-cookie"].lower()
    assert "max-age=43200" in ok.headers["set-cookie"].lower()
    assert c.get("/jobs", headers=HTML).status_code == 200


def test_a_login_redirect_keeps_every_filter(store: SQLiteStore) -> None:
    """A browser sent to log in from ``/jobs?state=unknown&queue=billing&limit=5`` comes back
    to that page with all three filters (the "&" once cut the target after the first)."""
    c = Client(console_app(store, token=TOKEN), base_url="http://console.example")
    r = c.get("/jobs?state=unknown&queue=billing&limit=5", headers=HTML, follow_redirects=False)
    assert r.status_code == 303
    assert (
        r.headers["location"] == "/login?next=/jobs%3Fstate%3Dunknown%26queue%3Dbilling%26limit%3D5"
    )
    c.page(r.headers["location"])
    ok = c.post(
        r.headers["location"], data={"csrf_token": c.csrf, "token": TOKEN}, follow_redirects=False
    )
    assert ok.status_code == 303
    assert ok.headers["location"] == "/jobs?state=unknown&queue=billing&limit=5"


def test_each_login_gets_its_own_cookie_which_expires() -> None:
    """Two logins get different cookies; a cookie older than 12 hours, from the future, of
    another token, or tampered with opens nothing."""
    from retrysafe.ui._security import LOGIN_MAX_AGE, Secrets

    secrets_, other = Secrets(TOKEN), Secrets(TOKEN + "-other")
    a, b = secrets_.auth_value(now=1_000_000), secrets_.auth_value(now=1_000_000)
    assert a != b and TOKEN not in a
    assert secrets_.login_ok(a, now=1_000_000 + LOGIN_MAX_AGE - 1)
    assert not secrets_.login_ok(a, now=1_000_000 + LOGIN_MAX_AGE)
    assert not secrets_.login_ok(a, now=1_000_000 - 3600)
    assert not other.login_ok(a, now=1_000_001)
    issued, nonce, mac = a.split(".")
    for forged in (
        f"{int(issued) + 1}.{nonce}.{mac}",
        f"{issued}.{nonce}x.{mac}",
        f"{issued}..{mac}",
        f"{issued}.{nonce}",
        "",
        "...",
        "9" * 40 + ".a.b",
        f"-{issued}.{nonce}.{mac}",
    ):
        assert not secrets_.login_ok(forged, now=1_000_001), forged


def test_a_login_redirect_never_leaves_the_console(store: SQLiteStore) -> None:
    """``next=//evil.example`` (an open redirect) lands on the console's own root."""
    c = Client(console_app(store, token=TOKEN), base_url="http://console.example")
    c.page("/login")
    r = c.post(
        "/login?next=//evil.example/x",
        data={"csrf_token": c.csrf, "token": TOKEN},
        follow_redirects=False,
    )
    assert r.headers["location"] == "/"


@pytest.mark.parametrize(
    "token", ["short", "has spaces in it 1234567", "", "0123456789abcdeé", "x" * 513]
)
def test_a_weak_token_is_a_configuration_error(store: SQLiteStore, token: str) -> None:
    """A token under 16 or over 512 characters, with whitespace or beyond visible ASCII (a
    Bearer header could not carry it) is refused when the app is built."""
    with pytest.raises(ConfigurationError, match="16–512 visible ASCII"):
        console_app(store, token=token)


def test_an_action_without_the_csrf_token_is_refused_and_changes_nothing(
    client: Client, outbox: Outbox
) -> None:
    """No CSRF token, or another session's, → 403; the job is still there."""
    (job_id,) = make(outbox, JobState.REJECTED)
    form = {"action": "purge", "queue": "default", "id": job_id, "confirmed": "yes"}
    assert client.post("/actions/apply", data=form).status_code == 403
    stranger = client_for(console_app(outbox.store))
    r = client.post("/actions/apply", data={**form, "csrf_token": stranger.csrf})
    assert r.status_code == 403 and "CSRF" in r.text
    assert outbox.get(job_id).state is JobState.REJECTED


def test_a_cross_site_post_is_refused_even_with_a_token(client: Client, outbox: Outbox) -> None:
    """An Origin of another site, or Sec-Fetch-Site: cross-site, → 403 before any form is read."""
    (job_id,) = make(outbox, JobState.REJECTED)
    form = {"csrf_token": client.csrf, "action": "purge", "id": job_id, "confirmed": "yes"}
    for headers in ({"origin": "http://evil.example"}, {"sec-fetch-site": "cross-site"}):
        assert client.post("/actions/apply", data=form, headers=headers).status_code == 403
    assert outbox.get(job_id).state is JobState.REJECTED


def test_actions_are_post_only(client: Client, outbox: Outbox) -> None:
    """GET on an action URL is 405: a link or an image tag can never change anything."""
    (job_id,) = make(outbox, JobState.REJECTED)
    r = client.get(f"/actions/apply?action=purge&id={job_id}&confirmed=yes")
    assert r.status_code == 405
    assert outbox.get(job_id).state is JobState.REJECTED


def test_an_action_runs_only_from_its_confirmation_page(client: Client, outbox: Outbox) -> None:
    """An apply without ``confirmed=yes`` is a 400 and changes nothing."""
    (job_id,) = make(outbox, JobState.REJECTED)
    form = {"csrf_token": client.csrf, "action": "purge", "queue": "default", "id": job_id}
    r = client.post("/actions/apply", data=form)
    assert r.status_code == 400 and "confirmation" in r.text
    assert outbox.get(job_id).state is JobState.REJECTED


def test_every_page_carries_the_security_headers(client: Client) -> None:
    """CSP without inline script, no framing, no referrer to other sites, no caching,
    nosniff."""
    for path in ("/", "/jobs", "/static/console.css", "/jobs?limit=x"):
        h = client.get(path, headers=HTML).headers
        assert "script-src 'self'" in h["content-security-policy"]
        assert "frame-ancestors 'none'" in h["content-security-policy"]
        assert h["x-content-type-options"] == "nosniff"
        assert h["referrer-policy"] == "same-origin"
        assert h["cache-control"] == "no-store"


def test_no_page_has_inline_script(client: Client, outbox: Outbox) -> None:
    """Every script is the shipped file (the CSP would block an inline one anyway)."""
    (job_id,) = make(outbox, JobState.UNKNOWN)
    for path in ("/", "/jobs", f"/jobs/{job_id}", "/dead-letters", "/keys"):
        text = client.page(path).text
        assert "<script>" not in text and "javascript:" not in text
        assert "onclick" not in text.lower()


# ---------------------------------------------------------------------- what a page shows
def test_a_job_page_hides_credentials_and_caps_the_payload(client: Client, outbox: Outbox) -> None:
    """Authorization and *token* header values never reach the HTML; a 50 KB body shows its
    first 4 KiB and says so."""
    job = outbox.submit(
        "http://127.0.0.1:9/x",
        content=b"A" * 50_000,
        headers={"Authorization": "Bearer sk-live-123", "X-Api-Token": "tok-456"},
    )
    text = client.page(f"/jobs/{job.id}").text
    assert "sk-live-123" not in text and "tok-456" not in text
    assert "hidden" in text
    assert "A" * 4096 in text and "A" * 4097 not in text
    assert "the first 4 KiB shown" in text
    assert job.key in text


def test_endpoint_secrets_are_masked(client: Client, store: SQLiteStore) -> None:
    """A webhook secret shows as whsec_••••<last 4>, on the list and the endpoint page."""
    from retrysafe.webhooks import Webhooks

    with Webhooks(store, allow_private=True) as hooks:
        e = hooks.add_endpoint("http://127.0.0.1:9/hook")
    secret = e.secrets[0][0]
    for path in ("/webhooks", f"/webhooks/endpoints/{e.id}"):
        text = client.page(path).text
        assert secret not in text and secret[6:20] not in text
        assert "whsec_••••" + secret[-4:] in text


@pytest.mark.parametrize(
    "query",
    [
        "host=%3Cscript%3Ealert(1)%3C/script%3E",
        "queue=%3Cimg%20src=x%20onerror=alert(1)%3E",
        "state=%3Cb%3Eunknown%3C/b%3E",
        "since=%22%3E%3Cscript%3Ealert(1)%3C/script%3E",
        "until=%3Csvg%20onload=alert(1)%3E",
        "after=%3Cscript%3E_x",
        "limit=%3Cscript%3E",
    ],
)
def test_injected_html_in_a_filter_is_escaped(client: Client, query: str) -> None:
    """Markup in any filter comes back as text (a 400 naming the parameter), never as markup."""
    r = client.get(f"/jobs?{query}", headers=HTML)
    assert r.status_code == 400
    assert "<script>" not in r.text and "<img" not in r.text and "<svg onload" not in r.text
    assert "&lt;" in r.text


def test_a_query_string_of_thousands_of_parameters_is_a_400(client: Client) -> None:
    """More than 200 query parameters: a 400 naming the query, not a crash."""
    r = client.get("/jobs?" + "&".join(f"state=unknown&x{i}=1" for i in range(300)), headers=HTML)
    assert r.status_code == 400 and 'id="error-message">query: ' in r.text


def test_a_queue_name_with_markup_is_refused_on_every_page(client: Client) -> None:
    """The dead-letter page's queue filter is checked and escaped as the jobs page's."""
    r = client.get("/dead-letters?queue=%22%3E%3Cscript%3E", headers=HTML)
    assert r.status_code == 400 and "<script>" not in r.text


@pytest.mark.parametrize(
    ("query", "param"),
    [
        ("limit=-1", "limit"),
        ("limit=0", "limit"),
        ("limit=501", "limit"),
        ("limit=99999999999999999999999", "limit"),
        ("limit=abc", "limit"),
        ("limit=1.5", "limit"),
        ("limit=1&limit=2", "limit"),
        ("after=12.5", "after"),
        ("after=nan_abc", "after"),
        ("after=inf_abc", "after"),
        ("state=bogus", "state"),
        ("since=yesterday", "since"),
        ("since=2026-12-01&until=2026-11-01", "until"),
        ("host=a%20b", "host"),
        ("host=127.0.0.1:-1", "host"),
        ("host=api.example:", "host"),
        ("host=api.example:http", "host"),
        ("after=-1_abc", "after"),
        ("after=99999999999999999999_aa", "after"),
        ("since=1969-12-31", "since"),
        ("since=9999-12-31T23:59:59-14:00", "since"),
        ("until=1970-01-01T00:00%2B14:00", "until"),
        ("after=1e5_abc", "after"),
        ("after=%2B1_abc", "after"),
        ("after=%D9%A1_abc", "after"),
        ("host=127.0.0.1%00", "host"),
    ],
)
def test_a_bad_parameter_is_a_400_naming_it(client: Client, query: str, param: str) -> None:
    """Negative, huge, fractional, repeated or non-numeric limits, bad positions, states,
    times and hosts: a 400 page whose message starts with the parameter's name."""
    r = client.get(f"/jobs?{query}", headers=HTML)
    assert r.status_code == 400
    assert re.search(rf'id="error-message">{param}: ', r.text), r.text


def test_a_missing_job_is_a_404_and_so_is_one_of_another_queue(
    client: Client, outbox: Outbox
) -> None:
    """An id that does not exist, or a job asked for under another queue, → 404 saying which."""
    (job_id,) = make(outbox, JobState.UNKNOWN)
    assert client.get("/jobs/" + "f" * 32, headers=HTML).status_code == 404
    r = client.get(f"/jobs/{job_id}?queue=webhooks", headers=HTML)
    assert r.status_code == 404 and "belongs to queue" in r.text
    assert client.get("/jobs/" + "x" * 300, headers=HTML).status_code == 400
    assert client.get("/webhooks/endpoints/ep_nope", headers=HTML).status_code == 404
    assert client.get("/webhooks/deliveries/nope", headers=HTML).status_code == 404
    assert client.get("/agents/run?id=nope", headers=HTML).status_code == 404
    assert client.get("/agents/run?id=" + "r" * 256, headers=HTML).status_code == 400


def test_the_jobs_page_pages_by_keyset_without_repeating_or_skipping(
    client: Client, outbox: Outbox
) -> None:
    """Following "older" through 120 jobs at 50 a page lists each once, newest first, even
    when new jobs arrive between two pages."""
    ids = make(outbox, JobState.SUCCEEDED, 120)
    seen: list[str] = []
    path = "/jobs"
    while path:
        text = client.page(path).text
        seen += re.findall(r'data-job="([0-9a-f]+)"', text)
        make(outbox, JobState.PENDING)  # arrives meanwhile: newer than every page's start
        nxt = re.search(r'href="(/jobs\?[^"]*after=[^"]*)" rel="next"', text)
        path = nxt.group(1).replace("&amp;", "&") if nxt else ""
        if len(seen) == 50:
            assert nxt is not None
    assert set(ids) <= set(seen)
    assert len(seen) == len(set(seen))
    order = [(outbox.get(i).created_at, i) for i in seen]
    assert order == sorted(order, reverse=True)


def test_the_jobs_page_filters_by_state_queue_host_and_time(client: Client, outbox: Outbox) -> None:
    """Each filter narrows the list to what it names."""
    unknown = make(outbox, JobState.UNKNOWN, 2, url="http://api.example:8443/a")
    done = make(outbox, JobState.SUCCEEDED, 3, url="http://other.example/b")

    def listed(q: str) -> set[str]:
        return set(re.findall(r'data-job="([0-9a-f]+)"', client.page("/jobs?" + q).text))

    assert listed("state=unknown") == set(unknown)
    assert listed("state=UNKNOWN&state=succeeded") == set(unknown + done)
    assert listed("host=api.example") == set(unknown)
    assert listed("host=api.example:8443") == set(unknown)
    assert listed("host=api.example:80") == set()
    assert listed("host=other.example:80") == set(done)
    assert listed("queue=webhooks") == set()
    assert listed("since=2999-01-01") == set()
    assert listed("until=2999-01-01") == set(unknown + done)


@pytest.fixture(params=["sqlite", "postgresql"])
def any_sql_store(request: pytest.FixtureRequest, sqlite_path: Path) -> Iterator[Any]:
    if request.param == "sqlite":
        store: Any = SQLiteStore(sqlite_path)
    else:
        from retrysafe.stores import PostgresStore

        pg_url = request.getfixturevalue("pg_url")
        store = PostgresStore(pg_url, schema=request.getfixturevalue("pg_schema"))
    yield store
    store.close()


def test_every_page_renders_on_sqlite_and_postgresql(any_sql_store: Any) -> None:
    """Overview, jobs (filtered and paged), a job, dead letters, webhooks, agent runs: 200."""
    with Outbox(any_sql_store) as outbox:
        make(outbox, JobState.UNKNOWN, 3, url="http://api.example/x")
        (job_id,) = make(outbox, JobState.REJECTED)
    c = client_for(console_app(any_sql_store))
    pages = [
        "/",
        "/jobs",
        "/jobs?state=unknown&host=api.example&since=2000-01-01T00:00&limit=2",
        f"/jobs/{job_id}",
        "/dead-letters",
        "/webhooks",
        "/webhooks/dead-letters",
        "/agents",
        "/keys",
        "/keys?recent=1",
        "/actions",
    ]
    for path in pages:
        r = c.page(path)
        assert r.status_code == 200, (path, r.text[:500])
    text = c.page("/jobs?state=unknown&limit=2").text
    nxt = re.search(r'href="(/jobs\?[^"]*)" rel="next"', text)
    assert nxt is not None
    assert c.page(nxt.group(1).replace("&amp;", "&")).status_code == 200


def test_on_redis_the_console_shows_keys_only(redis_url: str, redis_prefix: str) -> None:
    """A Redis store: the overview leads to the keys page; jobs say the store holds keys only;
    a stored key is found by its key and scope, with its status and headers."""
    import asyncio

    from retrysafe.stores import RedisStore

    store = RedisStore(redis_url, prefix=redis_prefix)
    try:

        async def endpoint(request: Request) -> JSONResponse:
            return JSONResponse({"ok": True}, status_code=201, headers={"x-order": "42"})

        app = IdempotencyMiddleware(
            Starlette(routes=[Route("/o", endpoint, methods=["POST"])]), store=store
        )

        async def call() -> None:
            import httpx

            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://svc") as http:
                r = await http.post("/o", json={}, headers={"idempotency-key": "order-1"})
                assert r.status_code == 201

        asyncio.run(call())
        c = client_for(console_app(store))
        assert c.get("/", headers=HTML, follow_redirects=False).headers["location"] == "/keys"
        r = c.page("/jobs")
        assert r.status_code == 404 and "idempotency keys only" in r.text
        c.page("/keys")
        found = c.post("/keys", data={"csrf_token": c.csrf, "key": "order-1", "scope_kind": "none"})
        assert found.status_code == 200
        assert 'id="key-status">201<' in found.text
        assert "<th>content-type</th><td>application/json</td>" in found.text
        missing = c.post(
            "/keys", data={"csrf_token": c.csrf, "key": "order-2", "scope_kind": "none"}
        )
        assert missing.status_code == 404 and "No key" in missing.text
    finally:
        store.close()


def test_the_keys_form_takes_an_authorization_value_without_showing_it(
    client: Client, store: SQLiteStore
) -> None:
    """The scope value (a credential) is posted, hashed as the middleware hashes it, and never
    echoed; a key with a control character is a 400 naming ``key``."""
    r = client.post(
        "/keys",
        data={
            "csrf_token": client.csrf,
            "key": "k-1",
            "scope_kind": "authorization",
            "scope": "Bearer very-secret-credential",
        },
    )
    assert r.status_code == 404 and "very-secret-credential" not in r.text
    bad = client.post(
        "/keys", data={"csrf_token": client.csrf, "key": "a\x01b", "scope_kind": "none"}
    )
    assert bad.status_code == 400 and 'id="error-message">key: ' in bad.text
    for value in ("not-hex!", "a" * 65):
        assert client.get(f"/keys?hash={value}", headers=HTML).status_code == 400


# ---------------------------------------------------------------------- actions
def test_purge_deletes_the_chosen_dead_letters_and_a_second_submit_is_a_no_op(
    client: Client, outbox: Outbox
) -> None:
    """Bulk purge deletes exactly the chosen dead letters; submitting it again changes nothing
    and says why; a PENDING job named with them is left alone."""
    dead = make(outbox, JobState.REJECTED, 2) + make(outbox, JobState.UNKNOWN)
    (kept,) = make(outbox, JobState.REJECTED)
    (pending,) = make(outbox, JobState.PENDING)
    client.page("/dead-letters")
    r = client.act("purge", [*dead, pending])
    assert r.status_code == 200 and "3 changed, 1 unchanged" in r.text
    for job_id in dead:
        assert outbox.store.get_job(job_id) is None
    assert outbox.get(kept).state is JobState.REJECTED
    assert outbox.get(pending).state is JobState.PENDING
    again = client.act("purge", dead)
    assert "0 changed, 3 unchanged" in again.text and "no such job" in again.text


def test_retry_puts_a_dead_letter_back_with_its_same_key(client: Client, outbox: Outbox) -> None:
    """Retry: REJECTED → PENDING, same key; again → unchanged, saying its state."""
    (job_id,) = make(outbox, JobState.REJECTED)
    key = outbox.get(job_id).key
    r = client.act("retry", [job_id])
    assert "rejected" in r.text and "pending" in r.text and "1 changed" in r.text
    assert outbox.get(job_id).state is JobState.PENDING and outbox.get(job_id).key == key
    assert "1 unchanged" in client.act("retry", [job_id]).text


def test_an_action_on_a_job_of_another_queue_changes_nothing(
    client: Client, outbox: Outbox
) -> None:
    """A job id posted with another queue is left alone ("belongs to queue …"); the webhooks
    queue cannot be reconciled as plain jobs (400)."""
    (job_id,) = make(outbox, JobState.REJECTED)
    r = client.act("purge", [job_id], queue="other")
    assert "belongs to queue" in r.text
    assert outbox.get(job_id).state is JobState.REJECTED
    form = {"csrf_token": client.csrf, "action": "purge", "queue": "webhooks", "id": job_id}
    assert client.post("/actions/confirm", data=form).status_code == 400


@pytest.mark.parametrize(
    ("form", "param"),
    [
        ({"action": "explode", "id": "a"}, "action"),
        ({"action": "purge"}, "id"),
        ({"action": "purge", "id": "<script>"}, "id"),
        ({"action": "purge", "id": [f"{i:032x}" for i in range(501)]}, "id"),
        ({"action": "enable", "id": ["ep_a", "ep_b"]}, "id"),
    ],
)
def test_a_bad_action_form_is_a_400_naming_the_field(
    client: Client, form: dict[str, Any], param: str
) -> None:
    """An unknown action, no ids, a malformed id, over 500 ids, two endpoints: 400."""
    r = client.post(
        "/actions/confirm", data={"csrf_token": client.csrf, "queue": "default", **form}
    )
    assert r.status_code == 400
    assert f'id="error-message">{param}: ' in r.text
    assert "<script>" not in r.text


def test_a_form_that_is_not_a_form_is_refused(client: Client) -> None:
    """JSON or a body over 64 KiB instead of a form: 415 / 413, nothing read."""
    assert client.post("/actions/apply", json={"action": "purge"}).status_code == 415
    big = "id=" + "a" * 70_000 + f"&csrf_token={client.csrf}"
    r = client.post(
        "/actions/apply",
        content=big,
        headers={"content-type": "application/x-www-form-urlencoded"},
    )
    assert r.status_code == 413


class Service:
    """A local endpoint behind the idempotency middleware that counts effects per key."""

    def __init__(self, tmp_path: Path) -> None:
        self.effects: dict[str, int] = {}
        self.lock = threading.Lock()

        async def orders(request: Request) -> JSONResponse:
            key = request.headers.get("idempotency-key", "")
            with self.lock:
                self.effects[key] = self.effects.get(key, 0) + 1
            return JSONResponse({"order": len(self.effects)}, status_code=201)

        app = Starlette(routes=[Route("/orders", orders, methods=["POST"])])
        self.keys = SQLiteStore(tmp_path / "service-keys.db")
        self.server = ServerThread(IdempotencyMiddleware(app, store=self.keys))

    def __enter__(self) -> Service:
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop()
        self.keys.close()


def test_reconcile_settles_an_unknown_job_with_its_same_key_and_one_effect(
    tmp_path: Path, client: Client, outbox: Outbox
) -> None:
    """The effect committed but the answer was lost (job UNKNOWN): reconcile from the console
    re-sends with the same key, the service replays, the job is SUCCEEDED, one effect."""
    with Service(tmp_path) as svc:
        job = outbox.submit(svc.server.url + "/orders", json={"sku": "A"})
        outbox.worker(policy=RetryPolicy(attempts=1)).run_until_idle()
        assert svc.effects == {job.key: 1}
        outbox_store(outbox.store).transition_job(  # the answer was lost: UNKNOWN
            job.id, from_states=[JobState.SUCCEEDED], state=JobState.UNKNOWN, now=0.0
        )
        client.page(f"/jobs/{job.id}")
        r = client.act("reconcile", [job.id])
        assert r.status_code == 200 and "unknown" in r.text and "succeeded" in r.text
        assert outbox.get(job.id).state is JobState.SUCCEEDED
        assert svc.effects == {job.key: 1}
        attempts = outbox.attempts(job.id)
        assert attempts[-1].replayed and attempts[-1].key == job.key
        again = client.act("reconcile", [job.id])
        assert "is succeeded, not unknown" in again.text
        assert svc.effects == {job.key: 1}


def test_reconcile_against_a_dead_endpoint_leaves_the_job_unknown_and_says_so(
    client: Client, outbox: Outbox
) -> None:
    """No answer again: the job stays UNKNOWN (an attempt recorded), reported as unchanged."""
    (job_id,) = make(outbox, JobState.UNKNOWN, url="http://127.0.0.1:9/x")
    r = client.act("reconcile", [job_id])
    assert "still unknown" in r.text
    assert outbox.get(job_id).state is JobState.UNKNOWN
    assert len(outbox.attempts(job_id)) == 1


def test_a_reconcile_cut_short_by_shutdown_is_a_503_and_logged(
    client: Client, outbox: Outbox, caplog: pytest.LogCaptureFixture
) -> None:
    """The console stopping mid-reconcile (its attempts cancelled) answers a 503 page that
    says so, and the action is logged like any other (was: a bare 500, no log line)."""
    import asyncio

    settled, waiting = make(outbox, JobState.UNKNOWN, 2, url="http://127.0.0.1:9/x")

    async def cancelled(*args: Any, **kwargs: Any) -> Any:
        # One attempt ended (its job SUCCEEDED) before the stop; the other job is UNKNOWN.
        outbox_store(outbox.store).transition_job(
            settled, from_states=[JobState.UNKNOWN], state=JobState.SUCCEEDED, now=0.0
        )
        raise asyncio.CancelledError

    with patch("retrysafe.client.areconcile", cancelled), caplog.at_level(logging.INFO):
        r = client.act("reconcile", [settled, waiting])
    assert r.status_code == 503 and "console was stopped during this reconcile" in r.text
    (line,) = [rec for rec in caplog.records if hasattr(rec, "console_action")]
    assert "stopped during this reconcile" in line.console_action["error"]
    assert line.console_action["changed"] == [
        {"id": settled, "from": "unknown", "to": "succeeded"}
    ]


def test_webhook_replay_enable_and_disable(client: Client, store: SQLiteStore) -> None:
    """Replay re-queues a dead-lettered delivery (same webhook-id), a second replay is a no-op;
    disable and enable an endpoint, each twice."""
    from retrysafe.webhooks import Webhooks

    with Webhooks(store, allow_private=True) as hooks:
        e = hooks.add_endpoint("http://127.0.0.1:9/hook")
        event = hooks.send("order.paid", {"id": 1})
        (d,) = hooks.deliveries()
        outbox_store(store).transition_job(
            d.id, from_states=[JobState.PENDING], state=JobState.UNKNOWN, now=0.0
        )
        client.page("/webhooks/dead-letters")
        r = client.act("replay", [d.id], queue="webhooks")
        assert "1 changed" in r.text
        (after,) = hooks.deliveries()
        assert after.state is JobState.PENDING and after.event_id == event.id
        assert "1 unchanged" in client.act("replay", [d.id], queue="webhooks").text
        off = client.act("disable", [e.id], reason="<b>maintenance</b>")
        assert "1 changed" in off.text
        assert not hooks.get_endpoint(e.id).enabled
        assert hooks.get_endpoint(e.id).disabled_reason == "<b>maintenance</b>"
        assert "&lt;b&gt;maintenance" in client.page(f"/webhooks/endpoints/{e.id}").text
        assert "disabled already" in client.act("disable", [e.id]).text
        assert "1 changed" in client.act("enable", [e.id]).text
        assert "enabled already" in client.act("enable", [e.id]).text
        assert "no such endpoint" in client.act("enable", ["ep_missing"]).text
        hooks.add_endpoint("http://127.0.0.1:9/other")
        assert "give more of the id" in client.act("enable", ["ep_"]).text  # both match


def test_every_action_is_logged_with_what_it_changed(
    client: Client, outbox: Outbox, caplog: pytest.LogCaptureFixture
) -> None:
    """One retrysafe.ui log record per action, with the ids and their before/after states;
    the actions page lists it."""
    (job_id,) = make(outbox, JobState.REJECTED)
    with caplog.at_level(logging.INFO, logger="retrysafe.ui"):
        client.act("purge", [job_id])
    (record,) = [r for r in caplog.records if r.name == "retrysafe.ui"]
    entry = record.console_action  # type: ignore[attr-defined]
    assert entry["action"] == "purge"
    assert entry["changed"] == [{"id": job_id, "from": "rejected", "to": "purged"}]
    assert job_id[:12] in client.page("/actions").text


# ---------------------------------------------------------------------- a store that fails
def test_a_locked_store_fails_an_action_cleanly_and_changes_nothing(
    sqlite_path: Path, outbox: Outbox
) -> None:
    """Another process holds SQLite's write lock: purge answers 503 naming the store error,
    and every job is still there once the lock is gone."""
    store = SQLiteStore(sqlite_path, busy_timeout=0.2)
    ids = make(outbox, JobState.REJECTED, 3)
    c = client_for(console_app(store))
    c.page("/dead-letters")
    locker = sqlite3.connect(sqlite_path, isolation_level=None)
    locker.execute("BEGIN EXCLUSIVE")
    try:
        form = {"csrf_token": c.csrf, "action": "purge", "queue": "default", "id": ids}
        r = c.post("/actions/apply", data={**form, "confirmed": "yes"})
        assert r.status_code == 503
        assert "store" in r.text.lower()
    finally:
        locker.execute("ROLLBACK")
        locker.close()
    assert all(outbox.get(i).state is JobState.REJECTED for i in ids)
    assert c.page("/dead-letters").status_code == 200
    store.close()


def test_a_store_that_goes_down_while_the_page_is_open_answers_a_clear_page(
    tmp_path: Path,
) -> None:
    """A Redis server stopped after the keys page was opened: the lookup is a 503 page
    saying the store is unavailable (not a traceback); nothing is written anywhere."""
    import subprocess
    import time

    from retrysafe._serving import free_port
    from retrysafe.stores import RedisStore

    port = free_port()
    server = subprocess.Popen(
        [
            "redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ],
        stdout=subprocess.DEVNULL,
        cwd=tmp_path,
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                store = RedisStore(f"redis://127.0.0.1:{port}/0", socket_timeout=1.0)
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        c = client_for(console_app(store))
        assert c.page("/keys").status_code == 200
        server.terminate()
        server.wait(10)
        r = c.post("/keys", data={"csrf_token": c.csrf, "key": "k", "scope_kind": "none"})
        assert r.status_code == 503 and "store is unavailable" in r.text
        assert "Traceback" not in r.text
        store.close()
    finally:
        server.kill()
        server.wait(10)


def test_an_agent_run_shows_its_audit_log_with_unknown_calls_highlighted(
    client: Client, store: SQLiteStore
) -> None:
    """The runs page lists a run whose id holds markup and slashes (escaped, linked); its page
    has one row per logical call, the unknown one highlighted with its key."""
    from urllib.parse import quote

    from retrysafe.agents import OutcomeUnknownError, start_run, tool

    @tool(kind="write", attempts=1)
    def charge(amount: int) -> str:
        if amount > 10:
            raise ConnectionError("answer lost")
        return f"charged {amount}"

    run_id = "<b>run/1?x=</b>"
    run = start_run(store, run_id)
    with run:
        with run.step(1):
            assert charge(5) == "charged 5"
        with run.step(2), pytest.raises(OutcomeUnknownError) as lost:
            charge(50)
    listing = client.page("/agents").text
    assert "<b>run" not in listing and "&lt;b&gt;run/1?x=&lt;/b&gt;" in listing
    (href,) = re.findall(r'href="(/agents/run\?id=[^"]+)"', listing)
    assert href == "/agents/run?id=" + quote(run_id, safe="")
    page = client.page(href)
    assert page.status_code == 200
    rows = re.findall(r'<tr class="call-(\w+)">', page.text)
    assert rows == ["succeeded", "unknown"]
    assert "<dd>2 (1 unknown)</dd>" in page.text
    assert f'class="key-unknown">{lost.value.key}<' in page.text


def test_agent_runs_are_keyset_paged_newest_first(client: Client, store: SQLiteStore) -> None:
    """Five runs, two a page: every run once, newest first, over three pages; a run started
    meanwhile neither repeats nor hides one; a forged position is a 400."""
    from retrysafe.agents import start_run

    for i in range(5):  # equal times (a coarse clock) sort by id, newest first too
        with start_run(store, f"run-{i}"):
            pass

    def runs_on(path: str) -> tuple[list[str], str | None]:
        r = client.page(path)
        assert r.status_code == 200, r.text
        nxt = re.search(r'href="(/agents\?[^"]+)" rel="next"', r.text)
        names = re.findall(r"<code>(run-\d)</code>", r.text)
        return names, None if nxt is None else nxt.group(1).replace("&amp;", "&")

    first, nxt = runs_on("/agents?limit=2")
    assert first == ["run-4", "run-3"] and nxt is not None
    with start_run(store, "run-new"):
        pass
    second, nxt = runs_on(nxt)
    assert second == ["run-2", "run-1"] and nxt is not None
    third, nxt = runs_on(nxt)
    assert third == ["run-0"] and nxt is None
    assert client.get("/agents?after=zz_1", headers=HTML).status_code == 400


@pytest.mark.parametrize(
    "back", ["//evil.example/x", "/\\evil.example", "https://evil.example", "/x\r\nSet-Cookie: a=b"]
)
def test_a_back_link_never_leaves_the_console(client: Client, outbox: Outbox, back: str) -> None:
    """The confirmation and result pages link "back" only to a path of the console."""
    (job_id,) = make(outbox, JobState.REJECTED)
    form = {"csrf_token": client.csrf, "action": "retry", "queue": "default", "id": job_id}
    r = client.post("/actions/confirm", data={**form, "back": back})
    assert r.status_code == 200
    assert re.findall(r'name="back" value="([^"]*)"', r.text) == ["/"]


def test_the_pager_keeps_the_filters_to_the_second(client: Client, outbox: Outbox) -> None:
    """The "older" link carries ``since`` with its seconds: page 2 runs page 1's filter."""
    ids = make(outbox, JobState.SUCCEEDED, 3)
    jobs = sorted((outbox.get(i) for i in ids), key=lambda j: j.created_at)
    import datetime as dt

    cut = dt.datetime.fromtimestamp(jobs[1].created_at, dt.timezone.utc)
    since = cut.replace(microsecond=0).strftime("%Y-%m-%dT%H:%M:%S")
    text = client.page(f"/jobs?since={since}&limit=1").text
    nxt = re.search(r'href="(/jobs\?[^"]*)" rel="next"', text)
    assert nxt is not None  # jobs[1] and jobs[2] match, one per page
    assert f"since={since.replace(':', '%3A')}" in nxt.group(1)


def test_the_console_mounts_under_a_path_of_another_app(store: SQLiteStore, outbox: Outbox) -> None:
    """Mounted at /ops/rs: links, the stylesheet, the login redirect and actions all follow
    the mount path."""
    from starlette.routing import Mount

    (job_id,) = make(outbox, JobState.REJECTED)
    host = Starlette(routes=[Mount("/ops/rs", console_app(store, token=TOKEN))])
    c = Client(host, base_url="http://ops.example")
    r = c.get("/ops/rs/jobs", headers=HTML, follow_redirects=False)
    assert r.headers["location"] == "/ops/rs/login?next=/jobs"
    c.page("/ops/rs/login")
    ok = c.post("/ops/rs/login?next=/jobs", data={"csrf_token": c.csrf, "token": TOKEN})
    assert ok.status_code == 200 and f'href="/ops/rs/jobs/{job_id}' in ok.text
    assert 'href="/ops/rs/static/console.css"' in ok.text
    assert c.get("/ops/rs/static/console.css").status_code == 200
    c.page(f"/ops/rs/jobs/{job_id}")
    form = {"csrf_token": c.csrf, "action": "purge", "queue": "default", "id": job_id}
    assert 'action="/ops/rs/actions/apply"' in c.post("/ops/rs/actions/confirm", data=form).text
    done = c.post("/ops/rs/actions/apply", data={**form, "confirmed": "yes"})
    assert "1 changed" in done.text
    assert outbox.store.get_job(job_id) is None


def test_concurrent_submits_of_one_action_change_and_log_each_item_once(
    store: SQLiteStore, outbox: Outbox
) -> None:
    """Eight simultaneous identical purges (a browser's retries, two tabs): across their
    results each job is "changed" exactly once, so the action log tells the truth."""
    import httpx

    ids = make(outbox, JobState.REJECTED, 5)
    with ServerThread(console_app(store)) as server:
        first = httpx.get(server.url + "/keys", headers=HTML)
        csrf = re.search(r'name="csrf_token" value="([0-9a-f]+)"', first.text)
        assert csrf is not None
        cookies = dict(first.cookies)
        form = {
            "csrf_token": csrf.group(1),
            "action": "purge",
            "queue": "default",
            "id": ids,
            "confirmed": "yes",
        }
        texts: list[str] = []

        def submit() -> None:
            r = httpx.post(server.url + "/actions/apply", data=form, cookies=cookies)
            texts.append(r.text)

        threads = [threading.Thread(target=submit) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    changed = [
        job_id
        for text in texts
        for job_id in re.findall(r"<tr><td><code>([0-9a-f]+)</code></td><td>rejected</td>", text)
    ]
    assert sorted(changed) == sorted(ids)


def test_a_limit_of_thousands_of_digits_is_a_400_not_a_crash(client: Client) -> None:
    """Python refuses int() of over 4,300 digits; the console refuses long limits first."""
    for path in ("/jobs", "/dead-letters", "/webhooks/dead-letters", "/agents"):
        r = client.get(f"{path}?limit={'9' * 5000}", headers=HTML)
        assert r.status_code == 400 and 'id="error-message">limit: ' in r.text


def test_the_host_filter_matches_ipv6_and_non_ascii_hosts(client: Client, outbox: Outbox) -> None:
    """``[::1]`` / ``[::1]:9000`` find a job to http://[::1]:9000; ``bücher.example`` finds
    its job as typed."""
    (v6,) = make(outbox, JobState.UNKNOWN, url="http://[::1]:9000/v6")
    (idn,) = make(outbox, JobState.UNKNOWN, url="http://bücher.example/x")

    def listed(q: str) -> set[str]:
        r = client.page("/jobs?" + q)
        assert r.status_code == 200, r.text
        return set(re.findall(r'data-job="([0-9a-f]+)"', r.text))

    assert listed("host=[::1]") == {v6}
    assert listed("host=%5B::1%5D:9000") == {v6}
    assert listed("host=[::1]:9001") == set()
    assert listed("host=b%C3%BCcher.example") == {idn}
    assert 'value="[::1]:9000"' in client.page("/jobs?host=[::1]:9000").text


def test_credentials_in_query_strings_and_more_header_names_are_hidden(
    client: Client, outbox: Outbox
) -> None:
    """``?access_token=…&api_key=…&sig=…`` show as ``…``; X-Access-Key, X-Private-Key,
    Passwd, X-Credentials and X-Session-Id values are hidden; the idempotency key is shown."""
    job = outbox.submit(
        "http://127.0.0.1:9/hdr?access_token=QSTOKEN&api_key=QSKEY&sig=QSSIG&page=2",
        json={},
        headers={
            "X-Access-Key": "h1secret",
            "X-Private-Key": "h2secret",
            "Passwd": "h3secret",
            "X-Credentials": "h4secret",
            "X-Session-Id": "h5secret",
            "X-Request-Id": "visible-id",
        },
    )
    text = client.page(f"/jobs/{job.id}").text
    for secret in ("QSTOKEN", "QSKEY", "QSSIG", "h1secret", "h2secret", "h3secret", "h4secret"):
        assert secret not in text
    assert "h5secret" not in text
    assert "access_token=…" in text and "page=2" in text
    assert "visible-id" in text and job.key in text
    listing = client.page("/jobs").text
    assert "QSTOKEN" not in listing


def test_control_and_bidi_characters_are_shown_escaped(client: Client, outbox: Outbox) -> None:
    """NUL, ESC and the right-to-left override in a payload or header reach the page as
    visible escapes, never as the characters themselves. (``submit`` now refuses such a
    header value; a job stored by an earlier release may still hold one.)"""
    job = outbox.submit(
        "http://127.0.0.1:9/x",
        content="a\x00b\x1b[31mc\u202ed".encode(),
        headers={"X-Note": "vw"},
    )
    with outbox.store.transaction() as conn:  # type: ignore[attr-defined]
        conn.execute(
            "UPDATE outbox_jobs SET headers = ? WHERE id = ?",
            ('[["X-Note", "v\\u007fw"]]', job.id),
        )
    text = client.page(f"/jobs/{job.id}").text
    assert "\x00" not in text and "\x1b" not in text and "\u202e" not in text
    assert "\x7f" not in text
    assert "a\\x00b\\x1b[31mc\\u202ed" in text


def test_a_repeated_form_field_is_a_400(client: Client, outbox: Outbox) -> None:
    """``action=purge&action=reconcile``: the console does not guess which was meant."""
    (job_id,) = make(outbox, JobState.UNKNOWN)
    form = {"csrf_token": client.csrf, "queue": "default", "id": job_id, "confirmed": "yes"}
    r = client.post("/actions/apply", data={**form, "action": ["purge", "reconcile"]})
    assert r.status_code == 400 and 'id="error-message">action: give it once' in r.text
    assert outbox.get(job_id).state is JobState.UNKNOWN


def test_the_dead_letter_page_of_the_webhooks_queue_is_the_webhook_dlq(client: Client) -> None:
    """Webhook deliveries are replayed from their own page: /dead-letters?queue=webhooks
    leads there instead of offering buttons that cannot work."""
    r = client.get("/dead-letters?queue=webhooks", headers=HTML, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/webhooks/dead-letters"


def test_a_script_with_the_bearer_token_acts_without_a_csrf_token(
    store: SQLiteStore, outbox: Outbox
) -> None:
    """Authorization: Bearer is proof enough (no browser adds it by itself); the login cookie
    alone still needs the form's CSRF token."""
    (a, b) = make(outbox, JobState.REJECTED, 2)
    app = console_app(store, token=TOKEN)
    script = TestClient(app, base_url="http://console.example")
    form = {"action": "purge", "queue": "default", "id": a, "confirmed": "yes"}
    r = script.post("/actions/apply", data=form, headers={"authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 200 and "1 changed" in r.text
    browser = Client(app, base_url="http://console.example")
    browser.page("/login")
    browser.post("/login", data={"csrf_token": browser.csrf, "token": TOKEN})
    refused = browser.post("/actions/apply", data={**form, "id": b})
    assert refused.status_code == 403
    assert outbox.get(b).state is JobState.REJECTED


def test_logout_forgets_the_login(store: SQLiteStore) -> None:
    """After Log out the pages ask for the token again."""
    c = Client(console_app(store, token=TOKEN), base_url="http://console.example")
    c.page("/login")
    c.post("/login", data={"csrf_token": c.csrf, "token": TOKEN})
    assert 'action="/logout"' in c.page("/jobs").text
    out = c.post("/logout", data={"csrf_token": c.csrf}, follow_redirects=False)
    assert out.status_code == 303 and out.headers["location"] == "/login"
    assert c.get("/jobs").status_code == 401
    assert 'action="/logout"' not in c.page("/login").text  # not logged in: nothing to end


def test_a_wrong_bearer_token_is_logged_like_a_wrong_login(
    store: SQLiteStore, caplog: pytest.LogCaptureFixture
) -> None:
    """Each wrong token, by the login form or a Bearer header, is one retrysafe.ui warning
    (and costs its sender a second, one refusal at a time)."""
    c = Client(console_app(store, token=TOKEN), base_url="http://console.example")
    with caplog.at_level(logging.WARNING, logger="retrysafe.ui"):
        assert (
            c.get("/jobs", headers={"authorization": "Bearer nope-nope-nope-nope"}).status_code
            == 401
        )
        c.page("/login")
        assert c.post("/login", data={"csrf_token": c.csrf, "token": "nope"}).status_code == 403
    refused = [r for r in caplog.records if r.getMessage() == "console token refused"]
    assert len(refused) == 2


def test_stored_location_headers_show_no_credentials(client: Client, store: SQLiteStore) -> None:
    """A stored answer's Location with user:password@ and ?access_token= shows neither on the
    keys page."""
    import asyncio

    import httpx

    async def created(request: Request) -> JSONResponse:
        return JSONResponse(
            {},
            status_code=201,
            headers={"location": "https://bob:hunter2@api.example/x?access_token=LOCSECRET&n=1"},
        )

    app = IdempotencyMiddleware(
        Starlette(routes=[Route("/o", created, methods=["POST"])]),
        store=store,
        config=__import__("retrysafe").server.IdempotencyConfig(replay_headers=("location",)),
    )

    async def call() -> None:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://svc"
        ) as http:
            r = await http.post("/o", json={}, headers={"idempotency-key": "loc-1"})
            assert r.status_code == 201

    asyncio.run(call())
    r = client.post("/keys", data={"csrf_token": client.csrf, "key": "loc-1", "scope_kind": "none"})
    assert r.status_code == 200 and "<th>location</th>" in r.text
    assert "hunter2" not in r.text and "LOCSECRET" not in r.text
    assert "access_token=…" in r.text and "n=1" in r.text


def test_an_origin_with_the_default_port_is_the_same_site(client: Client, outbox: Outbox) -> None:
    """``Origin: https://ops.example`` with ``Host: ops.example:443`` (a TLS proxy that
    forwards the Host) is the console's own origin."""
    (job_id,) = make(outbox, JobState.REJECTED)
    form = {"csrf_token": client.csrf, "action": "retry", "queue": "default", "id": job_id}
    c = TestClient(console_app(outbox.store, token=TOKEN), base_url="https://ops.example:443")
    r = c.post(
        "/actions/confirm",
        data=form,
        headers={"origin": "https://ops.example", "authorization": f"Bearer {TOKEN}"},
    )
    assert r.status_code == 200


def test_an_unbracketed_ipv6_host_filter_matches(client: Client, outbox: Outbox) -> None:
    """``host=::1`` (no brackets) is the IPv6 loopback, any port."""
    (v6,) = make(outbox, JobState.UNKNOWN, url="http://[::1]:9000/v6")
    text = client.page("/jobs?host=::1").text
    assert re.findall(r'data-job="([0-9a-f]+)"', text) == [v6]


def test_templates_are_read_once_at_start(store: SQLiteStore, tmp_path: Path) -> None:
    """A console keeps its pages while the installed package changes under it: every
    template is compiled when the app is made, and a changed file on disk is not re-read."""
    import jinja2

    from retrysafe.ui import _app

    made = []

    class Loader(jinja2.FileSystemLoader):
        def get_source(self, environment: Any, template: str) -> Any:
            made.append(template)
            return super().get_source(environment, template)

    templates = tmp_path / "templates"
    shutil.copytree(Path(_app.__file__).parent / "templates", templates)
    with patch("jinja2.PackageLoader", lambda *a: Loader(str(templates))):
        c = Client(console_app(store), base_url=BASE)
    assert "agents.html" in made and "overview.html" in made  # compiled up front
    (templates / "agents.html").write_text("{{ undefined_now }}")
    assert c.get("/agents", headers=HTML).status_code == 200


def test_a_short_job_id_opens_its_job(client: Client, outbox: Outbox) -> None:
    """The 12-character id a list shows opens the job (303 to its full id, as `retrysafe
    jobs show` takes a prefix); a prefix two jobs share is a 400 saying so; no match, 404."""
    ids = make(outbox, JobState.UNKNOWN, 17)  # 17 hex ids: two share a first character
    r = client.get(f"/jobs/{ids[0][:12]}", headers=HTML, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == f"/jobs/{ids[0]}"
    firsts = [i[0] for i in ids]
    shared = next(c for c in firsts if firsts.count(c) > 1)
    r = client.get(f"/jobs/{shared}", headers=HTML)
    assert r.status_code == 400 and "Several jobs" in r.text
    assert client.get("/jobs/zzzzzzzzzzzz", headers=HTML).status_code == 404
    r = client.get(f"/jobs/{ids[0][:12]}?queue=billing", headers=HTML, follow_redirects=False)
    assert r.status_code == 404 and "belongs to queue" in r.text  # not the link's queue
    r = client.get(f"/jobs/{ids[0][:12].upper()}", headers=HTML, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == f"/jobs/{ids[0]}"


def test_an_action_just_after_the_store_file_was_deleted_is_a_503_and_changes_nothing(
    client: Client, outbox: Outbox, store: SQLiteStore
) -> None:
    """The store's files removed a moment before a purge (inside the connections' once-a-
    second check): the action compares the file first, answers 503, and reports no change
    (it used to answer "1 changed" into the unlinked file)."""
    (job_id,) = make(outbox, JobState.REJECTED)
    client.page("/dead-letters")
    path = Path(store.connector.path)
    for suffix in ("", "-wal", "-shm"):
        Path(str(path) + suffix).unlink(missing_ok=True)
    r = client.act("purge", [job_id])
    assert r.status_code == 503 and "0 changed" in r.text, r.text
    assert not path.exists()


def test_an_agent_calls_secret_looking_arguments_are_hidden(
    client: Client, store: SQLiteStore
) -> None:
    """Arguments named like credentials (api_key, password, token, at any depth) show as
    ••••; the others as given."""
    from retrysafe.agents import start_run, tool

    @tool(kind="write", attempts=1)
    def connect(host: str, api_key: str, options: dict[str, Any]) -> str:
        return "ok"

    with start_run(store, "secrets-run") as run, run.step(1):
        connect("db.example", "sk-live-SECRET", {"password": "pw-SECRET", "port": 5432})
    page = client.page("/agents/run?id=secrets-run").text
    assert "SECRET" not in page
    assert "db.example" in page and "5432" in page and "\u2022\u2022\u2022\u2022" in page


def test_a_repeated_key_hash_is_a_400(client: Client) -> None:
    r = client.get("/keys?hash=ffe1&hash=db6f", headers=HTML)
    assert r.status_code == 400 and 'id="error-message">hash: give it once' in r.text


def test_a_job_whose_row_is_damaged_is_said_so_not_store_unavailable(
    client: Client, outbox: Outbox, store: SQLiteStore
) -> None:
    """A job row whose headers are no JSON (written by hand, not by retrysafe): its page is a
    500 naming the damaged row, not "the store is unavailable" (a 503 that tells an
    operator to wait for a store that is up); the other pages still open."""
    damaged, healthy = make(outbox, JobState.UNKNOWN, 2)
    path = store.url.removeprefix("sqlite:///")
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE outbox_jobs SET headers = 'not json' WHERE id = ?", (damaged,))
    r = client.get(f"/jobs/{damaged}")
    assert r.status_code == 500, r.text
    assert "damaged job row" in r.text.lower() and damaged in r.text
    assert "unavailable" not in r.text and "Traceback" not in r.text
    assert client.get(f"/jobs/{healthy}").status_code == 200
    with pytest.warns(RetrysafeWarning, match=f"left out of this listing: job {damaged}"):
        assert client.get("/dead-letters").status_code == 200
