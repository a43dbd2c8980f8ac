"""``@tool``: declare a function a read or write tool with its retry policy (SPEC §5, §7).

Write tools record each logical call (its key included) before the first attempt and replay
the stored result to every repeat. An attempt that raised a transport error or a timeout has
an unknown outcome: it is retried only with the SAME key, and when the attempts run out the
call is UNKNOWN (reported with its key), never silently failed. Read tools retry freely.

A claimed call is held under a short lease that its process renews (a heartbeat, SPEC §3
"Lease renewal") from its first attempt until its outcome is recorded, so a parallel
duplicate waits however long the tool runs, and takes the call over only once a dead (or
wedged, past ``max_run_time``) process stopped renewing. A claimant that finds its call taken
over writes nothing and raises :class:`~retrysafe.AgentError` with the key.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import math
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, Literal, TypeVar, cast, overload

import httpx

from retrysafe._exceptions import (
    AgentError,
    BudgetExceededError,
    CallIdReusedError,
    ConfigurationError,
    NoActiveRunError,
    OutcomeUnknownError,
    PayloadError,
    StoreError,
    StoreUnavailableError,
    ToolCallFailedError,
    ToolSignatureError,
)
from retrysafe._heartbeat import AsyncHeartbeat, Heartbeat
from retrysafe.agents._budget import attempts_refusal, step_budget
from retrysafe.agents._keys import (
    arguments_hash,
    bind_arguments,
    call_key,
    canonical_json,
    signature_hash,
)
from retrysafe.agents._models import AgentCall, AgentCallState
from retrysafe.agents._run import (
    AgentRun,
    _call_id_var,
    _derived_var,
    _key_var,
    _run_var,
    _step_var,
)
from retrysafe.core import (
    Action,
    Backoff,
    InProgress,
    KeyRecord,
    KeyReused,
    KeyState,
    LeaseTiming,
    TakeOver,
    classify_response,
    lease_timing,
)
from retrysafe.core import decide as key_decision
from retrysafe.testing import waited

__all__ = ["ToolSpec", "is_retryable", "tool"]

_F = TypeVar("_F", bound=Callable[..., Any])
_POLL = 0.02
_SUMMARY = 200

log = logging.getLogger("retrysafe.agents")


def is_retryable(exc: BaseException) -> bool:
    """The default retry rule: transport errors, timeouts and retryable HTTP answers (§5).

    ``httpx.TransportError``, ``TimeoutError`` and ``ConnectionError`` retry, and so does an
    ``httpx.HTTPStatusError`` whose status §5 retries or polls (408, 409 in progress, 429, 5xx).
    """
    if isinstance(exc, httpx.HTTPStatusError):
        action = classify_response(exc.response.status_code).action
        return action in (Action.RETRY, Action.POLL)
    return isinstance(exc, (httpx.TransportError, TimeoutError, ConnectionError))


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolSpec:
    """A tool's declaration, as ``@tool`` recorded it (``fn.__retrysafe_tool__``).

    ``timing`` holds the validated lease, heartbeat and maximum run time (seconds).
    """

    name: str
    kind: Literal["read", "write"]
    attempts: int
    backoff: Backoff
    retry_on: Callable[[BaseException], bool]
    dedupe: Literal["step", "run"]
    timing: LeaseTiming
    signature: inspect.Signature
    signature_hash: str
    #: ``module:qualname`` of the declared function (two tools under one name are refused).
    origin: str = ""

    @property
    def lease(self) -> float:
        """Seconds a claimed call holds without renewal (``timing.lease``)."""
        return self.timing.lease


@overload
def tool(fn: _F, /) -> _F: ...


@overload
def tool(
    *,
    kind: Literal["read", "write"] = ...,
    name: str | None = ...,
    attempts: int = ...,
    wait_initial: float = ...,
    wait_max: float = ...,
    retry_on: Callable[[BaseException], bool] = ...,
    dedupe: Literal["step", "run"] = ...,
    lease: float | timedelta = ...,
    heartbeat: float | timedelta | None = ...,
    max_run_time: float | timedelta = ...,
) -> Callable[[_F], _F]: ...


def tool(
    fn: Any = None,
    /,
    *,
    kind: Literal["read", "write"] = "read",
    name: str | None = None,
    attempts: int = 3,
    wait_initial: float = 0.1,
    wait_max: float = 5.0,
    retry_on: Callable[[BaseException], bool] = is_retryable,
    dedupe: Literal["step", "run"] = "step",
    lease: float | timedelta = 30.0,
    heartbeat: float | timedelta | None = None,
    max_run_time: float | timedelta = 3600.0,
) -> Any:
    """Declare a sync or async function an agent tool.

    Args:
        kind: ``"read"`` (no effect: retried freely, no key sent) or ``"write"`` (an effect:
            needs an agent run; one key per logical call, stored before the first attempt).
        name: the tool's name in the audit log (default: the function's ``__qualname__``).
        attempts: attempts per invocation (≥ 1); retries back off with full jitter between
            ``wait_initial`` and ``wait_max`` seconds (:class:`retrysafe.core.Backoff`).
        retry_on: which exceptions are retried (default :func:`is_retryable`). For a write
            tool they mean "outcome unknown": retried with the same key, and UNKNOWN when the
            attempts run out. Any other exception is a definitive failure.
        dedupe: ``"step"`` (default): the same arguments in another step are another call;
            ``"run"``: the same arguments anywhere in the run are the same call.
        lease: seconds (float or ``timedelta``) a claimed call holds without renewal: how
            long a process that died mid-call blocks it before a parallel duplicate or a
            resumed run may take it over (default 30 s). A live call renews it, however
            long the tool runs, so it need not cover the tool's run time.
        heartbeat: seconds between renewals (default ``lease / 3``): one fenced store write
            each, from a thread for a sync tool, on the event loop (the write itself in a
            worker thread) for an async one.
        max_run_time: seconds after the first attempt started (default one hour) when
            renewal stops: a wedged call then loses its lease like a dead one. Backoff
            waits between attempts count.

        The three durations follow :func:`retrysafe.core.lease_timing` (SPEC §3 "Lease
        renewal", §7; Temporal's activity heartbeats, Kleppmann's fencing tokens). A
        claimant whose renewal finds the call taken over logs it at ERROR level (run, key,
        tool), does not record its late result, and raises :class:`~retrysafe.AgentError`
        with the key, as it does when its next attempt finds the call taken over.

    Returns:
        The function wrapped with the same signature (frameworks that read signatures and
        docstrings see the original), marked with ``__retrysafe_tool__``.

    Raises:
        ConfigurationError: a bad ``kind``, ``attempts`` < 1 or bad waits; a ``lease``,
            ``heartbeat`` or ``max_run_time`` that is not seconds or a ``timedelta``, not
            finite, zero or negative, above its bound (``MAX_LEASE`` one day,
            ``MAX_RUN_TIME`` seven days), a heartbeat under ``MIN_HEARTBEAT`` (0.05 s), or a
            heartbeat not shorter than the lease.

    Warns:
        RetrysafeWarning: a heartbeat longer than half the lease (one late renewal lets a
            duplicate take over live work).
    """
    if kind not in ("read", "write"):
        raise ConfigurationError(f"kind must be 'read' or 'write', not {kind!r}", option="kind")
    if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1:
        raise ConfigurationError("attempts must be an integer >= 1", option="attempts")
    if dedupe not in ("step", "run"):
        raise ConfigurationError("dedupe must be 'step' or 'run'", option="dedupe")
    timing = lease_timing(lease, heartbeat=heartbeat, max_run_time=max_run_time)
    backoff = Backoff(base=wait_initial, cap=max(wait_max, wait_initial))

    def decorate(f: _F) -> _F:
        sig = inspect.signature(f)
        spec = ToolSpec(
            name=name or f.__qualname__,
            kind=kind,
            attempts=attempts,
            backoff=backoff,
            retry_on=retry_on,
            dedupe=dedupe,
            timing=timing,
            signature=sig,
            signature_hash=signature_hash(sig),
            origin=f"{f.__module__}:{f.__qualname__}",
        )
        wrapper: Any
        if inspect.iscoroutinefunction(f):

            @functools.wraps(f)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                return await _acall(spec, f, args, kwargs)

            wrapper = async_wrapper
        else:

            @functools.wraps(f)
            def sync_wrapper(*args: Any, **kwargs: Any) -> Any:
                return _call(spec, f, args, kwargs)

            wrapper = sync_wrapper
        wrapper.__retrysafe_tool__ = spec
        return cast(_F, wrapper)

    if fn is not None:
        return decorate(fn)
    return decorate


# ---------------------------------------------------------------------------- the call flow
class _Flow:
    """One invocation of a tool: the decisions, shared by the sync and async drivers."""

    def __init__(self, spec: ToolSpec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.spec = spec
        self.run: AgentRun | None = _run_var.get()
        if self.run is None and spec.kind == "write":
            raise NoActiveRunError(
                f"write tool {spec.name!r} was called outside an agent run; wrap the agent "
                "loop in `with start_run(store):` or `with resume_run(store, run_id):`",
                tool=spec.name,
            )
        self.token = 0
        self.call: AgentCall | None = None
        self.call_id: str | None = None
        self.derived = False  # the call id came from a framework adapter (derived_call_id)
        self.rng = random.Random()
        # Lease renewal: the heartbeat renewing this call's claim, whether a renewal found the
        # call taken over, whether the outcome was recorded (or refused) so that renewals have
        # nothing left to do, and whether this claimant was fenced out. The lock keeps a
        # renewal and the recording of the outcome apart, so a renewal that runs after the
        # outcome was written never mistakes the finished call for a lost one.
        self.beat: Heartbeat | AsyncHeartbeat | None = None
        self.lost = False
        self.recorded = False
        self.fenced_out = False
        self._guard = threading.Lock()
        self.started = time.perf_counter()
        if self.run is None:
            return
        if spec.kind == "write":
            self.run.check_tool(spec.name, spec.origin)
        bound = bind_arguments(spec.signature, spec.name, args, kwargs)
        digest = arguments_hash(bound)
        step = _step_var.get() or 0
        self.call_id = _call_id_var.get()
        self.derived = _derived_var.get()
        key = call_key(
            self.run.id,
            spec.name,
            step=None if spec.dedupe == "run" else step,
            arguments_digest=digest,
            call_id=self.call_id,
        )
        now = self.run.clock()
        self.call = AgentCall(
            key=key,
            run_id=self.run.id,
            step=step,
            tool=spec.name,
            kind=spec.kind,
            signature=spec.signature_hash,
            arguments_hash=digest,
            arguments_json=canonical_json(bound),
            state=AgentCallState.RUNNING,
            owner=self.run.owner,
            lease_expires_at=now + spec.lease,
            created_at=now,
            updated_at=now,
        )

    # What to do with the call the claim found: ("run", None) execute under the token held,
    # ("return", value) answer with the recorded result, ("take_over", (token, allow_unknown))
    # take the call over from that token (then execute, or poll again if another claimant
    # took it first), ("wait", None) poll the call again; or raise. No I/O: the sync and the
    # async driver do the store calls.
    def decide(self, outcome: str, row: AgentCall) -> tuple[str, Any]:
        run, spec, call = self.run, self.spec, self.call
        assert run is not None and call is not None
        if outcome == "conflict":
            raise ToolSignatureError(
                f"tool {spec.name!r} changed its parameters since run {run.id!r} recorded it "
                f"(signature {row.signature} then, {spec.signature_hash} now); the same call "
                "would get another key. Resume the run with the old tool, or start a new run",
                run_id=run.id,
                tool=spec.name,
                recorded=row.signature,
                current=spec.signature_hash,
            )
        if outcome == "claimed":
            self.token = row.fencing_token
            return "run", None
        if row.key != call.key:
            # The claim joined an earlier step's UNKNOWN call of this write (same arguments):
            # from here on this invocation is that call, under its key.
            call = self.call = replace(call, key=row.key, step=row.step)
        # The rows of SPEC §3 that agent calls share with keys: same key for another call,
        # running under a live lease, running under an expired one.
        decision = key_decision(_as_key_record(row), _fingerprint(call), run.clock())
        if isinstance(decision, KeyReused):
            raise self._reused(row)
        if isinstance(decision, InProgress):
            return "wait", None  # a parallel duplicate runs it: wait for its outcome
        if isinstance(decision, TakeOver):
            return "take_over", (decision.fencing_token, False)
        # Finished: the agent's own states.
        if row.state is AgentCallState.REFUSED:
            raise self._budget_error(row.error or "step budget exhausted", "steps", row)
        if spec.kind == "read":
            self.token = 0  # a repeated read runs again, without touching its audit row
            return "run", None
        if row.state is AgentCallState.SUCCEEDED:
            self._report("replayed", row.key)
            if row.result_json is None:
                raise ToolCallFailedError(
                    f"call {row.key} of {spec.name!r} succeeded but its result was not "
                    "JSON-serialisable, so it cannot be replayed; it is not run again",
                    run_id=run.id,
                    key=row.key,
                    tool=spec.name,
                    error=row.result_summary or "",
                )
            return "return", row.result
        if row.state is AgentCallState.FAILED:
            raise ToolCallFailedError(
                f"call {row.key} of {spec.name!r} failed before ({row.error}); it is not run again",
                run_id=run.id,
                key=row.key,
                tool=spec.name,
                error=row.error or "",
            )
        if run.retry_unknown:  # UNKNOWN: re-send it with its key only when asked to
            return "take_over", (row.fencing_token, True)
        self._report("unknown", row.key)
        raise self._unknown(row)

    def _report(self, outcome: str, key: str) -> None:
        """A write call's outcome to the run's telemetry: ``executed``, ``replayed``,
        ``unknown`` (recorded now, or found recorded) or ``failed``."""
        run = self.run
        if run is not None and run.telemetry is not None and self.spec.kind == "write":
            run.telemetry.agent_call(
                self.spec.name, outcome, time.perf_counter() - self.started, key
            )

    def _reused(self, row: AgentCall) -> CallIdReusedError:
        """A recorded call under this key that is another tool or other arguments.

        Derived keys contain both, so only an explicit call id reused for another tool or
        other arguments lands here; it is refused like the middleware's 422 for a reused key.
        """
        run, call = self.run, self.call
        assert run is not None and call is not None
        name = self.call_id if self.call_id is not None else row.key
        what = (
            f"for tool {row.tool!r}, not {call.tool!r}"
            if row.tool != call.tool
            else f"for {call.tool!r} with other arguments"
        )
        return CallIdReusedError(
            f"call id {name!r} of run {run.id!r} was already used {what} "
            f"(arguments hash {row.arguments_hash} recorded, {call.arguments_hash} now); "
            "nothing ran. Give each logical call its own call id",
            run_id=run.id,
            key=row.key,
            tool=call.tool,
            call_id=name,
            recorded_tool=row.tool,
            recorded_arguments_hash=row.arguments_hash,
            arguments_hash=call.arguments_hash,
        )

    def take_over(self, fencing_token: int, allow_unknown: bool) -> bool:
        """Take the call over from ``fencing_token`` (a store call). False: another claimant
        took it first (poll it again)."""
        run, call = self.run, self.call
        assert run is not None and call is not None
        now = run.clock()
        token = run.store.take_over_agent_call(
            call.key,
            fencing_token,
            owner=run.owner,
            lease_expires_at=now + self.spec.lease,
            now=now,
            allow_unknown=allow_unknown,
        )
        if token is None:
            return False
        self.token = token
        return True

    def _unknown(self, row: AgentCall) -> OutcomeUnknownError:
        assert self.run is not None
        return OutcomeUnknownError(
            f"outcome unknown, key {row.key}: {self.spec.name!r} may or may not have taken "
            f"effect ({row.error or 'no definitive answer'}); it was not run again. "
            "Reconcile with the same key, never a new one",
            run_id=self.run.id,
            key=row.key,
            tool=self.spec.name,
            attempts=row.attempts,
        )

    def _budget_error(self, reason: str, kind: str, row: AgentCall) -> BudgetExceededError:
        run = self.run
        assert run is not None
        if run.telemetry is not None:
            run.telemetry.budget_refusal(kind)
        limit = (run.max_steps if kind == "steps" else run.max_attempts) or 0
        return BudgetExceededError(
            f"agent run {run.id!r}: {reason}; call {row.key} of {self.spec.name!r} refused",
            run_id=run.id,
            limit=limit,
            kind=kind,
            key=row.key,
            tool=self.spec.name,
        )

    def claim(self) -> tuple[str, AgentCall]:
        run = self.run
        assert run is not None and self.call is not None
        budget = step_budget(run.max_steps)
        # A derived key joins an earlier UNKNOWN call of the same write with the same
        # arguments (SPEC §0): a call id the application named is its own logical call.
        join = self.spec.kind == "write" and (self.call_id is None or self.derived)
        try:
            return run.store.claim_agent_call(
                self.call, now=run.clock(), budget=budget, join_unknown=join
            )
        except StoreUnavailableError as unavailable:
            # A store that cannot be written now (another process kept SQLite's write lock
            # past busy_timeout, a read-only file): a call recorded under this key is what
            # the claim returns first, so a repeat is answered from a read — its stored
            # result, or its state — instead of failing. A new call needs the write.
            try:
                row = run.store.get_agent_call(self.call.key)
            except StoreError:
                raise unavailable from None
            if row is None:
                raise
            return "existing", row

    def get(self) -> AgentCall:
        assert self.run is not None and self.call is not None
        row = self.run.store.get_agent_call(self.call.key)
        if row is None:  # pragma: no cover - deleted under us
            raise AgentError("the call's record disappeared", key=self.call.key)
        return row

    def begin_attempt(self) -> None:
        """Count one attempt, or raise the attempt budget (the call becomes UNKNOWN)."""
        run, call = self.run, self.call
        if run is None or call is None or not self.token:
            return
        if run.max_attempts is not None:
            row = self.get()
            reason = attempts_refusal(row.attempts, run.max_attempts)
            if reason is not None:
                state = AgentCallState.UNKNOWN if row.attempts else AgentCallState.FAILED
                self.finish(state, error=reason)
                raise self._budget_error(reason, "attempts", row)
        now = run.clock()
        n = run.store.start_agent_attempt(
            call.key, self.token, lease_expires_at=now + self.spec.lease, now=now
        )
        if n is None:
            raise self._taken_over("")

    def _taken_over(self, detail: str) -> AgentError:
        """How a claimant that lost its claim is told (the call's key included)."""
        run, call = self.run, self.call
        assert run is not None and call is not None
        return AgentError(
            f"call {call.key} of {self.spec.name!r} was taken over by another claimant{detail}",
            run_id=run.id,
            key=call.key,
            tool=self.spec.name,
        )

    # ------------------------------------------------------------------ lease renewal
    def heartbeat(self) -> Heartbeat | None:
        """Start renewing the claim from threads (a sync tool); None when there is none."""
        if not self._holds_claim():
            return None
        beat = Heartbeat(self.renew, self.spec.timing, **self._beat_options())
        self.beat = beat
        return beat.start()

    def async_heartbeat(self) -> AsyncHeartbeat | None:
        """Start renewing the claim on the running event loop (an async tool): the store is
        sync, so each renewal runs in a worker thread."""
        if not self._holds_claim():
            return None

        async def renew() -> bool:
            return await asyncio.to_thread(self.renew)

        beat = AsyncHeartbeat(renew, self.spec.timing, **self._beat_options())
        self.beat = beat
        return beat.start()

    def _holds_claim(self) -> bool:
        return self.run is not None and self.call is not None and bool(self.token)

    def _beat_options(self) -> dict[str, Any]:
        assert self.run is not None
        return {
            "clock": self.run.clock,
            "on_lost": self.on_lost,
            "on_expired": self.on_expired,
            "on_error": self.on_renew_error,
        }

    def renew(self) -> bool:
        """One fenced renewal (in a thread): True renewed, False the call is not ours."""
        run, call = self.run, self.call
        assert run is not None and call is not None
        with self._guard:
            if self.recorded:
                return True  # the outcome is written: the heartbeat is being stopped
            return run.store.extend_agent_call_lease(
                call.key, self.token, lease_expires_at=run.clock() + self.spec.lease
            )

    def _log_fields(self) -> dict[str, Any]:
        assert self.run is not None and self.call is not None
        return {"run_id": self.run.id, "key": self.call.key, "tool": self.spec.name}

    def on_lost(self) -> None:
        """A renewal found the call under another token (or no longer running)."""
        self.lost = True
        fields = self._log_fields()
        log.error(
            "lease lost: call %s of run %r (tool %r) was taken over by another claimant (or "
            "marked UNKNOWN by a resumed run) while it ran; its late result will not be "
            "recorded",
            fields["key"],
            fields["run_id"],
            fields["tool"],
            extra=fields,
        )

    def on_expired(self) -> None:
        """The call ran past ``max_run_time``: renewal stopped, the lease will run out."""
        fields = self._log_fields()
        log.warning(
            "call %s of run %r (tool %r) ran past max_run_time (%g s): lease renewal stopped; "
            "once its lease ends a parallel duplicate may take it over",
            fields["key"],
            fields["run_id"],
            fields["tool"],
            self.spec.timing.max_run_time,
            extra=fields,
        )

    def on_renew_error(self, exc: BaseException) -> None:
        fields = self._log_fields()
        log.warning(
            "lease renewal of call %s of run %r failed (retried at the next heartbeat): %r",
            fields["key"],
            fields["run_id"],
            exc,
            extra=fields,
        )

    # ------------------------------------------------------------------ outcomes
    def finish(
        self, state: AgentCallState, *, result: Any = None, error: str | None = None
    ) -> bool:
        """Record the call's outcome, fenced by its token.

        Returns True when recorded (or when there is no claim to record), False when the
        call was taken over: nothing is written, and :attr:`fenced_out` is set.
        """
        run, call = self.run, self.call
        if run is None or call is None or not self.token:
            return True
        if self.beat is not None:
            self.beat.bounded = False  # the work is over: only its outcome is being recorded
        stored: str | None = None
        summary: str | None = None
        if state is AgentCallState.SUCCEEDED:
            try:
                stored = canonical_json(result)
            except PayloadError:
                stored = None
            summary = repr(result)
            if len(summary) > _SUMMARY:
                summary = summary[: _SUMMARY - 1] + "…"
        with self._guard:
            # A renewal that found the call taken over: the fenced write below would be
            # refused too, so do not even try to write the late result.
            ok = not self.lost and run.store.finish_agent_call(
                call.key,
                self.token,
                state=state,
                result=stored,
                result_summary=summary,
                error=error,
                now=run.clock(),
            )
            self.recorded = True
        if not ok:
            self.fenced_out = True
        elif state in _REPORTED:
            self._report(_REPORTED[state], call.key)
        return ok

    def succeeded(self, result: Any) -> None:
        """Record the tool's result, or raise when the call was taken over meanwhile."""
        if not self.finish(AgentCallState.SUCCEEDED, result=result):
            raise self._taken_over(
                " while this attempt ran (its lease ran out unrenewed, or a resumed run "
                "interrupted it); this attempt's result was not recorded: the call's outcome "
                "is the one recorded under its key"
            )

    def on_error(self, exc: BaseException, attempt: int) -> float | None:
        """Seconds to wait before the next attempt, or None when ``exc`` is final (recorded)."""
        spec = self.spec
        if self.lost:  # taken over: no further attempt, nothing to record
            self.fenced_out = True
            return None
        if isinstance(exc, Exception) and spec.retry_on(exc):
            if attempt + 1 < spec.attempts:
                return spec.backoff.delay(attempt, previous=spec.backoff.base, rng=self.rng)
            if spec.kind == "write":
                self.finish(AgentCallState.UNKNOWN, error=_describe(exc))
            else:
                self.finish(AgentCallState.FAILED, error=_describe(exc))
            return None
        if isinstance(exc, Exception):
            self.finish(AgentCallState.FAILED, error=_describe(exc))
        else:  # cancelled or interrupted mid-attempt: the effect may have happened
            self.finish(AgentCallState.UNKNOWN, error=f"interrupted: {_describe(exc)}")
        return None

    def final_error(self, exc: BaseException) -> BaseException:
        if self.fenced_out and isinstance(exc, Exception):
            return self._taken_over(
                f" while this attempt ran; its error ({_describe(exc)}) was not recorded"
            )
        retryable = isinstance(exc, Exception) and self.spec.retry_on(exc)
        if self.spec.kind == "write" and self.call is not None and self.token and retryable:
            return self._unknown(self.get())
        return exc


#: The telemetry outcome of a write call's recorded final state.
_REPORTED = {
    AgentCallState.SUCCEEDED: "executed",
    AgentCallState.UNKNOWN: "unknown",
    AgentCallState.FAILED: "failed",
}


def _fingerprint(call: AgentCall) -> str:
    """What makes two calls under one key the same call: the tool and the arguments."""
    return f"{call.arguments_hash}:{call.tool}"


def _as_key_record(row: AgentCall) -> KeyRecord:
    """A recorded call as SPEC §3's decision table sees a key (:func:`retrysafe.core.decide`):
    its fingerprint is the tool and the arguments; RUNNING is a running key under the call's
    lease and token; every other state is a completed key with nothing to replay over HTTP,
    which the agent decides on by its own states. It never expires: the audit log keeps it.
    """
    running = row.state is AgentCallState.RUNNING
    return KeyRecord(
        key_hash=row.key,
        fingerprint=_fingerprint(row),
        state=KeyState.RUNNING if running else KeyState.COMPLETED,
        fencing_token=row.fencing_token,
        lease_expires_at=row.lease_expires_at,
        expires_at=math.inf,
    )


def _describe(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= 500 else text[:499] + "…"


def _call(spec: ToolSpec, fn: Callable[..., Any], args: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    flow = _Flow(spec, args, kw)
    if flow.run is not None:
        outcome, row = flow.claim()
        while True:
            action, value = flow.decide(outcome, row)
            if action == "return":
                return value
            if action == "run" or (action == "take_over" and flow.take_over(*value)):
                break
            time.sleep(_POLL)
            outcome, row = "existing", flow.get()
    key = flow.call.key if flow.call is not None and spec.kind == "write" else None
    beat = flow.heartbeat()  # renews the claim until the outcome is recorded
    try:
        for attempt in range(spec.attempts):
            flow.begin_attempt()
            reset = _key_var.set(key)
            call_reset = _call_id_var.set(None)
            try:
                result = fn(*args, **kw)
            except BaseException as exc:
                wait = flow.on_error(exc, attempt)
                if wait is None:
                    final = flow.final_error(exc)
                    if final is exc:
                        raise
                    raise final from exc
                time.sleep(waited(wait))
                continue
            finally:
                _call_id_var.reset(call_reset)
                _key_var.reset(reset)
            flow.succeeded(result)
            return result
        raise AssertionError("unreachable")  # pragma: no cover
    finally:
        if beat is not None:
            beat.stop()


async def _acall(
    spec: ToolSpec, fn: Callable[..., Any], args: tuple[Any, ...], kw: dict[str, Any]
) -> Any:
    flow = _Flow(spec, args, kw)
    if flow.run is not None:
        outcome, row = await asyncio.to_thread(flow.claim)
        while True:
            action, value = flow.decide(outcome, row)
            if action == "return":
                return value
            if action == "run" or (
                action == "take_over" and await asyncio.to_thread(flow.take_over, *value)
            ):
                break
            await asyncio.sleep(_POLL)
            outcome, row = "existing", await asyncio.to_thread(flow.get)
    key = flow.call.key if flow.call is not None and spec.kind == "write" else None
    beat = flow.async_heartbeat()  # renews the claim until the outcome is recorded
    try:
        for attempt in range(spec.attempts):
            await asyncio.to_thread(flow.begin_attempt)
            reset = _key_var.set(key)
            call_reset = _call_id_var.set(None)
            try:
                result = await fn(*args, **kw)
            except BaseException as exc:
                wait = await asyncio.to_thread(flow.on_error, exc, attempt)
                if wait is None:
                    final = await asyncio.to_thread(flow.final_error, exc)
                    if final is exc:
                        raise
                    raise final from exc
                await asyncio.sleep(waited(wait))
                continue
            finally:
                _call_id_var.reset(call_reset)
                _key_var.reset(reset)
            await asyncio.to_thread(flow.succeeded, result)
            return result
        raise AssertionError("unreachable")  # pragma: no cover
    finally:
        if beat is not None:
            beat.stop()
