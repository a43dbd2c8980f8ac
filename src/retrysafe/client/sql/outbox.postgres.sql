-- The outbox (SPEC §5, §9) on PostgreSQL: the statements of retrysafe.client._store, with the
-- names and parameters of outbox.sqlite.sql (psycopg placeholders, %(name)s).
--
-- Clock: %(now)s NULL (clock="server", the default) means the database server's clock, the
-- statement's start time, so every host compares due times and leases against one clock. A
-- time the caller computed on its own clock comes as the pair %(<x>_at)s / %(<x>_in)s: the
-- absolute time (NULL on the server clock) and its offset from the caller's now, which is
-- added to the server's now. deadline_at is stored as given (the worker that checks it uses
-- its own clock). Lists of ids or states are JSON arrays of text, as on SQLite.
--
-- Many workers on many hosts share one database: claims lock their rows FOR UPDATE SKIP
-- LOCKED, so concurrent claimants get disjoint batches and never wait on each other's rows.

-- name: insert_job

-- Idempotent on the key: a second insert with the same key inserts nothing and returns no row.
INSERT INTO outbox_jobs
    (id, idempotency_key, queue, state, method, url, destination, headers, body,
     created_at, updated_at, due_at, deadline_at)
SELECT %(id)s::text, %(key)s::text, %(queue)s::text, 'pending', %(method)s::text,
       %(url)s::text, %(destination)s::text, %(headers)s::text, %(body)s::bytea,
       t.now, t.now, t.now, %(deadline_at)s::float8
FROM (SELECT coalesce(%(now)s::float8,
                      extract(epoch FROM statement_timestamp())::float8) AS now) AS t
ON CONFLICT (idempotency_key) DO NOTHING
RETURNING {job_columns};

-- name: add_job

-- insert_job without reading the row back, for the caller's clock (the job as stored is
-- the caller's own: its times are the caller's now): one changed row, or none when a job
-- with the key exists. RETURNING costs SQLite an ephemeral table per statement.
INSERT INTO outbox_jobs
    (id, idempotency_key, queue, state, method, url, destination, headers, body,
     created_at, updated_at, due_at, deadline_at)
SELECT %(id)s::text, %(key)s::text, %(queue)s::text, 'pending', %(method)s::text,
       %(url)s::text, %(destination)s::text, %(headers)s::text, %(body)s::bytea,
       t.now, t.now, t.now, %(deadline_at)s::float8
FROM (SELECT coalesce(%(now)s::float8,
                      extract(epoch FROM statement_timestamp())::float8) AS now) AS t
ON CONFLICT (idempotency_key) DO NOTHING;

-- name: add_large_job
-- as: add_job

-- add_job for a body over retrysafe.client._store.INLINE_BODY_MAX bytes, which SQLite keeps in
-- a table of its own. PostgreSQL keeps it in the row: an update that leaves a large value as
-- it was does not write it again (TOAST).

-- name: claim_jobs

