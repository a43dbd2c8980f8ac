"""The operator console (``retrysafe ui``, issue 15) in a real browser: Debian's headless
Chromium driven by Selenium, against a console served by uvicorn on loopback.

The store is a SQLite file filled through the public API only. Jobs go to a live local
endpoint behind :class:`~retrysafe.server.IdempotencyMiddleware` that counts its effects per
idempotency key; three of them commit their effect and then answer after the client's
timeout (commit-then-lose), so they end UNKNOWN with the effect done once. Two webhook
deliveries go to a receiver answering 500 until their schedule runs out (the webhook DLQ).
The operator's actions are clicked through the pages (form, confirmation, result), and what
they did is checked in the store, at the endpoint and at the receiver.

When ``RETRYSAFE_SCREENSHOTS`` names a directory, the tests save the pages docs/ui.md shows
there (``ui-*.png``).
"""

from __future__ import annotations

import asyncio
import os
import random
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from selenium.common.exceptions import (
    NoAlertPresentException,
    StaleElementReferenceException,
    WebDriverException,
)
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support.wait import WebDriverWait
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from retrysafe._serving import ServerThread, free_port
from retrysafe.client import Job, JobState, Outbox, RetryPolicy
from retrysafe.server import IdempotencyMiddleware
from retrysafe.stores import MemoryStore, SQLiteStore
from retrysafe.ui import console_app
from retrysafe.webhooks import SVIX, Delivery, Schedule, WebhookPolicy, Webhooks

#: Seconds a page, an element or a recorded answer may take to appear.
WAIT = 10.0
#: Seconds a commit-then-lose handler keeps its answer after its effect (the client gave up
#: after ``POLICY.timeout``).
LOSE_AFTER = 1.2
#: One counted attempt that times out, then two 409 in-progress polls: the job ends UNKNOWN.
POLICY = RetryPolicy(
    attempts=2,
    wait_initial=0.01,
    wait_max=0.02,
    timeout=0.5,
    poll_interval=0.01,
    polls=2,
    retry_after_max=0.02,
)
#: Three attempts ~10 ms apart, then the delivery is dead-lettered (UNKNOWN).
SCHEDULE = Schedule(name="default", attempts=3, base=0.01, cap=0.05, jitter=0.001)
HOOK_POLICY = WebhookPolicy(schedules=(SCHEDULE, SVIX), timeout=2.0, disable_after=None)
#: Text every filter is given (no quote or backslash: the error repeats it as a repr).
INJECTED = ("<script>alert(1)</script>", "<img src=x onerror=alert(2)>")


# ---------------------------------------------------------------------- the live services
@dataclass
class Orders:
    """``POST /orders`` behind the idempotency middleware: each run of the handler is one
    effect, counted per ``Idempotency-Key``. A body with ``lose`` answers only
    :data:`LOSE_AFTER` seconds after its effect (the client has timed out by then; the
    middleware records the answer anyway); one with ``reject`` is refused (422, no effect)."""

    effects: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def app(self, keys: MemoryStore) -> Any:
        async def create(request: Request) -> JSONResponse:
            body = await request.json()
            if body.get("reject"):
                return JSONResponse({"error": "refused"}, 422)
            with self.lock:
                self.effects[request.headers.get("idempotency-key", "")] += 1
            if body.get("lose"):
                await asyncio.sleep(LOSE_AFTER)
            return JSONResponse({"ref": body["ref"]}, 201)

        return IdempotencyMiddleware(
            Starlette(routes=[Route("/orders", create, methods=["POST"])]), store=keys
        )


@dataclass
class Receiver:
    """``POST /hook``: records every request's headers; answers 500 until ``ok``."""

    seen: list[dict[str, str]] = field(default_factory=list)
    ok: bool = False

    def app(self) -> Starlette:
        async def hook(request: Request) -> JSONResponse:
            await request.body()
            self.seen.append(dict(request.headers))
            return JSONResponse({"ok": self.ok}, 200 if self.ok else 500)

        return Starlette(routes=[Route("/hook", hook, methods=["POST"])])

    def ids(self, start: int = 0) -> list[str]:
        """The ``webhook-id`` of each request received, from the ``start``-th on."""
        return [h.get("webhook-id", "") for h in self.seen[start:]]


@dataclass
class World:
    """The console and what it shows. ``lost`` are the commit-then-lose jobs (UNKNOWN, one
    effect each; each test that acts takes its own), ``dead`` the dead-lettered deliveries."""

    url: str
    outbox: Outbox
    hooks: Webhooks
    orders: Orders
    receiver: Receiver
    lost: list[Job]
    dead: list[Delivery]
    endpoint_id: str


