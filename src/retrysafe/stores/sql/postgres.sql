-- retrysafe's PostgreSQL statements. Every statement the PostgreSQL store runs is a named block
-- here ("-- name: <name>"), loaded once by retrysafe.stores._sql. Parameters are psycopg's
-- named placeholders (%(name)s).
--
-- Clock: every statement that reads or writes a time takes %(now)s. NULL (the default, the
-- store's clock="server") means "the database server's clock": the statement start time,
-- extract(epoch FROM statement_timestamp()), so one statement sees one instant and every API
-- replica compares leases and retention against the same clock. A float is the caller's clock
-- (clock="caller", used by the contract tests to drive time by hand).
-- Times are Unix seconds (double precision). Keys are stored only as SHA-256 hashes.

-- name: create_schema
CREATE SCHEMA IF NOT EXISTS {schema};

-- name: lock_schema
-- Serialises schema creation between processes starting at once (held until commit).
SELECT pg_advisory_xact_lock(hashtext(current_schema() || '.retrysafe_schema'));

-- name: meta_exists
SELECT to_regclass('retrysafe_meta') IS NOT NULL;

-- name: schema
CREATE TABLE IF NOT EXISTS retrysafe_meta (
    name  text PRIMARY KEY,
    value text NOT NULL
);
CREATE TABLE IF NOT EXISTS idempotency_keys (
    key_hash         text PRIMARY KEY,
    fingerprint      text NOT NULL,
    -- 'released': a tombstone left by release_key. It keeps fencing_token so the next claim
    -- continues the key's token sequence; every key statement treats it as absent.
    state            text NOT NULL CHECK (state IN ('running', 'completed', 'released')),
    fencing_token    bigint NOT NULL,
    lease_expires_at double precision NOT NULL,
    expires_at       double precision NOT NULL,
    status           integer,
    headers          text,
    body             bytea,
    replayable       boolean NOT NULL DEFAULT true
);
CREATE INDEX IF NOT EXISTS idempotency_keys_expires_at ON idempotency_keys (expires_at);

-- name: get_schema_version
SELECT value FROM retrysafe_meta WHERE name = 'schema_version';

-- name: set_schema_version
INSERT INTO retrysafe_meta (name, value) VALUES ('schema_version', %(version)s)
ON CONFLICT (name) DO UPDATE SET value = excluded.value;

-- name: claim_key
-- Insert if absent; replace if the record's retention has expired or it was released (both
-- count as absent; the token sequence continues). The
-- conflicting row is locked by ON CONFLICT, so of concurrent claims exactly one inserts or
-- replaces. Returns the new record only when this call claimed the key; otherwise no row.
INSERT INTO idempotency_keys AS k
    (key_hash, fingerprint, state, fencing_token, lease_expires_at, expires_at)
VALUES (
    %(key_hash)s, %(fingerprint)s, 'running', 1,
    coalesce(%(now)s::float8, extract(epoch FROM statement_timestamp())::float8)
        + %(lease)s::float8,
    coalesce(%(now)s::float8, extract(epoch FROM statement_timestamp())::float8)
        + %(keep)s::float8
)
ON CONFLICT (key_hash) DO UPDATE SET
    fingerprint = excluded.fingerprint,
    state = 'running',
    fencing_token = k.fencing_token + 1,
    lease_expires_at = excluded.lease_expires_at,
    expires_at = excluded.expires_at,
    status = NULL, headers = NULL, body = NULL, replayable = true
WHERE k.expires_at <= coalesce(%(now)s::float8, extract(epoch FROM statement_timestamp())::float8)
   OR k.state = 'released'
RETURNING key_hash, fingerprint, state, fencing_token, lease_expires_at, expires_at,
          status, headers, body, replayable;

-- name: get_key
-- A released record (tombstone) reads as absent.
SELECT key_hash, fingerprint, state, fencing_token, lease_expires_at, expires_at,
       status, headers, body, replayable
FROM idempotency_keys WHERE key_hash = %(key_hash)s AND state <> 'released';