-- One statement: lease up to %(limit)s jobs of %(queue)s that are due, or IN_FLIGHT under a
-- lease that expired (the owner crashed), to the caller's token. Each branch walks its index
-- in order, stops at %(limit)s and locks its rows FOR UPDATE SKIP LOCKED: a row another
-- claimant is leasing right now is skipped, not waited for, so concurrent workers get
-- disjoint batches without blocking each other. A row changed by a claimant that committed
-- first is re-checked against the WHERE clause after the lock, so it is never leased twice.
-- A leased job's due_at is its lease's end, so one index serves both branches (see the SQLite
-- statement); the expired branch checks lease_expires_at too, for jobs leased by a worker of
-- an earlier release, which left due_at as it was. %(skip)s, a JSON array of destinations or
-- NULL, leaves their jobs where they are (the worker's destinations at their limit);
-- %(only)s, a destination or NULL, claims only its jobs.
WITH t AS (
    SELECT coalesce(%(now)s::float8, extract(epoch FROM statement_timestamp())::float8) AS now
), due AS (
    SELECT id, due_at AS at FROM outbox_jobs
    WHERE queue = %(queue)s AND state = 'pending' AND due_at <= (SELECT now FROM t)
      AND (%(skip)s::jsonb IS NULL
           OR destination <> ALL(ARRAY(SELECT jsonb_array_elements_text(%(skip)s::jsonb))))
      AND (%(only)s::text IS NULL OR destination = %(only)s::text)
    ORDER BY due_at LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), expired AS (
    SELECT id, due_at AS at FROM outbox_jobs
    WHERE queue = %(queue)s AND state = 'in_flight' AND due_at <= (SELECT now FROM t)
      AND lease_expires_at <= (SELECT now FROM t)
      AND (%(skip)s::jsonb IS NULL
           OR destination <> ALL(ARRAY(SELECT jsonb_array_elements_text(%(skip)s::jsonb))))
      AND (%(only)s::text IS NULL OR destination = %(only)s::text)
    ORDER BY due_at LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
UPDATE outbox_jobs
SET state = 'in_flight', lease_token = %(token)s,
    lease_expires_at = (SELECT now FROM t) + %(lease)s::float8,
    due_at = (SELECT now FROM t) + %(lease)s::float8,
    updated_at = (SELECT now FROM t)
WHERE id IN (
    SELECT id FROM (SELECT * FROM due UNION ALL SELECT * FROM expired) AS c
    ORDER BY at LIMIT %(limit)s
)
RETURNING {job_columns};

-- name: claim_unknown_jobs

-- Lease UNKNOWN jobs of %(queue)s for reconciliation (all, or the ids in the JSON array
-- %(ids)s).
WITH t AS (
    SELECT coalesce(%(now)s::float8, extract(epoch FROM statement_timestamp())::float8) AS now
)
UPDATE outbox_jobs
SET state = 'in_flight', lease_token = %(token)s,
    lease_expires_at = (SELECT now FROM t) + %(lease)s::float8,
    due_at = (SELECT now FROM t) + %(lease)s::float8,
    updated_at = (SELECT now FROM t)
WHERE id IN (
    SELECT id FROM outbox_jobs
    WHERE queue = %(queue)s AND state = 'unknown'
      AND (%(ids)s::jsonb IS NULL
           OR id = ANY(ARRAY(SELECT jsonb_array_elements_text(%(ids)s::jsonb))))
    ORDER BY created_at LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
RETURNING {job_columns};

-- name: finish_attempts

-- A batch of finishes, %(finishes)s a JSON array of objects (id, token, state, due_at, due_in,
-- terminal, error, now, counted, last_delay, status, outcome, key, started_at, duration,
-- error_type, replayed), in one statement whatever the batch's size. Each finish is fenced
-- by its lease token: a worker whose lease was taken over writes nothing for that job. A
-- job's update and its attempt's insert are the same statement, so both happen or neither
-- does; the attempt's number is the job's new send count. A finish's now is NULL on the
-- server's clock (then the statement's time is used, and due_in is added to it). Returns
-- (job id, number) per recorded attempt. The jobs are found by their ids (the first condition
-- of j): the planner guesses 100 rows for any jsonb_to_recordset, and on a small table, a
-- drained queue's, it then scanned every in-flight job instead, or the whole table (3-8 ms a
-- batch under four workers against well under 1 ms; tests/stores/test_postgres_plans.py).
WITH t AS (
    SELECT extract(epoch FROM statement_timestamp())::float8 AS now
), f AS (
    SELECT f.*, coalesce(f.now, (SELECT now FROM t)) AS at
    FROM jsonb_to_recordset(%(finishes)s::jsonb) AS f(
        id text, token text, state text, due_at float8, due_in float8, terminal boolean,
        error text, now float8, counted boolean, last_delay float8, status integer,
        outcome text, key text, started_at float8, duration float8, error_type text,
        replayed boolean)
), j AS (
    UPDATE outbox_jobs AS o
    SET state = f.state,
        due_at = coalesce(f.due_at, f.at + f.due_in),
        attempts = o.attempts + (CASE WHEN f.counted THEN 1 ELSE 0 END),
        sends = o.sends + 1,
        polls = o.polls + (CASE WHEN f.counted THEN 0 ELSE 1 END),
        last_delay = f.last_delay, lease_token = NULL, lease_expires_at = NULL,
        finished_at = CASE WHEN f.terminal THEN f.at END,
        last_status = f.status, last_outcome = f.outcome, last_error = f.error,
        updated_at = f.at
    FROM f
    WHERE o.id = ANY(ARRAY(SELECT f.id FROM f))
      AND o.id = f.id AND o.lease_token = f.token AND o.state = 'in_flight'
    RETURNING o.id, o.sends
)
INSERT INTO outbox_attempts
    (job_id, number, idempotency_key, started_at, duration, outcome, status, error_type,
     replayed, counted)
SELECT j.id, j.sends, f.key, f.started_at, f.duration, f.outcome, f.status, f.error_type,
       f.replayed, f.counted
FROM j JOIN f ON f.id = j.id
RETURNING job_id, number;

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
-- updated_at stays: a renewal is not a change of the job. The lease's end is due_at too (see
-- claim_jobs).
WITH t AS (
    SELECT coalesce(%(now)s::float8, extract(epoch FROM statement_timestamp())::float8)
           + %(lease)s::float8 AS until
)
UPDATE outbox_jobs
SET lease_expires_at = (SELECT until FROM t), due_at = (SELECT until FROM t)
WHERE id = %(id)s AND lease_token = %(token)s AND state = 'in_flight';

