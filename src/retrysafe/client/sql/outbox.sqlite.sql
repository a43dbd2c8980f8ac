-- The outbox (SPEC §5, §9) on SQLite: the statements of retrysafe.client._store, with the names
-- and parameters of outbox.postgres.sql. Times are Unix seconds (REAL) on the caller's clock
-- (:now is always given, and a caller-computed time is :<x>_at; the :<x>_in offsets are for
-- PostgreSQL's server clock and unused here). Lists of ids or states are JSON arrays of text
-- (:ids, :states, :from_states), read with json_each. Each statement is atomic under SQLite's
-- write lock; a block of two statements runs in one BEGIN IMMEDIATE transaction.
--
-- Job columns, in the order retrysafe.client._store.job_from_row reads them:
-- id, idempotency_key, queue, state, method, url, destination, headers, body, created_at,
-- updated_at, due_at, deadline_at, attempts, sends, polls, last_delay, lease_token,
-- lease_expires_at, finished_at, last_status, last_outcome, last_error

-- name: insert_job

-- Idempotent on the key: a second insert with the same key inserts nothing and returns no row.
INSERT INTO outbox_jobs
    (id, idempotency_key, queue, state, method, url, destination, headers, body,
     created_at, updated_at, due_at, deadline_at)
VALUES (:id, :key, :queue, 'pending', :method, :url, :destination, :headers, :body,
        :now, :now, :now, :deadline_at)
ON CONFLICT (idempotency_key) DO NOTHING
RETURNING {job_columns};

-- name: add_job

-- insert_job without reading the row back, for the caller's clock (the job as stored is
-- the caller's own: its times are the caller's now): one changed row, or none when a job
-- with the key exists. RETURNING costs SQLite an ephemeral table per statement.
INSERT INTO outbox_jobs
    (id, idempotency_key, queue, state, method, url, destination, headers, body,
     created_at, updated_at, due_at, deadline_at)
VALUES (:id, :key, :queue, 'pending', :method, :url, :destination, :headers, :body,
        :now, :now, :now, :deadline_at)
ON CONFLICT (idempotency_key) DO NOTHING;

-- name: add_large_job

-- add_job for a body over retrysafe.client._store.INLINE_BODY_MAX bytes: the row keeps the
-- body's length (an INTEGER) and the body goes to outbox_bodies, each written once (schema
-- version 4, schema.sqlite.sql: SQLite rewrites a whole row, overflow pages included, when an
-- update changes its size, as every claim and recorded attempt does). The body is inserted
-- only when the job was (changes(): the job insert just before, 0 on a key that exists).
INSERT INTO outbox_jobs
    (id, idempotency_key, queue, state, method, url, destination, headers, body,
     created_at, updated_at, due_at, deadline_at)
VALUES (:id, :key, :queue, 'pending', :method, :url, :destination, :headers, length(:body),
        :now, :now, :now, :deadline_at)
ON CONFLICT (idempotency_key) DO NOTHING;
INSERT INTO outbox_bodies (job_id, body) SELECT :id, :body WHERE changes() = 1;

-- name: claim_jobs

