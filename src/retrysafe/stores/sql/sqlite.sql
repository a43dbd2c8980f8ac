-- retrysafe's SQLite statements. Every statement the SQLite store runs is a named block here
-- ("-- name: <name>"), loaded once by retrysafe.stores._sql. Parameters are named (:name),
-- except in the key statements the middleware runs per request, which take numbered
-- parameters (?1, ?2, …; listed above each statement) because binding a tuple is cheaper.
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
    state            TEXT NOT NULL CHECK (state IN ('running', 'completed')),
    fencing_token    INTEGER NOT NULL,
    lease_expires_at REAL NOT NULL,
    expires_at       REAL NOT NULL,
    status           INTEGER,
    headers          TEXT,
    body             BLOB,
    replayable       INTEGER NOT NULL DEFAULT 1
);
CREATE INDEX IF NOT EXISTS idempotency_keys_expires_at ON idempotency_keys (expires_at);
CREATE TABLE IF NOT EXISTS outbox_jobs (
    id               TEXT PRIMARY KEY,
    idempotency_key  TEXT NOT NULL UNIQUE,
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
CREATE INDEX IF NOT EXISTS outbox_jobs_due ON outbox_jobs (state, due_at);
CREATE INDEX IF NOT EXISTS outbox_jobs_lease ON outbox_jobs (state, lease_expires_at);
CREATE INDEX IF NOT EXISTS outbox_jobs_created ON outbox_jobs (created_at);
CREATE TABLE IF NOT EXISTS outbox_attempts (
    job_id          TEXT NOT NULL REFERENCES outbox_jobs (id) ON DELETE CASCADE,
    number          INTEGER NOT NULL,
    idempotency_key TEXT NOT NULL,
    started_at      REAL NOT NULL,
    duration        REAL NOT NULL,
    outcome         TEXT NOT NULL,
    status          INTEGER,
    error_type      TEXT,
    replayed        INTEGER NOT NULL DEFAULT 0,
    counted         INTEGER NOT NULL DEFAULT 1,
    PRIMARY KEY (job_id, number)
) WITHOUT ROWID;

-- name: get_schema_version
SELECT value FROM retrysafe_meta WHERE name = 'schema_version';

-- name: set_schema_version
INSERT INTO retrysafe_meta (name, value) VALUES ('schema_version', :version)
ON CONFLICT (name) DO UPDATE SET value = excluded.value;

-- name: claim_key
-- ?1 key_hash, ?2 fingerprint, ?3 lease_expires_at, ?4 expires_at, ?5 now.
-- Insert if absent; replace if the record's retention has expired (it counts as absent).
-- Returns the new fencing token only when this call claimed the key; otherwise no row.
INSERT INTO idempotency_keys
    (key_hash, fingerprint, state, fencing_token, lease_expires_at, expires_at)
VALUES (?1, ?2, 'running', 1, ?3, ?4)
ON CONFLICT (key_hash) DO UPDATE SET
    fingerprint = excluded.fingerprint,
    state = 'running',
    fencing_token = idempotency_keys.fencing_token + 1,
    lease_expires_at = excluded.lease_expires_at,
    expires_at = excluded.expires_at,
    status = NULL, headers = NULL, body = NULL, replayable = 1
WHERE idempotency_keys.expires_at <= ?5
RETURNING fencing_token;

-- name: get_key
-- ?1 key_hash.
SELECT key_hash, fingerprint, state, fencing_token, lease_expires_at, expires_at,
       status, headers, body, replayable
FROM idempotency_keys WHERE key_hash = ?1;

-- name: take_over_key
-- ?1 key_hash, ?2 fencing_token, ?3 lease_expires_at, ?4 now.
-- Compare-and-swap: only when the lease of the given token has expired.
UPDATE idempotency_keys
SET fencing_token = fencing_token + 1, lease_expires_at = ?3
WHERE key_hash = ?1 AND fencing_token = ?2 AND state = 'running'
  AND lease_expires_at <= ?4
RETURNING key_hash, fingerprint, state, fencing_token, lease_expires_at, expires_at,
          status, headers, body, replayable;

-- name: complete_key
-- ?1 key_hash, ?2 fencing_token, ?3 status, ?4 headers, ?5 body, ?6 replayable,
-- ?7 expires_at.
UPDATE idempotency_keys
SET state = 'completed', status = ?3, headers = ?4, body = ?5, replayable = ?6,
    expires_at = ?7
WHERE key_hash = ?1 AND fencing_token = ?2 AND state = 'running';

-- name: release_key
-- ?1 key_hash, ?2 fencing_token.
DELETE FROM idempotency_keys
WHERE key_hash = ?1 AND fencing_token = ?2 AND state = 'running';

-- name: extend_key_lease
-- ?1 key_hash, ?2 fencing_token, ?3 lease_expires_at.
UPDATE idempotency_keys SET lease_expires_at = ?3
WHERE key_hash = ?1 AND fencing_token = ?2 AND state = 'running';

-- name: purge_keys
DELETE FROM idempotency_keys
WHERE rowid IN (
    SELECT rowid FROM idempotency_keys WHERE expires_at <= :now LIMIT :batch
);


-- ------------------------------------------------------------------ outbox (SPEC §5)
-- Job columns, in the order retrysafe.stores._sqlite_outbox reads them:
-- id, idempotency_key, state, method, url, destination, headers, body, created_at,
-- updated_at, due_at, deadline_at, attempts, sends, polls, last_delay, lease_token,
-- lease_expires_at, finished_at, last_status, last_outcome, last_error

-- name: insert_job
-- Idempotent on the key: a second insert with the same key inserts nothing and returns no row.
INSERT INTO outbox_jobs
    (id, idempotency_key, state, method, url, destination, headers, body,
     created_at, updated_at, due_at, deadline_at)
VALUES (:id, :key, 'pending', :method, :url, :destination, :headers, :body,
        :now, :now, :now, :deadline_at)
ON CONFLICT (idempotency_key) DO NOTHING
RETURNING id, idempotency_key, state, method, url, destination, headers, body, created_at,
          updated_at, due_at, deadline_at, attempts, sends, polls, last_delay, lease_token,
          lease_expires_at, finished_at, last_status, last_outcome, last_error;

-- name: claim_jobs
-- One statement, atomic under SQLite's write lock: lease up to :limit jobs that are due, or
-- IN_FLIGHT under a lease that expired (the owner crashed), to the caller's token.
UPDATE outbox_jobs
SET state = 'in_flight', lease_token = :token, lease_expires_at = :lease_expires_at,
    updated_at = :now
WHERE id IN (
    SELECT id FROM (
        SELECT id, due_at AS t FROM outbox_jobs WHERE state = 'pending' AND due_at <= :now
        UNION ALL
        SELECT id, lease_expires_at AS t FROM outbox_jobs
        WHERE state = 'in_flight' AND lease_expires_at <= :now
    ) ORDER BY t LIMIT :limit
)
RETURNING id, idempotency_key, state, method, url, destination, headers, body, created_at,
          updated_at, due_at, deadline_at, attempts, sends, polls, last_delay, lease_token,
          lease_expires_at, finished_at, last_status, last_outcome, last_error;

-- name: claim_unknown_jobs
-- Lease UNKNOWN jobs for reconciliation (all of them, or the ids in the JSON array :ids).
UPDATE outbox_jobs
SET state = 'in_flight', lease_token = :token, lease_expires_at = :lease_expires_at,
    updated_at = :now
WHERE id IN (
    SELECT id FROM outbox_jobs
    WHERE state = 'unknown' AND (:ids IS NULL OR id IN (SELECT value FROM json_each(:ids)))
    ORDER BY created_at LIMIT :limit
)
RETURNING id, idempotency_key, state, method, url, destination, headers, body, created_at,
          updated_at, due_at, deadline_at, attempts, sends, polls, last_delay, lease_token,
          lease_expires_at, finished_at, last_status, last_outcome, last_error;

-- name: finish_attempt
-- Fenced by the lease token: a worker whose lease was taken over writes nothing.
UPDATE outbox_jobs
SET state = :state, due_at = :due_at, attempts = attempts + :counted, sends = sends + 1,
    polls = polls + 1 - :counted,
    last_delay = :last_delay, lease_token = NULL, lease_expires_at = NULL,
    finished_at = :finished_at, last_status = :status, last_outcome = :outcome,
    last_error = :error, updated_at = :now
WHERE id = :id AND lease_token = :token AND state = 'in_flight'
RETURNING sends;

-- name: insert_attempt
INSERT INTO outbox_attempts
    (job_id, number, idempotency_key, started_at, duration, outcome, status, error_type,
     replayed, counted)
VALUES (:job_id, :number, :key, :started_at, :duration, :outcome, :status, :error_type,
        :replayed, :counted);

-- name: release_job
-- Give a leased job back without counting an attempt (deferral, cancellation, shutdown).
-- :state is 'pending' (due at :due_at) or a terminal state chosen by the caller.
UPDATE outbox_jobs
SET state = :state, due_at = :due_at, lease_token = NULL, lease_expires_at = NULL,
    finished_at = :finished_at, last_error = COALESCE(:error, last_error), updated_at = :now
WHERE id = :id AND lease_token = :token AND state = 'in_flight';

-- name: transition_job
-- Move a job from one of the JSON array :from_states to :state (cancel, retry, replay).
-- With :reset = 1 the attempt budget starts again (the attempt history and the key stay).
UPDATE outbox_jobs
SET state = :state, due_at = :now, updated_at = :now,
    finished_at = CASE WHEN :state = 'pending' THEN NULL ELSE :now END,
    attempts = CASE WHEN :reset = 1 THEN 0 ELSE attempts END,
    polls = CASE WHEN :reset = 1 THEN 0 ELSE polls END,
    last_delay = CASE WHEN :reset = 1 THEN 0 ELSE last_delay END,
    deadline_at = CASE WHEN :reset = 1 THEN :deadline_at ELSE deadline_at END
WHERE id = :id AND state IN (SELECT value FROM json_each(:from_states))
RETURNING id, idempotency_key, state, method, url, destination, headers, body, created_at,
          updated_at, due_at, deadline_at, attempts, sends, polls, last_delay, lease_token,
          lease_expires_at, finished_at, last_status, last_outcome, last_error;

-- name: get_job
SELECT id, idempotency_key, state, method, url, destination, headers, body, created_at,
       updated_at, due_at, deadline_at, attempts, sends, polls, last_delay, lease_token,
       lease_expires_at, finished_at, last_status, last_outcome, last_error
FROM outbox_jobs WHERE id = :id;

-- name: find_job_by_prefix
-- :prefix is validated as lower-case hex by the caller.
SELECT id FROM outbox_jobs WHERE id LIKE :prefix || '%' ORDER BY id LIMIT 2;

-- name: get_job_by_key
SELECT id, idempotency_key, state, method, url, destination, headers, body, created_at,
       updated_at, due_at, deadline_at, attempts, sends, polls, last_delay, lease_token,
       lease_expires_at, finished_at, last_status, last_outcome, last_error
FROM outbox_jobs WHERE idempotency_key = :key;

-- name: list_jobs
SELECT id, idempotency_key, state, method, url, destination, headers, body, created_at,
       updated_at, due_at, deadline_at, attempts, sends, polls, last_delay, lease_token,
       lease_expires_at, finished_at, last_status, last_outcome, last_error
FROM outbox_jobs
WHERE :states IS NULL OR state IN (SELECT value FROM json_each(:states))
ORDER BY created_at, id LIMIT :limit;

-- name: list_attempts
SELECT job_id, idempotency_key, number, started_at, duration, outcome, status, error_type,
       replayed, counted
FROM outbox_attempts WHERE job_id = :job_id ORDER BY number;

-- name: count_jobs
SELECT state, COUNT(*) FROM outbox_jobs GROUP BY state;

-- name: next_due
-- The earliest time a job becomes claimable (due PENDING, or IN_FLIGHT lease expiry).
SELECT MIN(t) FROM (
    SELECT MIN(due_at) AS t FROM outbox_jobs WHERE state = 'pending'
    UNION ALL
    SELECT MIN(lease_expires_at) AS t FROM outbox_jobs WHERE state = 'in_flight'
);

-- name: purge_jobs
DELETE FROM outbox_jobs
WHERE id IN (
    SELECT id FROM outbox_jobs
    WHERE state IN (SELECT value FROM json_each(:states)) AND updated_at <= :before
    LIMIT :batch
);
