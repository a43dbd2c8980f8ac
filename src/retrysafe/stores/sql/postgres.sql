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
