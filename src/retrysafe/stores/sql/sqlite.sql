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
    -- 'released': a tombstone left by release_key. It keeps fencing_token so the next claim
    -- continues the key's token sequence; every key statement treats it as absent.
    state            TEXT NOT NULL CHECK (state IN ('running', 'completed', 'released')),
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
CREATE INDEX IF NOT EXISTS outbox_jobs_lease ON outbox_jobs (queue, state, lease_expires_at);
CREATE INDEX IF NOT EXISTS outbox_jobs_created ON outbox_jobs (queue, created_at);
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

-- name: get_schema_version
SELECT value FROM retrysafe_meta WHERE name = 'schema_version';

-- name: set_schema_version
INSERT INTO retrysafe_meta (name, value) VALUES ('schema_version', :version)
ON CONFLICT (name) DO UPDATE SET value = excluded.value;

-- name: claim_key
-- ?1 key_hash, ?2 fingerprint, ?3 lease_expires_at, ?4 expires_at, ?5 now.
-- Insert if absent; replace if the record's retention has expired or it was released (both
-- count as absent), continuing its token sequence.
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
WHERE idempotency_keys.expires_at <= ?5 OR idempotency_keys.state = 'released'
RETURNING fencing_token;

-- name: get_key
-- ?1 key_hash. A released record (tombstone) reads as absent.
SELECT key_hash, fingerprint, state, fencing_token, lease_expires_at, expires_at,
       status, headers, body, replayable
FROM idempotency_keys WHERE key_hash = ?1 AND state <> 'released';

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
-- Leaves a tombstone, not a gap: deleting the row would restart the key's fencing tokens at 1
-- on the next claim, and a fenced-out owner still holding token 1 would own that claim. The
-- tombstone keeps its token and expires_at (purge_keys removes it once that passed).
UPDATE idempotency_keys
SET state = 'released', fingerprint = '', status = NULL, headers = NULL, body = NULL,
    replayable = 1
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
-- id, idempotency_key, queue, state, method, url, destination, headers, body, created_at,
-- updated_at, due_at, deadline_at, attempts, sends, polls, last_delay, lease_token,
-- lease_expires_at, finished_at, last_status, last_outcome, last_error
-- Every statement that picks jobs by state (claims, lists, counts, purges) is limited to one
-- :queue, so a worker never claims another queue's jobs (webhook deliveries must be signed
-- by the webhook worker; plain jobs must not be).

-- name: insert_job
-- Idempotent on the key: a second insert with the same key inserts nothing and returns no row.
INSERT INTO outbox_jobs
    (id, idempotency_key, queue, state, method, url, destination, headers, body,
     created_at, updated_at, due_at, deadline_at)
VALUES (:id, :key, :queue, 'pending', :method, :url, :destination, :headers, :body,
        :now, :now, :now, :deadline_at)
ON CONFLICT (idempotency_key) DO NOTHING
RETURNING id, idempotency_key, queue, state, method, url, destination, headers, body,
          created_at, updated_at, due_at, deadline_at, attempts, sends, polls, last_delay,
          lease_token, lease_expires_at, finished_at, last_status, last_outcome, last_error;

-- name: claim_jobs
-- One statement, atomic under SQLite's write lock: lease up to :limit jobs of :queue that are
-- due, or IN_FLIGHT under a lease that expired (the owner crashed), to the caller's token.
UPDATE outbox_jobs
SET state = 'in_flight', lease_token = :token, lease_expires_at = :lease_expires_at,
    updated_at = :now
-- Each branch walks its index in order and stops at :limit, so a backlog of 100,000 due
-- jobs costs the same as 10 (sorting the whole backlog per claim took ~18 ms at 100k).
WHERE id IN (
    SELECT id FROM (
        SELECT * FROM (
            SELECT id, due_at AS t FROM outbox_jobs
            WHERE queue = :queue AND state = 'pending' AND due_at <= :now
            ORDER BY due_at LIMIT :limit
        )
        UNION ALL
        SELECT * FROM (
            SELECT id, lease_expires_at AS t FROM outbox_jobs
            WHERE queue = :queue AND state = 'in_flight' AND lease_expires_at <= :now
            ORDER BY lease_expires_at LIMIT :limit
        )
    ) ORDER BY t LIMIT :limit
)
RETURNING id, idempotency_key, queue, state, method, url, destination, headers, body,
          created_at, updated_at, due_at, deadline_at, attempts, sends, polls, last_delay,
          lease_token, lease_expires_at, finished_at, last_status, last_outcome, last_error;

