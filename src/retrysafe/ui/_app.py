"""The console's pages: Starlette routes rendering Jinja2 templates (autoescaped) over
:class:`~retrysafe.ui._data.Console`, behind :class:`~retrysafe.ui._security.Guard`.

Reads are GET; every action is a POST through a confirmation page (``/actions/confirm`` →
``/actions/apply``), carries the CSRF token, and is written to the ``retrysafe.ui`` log with
what it changed. Store calls run in Starlette's thread pool (the stores are synchronous);
a store that fails answers a 503 page saying nothing was changed by that request (or, for an
action cut short, exactly which items were).
"""

from __future__ import annotations

import asyncio
import collections
import datetime as dt
import json
import logging
import math
import re
import secrets as _secrets
import time
from collections.abc import Callable, Mapping, Sequence
from importlib.resources import files
from typing import Any
from urllib.parse import parse_qs, urlencode

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from retrysafe._exceptions import (
    ConfigurationError,
    DamagedJobError,
    InvalidKeyError,
    StoreError,
)
from retrysafe.client._jobs import shown_url
from retrysafe.client._models import JobState
from retrysafe.ui._data import (
    DEAD_LETTER_STATES,
    WEBHOOK_QUEUE,
    ActionResult,
    Console,
    Position,
)
from retrysafe.ui._params import (
    BadInput,
    clip,
    form_value,
    parse_id,
    parse_ids,
    parse_job_filter,
    parse_limit,
    parse_position,
    parse_queue,
    parse_run_id,
    parse_states,
)
from retrysafe.ui._security import (
    AUTH_COOKIE,
    LOGIN_MAX_AGE,
    SESSION_COOKIE,
    Guard,
    Secrets,
    local_path,
)

__all__ = ["console_app"]

log = logging.getLogger("retrysafe.ui")

#: What a page shows of a payload, an agent call's arguments and a header value.
PAYLOAD_CAP = 4096
ARGUMENTS_CAP = 1024
HEADER_CAP = 300
#: The largest form the console reads (500 ids and the rest fit in far less).
FORM_CAP = 64 * 1024
#: Header names whose values never reach a page (credentials and session material).
_SECRET_HEADERS = ("authorization", "proxy-authorization", "cookie", "set-cookie")
#: Parts of a header or query-parameter name that mark its value as a credential.
_SECRET_WORDS = (
    "token", "secret", "pass", "pwd", "key", "signature", "auth", "cred", "session", "sig",
)  # fmt: skip
#: Headers whose value is a URL: shown as :func:`safe_url` shows URLs.
_URL_HEADERS = ("location", "content-location", "referer", "origin")
#: What a header whose name holds "key" may still show: not a credential.
_NOT_SECRET = ("idempotency-key",)
#: Characters a page shows escaped: C0/C1 controls but tab and newline, and the
#: bidirectional overrides and isolates that make text read other than it is (CVE-2021-42574).
_INVISIBLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\u200e\u200f]")
#: Outcome classes → the chart's colour class.
_OUTCOME_CLASS = {
    "success": "ok",
    "client_error": "rejected",
    "key_reused": "rejected",
    "in_progress": "wait",
    "rate_limited": "wait",
}
_ACTIONS: dict[str, dict[str, Any]] = {
    "reconcile": {
        "what": "jobs",
        "verb": "Reconcile",
        "explain": "Each UNKNOWN job is sent once more with its same idempotency key; the "
        "server's stored answer (or a first run, if the effect never happened) settles it.",
    },
    "retry": {
        "what": "jobs",
        "verb": "Retry",
        "explain": "Each job goes back to PENDING with its same key and a fresh attempt "
        "budget; a running worker sends it.",
    },
    "purge": {
        "what": "jobs",
        "verb": "Purge",
        "explain": "Each dead letter and its attempts are deleted for good. Nothing is sent.",
    },
    "replay": {
        "what": "deliveries",
        "verb": "Replay",
        "explain": "Each dead-lettered delivery goes back to PENDING with its same "
        "webhook-id and a fresh schedule; a running `retrysafe webhooks worker` sends it.",
    },
    "enable": {
        "what": "endpoint",
        "verb": "Enable",
        "explain": "New deliveries are sent to this endpoint again. Deliveries parked while "
        "it was disabled are not: send them with `retrysafe webhooks endpoints enable "
        "--replay-missed`.",
    },
    "disable": {
        "what": "endpoint",
        "verb": "Disable",
        "explain": "Deliveries to this endpoint stop; pending ones are parked (CANCELLED). "
        "The console does not replay parked deliveries: `retrysafe webhooks endpoints enable "
        "--replay-missed` does.",
    },
}


