-- Idempotency keys (SPEC §3, §9) on SQLite: the statements of retrysafe.stores._keys, with the
-- names and parameters of keys.postgres.sql. Times are Unix seconds (REAL) on the caller's
-- clock (:now is always given). Keys are stored only as SHA-256 hashes of (scope, key).

-- name: claim_key
-- Insert if absent; replace if the record's retention has expired or it was released (both
-- count as absent), continuing its token sequence. Returns the claimed record's token and
-- times only when this call claimed the key; otherwise no row. created_at is the claim's time
-- (a re-claim writes a new record, so a new time); it is in no index.
INSERT INTO idempotency_keys
    (key_hash, fingerprint, state, fencing_token, lease_expires_at, expires_at, created_at)
VALUES (:key_hash, :fingerprint, 'running', 1, :now + :lease, :now + :retention, :now)
ON CONFLICT (key_hash) DO UPDATE SET
    fingerprint = excluded.fingerprint,
    state = 'running',
    fencing_token = idempotency_keys.fencing_token + 1,
    lease_expires_at = excluded.lease_expires_at,
    expires_at = excluded.expires_at,
    created_at = excluded.created_at,
    status = NULL, headers = NULL, body = NULL, replayable = 1
WHERE idempotency_keys.expires_at <= :now OR idempotency_keys.state = 'released'
RETURNING fencing_token, lease_expires_at, expires_at;

-- name: insert_key
-- The first claim of a key (the hot path): insert if absent, nothing else. One changed row
-- means this call claimed it, and the caller knows the record it wrote (token 1, its own
-- times) without reading it back: RETURNING costs SQLite an ephemeral table per statement
-- (~30,000 instructions, a quarter of this statement). No row changed: claim_key decides.
INSERT INTO idempotency_keys
    (key_hash, fingerprint, state, fencing_token, lease_expires_at, expires_at, created_at)
VALUES (:key_hash, :fingerprint, 'running', 1, :now + :lease, :now + :retention, :now)
ON CONFLICT (key_hash) DO NOTHING;

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

-- ------------------------------------------------------------------ inspection (`retrysafe keys`)
-- Records as an operator sees them: tombstones included, with the state they have now
-- ('expired' once the retention ended, whatever was stored), never the raw key. Columns:
-- {entry_columns}, the body's size in bytes, whether the retention ended (and find_*: the body).

-- name: list_keys
-- One page, newest claim first, after the (coalesce(created_at, 0), key_hash) of the previous
-- page's last entry (:after_hash NULL: from the start); :running, :completed, :released and
-- :expired say which states to return. No index serves this order (one would cost every claim
-- an index write): it is a scan and a top-N sort, run by a person, never on the request path.
-- Records claimed before schema version 2 have no created_at and come last.
SELECT {entry_columns}, length(body), expires_at <= :now
FROM idempotency_keys
WHERE (:after_hash IS NULL
       OR (coalesce(created_at, 0), key_hash) < (:after_created, :after_hash))
  AND CASE WHEN expires_at <= :now THEN :expired
           WHEN state = 'running' THEN :running
           WHEN state = 'completed' THEN :completed
           ELSE :released END
ORDER BY coalesce(created_at, 0) DESC, key_hash DESC
LIMIT :limit;

-- name: find_key
-- One record by its whole key hash (the unique index).
SELECT {entry_columns}, length(body), expires_at <= :now, body
FROM idempotency_keys WHERE key_hash = :key_hash;

-- name: find_keys_by_prefix
-- Up to :limit records whose key hash starts with :prefix, compared literally (no LIKE
-- wildcards), in hash order; an empty prefix names none. A scan of the key_hash index.
SELECT {entry_columns}, length(body), expires_at <= :now, body
FROM idempotency_keys
WHERE length(:prefix) > 0 AND substr(key_hash, 1, length(:prefix)) = :prefix
ORDER BY key_hash LIMIT :limit;

-- name: evict_key
-- Forget the record an operator looked at (its token): it becomes a tombstone, exactly as
-- release_key leaves one, so it reads as absent, the next claim runs the handler again with a
-- larger token, and an owner still running under this token matches no fenced write. Not
-- fenced by state: a running record is evicted too (the caller decides whether it may be).
UPDATE idempotency_keys
SET state = 'released', fingerprint = '', status = NULL, headers = NULL, body = NULL,
    replayable = 1
WHERE key_hash = :key_hash AND fencing_token = :token AND state <> 'released';