-- name: claim_unknown_jobs
-- Lease UNKNOWN jobs of :queue for reconciliation (all of them, or the ids in the JSON
-- array :ids). "+created_at" keeps the planner on the (queue, state, …) index: walking the
-- (queue, created_at) index instead would read every finished job to find a few UNKNOWN.
UPDATE outbox_jobs
SET state = 'in_flight', lease_token = :token, lease_expires_at = :lease_expires_at,
    updated_at = :now
WHERE id IN (
    SELECT id FROM outbox_jobs
    WHERE queue = :queue AND state = 'unknown'
      AND (:ids IS NULL OR id IN (SELECT value FROM json_each(:ids)))
    ORDER BY +created_at LIMIT :limit
)
RETURNING id, idempotency_key, queue, state, method, url, destination, headers, body,
          created_at, updated_at, due_at, deadline_at, attempts, sends, polls, last_delay,
          lease_token, lease_expires_at, finished_at, last_status, last_outcome, last_error;

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

-- name: extend_job_lease
-- The live owner's heartbeat (SPEC §5 "Crash safety"): the lease ends at :lease_expires_at,
-- so an attempt slower than the lease is never claimed again while its worker lives. Fenced
-- like finish_attempt: once the job was taken over, finished, released or deleted, nothing
-- changes (rowcount 0). updated_at stays: a renewal is not a change of the job.
UPDATE outbox_jobs SET lease_expires_at = :lease_expires_at
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
RETURNING id, idempotency_key, queue, state, method, url, destination, headers, body,
          created_at, updated_at, due_at, deadline_at, attempts, sends, polls, last_delay,
          lease_token, lease_expires_at, finished_at, last_status, last_outcome, last_error;

-- name: get_job
SELECT id, idempotency_key, queue, state, method, url, destination, headers, body,
       created_at, updated_at, due_at, deadline_at, attempts, sends, polls, last_delay,
       lease_token, lease_expires_at, finished_at, last_status, last_outcome, last_error
FROM outbox_jobs WHERE id = :id;

-- name: find_job_by_prefix
-- :prefix is validated as lower-case hex by the caller.
SELECT id FROM outbox_jobs WHERE queue = :queue AND id LIKE :prefix || '%'
ORDER BY id LIMIT 2;

-- name: get_job_by_key
SELECT id, idempotency_key, queue, state, method, url, destination, headers, body,
       created_at, updated_at, due_at, deadline_at, attempts, sends, polls, last_delay,
       lease_token, lease_expires_at, finished_at, last_status, last_outcome, last_error
FROM outbox_jobs WHERE idempotency_key = :key;

-- name: list_jobs
SELECT id, idempotency_key, queue, state, method, url, destination, headers, body,
       created_at, updated_at, due_at, deadline_at, attempts, sends, polls, last_delay,
       lease_token, lease_expires_at, finished_at, last_status, last_outcome, last_error
FROM outbox_jobs
WHERE queue = :queue
  AND (:states IS NULL OR state IN (SELECT value FROM json_each(:states)))
ORDER BY created_at, id LIMIT :limit;

-- name: list_attempts
SELECT job_id, idempotency_key, number, started_at, duration, outcome, status, error_type,
       replayed, counted
FROM outbox_attempts WHERE job_id = :job_id ORDER BY number;

-- name: count_jobs
SELECT state, COUNT(*) FROM outbox_jobs WHERE queue = :queue GROUP BY state;

-- name: next_due
-- The earliest time a job of :queue becomes claimable (due PENDING, or IN_FLIGHT lease expiry).
SELECT MIN(t) FROM (
    SELECT MIN(due_at) AS t FROM outbox_jobs WHERE queue = :queue AND state = 'pending'
    UNION ALL
    SELECT MIN(lease_expires_at) AS t FROM outbox_jobs
    WHERE queue = :queue AND state = 'in_flight'
);