-- One statement, atomic under SQLite's write lock: lease up to :limit jobs of :queue that are
-- due, or IN_FLIGHT under a lease that expired (the owner crashed), to the caller's token.
-- A leased job's due_at is its lease's end (the time it is next claimable, like a pending
-- job's), so one index, (queue, state, due_at), serves both branches, and a claim or a finish
-- moves one index entry per job, not two. The expired branch also checks lease_expires_at:
-- a job leased by a worker of an earlier release, which left due_at as it was, is never
-- taken while its lease lives. :skip, a JSON array of destinations or NULL, leaves their jobs
-- where they are (the worker's destinations at their limit of attempts in flight); :only, a
-- destination or NULL, claims only its jobs.
UPDATE outbox_jobs
SET state = 'in_flight', lease_token = :token, lease_expires_at = :now + :lease,
    due_at = :now + :lease, updated_at = :now
-- Each branch walks its index in order and stops at :limit, so a backlog of 100,000 due
-- jobs costs the same as 10 (sorting the whole backlog per claim took ~18 ms at 100k).
WHERE id IN (
    SELECT id FROM (
        SELECT * FROM (
            SELECT id, due_at AS t FROM outbox_jobs
            WHERE queue = :queue AND state = 'pending' AND due_at <= :now
              AND (:skip IS NULL OR destination NOT IN (SELECT value FROM json_each(:skip)))
              AND (:only IS NULL OR destination = :only)
            ORDER BY due_at LIMIT :limit
        )
        UNION ALL
        SELECT * FROM (
            SELECT id, due_at AS t FROM outbox_jobs
            WHERE queue = :queue AND state = 'in_flight' AND due_at <= :now
              AND (lease_expires_at <= :now OR lease_expires_at IS NULL
                   OR lease_expires_at >= '')
              AND (:skip IS NULL OR destination NOT IN (SELECT value FROM json_each(:skip)))
              AND (:only IS NULL OR destination = :only)
            ORDER BY due_at LIMIT :limit
        )
        UNION ALL
        -- A due time that is no number (text or a BLOB, which SQLite sorts after every
        -- number) or none (infinite, or past the year 10^292), all written by hand, is never
        -- <= :now, so the job waited for ever and `--until-idle` with it: such a job is due.
        -- One index seek, empty in practice.
        SELECT * FROM (
            SELECT id, due_at AS t FROM outbox_jobs
            WHERE queue = :queue AND state = 'pending' AND due_at > 1e300
              AND (:skip IS NULL OR destination NOT IN (SELECT value FROM json_each(:skip)))
              AND (:only IS NULL OR destination = :only)
            LIMIT :limit
        )
    ) ORDER BY t LIMIT :limit
)
RETURNING {job_columns};

-- name: claim_unknown_jobs

-- Lease UNKNOWN jobs of :queue for reconciliation (all of them, or the ids in the JSON
-- array :ids). "+created_at" keeps the planner on the (queue, state, …) index: walking the
-- (queue, created_at) index instead would read every finished job to find a few UNKNOWN.
UPDATE outbox_jobs
SET state = 'in_flight', lease_token = :token, lease_expires_at = :now + :lease,
    due_at = :now + :lease, updated_at = :now
WHERE id IN (
    SELECT id FROM outbox_jobs
    WHERE queue = :queue AND state = 'unknown'
      AND (:ids IS NULL OR id IN (SELECT value FROM json_each(:ids)))
    ORDER BY +created_at LIMIT :limit
)
RETURNING {job_columns};

-- name: finish_attempts

-- each: rows
-- A batch of finishes: the block runs once per element of :rows (id, token, state, due_at,
-- terminal, error, now, counted, last_delay, status, outcome, key, started_at, duration,
-- error_type, replayed), all in one transaction. (PostgreSQL takes the batch as one JSON
-- array in one statement; here plain parameters per row cost well under half of taking
-- that JSON apart with json_extract.) Each finish is fenced by its lease token: a worker
-- whose lease was taken over writes nothing for that job. SQLite has no writable CTE, so the
-- attempt's insert and the job's update are two statements guarded by the same condition
-- (the job is IN_FLIGHT under the finish's token); the write lock keeps the job unchanged
-- between them, so both happen or neither does. An attempt's number is its job's new send
-- count; each recorded attempt returns (job id, number) (a job missing: not the owner),
-- read by a first statement under the same condition before the writes: the insert's
-- RETURNING would cost SQLite an ephemeral table per statement (0.86-0.95 x the record's CPU
-- without it: `python benchmarks/record_bench.py`, (plain) against (returning)).
SELECT id, sends + 1 FROM outbox_jobs
WHERE id = :id AND lease_token = :token AND state = 'in_flight';
INSERT INTO outbox_attempts
    (job_created_at, job_id, number, idempotency_key, started_at, duration, outcome, status,
     error_type, replayed, counted)
SELECT created_at, id, sends + 1, :key, :started_at, :duration, :outcome, :status,
       :error_type, :replayed, :counted
FROM outbox_jobs WHERE id = :id AND lease_token = :token AND state = 'in_flight';
UPDATE outbox_jobs
SET state = :state, due_at = :due_at,
    attempts = attempts + (CASE WHEN :counted THEN 1 ELSE 0 END),
    sends = sends + 1,
    polls = polls + (CASE WHEN :counted THEN 0 ELSE 1 END),
    last_delay = :last_delay, lease_token = NULL, lease_expires_at = NULL,
    finished_at = CASE WHEN :terminal THEN :now END,
    last_status = :status, last_outcome = :outcome, last_error = :error, updated_at = :now
WHERE id = :id AND lease_token = :token AND state = 'in_flight';

-- name: release_job

-- Give a leased job back without counting an attempt (deferral, cancellation, shutdown).
-- :state is 'pending' (due at :due_at) or a state chosen by the caller (:terminal: it is
-- terminal, so the job is finished now).
UPDATE outbox_jobs
SET state = :state, due_at = :due_at, lease_token = NULL, lease_expires_at = NULL,
    finished_at = CASE WHEN :terminal THEN :now END,
    last_error = coalesce(:error, last_error), updated_at = :now
WHERE id = :id AND lease_token = :token AND state = 'in_flight';

-- name: extend_job_lease

-- The live owner's heartbeat (SPEC §5 "Crash safety"): the lease ends :lease seconds after
-- :now, so an attempt slower than the lease is never claimed again while its worker lives.
-- Fenced like finish_attempt: once the job was taken over, finished, released or deleted,
-- nothing changes (rowcount 0). updated_at stays: a renewal is not a change of the job. The
-- lease's end is due_at too (see claim_jobs).
UPDATE outbox_jobs SET lease_expires_at = :now + :lease, due_at = :now + :lease
WHERE id = :id AND lease_token = :token AND state = 'in_flight';

-- name: transition_job

-- Move a job from one of the JSON array :from_states to :state (cancel, retry, replay).
-- With :reset the attempt budget starts again (the attempt history and the key stay).
UPDATE outbox_jobs
SET state = :state, due_at = :now, updated_at = :now,
    finished_at = CASE WHEN :state = 'pending' THEN NULL ELSE :now END,
    attempts = CASE WHEN :reset THEN 0 ELSE attempts END,
    polls = CASE WHEN :reset THEN 0 ELSE polls END,
    last_delay = CASE WHEN :reset THEN 0 ELSE last_delay END,
    deadline_at = CASE WHEN :reset THEN :deadline_at ELSE deadline_at END
WHERE id = :id AND state IN (SELECT value FROM json_each(:from_states))
RETURNING {job_columns};

-- name: hasten_job

-- A retry the retry budget deferred, due now instead of at :due_at (the time its release
-- set): only while it is still PENDING until exactly that time (a job claimed, retried by an
-- operator or rescheduled since, e.g. after a Retry-After, has another). :due_in is for
-- PostgreSQL's server clock; SQLite is always on the caller's.
UPDATE outbox_jobs SET due_at = :now, updated_at = :now
WHERE id = :id AND state = 'pending' AND due_at = :due_at;

-- name: get_job

SELECT {job_columns}
FROM outbox_jobs WHERE id = :id;

-- name: find_job_by_prefix

-- Up to two ids of :queue that start with :prefix, compared literally (no LIKE wildcards, so
-- any text is safe here); an empty prefix names no job.
SELECT id FROM outbox_jobs
WHERE queue = :queue AND length(:prefix) > 0 AND substr(id, 1, length(:prefix)) = :prefix
ORDER BY id LIMIT 2;

-- name: get_job_by_key

SELECT {job_columns}
FROM outbox_jobs WHERE idempotency_key = :key;

-- name: list_jobs

SELECT {job_columns}
FROM outbox_jobs
WHERE queue = :queue
  AND (:states IS NULL OR state IN (SELECT value FROM json_each(:states)))
ORDER BY created_at, id LIMIT :limit;

-- name: list_attempts
-- By the table's key: the job's creation time, then its id (schema.sqlite.sql). A job that
-- is gone has no attempts (they were deleted with it).

SELECT job_id, idempotency_key, number, started_at, duration, outcome, status, error_type,
       replayed, counted
FROM outbox_attempts
WHERE job_created_at = (SELECT created_at FROM outbox_jobs WHERE id = :job_id)
  AND job_id = :job_id
ORDER BY number;

-- name: count_jobs

SELECT state, count(*) FROM outbox_jobs WHERE queue = :queue GROUP BY state;

-- name: job_stats

-- Every queue's jobs by state, with the creation time of the oldest one in each, and the
-- clock they are measured on (NULL: the caller's, which SQLite always uses): the
-- metrics collector's one statement per scrape (a scan of the table; no per-queue round trips).
SELECT queue, state, count(*), min(created_at), NULL
FROM outbox_jobs GROUP BY queue, state;

-- name: next_due

-- The earliest time a job of :queue becomes claimable (due PENDING, or IN_FLIGHT lease
-- expiry), and the clock it is measured on (NULL: the caller's, which SQLite always uses).
SELECT MIN(t), NULL FROM (
    SELECT MIN(due_at) AS t FROM outbox_jobs WHERE queue = :queue AND state = 'pending'
    UNION ALL
    SELECT MIN(lease_expires_at) AS t FROM outbox_jobs
    WHERE queue = :queue AND state = 'in_flight'
);

-- name: purge_jobs

-- One batch of at most :batch jobs (attempts go with their job, ON DELETE CASCADE); only
-- those of the JSON array :ids when it is not NULL (the console's purge of chosen jobs).
DELETE FROM outbox_jobs
WHERE id IN (
    SELECT id FROM outbox_jobs
    WHERE queue = :queue AND state IN (SELECT value FROM json_each(:states))
      AND updated_at <= :before_at
      AND (:ids IS NULL OR id IN (SELECT value FROM json_each(:ids)))
    LIMIT :batch
);
