-- The SQLite schema of every feature (keys, outbox, webhooks, agents): one versioned layout,
-- created and upgraded by retrysafe.stores._sqlite (`retrysafe migrate`). Each feature's
-- statements live beside its store (<package>/sql/<feature>.sqlite.sql).
-- Times are Unix seconds (REAL). Keys are stored only as SHA-256 hashes of (scope, key).

-- name: schema

CREATE TABLE IF NOT EXISTS retrysafe_meta (
    name  TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
-- A rowid table with a unique index on key_hash, not a WITHOUT ROWID table keyed by it: key
-- hashes are random, so keying the rows by them makes every claim and every completion
-- rewrite a random page of wide rows, while rowids grow, so new rows (and their completions)
-- share the last few pages and only the narrow key_hash index takes a random page per claim.
CREATE TABLE IF NOT EXISTS idempotency_keys (
    key_hash         TEXT NOT NULL UNIQUE,
    fingerprint      TEXT NOT NULL,
    -- 'released': a tombstone left by release_key. It keeps fencing_token so the next claim
    -- continues the key's token sequence; every key statement treats it as absent.
    state            TEXT NOT NULL CHECK (state IN ('running', 'completed', 'released')),
    fencing_token    INTEGER NOT NULL,
    lease_expires_at REAL NOT NULL,
    expires_at       REAL NOT NULL,
    status           INTEGER,
    headers          TEXT,
    body             BLOB,
    replayable       INTEGER NOT NULL DEFAULT 1,
    -- When this record's claim was made (schema version 2; NULL for records claimed before
    -- the upgrade). Written by claim_key in the same statement; deliberately not indexed, so
    -- a claim updates no more indexes than before (`retrysafe keys list` sorts by a scan).
    created_at       REAL
);
CREATE INDEX IF NOT EXISTS idempotency_keys_expires_at ON idempotency_keys (expires_at);
CREATE TABLE IF NOT EXISTS outbox_jobs (
    id               TEXT PRIMARY KEY,
    idempotency_key  TEXT NOT NULL UNIQUE,
    queue            TEXT NOT NULL DEFAULT 'default',
    state            TEXT NOT NULL CHECK (state IN
                         ('pending', 'in_flight', 'succeeded', 'rejected', 'unknown', 'cancelled')),
    method           TEXT NOT NULL,
    url              TEXT NOT NULL,
    destination      TEXT NOT NULL,
    headers          TEXT NOT NULL,
    body             BLOB NOT NULL,
    created_at       REAL NOT NULL,
    updated_at       REAL NOT NULL,
    due_at           REAL NOT NULL,
    deadline_at      REAL,
    attempts         INTEGER NOT NULL DEFAULT 0,
    sends            INTEGER NOT NULL DEFAULT 0,
    polls            INTEGER NOT NULL DEFAULT 0,
    last_delay       REAL NOT NULL DEFAULT 0,
    lease_token      TEXT,
    lease_expires_at REAL,
    finished_at      REAL,
    last_status      INTEGER,
    last_outcome     TEXT,
    last_error       TEXT
);
-- A job belongs to one queue ('default' for the outbox, 'webhooks' for webhook deliveries):
-- a worker claims, lists, counts and purges only its own queue, so every index a worker
-- walks starts with it.
CREATE INDEX IF NOT EXISTS outbox_jobs_due ON outbox_jobs (queue, state, due_at);
-- A leased job's due_at is its lease's end, so outbox_jobs_due finds expired leases too; the
-- index on (queue, state, lease_expires_at) of earlier releases made every claim and every
-- finish move a second index entry, and is dropped where this script runs.
DROP INDEX IF EXISTS outbox_jobs_lease;
CREATE INDEX IF NOT EXISTS outbox_jobs_created ON outbox_jobs (queue, created_at);
-- An attempt is keyed by its job's creation time first (schema version 3): job ids are random,
-- so attempts keyed by (job_id, number) put each insert of a batch on a random page of the
-- table (a page read once the table outgrows the cache, and a page written per attempt at
-- every commit), while jobs are claimed about in the order they were created, so a batch's
-- attempts now share the last pages: the record takes 0.68 x the CPU with 300,000 attempts
-- of history (`python benchmarks/record_bench.py --history 300000`, (plain) against
-- (random)). The job's attempts are found by its (created_at, id); the
-- trigger below deletes them with the job (the index a foreign key on job_id alone would
-- need to cascade is the random one this layout avoids).
CREATE TABLE IF NOT EXISTS outbox_attempts (
    job_created_at  REAL NOT NULL,
    job_id          TEXT NOT NULL,
    number          INTEGER NOT NULL,
    idempotency_key TEXT NOT NULL,
    started_at      REAL NOT NULL,
    duration        REAL NOT NULL,
    outcome         TEXT NOT NULL,
    status          INTEGER,
    error_type      TEXT,
    replayed        INTEGER NOT NULL DEFAULT 0,
    counted         INTEGER NOT NULL DEFAULT 1,
    PRIMARY KEY (job_created_at, job_id, number)
) WITHOUT ROWID;
CREATE TRIGGER IF NOT EXISTS outbox_attempts_of_deleted_job AFTER DELETE ON outbox_jobs
BEGIN DELETE FROM outbox_attempts WHERE job_created_at = OLD.created_at AND job_id = OLD.id; END;
-- A body over 3.5 KiB (retrysafe.client._store.INLINE_BODY_MAX) is kept here (schema version
-- 4), and the job's row keeps its length, an INTEGER where the body's BLOB would be; the
-- insert (add_large_job in client/sql/outbox.sqlite.sql) writes each once, and the statements
-- read the body back through retrysafe.client._store.JOB_READS. SQLite rewrites a whole row,
-- overflow pages included, whenever an update changes the row's size, and a claim and a
-- recorded attempt both do: a 16 KB body was written twice more per attempt, and jobs of
-- 16 KB bodies were delivered at about half the rate of small ones. Smaller bodies stay in
-- the row: with the other columns they fit its page, which a claim writes anyway. Jobs
-- written before version 4 keep their bodies in their rows; both are read alike.
CREATE TABLE IF NOT EXISTS outbox_bodies (
    job_id TEXT PRIMARY KEY,
    body   BLOB NOT NULL
);
CREATE TRIGGER IF NOT EXISTS outbox_bodies_of_deleted_job AFTER DELETE ON outbox_jobs
WHEN typeof(OLD.body) = 'integer'
BEGIN DELETE FROM outbox_bodies WHERE job_id = OLD.id; END;
-- Webhooks (SPEC §6). An endpoint's secrets are a JSON array of [secret, expires_at|null],
-- the current secret first; event_types a JSON array ([] = every type). A delivery is one
-- outbox job (its id) of one event to one endpoint; deleting the job deletes the delivery.
CREATE TABLE IF NOT EXISTS webhook_endpoints (
    id               TEXT PRIMARY KEY,
    url              TEXT NOT NULL,
    secrets          TEXT NOT NULL,
    event_types      TEXT NOT NULL,
    description      TEXT NOT NULL DEFAULT '',
    schedule         TEXT NOT NULL,
    rate_limit       REAL,
    enabled          INTEGER NOT NULL DEFAULT 1,
    disabled_reason  TEXT,
    failure_count    INTEGER NOT NULL DEFAULT 0,
    first_failure_at REAL,
    created_at       REAL NOT NULL,
    updated_at       REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS webhook_events (
    id          TEXT PRIMARY KEY,
    event_type  TEXT NOT NULL,
    payload     BLOB NOT NULL,
    created_at  REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS webhook_deliveries (
    job_id      TEXT PRIMARY KEY REFERENCES outbox_jobs (id) ON DELETE CASCADE,
    event_id    TEXT NOT NULL REFERENCES webhook_events (id) ON DELETE CASCADE,
    endpoint_id TEXT NOT NULL REFERENCES webhook_endpoints (id) ON DELETE CASCADE,
    created_at  REAL NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS webhook_deliveries_endpoint
    ON webhook_deliveries (endpoint_id, created_at);
CREATE INDEX IF NOT EXISTS webhook_deliveries_event ON webhook_deliveries (event_id);
-- Agent tool calls (SPEC §7). One row per agent run and one per logical tool call (the audit
-- log); a call's idempotency key is derived from the run and the call, so it is the primary key.
-- States: running, succeeded, failed (definitive), unknown (outcome unknown), refused (budget).
CREATE TABLE IF NOT EXISTS agent_runs (
    id           TEXT PRIMARY KEY,
    state        TEXT NOT NULL CHECK (state IN ('active', 'stopped')),
    max_steps    INTEGER,
    max_attempts INTEGER,
    reason       TEXT,
    created_at   REAL NOT NULL,
    updated_at   REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS agent_calls (
    idempotency_key  TEXT PRIMARY KEY,
    run_id           TEXT NOT NULL REFERENCES agent_runs (id) ON DELETE CASCADE,
    step             INTEGER NOT NULL,
    tool             TEXT NOT NULL,
    kind             TEXT NOT NULL CHECK (kind IN ('read', 'write')),
    signature        TEXT NOT NULL,
    arguments_hash   TEXT NOT NULL,
    arguments        TEXT NOT NULL,
    state            TEXT NOT NULL CHECK (state IN
                         ('running', 'succeeded', 'failed', 'unknown', 'refused')),
    attempts         INTEGER NOT NULL DEFAULT 0,
    fencing_token    INTEGER NOT NULL DEFAULT 1,
    owner            TEXT NOT NULL,
    lease_expires_at REAL NOT NULL,
    result           TEXT,
    result_summary   TEXT,
    error            TEXT,
    created_at       REAL NOT NULL,
    updated_at       REAL NOT NULL,
    finished_at      REAL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS agent_calls_run ON agent_calls (run_id, created_at);
CREATE INDEX IF NOT EXISTS agent_calls_tool ON agent_calls (run_id, tool, signature);

-- name: add_keys_created_at
-- Upgrade to version 2 (stores/_schema.py ADDED_COLUMNS). SQLite has no ADD COLUMN IF NOT
-- EXISTS: the store runs this only when the table lacks the column (table_columns below).
ALTER TABLE idempotency_keys ADD COLUMN created_at REAL;

-- name: copy_outbox_attempts
-- Upgrade to version 3 (stores/_sqlite.py REBUILT_TABLES): the attempts of the layout before,
-- keyed by (job_id, number) and renamed aside before the layout above ran, copied into the
-- table it created, each with its job's creation time (an attempt whose job is gone was
-- already deleted with it by the foreign key of that layout).
INSERT INTO outbox_attempts
    (job_created_at, job_id, number, idempotency_key, started_at, duration, outcome, status,
     error_type, replayed, counted)
SELECT j.created_at, a.job_id, a.number, a.idempotency_key, a.started_at, a.duration,
       a.outcome, a.status, a.error_type, a.replayed, a.counted
FROM retrysafe_rebuilt_outbox_attempts a JOIN outbox_jobs j ON j.id = a.job_id;

-- name: delete_orphan_attempts
-- The attempts of jobs that are gone, left while outbox_attempts_of_deleted_job was missing
-- (dropped by hand): a migration that re-creates the trigger deletes them
-- (stores/_sqlite.py ORPHANED_BY).
DELETE FROM outbox_attempts
WHERE NOT EXISTS (
    SELECT 1 FROM outbox_jobs j WHERE j.created_at = job_created_at AND j.id = job_id
);

-- name: delete_orphan_bodies
-- The bodies of jobs that are gone, left while outbox_bodies_of_deleted_job was missing.
DELETE FROM outbox_bodies WHERE job_id NOT IN (SELECT id FROM outbox_jobs);

-- name: table_columns
SELECT name FROM pragma_table_info(:table);

-- name: list_objects
-- Every table, index and trigger (retrysafe._schema.tables and indexes name those it needs).
SELECT name FROM sqlite_master WHERE type IN ('table', 'index', 'trigger');

-- name: get_schema_version

SELECT value FROM retrysafe_meta WHERE name = 'schema_version';

-- name: set_schema_version

INSERT INTO retrysafe_meta (name, value) VALUES ('schema_version', :version)
ON CONFLICT (name) DO UPDATE SET value = excluded.value;