-- name: purge_jobs
DELETE FROM outbox_jobs
WHERE id IN (
    SELECT id FROM outbox_jobs
    WHERE queue = :queue AND state IN (SELECT value FROM json_each(:states))
      AND updated_at <= :before
    LIMIT :batch
);


-- ------------------------------------------------------------------ webhooks (SPEC §6)
-- Endpoint columns, in the order retrysafe.stores._sqlite_webhooks reads them:
-- id, url, secrets, event_types, description, schedule, rate_limit, enabled,
-- disabled_reason, failure_count, first_failure_at, created_at, updated_at
-- Delivery columns: job_id, event_id, event_type, endpoint_id, url, state, attempts, sends,
-- last_status, last_outcome, last_error, due_at, created_at, updated_at

-- name: insert_endpoint
INSERT INTO webhook_endpoints
    (id, url, secrets, event_types, description, schedule, rate_limit, enabled,
     disabled_reason, created_at, updated_at)
VALUES (:id, :url, :secrets, :event_types, :description, :schedule, :rate_limit, :enabled,
        :disabled_reason, :now, :now)
RETURNING id, url, secrets, event_types, description, schedule, rate_limit, enabled,
          disabled_reason, failure_count, first_failure_at, created_at, updated_at;

-- name: get_endpoint
SELECT id, url, secrets, event_types, description, schedule, rate_limit, enabled,
       disabled_reason, failure_count, first_failure_at, created_at, updated_at
FROM webhook_endpoints WHERE id = :id;

-- name: list_endpoints
SELECT id, url, secrets, event_types, description, schedule, rate_limit, enabled,
       disabled_reason, failure_count, first_failure_at, created_at, updated_at
FROM webhook_endpoints ORDER BY created_at, id;

-- name: update_endpoint
UPDATE webhook_endpoints
SET url = :url, secrets = :secrets, event_types = :event_types, description = :description,
    schedule = :schedule, rate_limit = :rate_limit, updated_at = :now
WHERE id = :id
RETURNING id, url, secrets, event_types, description, schedule, rate_limit, enabled,
          disabled_reason, failure_count, first_failure_at, created_at, updated_at;

-- name: set_endpoint_enabled
-- Enabling or disabling starts a new failure run.
UPDATE webhook_endpoints
SET enabled = :enabled, disabled_reason = :reason, failure_count = 0,
    first_failure_at = NULL, updated_at = :now
WHERE id = :id
RETURNING id, url, secrets, event_types, description, schedule, rate_limit, enabled,
          disabled_reason, failure_count, first_failure_at, created_at, updated_at;

-- name: record_endpoint_failure
UPDATE webhook_endpoints
SET failure_count = failure_count + 1, first_failure_at = COALESCE(first_failure_at, :now)
WHERE id = :id
RETURNING failure_count, first_failure_at, enabled;

-- name: reset_endpoint_failures
UPDATE webhook_endpoints SET failure_count = 0, first_failure_at = NULL
WHERE id = :id AND failure_count > 0;

-- name: delete_endpoint_jobs
-- The endpoint's jobs (their deliveries and attempts cascade). A job in flight is deleted
-- too: the worker's fenced writes then change nothing.
DELETE FROM outbox_jobs
WHERE id IN (SELECT job_id FROM webhook_deliveries WHERE endpoint_id = :id);

-- name: delete_endpoint
DELETE FROM webhook_endpoints WHERE id = :id;

-- name: cancel_endpoint_jobs
-- Park the endpoint's pending deliveries (disabled endpoint): kept, replayable.
UPDATE outbox_jobs
SET state = 'cancelled', finished_at = :now, updated_at = :now,
    last_error = COALESCE(:reason, last_error)
WHERE state = 'pending'
  AND id IN (SELECT job_id FROM webhook_deliveries WHERE endpoint_id = :id);