def _wait_recorded(keys: MemoryStore, count: int) -> None:
    """Until the middleware has recorded ``count`` completed keys (the lost answers are
    recorded after the handler returns, after the client left)."""
    deadline = time.monotonic() + WAIT
    while True:
        entries = keys.list_keys(now=time.time(), limit=1000)
        if sum(e.state == "completed" for e in entries) >= count:
            return
        assert time.monotonic() < deadline, f"answers not recorded: {entries}"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    """A console on a SQLite store with 3 UNKNOWN (commit-then-lose), 2 SUCCEEDED and 1
    REJECTED job and 2 dead-lettered webhook deliveries."""
    store = SQLiteStore(tmp_path_factory.mktemp("console") / "console.db")
    keys = MemoryStore()
    orders, receiver = Orders(), Receiver()
    with ServerThread(orders.app(keys)) as api, ServerThread(receiver.app()) as hook_server:
        outbox = Outbox(store, policy=POLICY)
        target = api.url + "/orders"
        lost = [outbox.submit(target, json={"ref": f"lost-{i}", "lose": True}) for i in range(3)]
        for i in range(2):
            outbox.submit(target, json={"ref": f"ok-{i}"})
        outbox.submit(target, json={"ref": "refused", "reject": True})
        outbox.worker(poll_interval=0.01, budget=None, rng=random.Random(7)).run_until_idle()
        _wait_recorded(keys, 6)
        lost = [outbox.get(j.id) for j in lost]
        assert [j.state for j in lost] == [JobState.UNKNOWN] * 3
        assert [orders.effects[j.key] for j in lost] == [1, 1, 1]

        hooks = Webhooks(store, allow_private=True, policy=HOOK_POLICY)
        endpoint = hooks.add_endpoint(hook_server.url + "/hook")
        for i in range(2):
            hooks.send("order.paid", {"order": i})
        hooks.worker(poll_interval=0.01, budget=None, rng=random.Random(7)).run_until_idle()
        dead = hooks.dead_letters()
        assert [d.state for d in dead] == [JobState.UNKNOWN] * 2
        assert len(receiver.seen) == 2 * SCHEDULE.attempts

        with ServerThread(console_app(store), host="127.0.0.1") as console:
            yield World(console.url, outbox, hooks, orders, receiver, lost, dead, endpoint.id)
        hooks.close()
        outbox.close()
    store.close()


# ---------------------------------------------------------------------- browser helpers
def submit(driver: WebDriver, button: WebElement) -> None:
    """Press a button that submits its form, and wait for the next page to have loaded."""
    page = driver.find_element(By.TAG_NAME, "html")
    button.click()
    WebDriverWait(driver, WAIT).until(lambda _: _gone(page))
    WebDriverWait(driver, WAIT).until(
        lambda d: d.execute_script("return document.readyState") == "complete"
    )


def _gone(element: WebElement) -> bool:
    """Whether ``element``'s document was replaced (selenium's ``staleness_of``, plus the
    error chromedriver sometimes answers instead of "stale" while the old document is being
    torn down: "Node with given id does not belong to the document")."""
    try:
        element.is_enabled()
    except StaleElementReferenceException:
        return True
    except WebDriverException as exc:
        if "does not belong to the document" in str(exc):
            return True
        raise
    return False


def status(driver: WebDriver) -> int:
    """The HTTP status of the page shown (the Navigation Timing entry's)."""
    return int(
        driver.execute_script("return performance.getEntriesByType('navigation')[0].responseStatus")
    )


def text(driver: WebDriver, css: str) -> str:
    return driver.find_element(By.CSS_SELECTOR, css).text


def cells(row: WebElement) -> list[str]:
    return [td.text for td in row.find_elements(By.TAG_NAME, "td")]


def shot(driver: WebDriver, screenshots: Path | None, name: str) -> None:
    """Save the window as ``name`` in the screenshots directory, if one is set."""
    if screenshots is not None:
        assert driver.save_screenshot(str(screenshots / name)), name


def no_alert(driver: WebDriver) -> bool:
    try:
        driver.switch_to.alert  # noqa: B018 - the property raises when there is none
    except NoAlertPresentException:
        return True
    return False


def job_snapshot(world: World, job_id: str) -> tuple[Any, ...]:
    """What an action on the job would change: its row, its attempts, its effects."""
    job = world.outbox.get(job_id)
    attempts = world.outbox.attempts(job_id)
    return job, [(a.number, a.outcome, a.status) for a in attempts], world.orders.effects[job.key]


