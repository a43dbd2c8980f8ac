-- Idempotency keys (SPEC §3, §9) on SQLite: the statements of retrysafe.stores._keys, with the
-- names and parameters of keys.postgres.sql. Times are Unix seconds (REAL) on the caller's
-- clock (:now is always given). Keys are stored only as SHA-256 hashes of (scope, key).

-- name: claim_key
-- Insert if absent; replace if the record's retention has expired or it was released (both
-- count as absent), continuing its token sequence. Returns the claimed record's token and
-- times only when this call claimed the key; otherwise no row.
INSERT INTO idempotency_keys
    (key_hash, fingerprint, state, fencing_token, lease_expires_at, expires_at)
VALUES (:key_hash, :fingerprint, 'running', 1, :now + :lease, :now + :retention)
ON CONFLICT (key_hash) DO UPDATE SET
    fingerprint = excluded.fingerprint,
    state = 'running',
    fencing_token = idempotency_keys.fencing_token + 1,
    lease_expires_at = excluded.lease_expires_at,
    expires_at = excluded.expires_at,
    status = NULL, headers = NULL, body = NULL, replayable = 1
WHERE idempotency_keys.expires_at <= :now OR idempotency_keys.state = 'released'
RETURNING fencing_token, lease_expires_at, expires_at;

-- name: get_key
-- A released record (tombstone) reads as absent.
SELECT {key_columns}
FROM idempotency_keys WHERE key_hash = :key_hash AND state <> 'released';

-- name: take_over_key
-- Compare-and-swap: only the running record of exactly this token, once its lease expired.
UPDATE idempotency_keys
SET fencing_token = fencing_token + 1, lease_expires_at = :now + :lease
WHERE key_hash = :key_hash AND fencing_token = :token AND state = 'running'
  AND lease_expires_at <= :now
RETURNING {key_columns};

-- name: complete_key
UPDATE idempotency_keys
SET state = 'completed', status = :status, headers = :headers, body = :body,
    replayable = :replayable, expires_at = :now + :retention
WHERE key_hash = :key_hash AND fencing_token = :token AND state = 'running';

-- name: release_key
-- Leaves a tombstone, not a gap: deleting the row would restart the key's fencing tokens at 1
-- on the next claim, and a fenced-out owner still holding token 1 would own that claim. The
-- tombstone keeps its token and expires_at (purge_keys removes it once that passed).
UPDATE idempotency_keys
SET state = 'released', fingerprint = '', status = NULL, headers = NULL, body = NULL,
    replayable = 1
WHERE key_hash = :key_hash AND fencing_token = :token AND state = 'running';

-- name: extend_key_lease
UPDATE idempotency_keys SET lease_expires_at = :now + :lease
WHERE key_hash = :key_hash AND fencing_token = :token AND state = 'running';

-- name: purge_keys
-- One batch of records whose retention ended.
DELETE FROM idempotency_keys
WHERE rowid IN (
    SELECT rowid FROM idempotency_keys WHERE expires_at <= :now LIMIT :batch
);
