"""The outbox store's job lifecycle (``retrysafe.client.OutboxStore``, SPEC §5, §9) as a model:
random sequences of insert / claim / claim_unknown / finish_attempt / release / extend /
transition / purge over two queues, with the clock moved by hand, on SQLite and PostgreSQL
(``outbox_store(store)``, caller's clock), compared after every step with a plain-Python model
of the contract.

The model is exact except where the contract leaves a choice: a claim with more due jobs than
its limit may take any of those tied at the cut-off time (earliest first is all it promises).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field, replace

from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from retrysafe.client import Attempt, Job, JobState, NewJob, OutboxStore, outbox_store

from .conftest import model_settings

T0 = 1_700_000_000.0
QUEUES = ("a", "b")
ALL_STATES = tuple(JobState)
STATE_SETS = st.lists(st.sampled_from(ALL_STATES), unique=True, max_size=4)
#: The lease's own token, or one that never held it (a worker fenced out long ago).
CURRENT = "current"
TOKENS = st.one_of(st.just(CURRENT), st.just(CURRENT), st.just("stale-token"))
STEPS = st.one_of(st.sampled_from([0.0, 0.5, 1.0, 30.0, 600.0]), st.floats(0.0, 5000.0))
LEASES = st.one_of(st.sampled_from([1.0, 30.0]), st.floats(0.01, 300.0))
OFFSETS = st.one_of(st.sampled_from([0.0, 1.0, 60.0]), st.floats(-100.0, 3000.0))
ERRORS = st.one_of(st.none(), st.sampled_from(["ReadTimeout", "503 from upstream", "é ✓"]))
STATUSES = st.one_of(st.none(), st.sampled_from([200, 201, 409, 422, 503]))
#: Indexes into the jobs inserted so far (taken modulo their number).
JOBS = st.integers(0, 7)
#: Pick among the IN_FLIGHT jobs (True) or among all inserted ones.
LEASED = st.booleans()


@dataclass
class OutboxModel:
    """What the contract says the store holds."""

    jobs: dict[str, Job] = field(default_factory=dict)
    attempts: dict[str, list[Attempt]] = field(default_factory=dict)

    def by_key(self, key: str) -> Job | None:
        return next((j for j in self.jobs.values() if j.key == key), None)

    def insert(self, new: NewJob, now: float) -> tuple[bool, Job]:
        existing = self.by_key(new.key)
        if existing is not None:
            return False, existing
        job = Job(
            id=new.id,
            key=new.key,
            queue=new.queue,
            state=JobState.PENDING,
            method=new.method,
            url=new.url,
            destination=new.destination,
            headers=new.headers,
            body=new.body,
            created_at=now,
            updated_at=now,
            due_at=now,
            deadline_at=new.deadline_at,
            attempts=0,
            sends=0,
            polls=0,
            last_delay=0.0,
            lease_token=None,
            lease_expires_at=None,
            finished_at=None,
            last_status=None,
            last_outcome=None,
            last_error=None,
        )
        self.jobs[job.id] = job
        self.attempts[job.id] = []
        return True, job

    def claimable_at(self, queue: str, now: float) -> dict[str, float]:
        """Claimable jobs of ``queue`` and the time each became claimable."""
        out: dict[str, float] = {}
        for j in self.jobs.values():
            if j.queue != queue:
                continue
            if j.state is JobState.PENDING and j.due_at <= now:
                out[j.id] = j.due_at
            elif (
                j.state is JobState.IN_FLIGHT
                and j.lease_expires_at is not None
                and j.lease_expires_at <= now
            ):
                out[j.id] = j.lease_expires_at
        return out

    def lease(self, ids: list[str], token: str, now: float, lease: float) -> None:
        for i in ids:
            self.jobs[i] = replace(
                self.jobs[i],
                state=JobState.IN_FLIGHT,
                lease_token=token,
                lease_expires_at=now + lease,
                due_at=now + lease,  # a leased job is due at its lease's end
                updated_at=now,
            )

    def owned(self, job_id: str, token: str) -> Job | None:
        job = self.jobs.get(job_id)
        if job is None or job.state is not JobState.IN_FLIGHT or job.lease_token != token:
            return None
        return job

    def finish(
        self,
        job_id: str,
        token: str,
        attempt: Attempt,
        state: JobState,
        due_at: float,
        last_delay: float,
        error: str | None,
        now: float,
    ) -> Attempt | None:
        job = self.owned(job_id, token)
        if job is None:
            return None
        recorded = replace(attempt, job_id=job_id, number=job.sends + 1)
        self.attempts[job_id].append(recorded)
        self.jobs[job_id] = replace(
            job,
            state=state,
            due_at=due_at,
            attempts=job.attempts + attempt.counted,
            sends=job.sends + 1,
            polls=job.polls + (not attempt.counted),
            last_delay=last_delay,
            lease_token=None,
            lease_expires_at=None,
            finished_at=now if state.is_terminal else None,
            last_status=attempt.status,
            last_outcome=attempt.outcome,
            last_error=error,
            updated_at=now,
        )
        return recorded

    def release(
        self, job_id: str, token: str, state: JobState, due_at: float, error: str | None, now: float
    ) -> bool:
        job = self.owned(job_id, token)
        if job is None:
            return False
        self.jobs[job_id] = replace(
            job,
            state=state,
            due_at=due_at,
            lease_token=None,
            lease_expires_at=None,
            finished_at=now if state.is_terminal else None,
            last_error=job.last_error if error is None else error,
            updated_at=now,
        )
        return True

    def extend(self, job_id: str, token: str, now: float, lease: float) -> bool:
        job = self.owned(job_id, token)
        if job is None:
            return False
        self.jobs[job_id] = replace(job, lease_expires_at=now + lease, due_at=now + lease)
        return True

    def transition(
        self,
        job_id: str,
        from_states: list[JobState],
        state: JobState,
        now: float,
        reset: bool,
        deadline_at: float | None,
    ) -> Job | None:
        job = self.jobs.get(job_id)
        if job is None or job.state not in from_states:
            return None
        new = replace(
            job,
            state=state,
            due_at=now,
            updated_at=now,
            finished_at=None if state is JobState.PENDING else now,
        )
        if reset:
            new = replace(new, attempts=0, polls=0, last_delay=0.0, deadline_at=deadline_at)
        self.jobs[job_id] = new
        return new

    def purge(self, queue: str, states: list[JobState], before: float) -> int:
        dead = [
            j.id
            for j in self.jobs.values()
            if j.queue == queue and j.state in states and j.updated_at <= before
        ]
        for i in dead:
            del self.jobs[i]
            del self.attempts[i]
        return len(dead)

    def listed(self, queue: str) -> list[Job]:
        return sorted(
            (j for j in self.jobs.values() if j.queue == queue), key=lambda j: (j.created_at, j.id)
        )

    def next_due(self, queue: str) -> float | None:
        mine = [j for j in self.jobs.values() if j.queue == queue]
        times = [j.due_at for j in mine if j.state is JobState.PENDING]
        times += [
            j.lease_expires_at
            for j in mine
            if j.state is JobState.IN_FLIGHT and j.lease_expires_at is not None
        ]
        return min(times, default=None)


class OutboxMachine(RuleBasedStateMachine):
    """Drives one outbox store and the model side by side; subclassed per test with
    ``store``."""

    store: OutboxStore

    def __init__(self) -> None:
        super().__init__()
        salt = uuid.uuid4().hex  # idempotency keys are unique across the whole table
        self.keys = [f"{salt}-{i}" for i in range(4)]
        self.model = OutboxModel()
        self.inserted: list[str] = []  # job ids, deleted ones included
        self.now = T0

    def _job(self, i: int, *, leased: bool = False) -> str | None:
        """Job ``i`` of those inserted (deleted ones included), or with ``leased`` of those
        IN_FLIGHT now, when there are any (the owner's writes are the ones that matter)."""
        ids = self.inserted
        if leased:
            ids = sorted(j.id for j in self.model.jobs.values() if j.state is JobState.IN_FLIGHT)
            ids = ids or self.inserted
        return ids[i % len(ids)] if ids else None

    def _token(self, job_id: str, token: str) -> str:
        if token == CURRENT:
            job = self.model.jobs.get(job_id)
            return (job.lease_token if job is not None else None) or "never-leased"
        return token

    def _claimed(self, got: list[Job], before: dict[str, float], limit: int) -> list[str]:
        """Check a claim's answer against the claimable jobs; return the ids it leased."""
        ids = [j.id for j in got]
        assert len(set(ids)) == len(ids) and set(ids) <= set(before)
        assert len(ids) == min(limit, len(before))
        left = [t for i, t in before.items() if i not in ids]
        assert all(before[i] <= t for i in ids for t in left), "earliest first"
        assert [(j.created_at, j.id) for j in got] == sorted((j.created_at, j.id) for j in got)
        return ids

    @initialize(queues=st.lists(st.sampled_from(QUEUES), min_size=3, max_size=3), lease=LEASES)
    def start_with_three_jobs_one_leased(self, queues: list[str], lease: float) -> None:
        """Every example starts from an empty store, inserts three jobs and claims one."""
        for queue in QUEUES:
            assert self.store.list_jobs(queue=queue, states=None, limit=10) == []
        for k, queue in enumerate(queues):
            self.insert(k, queue, None, b"")
        self.claim(queues[0], 1, lease)

    @rule(dt=STEPS)
    def advance_clock(self, dt: float) -> None:
        self.now += dt

    @rule(
        k=st.integers(0, 3),
        queue=st.sampled_from(QUEUES),
        deadline=st.one_of(st.none(), st.floats(0.0, 1000.0)),
        body=st.binary(max_size=32),
    )
    def insert(self, k: int, queue: str, deadline: float | None, body: bytes) -> None:
        new = NewJob(
            id=uuid.uuid4().hex,
            key=self.keys[k],
            method="POST",
            url=f"http://example.test/{k}",
            destination="http://example.test:80",
            headers=(("content-type", "application/octet-stream"), ("x-n", str(k))),
            body=body,
            deadline_at=None if deadline is None else self.now + deadline,
            queue=queue,
        )
        got = self.store.insert_job(new, now=self.now)
        assert got == self.model.insert(new, self.now)
        if got[0]:
            self.inserted.append(new.id)

    @rule(queue=st.sampled_from(QUEUES), limit=st.integers(1, 3), lease=LEASES)
    def claim(self, queue: str, limit: int, lease: float) -> None:
        token = uuid.uuid4().hex
        before = self.model.claimable_at(queue, self.now)
        got = self.store.claim_jobs(
            queue=queue, token=token, now=self.now, lease=lease, limit=limit
        )
        ids = self._claimed(got, before, limit)
        self.model.lease(ids, token, self.now, lease)
        assert got == [self.model.jobs[i] for i in ids]

    @rule(
        queue=st.sampled_from(QUEUES),
        limit=st.integers(1, 3),
        lease=LEASES,
        only=st.one_of(st.none(), st.lists(JOBS, max_size=3)),
    )
    def claim_unknown(self, queue: str, limit: int, lease: float, only: list[int] | None) -> None:
        token = uuid.uuid4().hex
        ids = None if only is None else sorted({self._job(i) or "none" for i in only})
        unknown = {
            j.id: j.created_at
            for j in self.model.jobs.values()
            if j.queue == queue and j.state is JobState.UNKNOWN and (ids is None or j.id in ids)
        }
        got = self.store.claim_unknown_jobs(
            queue=queue, token=token, now=self.now, lease=lease, limit=limit, ids=ids
        )
        leased = [j.id for j in got]
        assert len(set(leased)) == len(leased) and set(leased) <= set(unknown)
        assert len(leased) == min(limit, len(unknown))
        left = [t for i, t in unknown.items() if i not in leased]
        assert all(unknown[i] <= t for i in leased for t in left), "oldest first"
        self.model.lease(leased, token, self.now, lease)
        assert sorted(got, key=lambda j: j.id) == sorted(
            (self.model.jobs[i] for i in leased), key=lambda j: j.id
        )

    @rule(
        i=JOBS,
        leased=LEASED,
        token=TOKENS,
        state=st.sampled_from(
            [JobState.PENDING, JobState.SUCCEEDED, JobState.REJECTED, JobState.UNKNOWN]
        ),
        due=OFFSETS,
        counted=st.booleans(),
        status=STATUSES,
        error=ERRORS,
    )
    def finish_attempt(
        self,
        i: int,
        leased: bool,
        token: str,
        state: JobState,
        due: float,
        counted: bool,
        status: int | None,
        error: str | None,
    ) -> None:
        job_id = self._job(i, leased=leased)
        if job_id is None:
            return
        token = self._token(job_id, token)
        key = self.model.jobs[job_id].key if job_id in self.model.jobs else "gone"
        attempt = Attempt(
            job_id="",
            key=key,
            number=0,
            started_at=self.now - 0.25,
            duration=0.25,
            outcome="success" if counted else "in_progress",
            status=status,
            error_type=None if status else "ReadTimeout",
            replayed=bool(status and status < 300),
            counted=counted,
        )
        due_at, delay = self.now + max(due, 0.0), max(due, 0.0)
        got = self.store.finish_attempt(
            job_id, token, attempt, state=state, due_at=due_at, last_delay=delay,
            error=error, now=self.now,
        )  # fmt: skip
        want = self.model.finish(job_id, token, attempt, state, due_at, delay, error, self.now)
        assert got == want
        assert self.store.list_attempts(job_id) == self.model.attempts.get(job_id, [])

    @rule(
        i=JOBS,
        leased=LEASED,
        token=TOKENS,
        state=st.sampled_from([JobState.PENDING, JobState.CANCELLED, JobState.UNKNOWN]),
        due=OFFSETS,
        error=ERRORS,
    )
    def release(
        self, i: int, leased: bool, token: str, state: JobState, due: float, error: str | None
    ) -> None:
        job_id = self._job(i, leased=leased)
        if job_id is None:
            return
        token = self._token(job_id, token)
        got = self.store.release_job(
            job_id, token, state=state, due_at=self.now + due, error=error, now=self.now
        )
        assert got == self.model.release(job_id, token, state, self.now + due, error, self.now)

    @rule(i=JOBS, leased=LEASED, token=TOKENS, lease=LEASES, expired=st.booleans())
    def extend_lease(self, i: int, leased: bool, token: str, lease: float, expired: bool) -> None:
        """``expired``: renew only once the lease ran out (still the token's if nobody
        claimed the job meanwhile)."""
        job_id = self._job(i, leased=leased)
        if job_id is None:
            return
        job = self.model.jobs.get(job_id)
        if expired and job is not None and job.lease_expires_at is not None:
            self.now = max(self.now, job.lease_expires_at)
        token = self._token(job_id, token)
        got = self.store.extend_job_lease(job_id, token, now=self.now, lease=lease)
        assert got == self.model.extend(job_id, token, self.now, lease)

    @rule(
        i=JOBS,
        from_states=STATE_SETS,
        state=st.sampled_from([JobState.PENDING, JobState.CANCELLED]),
        reset=st.booleans(),
        deadline=st.one_of(st.none(), st.floats(0.0, 1000.0)),
    )
    def transition(
        self,
        i: int,
        from_states: list[JobState],
        state: JobState,
        reset: bool,
        deadline: float | None,
    ) -> None:
        job_id = self._job(i)
        if job_id is None:
            return
        deadline_at = None if deadline is None else self.now + deadline
        got = self.store.transition_job(
            job_id, from_states=from_states, state=state, now=self.now, reset=reset,
            deadline_at=deadline_at,
        )  # fmt: skip
        assert got == self.model.transition(
            job_id, from_states, state, self.now, reset, deadline_at
        )

    @rule(
        queue=st.sampled_from(QUEUES),
        states=STATE_SETS,
        ago=st.one_of(st.just(0.0), st.floats(0.0, 5000.0)),
        batch=st.integers(1, 3),
    )
    def purge(self, queue: str, states: list[JobState], ago: float, batch: int) -> None:
        before = self.now - ago
        got = self.store.purge_jobs(queue=queue, states=states, before=before, batch=batch)
        assert got == self.model.purge(queue, states, before)

    @invariant()
    def every_queue_lists_as_the_model_says(self) -> None:
        for queue in QUEUES:
            assert self.store.list_jobs(queue=queue, states=None, limit=100) == (
                self.model.listed(queue)
            )
            assert self.store.next_due(queue=queue) == self.model.next_due(queue)

    def teardown(self) -> None:
        for queue in QUEUES:
            self.store.purge_jobs(queue=queue, states=ALL_STATES, before=1e18)


def test_outbox_store_follows_the_job_lifecycle_model(sql_store: object) -> None:
    """On SQLite and PostgreSQL, any sequence of inserts, claims, finishes, releases,
    renewals, transitions and purges with any clock moves leaves the jobs, attempts, due
    times and counts the contract's model says (SPEC §5, §9)."""

    class Machine(OutboxMachine):
        store = outbox_store(sql_store)

    run_state_machine_as_test(Machine, settings=model_settings(0.5))  # type: ignore[no-untyped-call]