-- name: retarget_endpoint_jobs
-- A new endpoint URL applies to every delivery not succeeded yet, whatever its lease state:
-- pending, parked, dead letters, and in flight (a live worker's current attempt still goes
-- to the URL it read at its claim; a crashed worker's expired lease is re-claimed with
-- the new URL). The lease and fencing token are left alone.
UPDATE outbox_jobs
SET url = :url, destination = :destination, updated_at = :now
WHERE state <> 'succeeded'
  AND id IN (SELECT job_id FROM webhook_deliveries WHERE endpoint_id = :id);

-- name: insert_event
-- Idempotent on the event id: a second insert returns no row.
INSERT INTO webhook_events (id, event_type, payload, created_at)
VALUES (:id, :event_type, :payload, :now)
ON CONFLICT (id) DO NOTHING
RETURNING id, event_type, payload, created_at;

-- name: get_event
SELECT id, event_type, payload, created_at FROM webhook_events WHERE id = :id;

-- name: insert_delivery
INSERT INTO webhook_deliveries (job_id, event_id, endpoint_id, created_at)
VALUES (:job_id, :event_id, :endpoint_id, :now);

-- name: park_job
-- A delivery recorded for a disabled endpoint: kept, CANCELLED until replayed.
UPDATE outbox_jobs
SET state = 'cancelled', finished_at = :now, last_error = 'endpoint disabled'
WHERE id = :id;

-- name: delivery_context
-- What the worker needs per attempt: the event id and the endpoint of a job.
SELECT d.event_id, e.id, e.url, e.secrets, e.event_types, e.description, e.schedule,
       e.rate_limit, e.enabled, e.disabled_reason, e.failure_count, e.first_failure_at,
       e.created_at, e.updated_at
FROM webhook_deliveries d JOIN webhook_endpoints e ON e.id = d.endpoint_id
WHERE d.job_id = :job_id;

-- name: list_deliveries
SELECT d.job_id, d.event_id, v.event_type, d.endpoint_id, j.url, j.state, j.attempts, j.sends,
       j.last_status, j.last_outcome, j.last_error, j.due_at, d.created_at, j.updated_at
FROM webhook_deliveries d
JOIN outbox_jobs j ON j.id = d.job_id
JOIN webhook_events v ON v.id = d.event_id
WHERE (:event_id IS NULL OR d.event_id = :event_id)
  AND (:endpoint_id IS NULL OR d.endpoint_id = :endpoint_id)
  AND (:event_type IS NULL OR v.event_type = :event_type)
  AND (:states IS NULL OR j.state IN (SELECT value FROM json_each(:states)))
  AND (:job_ids IS NULL OR d.job_id IN (SELECT value FROM json_each(:job_ids)))
ORDER BY d.created_at, d.job_id LIMIT :limit;

-- name: find_delivery_by_prefix
-- :prefix is validated as lower-case hex by the caller.
SELECT job_id FROM webhook_deliveries WHERE job_id LIKE :prefix || '%' ORDER BY job_id LIMIT 2;

-- name: purge_deliveries
-- Delete terminal deliveries (their jobs; the delivery rows and attempts cascade).
DELETE FROM outbox_jobs
WHERE id IN (
    SELECT d.job_id FROM webhook_deliveries d
    JOIN outbox_jobs j ON j.id = d.job_id
    JOIN webhook_events v ON v.id = d.event_id
    WHERE j.state IN (SELECT value FROM json_each(:states)) AND j.updated_at <= :before
      AND (:endpoint_id IS NULL OR d.endpoint_id = :endpoint_id)
      AND (:event_type IS NULL OR v.event_type = :event_type)
    LIMIT :batch
);

-- ---------------------------------------------------------------- agent tool calls (SPEC §7)

-- name: insert_agent_run
INSERT INTO agent_runs (id, state, max_steps, max_attempts, created_at, updated_at)
VALUES (:id, 'active', :max_steps, :max_attempts, :now, :now)
ON CONFLICT (id) DO NOTHING
RETURNING id, state, max_steps, max_attempts, reason, created_at, updated_at;

-- name: get_agent_run
SELECT id, state, max_steps, max_attempts, reason, created_at, updated_at
FROM agent_runs WHERE id = :id;