# ---------------------------------------------------------------------- the tests
def test_overview_shows_unknown_count_and_chart(
    browser: WebDriver, world: World, screenshots: Path | None
) -> None:
    """The overview's counts table shows the store's UNKNOWN count, and the chart is an SVG."""
    browser.get(world.url + "/")
    counts = world.outbox.counts()
    assert counts[JobState.UNKNOWN] >= 2 and counts[JobState.REJECTED] == 1
    assert text(browser, '#counts a[data-count="default:unknown"]') == str(counts[JobState.UNKNOWN])
    assert text(browser, '#counts a[data-count="default:rejected"]') == "1"
    chart = browser.find_element(By.CSS_SELECTOR, "svg.chart")
    assert chart.is_displayed()
    assert chart.find_elements(By.TAG_NAME, "rect"), "the last hour's attempts draw bars"
    assert world.endpoint_id in text(browser, "#troubled"), "the failing endpoint is listed"
    shot(browser, screenshots, "ui-overview.png")


def test_filter_jobs_to_unknown(browser: WebDriver, world: World, screenshots: Path | None) -> None:
    """Ticking UNKNOWN in the jobs filter form and submitting it lists the UNKNOWN jobs only."""
    browser.get(world.url + "/jobs")
    every = {
        r.get_attribute("data-state")
        for r in browser.find_elements(By.CSS_SELECTOR, "#jobs tbody tr")
    }
    assert every > {"unknown"}, "unfiltered, the list holds other states too"
    browser.find_element(By.CSS_SELECTOR, '#filters input[name="state"][value="unknown"]').click()
    submit(browser, browser.find_element(By.CSS_SELECTOR, '#filters button[type="submit"]'))
    assert "state=unknown" in browser.current_url
    rows = browser.find_elements(By.CSS_SELECTOR, "#jobs tbody tr")
    assert {r.get_attribute("data-state") for r in rows} == {"unknown"}
    expected = {j.id for j in world.outbox.jobs(states=[JobState.UNKNOWN])}
    assert {r.get_attribute("data-job") for r in rows} == expected
    box = browser.find_element(By.CSS_SELECTOR, '#filters input[name="state"][value="unknown"]')
    assert box.is_selected(), "the filter form shows the filter applied"
    shot(browser, screenshots, "ui-jobs-unknown.png")


def test_job_page_lists_its_attempts(
    browser: WebDriver, world: World, screenshots: Path | None
) -> None:
    """A job opened from the list shows one timeline row per recorded attempt, in order."""
    job = world.lost[2]
    browser.get(world.url + "/jobs?state=unknown")
    submit(browser, browser.find_element(By.CSS_SELECTOR, f'#jobs tr[data-job="{job.id}"] a'))
    assert text(browser, "h1 code") == job.id
    assert text(browser, "#job-key") == job.key
    recorded = world.outbox.attempts(job.id)
    assert len(recorded) >= 2, "a timed-out attempt and its polls"
    rows = [cells(r) for r in browser.find_elements(By.CSS_SELECTOR, "#attempts tbody tr")]
    assert [(r[0], r[3]) for r in rows] == [(str(a.number), a.outcome) for a in recorded]
    assert [r[7] for r in rows] == ["yes" if a.counted else "no (poll)" for a in recorded]
    shot(browser, screenshots, "ui-job.png")


def test_reconcile_settles_with_the_same_key_and_one_effect(
    browser: WebDriver, world: World, screenshots: Path | None
) -> None:
    """Reconcile, confirmed, makes a lost job SUCCEEDED with its key; the endpoint ran it once."""
    job = world.lost[0]
    browser.get(f"{world.url}/jobs/{job.id}")
    submit(browser, browser.find_element(By.CSS_SELECTOR, 'button[data-action="reconcile"]'))
    assert text(browser, "h1") == "Reconcile 1 item?"
    assert text(browser, "#confirm-ids") == job.id
    assert world.outbox.get(job.id).state is JobState.UNKNOWN, "the confirmation changes nothing"
    shot(browser, screenshots, "ui-confirm.png")

    submit(browser, browser.find_element(By.ID, "confirm-button"))
    assert status(browser) == 200
    changed = browser.find_elements(By.CSS_SELECTOR, "#changed tbody tr")
    assert [cells(r) for r in changed] == [[job.id, "unknown", "succeeded"]]
    shot(browser, screenshots, "ui-result.png")

    submit(browser, browser.find_element(By.ID, "back"))
    assert text(browser, "h1 .state") == "SUCCEEDED"
    assert text(browser, "#job-key") == job.key
    after = world.outbox.get(job.id)
    assert (after.state, after.key) == (JobState.SUCCEEDED, job.key)
    assert world.outbox.attempts(job.id)[-1].replayed, "the stored answer was replayed"
    assert world.orders.effects[job.key] == 1