-- name: take_over_key
-- Compare-and-swap: only the running record of exactly this token, and only once its lease
-- expired by the store's clock.
UPDATE idempotency_keys
SET fencing_token = fencing_token + 1,
    lease_expires_at = coalesce(%(now)s::float8, extract(epoch FROM statement_timestamp())::float8)
        + %(lease)s::float8
WHERE key_hash = %(key_hash)s AND fencing_token = %(token)s AND state = 'running'
  AND lease_expires_at <= coalesce(%(now)s::float8,
                                   extract(epoch FROM statement_timestamp())::float8)
RETURNING key_hash, fingerprint, state, fencing_token, lease_expires_at, expires_at,
          status, headers, body, replayable;

-- name: complete_key
UPDATE idempotency_keys
SET state = 'completed', status = %(status)s, headers = %(headers)s, body = %(body)s,
    replayable = %(replayable)s,
    expires_at = coalesce(%(now)s::float8, extract(epoch FROM statement_timestamp())::float8)
        + %(retention)s::float8
WHERE key_hash = %(key_hash)s AND fencing_token = %(token)s AND state = 'running';

-- name: release_key
-- Leaves a tombstone, not a gap: deleting the row would restart the key's fencing tokens at 1
-- on the next claim, and a fenced-out owner still holding token 1 would own that claim. The
-- tombstone keeps its token and expires_at (purge_keys removes it once that passed).
UPDATE idempotency_keys
SET state = 'released', fingerprint = '', status = NULL, headers = NULL, body = NULL,
    replayable = true
WHERE key_hash = %(key_hash)s AND fencing_token = %(token)s AND state = 'running';

-- name: extend_key_lease
UPDATE idempotency_keys
SET lease_expires_at = coalesce(%(now)s::float8,
                                extract(epoch FROM statement_timestamp())::float8)
    + %(lease)s::float8
WHERE key_hash = %(key_hash)s AND fencing_token = %(token)s AND state = 'running';

-- name: purge_keys
-- One batch: rows another transaction holds (a claim replacing them) are skipped.
DELETE FROM idempotency_keys
WHERE key_hash IN (
    SELECT key_hash FROM idempotency_keys
    WHERE expires_at <= coalesce(%(now)s::float8,
                                 extract(epoch FROM statement_timestamp())::float8)
    LIMIT %(batch)s
    FOR UPDATE SKIP LOCKED
);

