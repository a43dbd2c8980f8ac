-- retrysafe's SQLite statements. Every statement the SQLite store runs is a named block here
-- ("-- name: <name>"), loaded once by retrysafe.stores._sql. Parameters are named (:name).
-- Times are Unix seconds (REAL). Keys are stored only as SHA-256 hashes of (scope, key).

-- name: schema
CREATE TABLE IF NOT EXISTS retrysafe_meta (
    name  TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS idempotency_keys (
    key_hash         TEXT PRIMARY KEY,
    fingerprint      TEXT NOT NULL,
    state            TEXT NOT NULL CHECK (state IN ('running', 'completed')),
    fencing_token    INTEGER NOT NULL,
    lease_expires_at REAL NOT NULL,
    expires_at       REAL NOT NULL,
    status           INTEGER,
    headers          TEXT,
    body             BLOB,
    replayable       INTEGER NOT NULL DEFAULT 1
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS idempotency_keys_expires_at ON idempotency_keys (expires_at);

-- name: get_schema_version
SELECT value FROM retrysafe_meta WHERE name = 'schema_version';

-- name: set_schema_version
INSERT INTO retrysafe_meta (name, value) VALUES ('schema_version', :version)
ON CONFLICT (name) DO UPDATE SET value = excluded.value;

-- name: claim_key
-- Insert if absent; replace if the record's retention has expired (it counts as absent).
-- Returns the row only when this call claimed the key; otherwise no row.
INSERT INTO idempotency_keys
    (key_hash, fingerprint, state, fencing_token, lease_expires_at, expires_at)
VALUES (:key_hash, :fingerprint, 'running', 1, :lease_expires_at, :expires_at)
ON CONFLICT (key_hash) DO UPDATE SET
    fingerprint = excluded.fingerprint,
    state = 'running',
    fencing_token = idempotency_keys.fencing_token + 1,
    lease_expires_at = excluded.lease_expires_at,
    expires_at = excluded.expires_at,
    status = NULL, headers = NULL, body = NULL, replayable = 1
WHERE idempotency_keys.expires_at <= :now
RETURNING key_hash, fingerprint, state, fencing_token, lease_expires_at, expires_at,
          status, headers, body, replayable;

-- name: get_key
SELECT key_hash, fingerprint, state, fencing_token, lease_expires_at, expires_at,
       status, headers, body, replayable
FROM idempotency_keys WHERE key_hash = :key_hash;

-- name: take_over_key
-- Compare-and-swap: only when the lease of the given token has expired.
UPDATE idempotency_keys
SET fencing_token = fencing_token + 1, lease_expires_at = :lease_expires_at
WHERE key_hash = :key_hash AND fencing_token = :fencing_token AND state = 'running'
  AND lease_expires_at <= :now
RETURNING key_hash, fingerprint, state, fencing_token, lease_expires_at, expires_at,
          status, headers, body, replayable;

-- name: complete_key
UPDATE idempotency_keys
SET state = 'completed', status = :status, headers = :headers, body = :body,
    replayable = :replayable, expires_at = :expires_at
WHERE key_hash = :key_hash AND fencing_token = :fencing_token AND state = 'running';

-- name: release_key
DELETE FROM idempotency_keys
WHERE key_hash = :key_hash AND fencing_token = :fencing_token AND state = 'running';

-- name: extend_key_lease
UPDATE idempotency_keys SET lease_expires_at = :lease_expires_at
WHERE key_hash = :key_hash AND fencing_token = :fencing_token AND state = 'running';

-- name: purge_keys
DELETE FROM idempotency_keys
WHERE key_hash IN (
    SELECT key_hash FROM idempotency_keys WHERE expires_at <= :now LIMIT :batch
);