-- name: transition_job

-- Move a job from one of the JSON array %(from_states)s to %(state)s (cancel, retry,
-- replay). With %(reset)s the attempt budget starts again (the attempt history and the key
-- stay).
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
WHERE id = %(id)s
  AND state = ANY(ARRAY(SELECT jsonb_array_elements_text(%(from_states)s::jsonb)))
RETURNING {job_columns};

-- name: hasten_job

-- A retry the retry budget deferred, due now instead of at the time its release set: only
-- while it is still PENDING until exactly that time (a job claimed, retried by an operator or
-- rescheduled since, e.g. after a Retry-After, has another). That time is %(due_at)s on the
-- caller's clock; on the server's, the release stored its now (updated_at) + %(due_in)s.
WITH t AS (
    SELECT coalesce(%(now)s::float8, extract(epoch FROM statement_timestamp())::float8) AS now
)
UPDATE outbox_jobs
SET due_at = (SELECT now FROM t), updated_at = (SELECT now FROM t)
WHERE id = %(id)s AND state = 'pending'
  AND due_at = coalesce(%(due_at)s::float8, updated_at + %(due_in)s::float8);

-- name: get_job

SELECT {job_columns}
FROM outbox_jobs WHERE id = %(id)s;

-- name: find_job_by_prefix

-- Up to two ids of %(queue)s that start with %(prefix)s, compared literally (no LIKE
-- wildcards, so any text is safe here); an empty prefix names no job.
SELECT id FROM outbox_jobs
WHERE queue = %(queue)s AND length(%(prefix)s::text) > 0
  AND substr(id, 1, length(%(prefix)s::text)) = %(prefix)s::text
ORDER BY id LIMIT 2;

-- name: get_job_by_key

SELECT {job_columns}
FROM outbox_jobs WHERE idempotency_key = %(key)s;

-- name: list_jobs

SELECT {job_columns}
FROM outbox_jobs
WHERE queue = %(queue)s
  AND (%(states)s::jsonb IS NULL
       OR state = ANY(ARRAY(SELECT jsonb_array_elements_text(%(states)s::jsonb))))
ORDER BY created_at, id LIMIT %(limit)s;

-- name: list_attempts

SELECT job_id, idempotency_key, number, started_at, duration, outcome, status, error_type,
       replayed, counted
FROM outbox_attempts WHERE job_id = %(job_id)s ORDER BY number;

-- name: count_jobs

SELECT state, count(*) FROM outbox_jobs WHERE queue = %(queue)s GROUP BY state;

-- name: job_stats

-- Every queue's jobs by state, with the creation time of the oldest one in each, and the
-- clock they are measured on (the server's now): the
-- metrics collector's one statement per scrape (a scan of the table; no per-queue round trips).
SELECT queue, state, count(*), min(created_at), extract(epoch FROM statement_timestamp())::float8
FROM outbox_jobs GROUP BY queue, state;

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

-- One batch of at most %(batch)s jobs (attempts go with their job, ON DELETE CASCADE); rows
-- another transaction holds (a claim or a finish in progress) are skipped; only those of the
-- JSON array %(ids)s when it is not NULL (the console's purge of chosen jobs).
WITH t AS (
    SELECT coalesce(%(before_at)s::float8,
                    extract(epoch FROM statement_timestamp())::float8 + %(before_in)s::float8)
           AS before
)
DELETE FROM outbox_jobs
WHERE id IN (
    SELECT id FROM outbox_jobs
    WHERE queue = %(queue)s
      AND state = ANY(ARRAY(SELECT jsonb_array_elements_text(%(states)s::jsonb)))
      AND updated_at <= (SELECT before FROM t)
      AND (%(ids)s::jsonb IS NULL
           OR id = ANY(ARRAY(SELECT jsonb_array_elements_text(%(ids)s::jsonb))))
    LIMIT %(batch)s
    FOR UPDATE SKIP LOCKED
);