def test_replay_dead_webhook_keeps_its_webhook_id(
    browser: WebDriver, world: World, screenshots: Path | None
) -> None:
    """A delivery replayed from the webhook DLQ page reaches the receiver with its webhook-id."""
    chosen, other = world.dead
    first = [i for i in world.receiver.ids() if i == chosen.event_id]
    assert len(first) == SCHEDULE.attempts
    browser.get(world.url + "/webhooks/dead-letters")
    browser.find_element(
        By.CSS_SELECTOR, f'tr[data-delivery="{chosen.id}"] input[name="id"]'
    ).click()
    shot(browser, screenshots, "ui-webhook-dlq.png")
    submit(browser, browser.find_element(By.CSS_SELECTOR, 'button[name="action"][value="replay"]'))
    assert text(browser, "#confirm-ids") == chosen.id
    submit(browser, browser.find_element(By.ID, "confirm-button"))
    rows = browser.find_elements(By.CSS_SELECTOR, "#changed tbody tr")
    assert [cells(r) for r in rows] == [[chosen.id, "unknown", "pending"]]

    seen = len(world.receiver.seen)
    world.receiver.ok = True
    try:
        worker = world.hooks.worker(poll_interval=0.01, budget=None, rng=random.Random(7))
        worker.run_until_idle()
    finally:
        world.receiver.ok = False
    assert world.receiver.ids(seen) == [chosen.event_id]
    assert world.hooks.delivery(chosen.id).state is JobState.SUCCEEDED
    assert world.hooks.delivery(other.id).state is JobState.UNKNOWN


@pytest.mark.parametrize("step", ["confirm", "apply"])
def test_action_without_csrf_token_is_refused(browser: WebDriver, world: World, step: str) -> None:
    """A form whose CSRF token was removed is refused with a 403 page and changes nothing."""
    job = world.lost[1]
    before = job_snapshot(world, job.id)
    browser.get(f"{world.url}/jobs/{job.id}")
    if step == "apply":
        submit(browser, browser.find_element(By.CSS_SELECTOR, 'button[data-action="reconcile"]'))
        form, button = "#confirm", browser.find_element(By.ID, "confirm-button")
    else:
        form = 'form:has(button[data-action="reconcile"])'
        button = browser.find_element(By.CSS_SELECTOR, 'button[data-action="reconcile"]')
    removed = browser.execute_script(
        "const i = document.querySelector(arguments[0] + ' input[name=csrf_token]');"
        "i.remove(); return document.querySelectorAll(arguments[0] + ' [name=csrf_token]').length;",
        form,
    )
    assert removed == 0
    submit(browser, button)
    assert status(browser) == 403
    assert "CSRF token is missing" in text(browser, "#error-message")
    assert job_snapshot(world, job.id) == before
    browser.get(world.url + "/actions")
    assert job.id not in browser.find_element(By.TAG_NAME, "main").text


def test_non_loopback_listen_without_token_is_refused(tmp_path: Path) -> None:
    """``retrysafe ui --listen 0.0.0.0:PORT`` without a token exits 2 and names --token."""
    db = tmp_path / "never.db"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "RETRYSAFE_UI_TOKEN"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "retrysafe",
            "ui",
            "--store",
            f"sqlite:///{db}",
            "--listen",
            f"0.0.0.0:{port}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert proc.returncode == 2, proc.stderr
    assert "--token" in proc.stderr
    assert "0.0.0.0 is not a loopback address" in proc.stderr
    assert not db.exists()
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0


FILTERS = (
    [("/jobs", name) for name in ("queue", "state", "host", "since", "until", "limit", "after")]
    + [("/dead-letters", name) for name in ("queue", "state", "limit", "after")]
    + [
        ("/webhooks/dead-letters", "limit"),
        ("/webhooks/dead-letters", "after"),
        ("/webhooks/endpoints/{endpoint}", "state"),
        ("/webhooks/endpoints/{endpoint}", "limit"),
        ("/webhooks/endpoints/{endpoint}", "after"),
        ("/agents", "limit"),
        ("/keys", "hash"),
    ]
)


@pytest.mark.parametrize(("path", "param"), FILTERS)
@pytest.mark.parametrize("injected", INJECTED, ids=["script", "img"])
def test_injected_filter_is_shown_escaped(
    browser: WebDriver, world: World, path: str, param: str, injected: str
) -> None:
    """HTML/JS in a filter is shown literally in the 400 page's error and never runs."""
    page = path.format(endpoint=world.endpoint_id)
    browser.get(f"{world.url}{page}?{param}={quote(injected)}")
    assert no_alert(browser)
    assert status(browser) == 400
    message = text(browser, "#error-message")
    assert message.startswith(f"{param}: ") and injected in message
    assert browser.find_elements(By.CSS_SELECTOR, "main script, main img") == []