-- ------------------------------------------------------------------ outbox (SPEC §5)
-- Job columns, in the order retrysafe.stores._postgres_outbox reads them:
-- id, idempotency_key, queue, state, method, url, destination, headers, body, created_at,
-- updated_at, due_at, deadline_at, attempts, sends, polls, last_delay, lease_token,
-- lease_expires_at, finished_at, last_status, last_outcome, last_error
-- Every statement that picks jobs by state (claims, lists, counts, purges) is limited to one
-- %(queue)s. Clock: %(now)s as above (NULL: the server's clock). A time the caller computed
-- (a due time, a purge cut-off) arrives twice: %(x_at)s, the caller's absolute time, used
-- with clock="caller", and %(x_in)s, the same time as an offset from the caller's now, added
-- to the server's clock when %(x_at)s is NULL (clock="server").

-- name: outbox_exists
SELECT to_regclass('outbox_jobs') IS NOT NULL;

-- name: outbox_schema
CREATE TABLE IF NOT EXISTS outbox_jobs (
    id               text PRIMARY KEY,
    idempotency_key  text NOT NULL UNIQUE,
    queue            text NOT NULL DEFAULT 'default',
    state            text NOT NULL CHECK (state IN
                         ('pending', 'in_flight', 'succeeded', 'rejected', 'unknown', 'cancelled')),
    method           text NOT NULL,
    url              text NOT NULL,
    destination      text NOT NULL,
    headers          text NOT NULL,
    body             bytea NOT NULL,
    created_at       double precision NOT NULL,
    updated_at       double precision NOT NULL,
    due_at           double precision NOT NULL,
    deadline_at      double precision,
    attempts         integer NOT NULL DEFAULT 0,
    sends            integer NOT NULL DEFAULT 0,
    polls            integer NOT NULL DEFAULT 0,
    last_delay       double precision NOT NULL DEFAULT 0,
    lease_token      text,
    lease_expires_at double precision,
    finished_at      double precision,
    last_status      integer,
    last_outcome     text,
    last_error       text
);
-- Every index a worker walks starts with the queue (as in SQLite).
CREATE INDEX IF NOT EXISTS outbox_jobs_due ON outbox_jobs (queue, state, due_at);
CREATE INDEX IF NOT EXISTS outbox_jobs_lease ON outbox_jobs (queue, state, lease_expires_at);
CREATE INDEX IF NOT EXISTS outbox_jobs_created ON outbox_jobs (queue, created_at);
CREATE INDEX IF NOT EXISTS outbox_jobs_updated ON outbox_jobs (queue, state, updated_at);
CREATE TABLE IF NOT EXISTS outbox_attempts (
    job_id          text NOT NULL REFERENCES outbox_jobs (id) ON DELETE CASCADE,
    number          integer NOT NULL,
    idempotency_key text NOT NULL,
    started_at      double precision NOT NULL,
    duration        double precision NOT NULL,
    outcome         text NOT NULL,
    status          integer,
    error_type      text,
    replayed        boolean NOT NULL DEFAULT false,
    counted         boolean NOT NULL DEFAULT true,
    PRIMARY KEY (job_id, number)
);

-- name: insert_job
-- Idempotent on the key: a second insert with the same key inserts nothing and returns no row.
INSERT INTO outbox_jobs
    (id, idempotency_key, queue, state, method, url, destination, headers, body,
     created_at, updated_at, due_at, deadline_at)
SELECT %(id)s::text, %(key)s::text, %(queue)s::text, 'pending', %(method)s::text,
       %(url)s::text, %(destination)s::text, %(headers)s::text, %(body)s::bytea, t.now, t.now, t.now, %(deadline_at)s::float8
FROM (SELECT coalesce(%(now)s::float8,
                      extract(epoch FROM statement_timestamp())::float8) AS now) AS t
ON CONFLICT (idempotency_key) DO NOTHING
RETURNING id, idempotency_key, queue, state, method, url, destination, headers, body,
          created_at, updated_at, due_at, deadline_at, attempts, sends, polls, last_delay,
          lease_token, lease_expires_at, finished_at, last_status, last_outcome, last_error;

-- name: claim_jobs
-- One statement: lease up to %(limit)s jobs of %(queue)s that are due, or IN_FLIGHT under a
-- lease that expired (the owner crashed), to the caller's token. Each branch walks its index
-- in order, stops at %(limit)s and locks its rows FOR UPDATE SKIP LOCKED: a row another
-- claimant is leasing right now is skipped, not waited for, so concurrent workers get
-- disjoint batches without blocking each other. A row changed by a claimant that committed
-- first is re-checked against the WHERE clause after the lock, so it is never leased twice.
WITH t AS (
    SELECT coalesce(%(now)s::float8, extract(epoch FROM statement_timestamp())::float8) AS now
), due AS (
    SELECT id, due_at AS at FROM outbox_jobs
    WHERE queue = %(queue)s AND state = 'pending' AND due_at <= (SELECT now FROM t)
    ORDER BY due_at LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), expired AS (
    SELECT id, lease_expires_at AS at FROM outbox_jobs
    WHERE queue = %(queue)s AND state = 'in_flight' AND lease_expires_at <= (SELECT now FROM t)
    ORDER BY lease_expires_at LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
UPDATE outbox_jobs
SET state = 'in_flight', lease_token = %(token)s,
    lease_expires_at = (SELECT now FROM t) + %(lease)s::float8,
    updated_at = (SELECT now FROM t)
WHERE id IN (
    SELECT id FROM (SELECT * FROM due UNION ALL SELECT * FROM expired) AS c
    ORDER BY at LIMIT %(limit)s
)
RETURNING id, idempotency_key, queue, state, method, url, destination, headers, body,
          created_at, updated_at, due_at, deadline_at, attempts, sends, polls, last_delay,
          lease_token, lease_expires_at, finished_at, last_status, last_outcome, last_error;

-- name: claim_unknown_jobs
-- Lease UNKNOWN jobs of %(queue)s for reconciliation (all, or the ids in %(ids)s).
WITH t AS (
    SELECT coalesce(%(now)s::float8, extract(epoch FROM statement_timestamp())::float8) AS now
)
UPDATE outbox_jobs
SET state = 'in_flight', lease_token = %(token)s,
    lease_expires_at = (SELECT now FROM t) + %(lease)s::float8,
    updated_at = (SELECT now FROM t)
WHERE id IN (
    SELECT id FROM outbox_jobs
    WHERE queue = %(queue)s AND state = 'unknown'
      AND (%(ids)s::text[] IS NULL OR id = ANY(%(ids)s::text[]))
    ORDER BY created_at LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
RETURNING id, idempotency_key, queue, state, method, url, destination, headers, body,
          created_at, updated_at, due_at, deadline_at, attempts, sends, polls, last_delay,
          lease_token, lease_expires_at, finished_at, last_status, last_outcome, last_error;

-- name: finish_attempt
-- Fenced by the lease token: a worker whose lease was taken over writes nothing. The job's
-- update and the attempt's insert are one statement, so both happen or neither does; the
-- attempt's number is the job's new send count. Returns that number (no row: not the owner).
WITH t AS (
    SELECT coalesce(%(now)s::float8, extract(epoch FROM statement_timestamp())::float8) AS now
), j AS (
    UPDATE outbox_jobs
    SET state = %(state)s,
        due_at = coalesce(%(due_at)s::float8, (SELECT now FROM t) + %(due_in)s::float8),
        attempts = attempts + (CASE WHEN %(counted)s THEN 1 ELSE 0 END),
        sends = sends + 1,
        polls = polls + (CASE WHEN %(counted)s THEN 0 ELSE 1 END),
        last_delay = %(last_delay)s, lease_token = NULL, lease_expires_at = NULL,
        finished_at = CASE WHEN %(terminal)s THEN (SELECT now FROM t) END,
        last_status = %(status)s::integer, last_outcome = %(outcome)s, last_error = %(error)s,
        updated_at = (SELECT now FROM t)
    WHERE id = %(id)s AND lease_token = %(token)s AND state = 'in_flight'
    RETURNING id, sends
)
INSERT INTO outbox_attempts
    (job_id, number, idempotency_key, started_at, duration, outcome, status, error_type,
     replayed, counted)
SELECT j.id, j.sends, %(key)s::text, %(started_at)s::float8, %(duration)s::float8,
       %(outcome)s::text, %(status)s::integer, %(error_type)s::text, %(replayed)s::boolean,
       %(counted)s::boolean
FROM j
RETURNING number;

-- name: release_job
-- Give a leased job back without counting an attempt (deferral, cancellation, shutdown).
WITH t AS (
    SELECT coalesce(%(now)s::float8, extract(epoch FROM statement_timestamp())::float8) AS now
)
UPDATE outbox_jobs
SET state = %(state)s,
    due_at = coalesce(%(due_at)s::float8, (SELECT now FROM t) + %(due_in)s::float8),
    lease_token = NULL, lease_expires_at = NULL,
    finished_at = CASE WHEN %(terminal)s THEN (SELECT now FROM t) END,
    last_error = coalesce(%(error)s, last_error), updated_at = (SELECT now FROM t)
WHERE id = %(id)s AND lease_token = %(token)s AND state = 'in_flight';

-- name: extend_job_lease
-- The live owner's heartbeat (SPEC §5 "Crash safety"): the lease ends %(lease)s seconds from
-- now (the server's clock, like the claims), so an attempt slower than the lease is never
-- claimed again while its worker lives. Fenced like finish_attempt: once the job was taken
-- over, finished, released or deleted, nothing changes (no row). The row lock orders it with
-- a concurrent claim: a claim that locked the row first leaves it under another token.
-- updated_at stays: a renewal is not a change of the job.
UPDATE outbox_jobs
SET lease_expires_at = coalesce(%(now)s::float8,
                                extract(epoch FROM statement_timestamp())::float8)
    + %(lease)s::float8
WHERE id = %(id)s AND lease_token = %(token)s AND state = 'in_flight';

-- name: transition_job
-- Move a job from one of %(from_states)s to %(state)s (cancel, retry, replay). With
-- %(reset)s the attempt budget starts again (the attempt history and the key stay).
WITH t AS (
    SELECT coalesce(%(now)s::float8, extract(epoch FROM statement_timestamp())::float8) AS now
)
UPDATE outbox_jobs
SET state = %(state)s, due_at = (SELECT now FROM t), updated_at = (SELECT now FROM t),
    finished_at = CASE WHEN %(state)s = 'pending' THEN NULL ELSE (SELECT now FROM t) END,
    attempts = CASE WHEN %(reset)s THEN 0 ELSE attempts END,
    polls = CASE WHEN %(reset)s THEN 0 ELSE polls END,
    last_delay = CASE WHEN %(reset)s THEN 0 ELSE last_delay END,
    deadline_at = CASE WHEN %(reset)s THEN %(deadline_at)s::float8 ELSE deadline_at END
WHERE id = %(id)s AND state = ANY(%(from_states)s::text[])
RETURNING id, idempotency_key, queue, state, method, url, destination, headers, body,
          created_at, updated_at, due_at, deadline_at, attempts, sends, polls, last_delay,
          lease_token, lease_expires_at, finished_at, last_status, last_outcome, last_error;

-- name: get_job
SELECT id, idempotency_key, queue, state, method, url, destination, headers, body,
       created_at, updated_at, due_at, deadline_at, attempts, sends, polls, last_delay,
       lease_token, lease_expires_at, finished_at, last_status, last_outcome, last_error
FROM outbox_jobs WHERE id = %(id)s;

-- name: get_job_by_key
SELECT id, idempotency_key, queue, state, method, url, destination, headers, body,
       created_at, updated_at, due_at, deadline_at, attempts, sends, polls, last_delay,
       lease_token, lease_expires_at, finished_at, last_status, last_outcome, last_error
FROM outbox_jobs WHERE idempotency_key = %(key)s;

-- name: find_job_by_prefix
-- %(pattern)s is the caller-validated lower-case hex prefix followed by the LIKE wildcard.
SELECT id FROM outbox_jobs WHERE queue = %(queue)s AND id LIKE %(pattern)s
ORDER BY id LIMIT 2;

-- name: list_jobs
SELECT id, idempotency_key, queue, state, method, url, destination, headers, body,
       created_at, updated_at, due_at, deadline_at, attempts, sends, polls, last_delay,
       lease_token, lease_expires_at, finished_at, last_status, last_outcome, last_error
FROM outbox_jobs
WHERE queue = %(queue)s AND (%(states)s::text[] IS NULL OR state = ANY(%(states)s::text[]))
ORDER BY created_at, id LIMIT %(limit)s;

-- name: list_attempts
SELECT job_id, idempotency_key, number, started_at, duration, outcome, status, error_type,
       replayed, counted
FROM outbox_attempts WHERE job_id = %(job_id)s ORDER BY number;

-- name: count_jobs
SELECT state, count(*) FROM outbox_jobs WHERE queue = %(queue)s GROUP BY state;

-- name: next_due
-- The earliest time a job of %(queue)s becomes claimable (due PENDING, or IN_FLIGHT lease
-- expiry), and the server's clock now (to turn it into the caller's clock).
SELECT least(
           (SELECT min(due_at) FROM outbox_jobs WHERE queue = %(queue)s AND state = 'pending'),
           (SELECT min(lease_expires_at) FROM outbox_jobs
            WHERE queue = %(queue)s AND state = 'in_flight')
       ),
       extract(epoch FROM statement_timestamp())::float8;

-- name: purge_jobs
-- One batch (attempts go with their job, ON DELETE CASCADE); rows another transaction holds
-- (a claim or a finish in progress) are skipped.
WITH t AS (
    SELECT coalesce(%(before_at)s::float8,
                    extract(epoch FROM statement_timestamp())::float8 + %(before_in)s::float8)
           AS before
)
DELETE FROM outbox_jobs
WHERE id IN (
    SELECT id FROM outbox_jobs
    WHERE queue = %(queue)s AND state = ANY(%(states)s::text[])
      AND updated_at <= (SELECT before FROM t)
    LIMIT %(batch)s
    FOR UPDATE SKIP LOCKED
);

-- ------------------------------------------------------------------ agent tool calls (SPEC §7)
-- The same tables and semantics as sqlite.sql: one row per agent run and one per logical tool
-- call (the audit log); a call's idempotency key is derived from the run and the call, so it
-- is the primary key. States: running, succeeded, failed (definitive), unknown (outcome
-- unknown), refused (budget).
-- Clock: the agent layer computes every time (now, lease_expires_at) on the caller's clock and
-- compares leases itself, so these statements store %(now)s as given in both clock modes.

-- name: agents_exists
SELECT to_regclass('agent_calls') IS NOT NULL;

-- name: agents_schema
CREATE TABLE IF NOT EXISTS agent_runs (
    id           text PRIMARY KEY,
    state        text NOT NULL CHECK (state IN ('active', 'stopped')),
    max_steps    integer,
    max_attempts integer,
    reason       text,
    created_at   double precision NOT NULL,
    updated_at   double precision NOT NULL
);
CREATE TABLE IF NOT EXISTS agent_calls (
    idempotency_key  text PRIMARY KEY,
    run_id           text NOT NULL REFERENCES agent_runs (id) ON DELETE CASCADE,
    step             integer NOT NULL,
    tool             text NOT NULL,
    kind             text NOT NULL CHECK (kind IN ('read', 'write')),
    signature        text NOT NULL,
    arguments_hash   text NOT NULL,
    arguments        text NOT NULL,
    state            text NOT NULL CHECK (state IN
                         ('running', 'succeeded', 'failed', 'unknown', 'refused')),
    attempts         integer NOT NULL DEFAULT 0,
    fencing_token    bigint NOT NULL DEFAULT 1,
    owner            text NOT NULL,
    lease_expires_at double precision NOT NULL,
    result           text,
    result_summary   text,
    error            text,
    created_at       double precision NOT NULL,
    updated_at       double precision NOT NULL,
    finished_at      double precision
);
CREATE INDEX IF NOT EXISTS agent_calls_run ON agent_calls (run_id, created_at);
CREATE INDEX IF NOT EXISTS agent_calls_tool ON agent_calls (run_id, tool, signature);

-- name: insert_agent_run
INSERT INTO agent_runs (id, state, max_steps, max_attempts, created_at, updated_at)
VALUES (%(id)s, 'active', %(max_steps)s, %(max_attempts)s, %(now)s, %(now)s)
ON CONFLICT (id) DO NOTHING
RETURNING id, state, max_steps, max_attempts, reason, created_at, updated_at;

-- name: get_agent_run
SELECT id, state, max_steps, max_attempts, reason, created_at, updated_at
FROM agent_runs WHERE id = %(id)s;

-- name: lock_agent_run
-- Serialises the claims of one run (held until commit), as SQLite's BEGIN IMMEDIATE does: the
-- signature check, the step-budget count and the insert see no concurrent claim of this run.
SELECT id FROM agent_runs WHERE id = %(run_id)s FOR UPDATE;

-- name: list_agent_runs
SELECT r.id, r.state, r.max_steps, r.max_attempts, r.reason, r.created_at, r.updated_at,
       (SELECT count(*) FROM agent_calls c WHERE c.run_id = r.id AND c.state <> 'refused'),
       (SELECT count(*) FROM agent_calls c WHERE c.run_id = r.id AND c.state = 'unknown')
FROM agent_runs r ORDER BY r.created_at DESC, r.id LIMIT %(limit)s;

-- name: stop_agent_run
UPDATE agent_runs SET state = 'stopped', reason = %(reason)s, updated_at = %(now)s
WHERE id = %(id)s;

-- name: agent_signature_conflict
-- A call of the same tool in this run recorded under another signature (the tool changed).
SELECT idempotency_key FROM agent_calls
WHERE run_id = %(run_id)s AND tool = %(tool)s AND signature <> %(signature)s LIMIT 1;

-- name: count_agent_calls
-- Logical calls that count against the step budget (refusals do not).
SELECT count(*) FROM agent_calls WHERE run_id = %(run_id)s AND state <> 'refused';

-- name: insert_agent_call
-- Insert if absent, in one statement: of concurrent claimants of one key exactly one gets the
-- row back; the others get no row and read the existing call.
INSERT INTO agent_calls
    (idempotency_key, run_id, step, tool, kind, signature, arguments_hash, arguments, state,
     owner, lease_expires_at, error, created_at, updated_at, finished_at)
VALUES (%(key)s, %(run_id)s, %(step)s, %(tool)s, %(kind)s, %(signature)s, %(arguments_hash)s,
        %(arguments)s, %(state)s, %(owner)s, %(lease_expires_at)s, %(error)s, %(now)s, %(now)s,
        %(finished_at)s)
ON CONFLICT (idempotency_key) DO NOTHING
RETURNING idempotency_key, run_id, step, tool, kind, signature, arguments_hash, arguments,
          state, attempts, fencing_token, owner, lease_expires_at, result, result_summary,
          error, created_at, updated_at, finished_at;

-- name: get_agent_call
SELECT idempotency_key, run_id, step, tool, kind, signature, arguments_hash, arguments, state,
       attempts, fencing_token, owner, lease_expires_at, result, result_summary, error,
       created_at, updated_at, finished_at
FROM agent_calls WHERE idempotency_key = %(key)s;

-- name: list_agent_calls
SELECT idempotency_key, run_id, step, tool, kind, signature, arguments_hash, arguments, state,
       attempts, fencing_token, owner, lease_expires_at, result, result_summary, error,
       created_at, updated_at, finished_at
FROM agent_calls WHERE run_id = %(run_id)s ORDER BY created_at, step, idempotency_key;

-- name: take_over_agent_call
-- Compare-and-swap: a running call whose lease expired, or (when allowed) an unknown one.
UPDATE agent_calls SET
    state = 'running', fencing_token = fencing_token + 1, owner = %(owner)s,
    lease_expires_at = %(lease_expires_at)s, updated_at = %(now)s, finished_at = NULL
WHERE idempotency_key = %(key)s AND fencing_token = %(token)s
  AND ((state = 'running' AND lease_expires_at <= %(now)s)
       OR (state = 'unknown' AND %(allow_unknown)s::boolean))
RETURNING fencing_token;

-- name: start_agent_attempt
UPDATE agent_calls SET attempts = attempts + 1, lease_expires_at = %(lease_expires_at)s,
    updated_at = %(now)s
WHERE idempotency_key = %(key)s AND fencing_token = %(token)s AND state = 'running'
RETURNING attempts;

-- name: extend_agent_call_lease
-- The live claimant's heartbeat (SPEC §3 "Lease renewal", §7): fenced like finish_agent_call,
-- so once the call was taken over (another token), finished or interrupted nothing changes
-- (no row). The lease only moves forward: renewals run in threads of their own, and a late one
-- must not shorten the lease a newer one set. updated_at stays: a renewal is no change.
UPDATE agent_calls
SET lease_expires_at = greatest(lease_expires_at, %(lease_expires_at)s::float8)
WHERE idempotency_key = %(key)s AND fencing_token = %(token)s AND state = 'running';

-- name: finish_agent_call
UPDATE agent_calls SET state = %(state)s, result = %(result)s,
    result_summary = %(result_summary)s, error = %(error)s, updated_at = %(now)s,
    finished_at = %(now)s
WHERE idempotency_key = %(key)s AND fencing_token = %(token)s AND state = 'running';

-- name: interrupt_agent_calls
-- A resumed run: calls left running by a process that stopped have an unknown outcome.
UPDATE agent_calls SET state = 'unknown', updated_at = %(now)s, finished_at = %(now)s,
    error = 'interrupted: the process running this call stopped; outcome unknown'
WHERE run_id = %(run_id)s AND state = 'running';