-- name: list_agent_runs
SELECT r.id, r.state, r.max_steps, r.max_attempts, r.reason, r.created_at, r.updated_at,
       (SELECT count(*) FROM agent_calls c WHERE c.run_id = r.id AND c.state != 'refused'),
       (SELECT count(*) FROM agent_calls c WHERE c.run_id = r.id AND c.state = 'unknown')
FROM agent_runs r ORDER BY r.created_at DESC, r.id LIMIT :limit;

-- name: stop_agent_run
UPDATE agent_runs SET state = 'stopped', reason = :reason, updated_at = :now WHERE id = :id;

-- name: agent_signature_conflict
-- A call of the same tool in this run recorded under another signature (the tool changed).
SELECT idempotency_key FROM agent_calls
WHERE run_id = :run_id AND tool = :tool AND signature != :signature LIMIT 1;

-- name: count_agent_calls
-- Logical calls that count against the step budget (refusals do not).
SELECT count(*) FROM agent_calls WHERE run_id = :run_id AND state != 'refused';

-- name: insert_agent_call
INSERT INTO agent_calls
    (idempotency_key, run_id, step, tool, kind, signature, arguments_hash, arguments, state,
     owner, lease_expires_at, error, created_at, updated_at, finished_at)
VALUES (:key, :run_id, :step, :tool, :kind, :signature, :arguments_hash, :arguments, :state,
        :owner, :lease_expires_at, :error, :now, :now, :finished_at);

-- name: get_agent_call
SELECT idempotency_key, run_id, step, tool, kind, signature, arguments_hash, arguments, state,
       attempts, fencing_token, owner, lease_expires_at, result, result_summary, error,
       created_at, updated_at, finished_at
FROM agent_calls WHERE idempotency_key = :key;

-- name: list_agent_calls
SELECT idempotency_key, run_id, step, tool, kind, signature, arguments_hash, arguments, state,
       attempts, fencing_token, owner, lease_expires_at, result, result_summary, error,
       created_at, updated_at, finished_at
FROM agent_calls WHERE run_id = :run_id ORDER BY created_at, step, idempotency_key;

-- name: take_over_agent_call
-- Compare-and-swap: a running call whose lease expired, or (when allowed) an unknown one.
UPDATE agent_calls SET
    state = 'running', fencing_token = fencing_token + 1, owner = :owner,
    lease_expires_at = :lease_expires_at, updated_at = :now, finished_at = NULL
WHERE idempotency_key = :key AND fencing_token = :token
  AND ((state = 'running' AND lease_expires_at <= :now)
       OR (state = 'unknown' AND :allow_unknown = 1))
RETURNING fencing_token;

-- name: start_agent_attempt
UPDATE agent_calls SET attempts = attempts + 1, lease_expires_at = :lease_expires_at,
    updated_at = :now
WHERE idempotency_key = :key AND fencing_token = :token AND state = 'running'
RETURNING attempts;

-- name: extend_agent_call_lease
-- The live claimant's heartbeat (SPEC §3 "Lease renewal", §7): fenced like finish_agent_call,
-- so once the call was taken over (another token), finished or interrupted nothing changes
-- (rowcount 0). The lease only moves forward: renewals run in threads of their own, and a late
-- one must not shorten the lease a newer one set. updated_at stays: a renewal is no change.
UPDATE agent_calls SET lease_expires_at = max(lease_expires_at, :lease_expires_at)
WHERE idempotency_key = :key AND fencing_token = :token AND state = 'running';

-- name: finish_agent_call
UPDATE agent_calls SET state = :state, result = :result, result_summary = :result_summary,
    error = :error, updated_at = :now, finished_at = :now
WHERE idempotency_key = :key AND fencing_token = :token AND state = 'running';

-- name: interrupt_agent_calls
-- A resumed run: calls left running by a process that stopped have an unknown outcome.
UPDATE agent_calls SET state = 'unknown', updated_at = :now, finished_at = :now,
    error = 'interrupted: the process running this call stopped; outcome unknown'
WHERE run_id = :run_id AND state = 'running';