# ---------------------------------------------------------------------- formatting
def when(ts: float | None) -> str:
    """Unix seconds → ``2026-12-01 14:03:12Z`` (UTC)."""
    if ts is None:
        return ""
    if not math.isfinite(ts):
        return "never"
    try:
        return dt.datetime.fromtimestamp(ts, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")
    except (OverflowError, OSError, ValueError):
        return f"{ts:g}"


def age(seconds: float | None) -> str:
    """Seconds → ``42s`` / ``5m 3s`` / ``2h 1m`` / ``3d 4h``."""
    if seconds is None or not math.isfinite(seconds):
        return ""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60}s"
    if s < 86400:
        return f"{s // 3600}h {s % 3600 // 60}m"
    return f"{s // 86400}d {s % 86400 // 3600}h"


def is_secret_name(name: str) -> bool:
    """Whether a header or query parameter named ``name`` carries a credential."""
    lower = name.lower()
    if lower in _NOT_SECRET:
        return False
    return lower in _SECRET_HEADERS or any(w in lower for w in _SECRET_WORDS)


def shown_arguments(arguments_json: str) -> str:
    """An agent call's arguments as the run page shows them: the value of every field whose
    name carries a credential (``api_key``, ``password``, ``token``, … — the rule of
    :func:`is_secret_name`, at any depth) replaced by ``"••••"``; text that is not JSON as
    it is."""
    try:
        arguments = json.loads(arguments_json)
    except ValueError:
        return arguments_json

    def hide(value: Any) -> Any:
        if isinstance(value, dict):
            return {
                k: "\u2022\u2022\u2022\u2022" if is_secret_name(str(k)) else hide(v)
                for k, v in value.items()
            }
        if isinstance(value, list):
            return [hide(v) for v in value]
        return value

    return json.dumps(hide(arguments), ensure_ascii=False, separators=(",", ":"))


def shown_header(name: str, value: str) -> str:
    """A header value as a page shows it: credentials hidden, the rest capped."""
    if is_secret_name(name):
        return f"(hidden: {len(value)} characters)"
    if name.lower() in _URL_HEADERS:
        value = safe_url(value)
    return clip(value, HEADER_CAP)


def safe_url(url: str) -> str:
    """A URL as a page shows it: no ``user:password@`` (:func:`shown_url`), and the value of
    every query parameter whose name marks a credential (``access_token``, ``api_key``,
    ``sig``…) replaced by ``…``."""
    shown = shown_url(url, 2000)
    base, sep, query = shown.partition("?")
    if not sep:
        return shown
    query, hash_sep, fragment = query.partition("#")
    parts = []
    for part in query.split("&"):
        name, eq, _ = part.partition("=")
        parts.append(f"{name}=…" if eq and is_secret_name(name) else part)
    return base + "?" + "&".join(parts) + hash_sep + fragment


def visible(value: Any) -> Any:
    """What every ``{{ … }}`` of a page passes through (Jinja's ``finalize``): text with its
    control and bidirectional-override characters shown as ``\\xNN`` / ``\\uNNNN`` escapes,
    so a payload can neither break the HTML (NUL) nor read other than it is; markup the
    templates made (macros) is left as it is."""
    import markupsafe

    if isinstance(value, str) and not isinstance(value, markupsafe.Markup):
        return _INVISIBLE.sub(lambda m: m.group(0).encode("unicode_escape").decode(), value)
    return value


def shown_body(body: bytes, cap: int = PAYLOAD_CAP) -> dict[str, Any]:
    """A payload as a page shows it: at most ``cap`` bytes, as text when it is UTF-8."""
    head = body[:cap]
    try:
        text = head.decode("utf-8")
        binary = False
    except UnicodeDecodeError as exc:
        if exc.start >= len(head) - 3 and len(body) > cap:  # a character cut by the cap
            text, binary = head[: exc.start].decode("utf-8"), False
        else:
            text, binary = head.hex(" ", 1)[: cap * 3], True
    return {"text": text, "binary": binary, "size": len(body), "cut": len(body) > cap}


def mask_secret(secret: str) -> str:
    """``whsec_…`` → ``whsec_••••abcd``: enough to tell two secrets apart, never the secret."""
    prefix = "whsec_" if secret.startswith("whsec_") else ""
    rest = secret[len(prefix) :]
    return f"{prefix}••••{rest[-4:]}" if len(rest) > 8 else f"{prefix}••••"


