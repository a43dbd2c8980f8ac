-- The PostgreSQL schema of every feature (keys, outbox, webhooks, agents): one versioned
-- layout, created and upgraded by retrysafe.stores._postgres (`retrysafe migrate`). Each
-- feature's statements live beside its store (<package>/sql/<feature>.postgres.sql).
-- Times are Unix seconds (double precision). Keys are stored only as SHA-256 hashes.

-- name: create_schema

CREATE SCHEMA IF NOT EXISTS {schema};

-- name: lock_schema

-- Serialises schema creation between processes starting at once (held until commit).
-- Keyed by the schema's name, not current_schema(): that is NULL while the schema is missing.
SELECT pg_advisory_xact_lock(hashtext(%(schema)s || '.retrysafe_schema'));

-- name: missing_tables
-- The tables and indexes of the layout (retrysafe._schema.tables and indexes) that this schema
-- lacks (an index is a relation too).
SELECT t FROM unnest(%(tables)s::text[]) AS t WHERE to_regclass(t) IS NULL;

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
    replayable       boolean NOT NULL DEFAULT true,
    -- When this record's claim was made (schema version 2; NULL for records claimed before
    -- the upgrade). Written by claim_key in the same statement; deliberately not indexed, so
    -- a claim updates no more indexes than before (`retrysafe keys list` sorts by a scan).
    created_at       double precision
);
-- The upgrade of a version-1 table (stores/_schema.py ADDED_COLUMNS); a no-op on a new one.
ALTER TABLE idempotency_keys ADD COLUMN IF NOT EXISTS created_at double precision;
CREATE INDEX IF NOT EXISTS idempotency_keys_expires_at ON idempotency_keys (expires_at);

-- name: get_schema_version

SELECT value FROM retrysafe_meta WHERE name = 'schema_version';

-- name: set_schema_version

INSERT INTO retrysafe_meta (name, value) VALUES ('schema_version', %(version)s)
ON CONFLICT (name) DO UPDATE SET value = excluded.value;

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
-- A leased job's due_at is its lease's end, so outbox_jobs_due finds expired leases too; the
-- index on (queue, state, lease_expires_at) of earlier releases made every claim and every
-- finish move a second index entry, and is dropped where this script runs.
DROP INDEX IF EXISTS outbox_jobs_lease;
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

-- name: webhooks_schema
-- Webhooks (SPEC §6), as in SQLite. An endpoint's secrets are a JSON array of
-- [secret, expires_at|null], the current secret first; event_types a JSON array ([] = every
-- type). A delivery is one outbox job (its id) of one event to one endpoint.
CREATE TABLE IF NOT EXISTS webhook_endpoints (
    id               text PRIMARY KEY,
    url              text NOT NULL,
    secrets          text NOT NULL,
    event_types      text NOT NULL,
    description      text NOT NULL DEFAULT '',
    schedule         text NOT NULL,
    rate_limit       double precision,
    enabled          boolean NOT NULL DEFAULT true,
    disabled_reason  text,
    failure_count    integer NOT NULL DEFAULT 0,
    first_failure_at double precision,
    created_at       double precision NOT NULL,
    updated_at       double precision NOT NULL
);
CREATE TABLE IF NOT EXISTS webhook_events (
    id          text PRIMARY KEY,
    event_type  text NOT NULL,
    payload     bytea NOT NULL,
    created_at  double precision NOT NULL
);
CREATE TABLE IF NOT EXISTS webhook_deliveries (
    job_id      text PRIMARY KEY REFERENCES outbox_jobs (id) ON DELETE CASCADE,
    event_id    text NOT NULL REFERENCES webhook_events (id) ON DELETE CASCADE,
    endpoint_id text NOT NULL REFERENCES webhook_endpoints (id) ON DELETE CASCADE,
    created_at  double precision NOT NULL
);
CREATE INDEX IF NOT EXISTS webhook_deliveries_endpoint
    ON webhook_deliveries (endpoint_id, created_at);
CREATE INDEX IF NOT EXISTS webhook_deliveries_event ON webhook_deliveries (event_id);