def qs(params: Mapping[str, Any]) -> str:
    """A query string of the non-empty ``params`` (lists repeat the name)."""
    pairs: list[tuple[str, str]] = []
    for k, v in params.items():
        if v is None or v == "" or v == []:
            continue
        if isinstance(v, list | tuple):
            pairs.extend((k, str(x)) for x in v)
        else:
            pairs.append((k, str(v)))
    return ("?" + urlencode(pairs)) if pairs else ""


def _iso(ts: float | None) -> str:
    if ts is None:
        return ""
    # Seconds kept: the pager's links must run the same filter as the page they leave.
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")


# ---------------------------------------------------------------------- the app
class _App:
    """The routes' shared state: the console, the templates, the secrets and the recent
    actions (the last 200, newest first, for the actions page)."""

    def __init__(self, console: Console, secrets: Secrets, *, title: str, store_name: str) -> None:
        import jinja2

        self.console = console
        self.secrets = secrets
        self.title = title
        self.store_name = store_name
        self.recent: collections.deque[dict[str, Any]] = collections.deque(maxlen=200)
        self._lock: asyncio.Lock | None = None
        self.guard: Any = None  # set by console_app: the Guard in front of these pages
        self.env = jinja2.Environment(
            loader=jinja2.PackageLoader("retrysafe.ui", "templates"),
            autoescape=True,
            undefined=jinja2.StrictUndefined,
            finalize=visible,
            # Every template is compiled now and never re-read: a console keeps serving the
            # pages of the code it runs while the package is upgraded under it (a template
            # read from the new release beside the old code failed with a 500).
            auto_reload=False,
            cache_size=-1,
        )
        self.env.globals.update(
            when=when,
            age=age,
            qs=qs,
            clip=clip,
            shown_url=safe_url,
            shown_header=shown_header,
            shown_arguments=shown_arguments,
            mask_secret=mask_secret,
            JobState=JobState,
            WEBHOOK_QUEUE=WEBHOOK_QUEUE,
        )
        for name in self.env.list_templates(extensions=["html"]):
            self.env.get_template(name)

    def action_lock(self) -> asyncio.Lock:
        """The lock every action holds (made on the serving event loop at first use)."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    # -------------------------------------------------------------- rendering
    def render(
        self, request: Request, template: str, status: int = 200, **context: Any
    ) -> HTMLResponse:
        cookies: dict[str, str] = request.scope.get("state", {}).get("cookies", {})
        session = cookies.get(SESSION_COOKIE)
        new_session = session is None or len(session) != 64
        if new_session:
            session = _secrets.token_hex(32)
        assert session is not None
        root = request.scope.get("root_path", "")
        page = self.env.get_template(template).render(
            request=request,
            root=root,
            title=self.title,
            store_name=self.store_name,
            has_outbox=self.console.has_outbox,
            has_keys=self.console.has_keys,
            csrf=self.secrets.csrf_token(session),
            token_required=self.secrets.token is not None,
            # "Log out" only for a browser that is logged in (its cookie, not a Bearer script).
            logged_in=self.secrets.login_ok(cookies.get(AUTH_COOKIE, "")),
            now=time.time(),
            **context,
        )
        response = HTMLResponse(page, status_code=status)
        if new_session:
            response.set_cookie(
                SESSION_COOKIE,
                session,
                httponly=True,
                samesite="strict",
                path=root or "/",
                secure=request.url.scheme == "https",
            )
        return response

    def error(self, request: Request, status: int, message: str) -> HTMLResponse:
        return self.render(request, "error.html", status, message=message)

    async def io(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return await run_in_threadpool(fn, *args, **kwargs)

    # -------------------------------------------------------------- errors
    def guarded(self, handler: Callable[[Request], Any]) -> Callable[[Request], Any]:
        async def endpoint(request: Request) -> Response:
            try:
                response: Response = await handler(request)
            except BadInput as exc:
                return self.error(request, 400, str(exc))
            except _Refused as exc:
                return self.error(request, exc.status, str(exc))
            except DamagedJobError as exc:
                # The store is up; one row in it is not: waiting (a 503) would not help.
                what = "" if request.method == "GET" else " Nothing was changed by this request."
                return self.error(request, 500, f"Damaged job row: {exc}{what}")
            except StoreError as exc:
                what = "" if request.method == "GET" else " Nothing was changed by this request."
                return self.error(request, 503, f"The store is unavailable: {exc}.{what}")
            return response

        endpoint.__name__ = handler.__name__
        return endpoint

    def needs_outbox(self, request: Request) -> HTMLResponse | None:
        if not self.console.has_outbox:
            return self.error(
                request,
                404,
                f"{self.store_name} holds idempotency keys only: jobs, webhooks and agent "
                "runs live in a SQL store (sqlite:///… or postgresql://…). See Keys.",
            )
        return None

    # -------------------------------------------------------------- forms
    async def form(self, request: Request) -> dict[str, list[str]]:
        """The POST body as a form, CSRF-checked.

        Raises:
            _Refused: not a form (415), over :data:`FORM_CAP` (413), unreadable (400), or its
                CSRF token missing or wrong (403); the page says so and nothing is read.
        """
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if kind != "application/x-www-form-urlencoded":
            raise _Refused(415, "actions take an HTML form (application/x-www-form-urlencoded)")
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > FORM_CAP:
                raise _Refused(413, f"the form is larger than {FORM_CAP // 1024} KiB")
        try:
            form = parse_qs(body.decode("utf-8"), keep_blank_values=True, max_num_fields=2000)
        except (UnicodeDecodeError, ValueError) as exc:
            raise _Refused(400, f"the form cannot be read: {exc}") from None
        state = request.scope.get("state", {})
        if state.get("bearer"):
            return form
        given = form_value(form, "csrf_token") or ""
        if not self.secrets.csrf_ok(state.get("cookies", {}).get(SESSION_COOKIE), given):
            raise _Refused(
                403,
                "the form's CSRF token is missing or does not match this browser's session "
                "(an old tab, a restarted console, or a request from another site). Nothing "
                "was changed: reload the page and submit again.",
            )
        return form

    def record(self, request: Request, result: ActionResult, target: str) -> None:
        """Write the action to the log (and the actions page) with what it changed."""
        client = request.client.host if request.client else None
        entry = {"at": time.time(), "target": target, "client": client, **result.to_log()}
        self.recent.appendleft(entry)
        level = logging.WARNING if result.error else logging.INFO
        log.log(
            level,
            f"console {result.action} on {target}: {len(result.changed)} changed, "
            f"{len(result.unchanged)} unchanged"
            + (f", error: {result.error}" if result.error else ""),
            extra={"console_action": entry},
        )


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _page(rows: list[Any], limit: int) -> tuple[list[Any], str | None]:
    """A page read with ``limit + 1`` rows → its ``limit`` rows and the "older" link's
    position (the last row's :class:`~retrysafe.ui._data.Position`), None on the last page."""
    if len(rows) <= limit:
        return rows, None
    rows = rows[:limit]
    return rows, Position(rows[-1].created_at, rows[-1].id).token()


async def _keyset_page(
    request: Request, read: Callable[..., list[Any]]
) -> tuple[list[Any], str | None, int, Position | None]:
    """A list page's rows by the request's ``limit`` and ``after``: ``read(limit=, after=)``
    in a thread, one row more than shown (so the "older" link appears only when there is
    more). Returns the rows, the next position, the limit and the position read after."""
    query = _query(request)
    limit = parse_limit(query)
    after = parse_position(query)
    rows = await run_in_threadpool(read, limit=limit + 1, after=after)
    shown, nxt = _page(rows, limit)
    return shown, nxt, limit, after


def _query(request: Request) -> dict[str, list[str]]:
    """The query string's parameters (at most 200: more is a 400, not a parse)."""
    try:
        return parse_qs(request.url.query, keep_blank_values=False, max_num_fields=200)
    except ValueError:
        raise BadInput("query", "more than 200 parameters") from None


def _pages(app: _App) -> list[Any]:
    console = app.console

    async def overview(request: Request) -> Response:
        if not console.has_outbox:
            return RedirectResponse(request.scope.get("root_path", "") + "/keys", 303)
        now = time.time()

        def read() -> dict[str, Any]:
            stats = console.stats()
            chart = console.chart(now)
            with console.webhooks() as hooks:
                endpoints = hooks.list_endpoints()
            return {"stats": stats, "chart": chart, "endpoints": endpoints}

        data = await app.io(read)
        queues: dict[str, dict[str, Any]] = {}
        for queue, state, n, oldest in data["stats"]:
            row = queues.setdefault(queue, {s.value: 0 for s in JobState} | {"ages": {}})
            row[state.value] = n
            row["ages"][state.value] = oldest
        troubled = [e for e in data["endpoints"] if not e.enabled or e.failure_count > 0]
        return app.render(
            request,
            "overview.html",
            queues=dict(sorted(queues.items(), key=lambda kv: (kv[0] != "default", kv[0]))),
            chart=_chart(data["chart"], now),
            troubled=troubled,
        )

    async def jobs(request: Request) -> Response:
        if (refusal := app.needs_outbox(request)) is not None:
            return refusal
        query = _query(request)
        f = parse_job_filter(query)
        limit = parse_limit(query)
        after = parse_position(query)
        found, queues = await app.io(
            lambda: (console.jobs(f, limit=limit + 1, after=after), console.queues())
        )
        found, nxt = _page(found, limit)
        params = {
            "queue": f.queue,
            "state": [s.value for s in f.states],
            "host": f.host_text,
            "since": _iso(f.since),
            "until": _iso(f.until),
            "limit": limit if limit != 50 else None,
        }
        return app.render(
            request,
            "jobs.html",
            jobs=found,
            f=f,
            queues=queues,
            params=params,
            next_after=nxt,
            first_page=after is None,
            since_text=_iso(f.since),
            until_text=_iso(f.until),
        )

    async def job(request: Request) -> Response:
        if (refusal := app.needs_outbox(request)) is not None:
            return refusal
        job_id = parse_id(request.path_params["job_id"], "job id")
        query = _query(request)
        queue = (query.get("queue") or [""])[0] or None
        found, attempts = await app.io(lambda: (console.job(job_id), console.attempts(job_id)))
        if found is None:
            # The short id a list shows (its first 12 characters), as `retrysafe jobs show`
            # takes it (ids are lower-case hex): one match is that job's page; two say so.
            prefix = job_id.lower()
            in_queue = None if queue is None else parse_queue(queue)
            same = await app.io(console.jobs_with_prefix, prefix, in_queue)
            if len(same) == 1:
                target = f"{request.scope.get('root_path', '')}/jobs/{same[0]}"
                raw = request.url.query
                return RedirectResponse(target + ("?" + raw if raw else ""), 303)
            if same:
                return app.error(
                    request,
                    400,
                    f"Several jobs have ids starting with {job_id}; give more of the id.",
                )
            if in_queue is not None:
                elsewhere = await app.io(console.jobs_with_prefix, prefix, None)
                if len(elsewhere) == 1:
                    other = await app.io(console.job, elsewhere[0])
                    if other is not None:
                        return app.error(
                            request,
                            404,
                            f"Job {other.id} belongs to queue {other.queue!r}, "
                            f"not {clip(in_queue)!r}.",
                        )
            return app.error(
                request, 404, f"No job {job_id} in this store (purged, or never submitted)."
            )
        if queue is not None and parse_queue(queue) != found.queue:
            return app.error(
                request,
                404,
                f"Job {job_id} belongs to queue {found.queue!r}, not {clip(queue)!r}.",
            )
        delivery = None
        if found.queue == WEBHOOK_QUEUE:
            delivery = f"/webhooks/deliveries/{found.id}"
        return app.render(
            request,
            "job.html",
            job=found,
            attempts=attempts,
            body=shown_body(found.body),
            delivery=delivery,
        )

    async def dead_letters(request: Request) -> Response:
        if (refusal := app.needs_outbox(request)) is not None:
            return refusal
        from retrysafe.ui._data import JobFilter

        query = _query(request)
        queue = parse_queue((query.get("queue") or [""])[0] or None)
        if queue == WEBHOOK_QUEUE:
            return RedirectResponse(
                request.scope.get("root_path", "") + "/webhooks/dead-letters", 303
            )
        states = parse_states(query, DEAD_LETTER_STATES) or DEAD_LETTER_STATES
        limit = parse_limit(query)
        after = parse_position(query)
        f = JobFilter(queue=queue, states=tuple(states))
        found, queues = await app.io(
            lambda: (console.jobs(f, limit=limit + 1, after=after), console.queues())
        )
        found, nxt = _page(found, limit)
        return app.render(
            request,
            "dead_letters.html",
            jobs=found,
            queue=queue,
            queues=[q for q in queues if q != WEBHOOK_QUEUE],
            states=[s.value for s in states],
            next_after=nxt,
            limit=limit,
        )

    async def confirm(request: Request) -> Response:
        return await _act(request, apply=False)

    async def apply(request: Request) -> Response:
        return await _act(request, apply=True)

    async def _act(request: Request, *, apply: bool) -> Response:
        form = await app.form(request)
        action = form_value(form, "action") or ""
        if action not in _ACTIONS:
            raise BadInput("action", f"{clip(action)!r} is not one of {', '.join(_ACTIONS)}")
        spec = _ACTIONS[action]
        if spec["what"] == "jobs" and not console.has_outbox:
            return app.needs_outbox(request) or app.error(request, 404, "")
        ids = parse_ids(form)
        queue = parse_queue(form_value(form, "queue") or None)
        if spec["what"] == "jobs" and queue == WEBHOOK_QUEUE:
            raise BadInput(
                "queue",
                f"webhook deliveries are not given the jobs' {action}: replay them from the "
                "Webhooks pages (each attempt is signed), or purge them with `retrysafe "
                "webhooks dlq purge`",
            )
        if spec["what"] == "endpoint" and len(ids) != 1:
            raise BadInput("id", "enable and disable take one endpoint")
        reason = clip((form_value(form, "reason") or "").strip(), 200)
        reason = reason or "disabled from the console"
        back = local_path(form_value(form, "back") or "")
        if not apply:
            return app.render(
                request,
                "confirm.html",
                action=action,
                spec=spec,
                ids=ids,
                queue=queue,
                reason=reason,
                back=back,
            )
        if form_value(form, "confirmed") != "yes":
            raise BadInput("confirmed", "an action runs only from its confirmation page")
        # One action at a time per console: what an item was before and after is then what
        # this action did, not what a concurrent one did (the log names each change once).
        async with app.action_lock():
            console.before_action()
            if action == "reconcile":
                result = await console.reconcile(queue, ids)
            elif action == "retry":
                result = await app.io(console.retry, queue, ids)
            elif action == "purge":
                result = await app.io(console.purge, queue, ids)
            elif action == "replay":
                result = await app.io(console.replay_deliveries, ids)
            else:
                result = await app.io(
                    console.set_endpoint, ids[0], enabled=action == "enable", reason=reason
                )
        target = f"queue {queue!r}" if spec["what"] == "jobs" else spec["what"]
        app.record(request, result, target)
        status = 503 if result.error else 200
        return app.render(
            request, "result.html", status, result=result, spec=spec, queue=queue, back=back
        )

    async def webhooks(request: Request) -> Response:
        if (refusal := app.needs_outbox(request)) is not None:
            return refusal

        def read() -> Any:
            with console.webhooks() as hooks:
                return hooks.list_endpoints()

        endpoints = await app.io(read)
        return app.render(request, "webhooks.html", endpoints=endpoints)

    async def endpoint(request: Request) -> Response:
        if (refusal := app.needs_outbox(request)) is not None:
            return refusal
        from retrysafe._exceptions import EndpointNotFoundError

        endpoint_id = parse_id(request.path_params["endpoint_id"], "endpoint id")
        query = _query(request)
        limit = parse_limit(query)
        after = parse_position(query)
        states = parse_states(query)

        def read() -> Any:
            with console.webhooks() as hooks:
                try:
                    e = hooks.get_endpoint(endpoint_id)
                except EndpointNotFoundError:
                    return None, []
            return e, console.deliveries(
                endpoint_id=e.id, states=states or None, limit=limit + 1, after=after
            )

        e, deliveries = await app.io(read)
        if e is None:
            return app.error(request, 404, f"No webhook endpoint {endpoint_id}.")
        deliveries, nxt = _page(deliveries, limit)
        return app.render(
            request,
            "endpoint.html",
            e=e,
            deliveries=deliveries,
            next_after=nxt,
            states=[s.value for s in states],
            limit=limit,
        )

    async def delivery(request: Request) -> Response:
        if (refusal := app.needs_outbox(request)) is not None:
            return refusal
        from retrysafe._exceptions import JobNotFoundError

        delivery_id = parse_id(request.path_params["delivery_id"], "delivery id")

        def read() -> Any:
            with console.webhooks() as hooks:
                try:
                    d = hooks.dispatcher.store.list_deliveries(ids=[delivery_id], limit=1)
                except JobNotFoundError:
                    d = []
                if not d:
                    return None, []
                return d[0], console.attempts(delivery_id)

        d, attempts = await app.io(read)
        if d is None:
            return app.error(request, 404, f"No webhook delivery {delivery_id}.")
        return app.render(request, "delivery.html", d=d, attempts=attempts)

    async def webhook_dlq(request: Request) -> Response:
        if (refusal := app.needs_outbox(request)) is not None:
            return refusal
        found, nxt, limit, _ = await _keyset_page(request, console.dead_deliveries)
        return app.render(
            request, "webhook_dlq.html", deliveries=found, next_after=nxt, limit=limit
        )

    async def agents(request: Request) -> Response:
        if (refusal := app.needs_outbox(request)) is not None:
            return refusal
        runs, nxt, limit, after = await _keyset_page(request, console.agent_runs)
        return app.render(
            request,
            "agents.html",
            runs=runs,
            next_after=nxt,
            first_page=after is None,
            limit=limit,
        )

    async def agent_run(request: Request) -> Response:
        if (refusal := app.needs_outbox(request)) is not None:
            return refusal
        ids = _query(request).get("id") or []
        if len(ids) != 1:
            raise BadInput("id", "name one run: /agents/run?id=RUN_ID")
        run_id = parse_run_id(ids[0])
        found = await app.io(console.agent_run, run_id)
        if found is None:
            return app.error(request, 404, f"No agent run {clip(run_id)!r}.")
        run, calls = found
        return app.render(request, "agent_run.html", run=run, calls=calls, cap=ARGUMENTS_CAP)

    async def keys(request: Request) -> Response:
        if not console.has_keys:
            return app.error(request, 404, f"{app.store_name} holds no idempotency keys.")
        query = _query(request)
        lookup = None
        shown = ""
        if request.method == "POST":
            form = await app.form(request)
            lookup, shown = _key_target(form)
        elif query.get("hash"):
            if len(query["hash"]) > 1:
                raise BadInput("hash", "give it once")
            text = query["hash"][0].strip().lower()
            if not (0 < len(text) <= 64) or any(c not in "0123456789abcdef" for c in text):
                raise BadInput("hash", f"{clip(text)!r} is not a key hash (hex digits)")
            lookup, shown = text, f"with hash {text}"
        now = time.time()
        found: list[Any] = []
        recent: list[Any] = []
        if lookup is not None:
            found = await app.io(console.store.find_keys, lookup, now=now, limit=11)
        elif query.get("recent"):
            recent = await app.io(console.store.list_keys, now=now, limit=parse_limit(query))
        from retrysafe.cli._keys import next_attempt

        return app.render(
            request,
            "keys.html",
            lookup=lookup,
            shown=shown,
            found=found[:10],
            ambiguous=len(found) > 1,
            recent=recent,
            next_attempt=next_attempt,
            status=404 if lookup is not None and not found else 200,
        )

    async def logout(request: Request) -> Response:
        await app.form(request)
        root = request.scope.get("root_path", "")
        response = RedirectResponse(root + ("/login" if app.secrets.token else "/"), 303)
        response.delete_cookie(AUTH_COOKIE, path=root or "/", samesite="strict")
        response.delete_cookie(SESSION_COOKIE, path=root or "/", samesite="strict")
        return response

    async def actions(request: Request) -> Response:
        return app.render(request, "actions.html", recent=list(app.recent))

    async def login(request: Request) -> Response:
        root = request.scope.get("root_path", "")
        nxt = local_path((_query(request).get("next") or ["/"])[0])
        if app.secrets.token is None:
            return RedirectResponse(root + "/", 303)
        if request.method == "GET":
            return app.render(request, "login.html", next=nxt, failed=False)
        form = await app.form(request)
        if not app.secrets.token_ok((form.get("token") or [""])[0]):
            # One wrong guess per second per console, logged (the guard's rule, shared with
            # wrong Bearer tokens).
            await app.guard.refused_token(request.scope)
            return app.render(request, "login.html", 403, next=nxt, failed=True)
        response = RedirectResponse(root + nxt, 303)
        response.set_cookie(
            AUTH_COOKIE,
            app.secrets.auth_value(),
            max_age=LOGIN_MAX_AGE,
            httponly=True,
            samesite="strict",
            path=root or "/",
            secure=request.url.scheme == "https",
        )
        return response

    g = app.guarded
    return [
        Route("/", g(overview)),
        Route("/jobs", g(jobs)),
        Route("/jobs/{job_id:path}", g(job)),
        Route("/dead-letters", g(dead_letters)),
        Route("/actions/confirm", g(confirm), methods=["POST"]),
        Route("/actions/apply", g(apply), methods=["POST"]),
        Route("/actions", g(actions)),
        Route("/webhooks", g(webhooks)),
        Route("/webhooks/dead-letters", g(webhook_dlq)),
        Route("/webhooks/endpoints/{endpoint_id:path}", g(endpoint)),
        Route("/webhooks/deliveries/{delivery_id:path}", g(delivery)),
        Route("/agents", g(agents)),
        Route("/agents/run", g(agent_run)),
        Route("/keys", g(keys), methods=["GET", "POST"]),
        Route("/login", g(login), methods=["GET", "POST"]),
        Route("/logout", g(logout), methods=["POST"]),
        Mount("/static", StaticFiles(directory=str(files("retrysafe.ui") / "static"))),
    ]


def _key_target(form: Mapping[str, Sequence[str]]) -> tuple[str, str]:
    """The keys form → ``(hash, how it was named)`` by the rule ``retrysafe keys`` uses."""
    from retrysafe.cli._keys import key_lookup
    from retrysafe.core import parse_key

    key = (form.get("key") or [""])[0]
    how = (form.get("scope_kind") or ["none"])[0]
    scope_value = (form.get("scope") or [""])[0]
    try:
        parsed = parse_key(key)
    except InvalidKeyError as exc:
        raise BadInput("key", str(exc)) from None
    try:
        if how == "authorization":
            hashed, shown = key_lookup(parsed, authorization=scope_value)
        elif how == "scope":
            hashed, shown = key_lookup(parsed, scope=scope_value)
        elif how == "none":
            hashed, shown = key_lookup(parsed)
        else:
            raise BadInput("scope_kind", f"{clip(how)!r} is not none, authorization or scope")
    except ValueError as exc:
        if isinstance(exc, BadInput):
            raise
        raise BadInput("authorization", str(exc)) from None
    return hashed, f"{clip(parsed, 80)!r} {shown}"


def _chart(buckets: list[dict[str, int]], now: float) -> dict[str, Any]:
    """The overview's bar chart as SVG geometry: one stacked bar per five-minute bucket."""
    width, height, gap = 480, 120, 4
    n = len(buckets)
    bar = (width - gap * (n + 1)) / n
    top = max([sum(b.values()) for b in buckets] + [1])
    bars = []
    totals: dict[str, int] = {}
    for i, b in enumerate(buckets):
        y = float(height)
        x = gap + i * (bar + gap)
        for outcome, count in sorted(b.items()):
            totals[outcome] = totals.get(outcome, 0) + count
            h = height * count / top
            y -= h
            bars.append(
                {
                    "x": round(x, 1),
                    "y": round(y, 1),
                    "w": round(bar, 1),
                    "h": round(h, 1),
                    "cls": _OUTCOME_CLASS.get(outcome, "failed"),
                    "label": f"{count} {outcome}, {(n - i) * 5}–{(n - i - 1) * 5} min ago",
                }
            )
    return {"width": width, "height": height, "bars": bars, "top": top, "totals": totals}


def console_app(
    store: Any,
    *,
    token: str | None = None,
    loopback_only: bool | None = None,
    reconcile_timeout: float = 10.0,
    title: str = "retrysafe console",
    store_name: str | None = None,
) -> Any:
    """The operator console as an ASGI application, to run with ``retrysafe ui`` or to
    mount in your own app (``Mount("/retrysafe", console_app(store, token=…))``).

    Args:
        store: an open store (:func:`retrysafe.stores.open_store`): SQLite or PostgreSQL
            for every page, Redis (any key store) for the keys page. The caller closes it.
        token: the access token (16–512 visible ASCII characters), required by every page when given
            (``Authorization: Bearer``, or the login form's cookie). Without one, the
            console answers only requests to a loopback name.
        loopback_only: answer only requests whose ``Host`` is a loopback name (default:
            True without a token, False with one).
        reconcile_timeout: seconds per reconcile attempt.
        title: the pages' title.
        store_name: how pages name the store (default: its URL without a password).

    Raises:
        ConfigurationError: ``token`` is not 16–512 visible ASCII characters.
    """
    if token is not None and (
        len(token) < 16 or len(token) > 512 or not all(33 <= ord(c) <= 126 for c in token)
    ):
        raise ConfigurationError(
            "the console's token must be 16–512 visible ASCII characters (no spaces) "
            "(e.g. `python -c 'import secrets; print(secrets.token_urlsafe())'`)",
            option="token",
        )
    if store_name is None:
        from retrysafe.stores._url_check import redact_url

        url = getattr(store, "url", None)
        store_name = redact_url(url) if isinstance(url, str) else type(store).__name__
    secrets = Secrets(token)
    console = Console(store, reconcile_timeout=reconcile_timeout)
    app = _App(console, secrets, title=title, store_name=store_name)
    inner = Starlette(routes=_pages(app))
    app.guard = Guard(
        inner,
        secrets=secrets,
        loopback_only=(token is None) if loopback_only is None else loopback_only,
    )
    return app.guard
