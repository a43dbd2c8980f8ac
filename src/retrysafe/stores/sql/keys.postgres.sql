-- Idempotency keys (SPEC §3, §9) on PostgreSQL: the statements of retrysafe.stores._keys, with
-- the names and parameters of keys.sqlite.sql (psycopg placeholders, %(name)s).
--
-- Clock: %(now)s NULL (clock="server", the default) means the database server's clock, the
-- statement's start time, so one statement sees one instant and every API replica compares
-- leases and retention against the same clock; a float is the caller's clock (clock="caller").

-- name: claim_key

-- Insert if absent; replace if the record's retention has expired or it was released (both
-- count as absent; the token sequence continues). The
-- conflicting row is locked by ON CONFLICT, so of concurrent claims exactly one inserts or
-- replaces. Returns the new record only when this call claimed the key; otherwise no row.
-- created_at is the claim's time (a re-claim writes a new record, so a new time); it is in no
-- index.
INSERT INTO idempotency_keys AS k
    (key_hash, fingerprint, state, fencing_token, lease_expires_at, expires_at, created_at)
VALUES (
    %(key_hash)s, %(fingerprint)s, 'running', 1,
    coalesce(%(now)s::float8, extract(epoch FROM statement_timestamp())::float8)
        + %(lease)s::float8,
    coalesce(%(now)s::float8, extract(epoch FROM statement_timestamp())::float8)
        + %(retention)s::float8,
    coalesce(%(now)s::float8, extract(epoch FROM statement_timestamp())::float8)
)
ON CONFLICT (key_hash) DO UPDATE SET
    fingerprint = excluded.fingerprint,
    state = 'running',
    fencing_token = k.fencing_token + 1,
    lease_expires_at = excluded.lease_expires_at,
    expires_at = excluded.expires_at,
    created_at = excluded.created_at,
    status = NULL, headers = NULL, body = NULL, replayable = true
WHERE k.expires_at <= coalesce(%(now)s::float8, extract(epoch FROM statement_timestamp())::float8)
   OR k.state = 'released'
RETURNING fencing_token, lease_expires_at, expires_at;

-- name: insert_key

-- The first claim of a key on the caller's clock (clock="caller": %(now)s is a float): insert
-- if absent, nothing else; one changed row means this call claimed it with token 1 and the
-- caller's times (see keys.sqlite.sql). No row changed: claim_key decides.
INSERT INTO idempotency_keys
    (key_hash, fingerprint, state, fencing_token, lease_expires_at, expires_at, created_at)
VALUES (
    %(key_hash)s, %(fingerprint)s, 'running', 1, %(now)s::float8 + %(lease)s::float8,
    %(now)s::float8 + %(retention)s::float8, %(now)s::float8
)
ON CONFLICT (key_hash) DO NOTHING;

-- name: get_key

-- A released record (tombstone) reads as absent.
SELECT {key_columns}
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
RETURNING {key_columns};

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

-- ------------------------------------------------------------------ inspection (`retrysafe keys`)
-- Records as an operator sees them: tombstones included, with the state they have now
-- ('expired' once the retention ended by the store's clock, whatever was stored), never the
-- raw key. Columns: {entry_columns}, the body's size in bytes, whether the retention ended
-- (and find_*: the body).

-- name: list_keys

-- One page, newest claim first, after the (coalesce(created_at, 0), key_hash) of the previous
-- page's last entry (%(after_hash)s NULL: from the start); %(running)s, %(completed)s,
-- %(released)s and %(expired)s say which states to return. No index serves this order (one
-- would cost every claim an index write): it is a scan and a top-N sort, run by a person,
-- never on the request path. Records claimed before schema version 2 have no created_at and
-- come last.
SELECT {entry_columns}, octet_length(body),
       expires_at <= coalesce(%(now)s::float8, extract(epoch FROM statement_timestamp())::float8)
FROM idempotency_keys
WHERE (%(after_hash)s::text IS NULL
       OR (coalesce(created_at, 0), key_hash)
          < (%(after_created)s::float8, %(after_hash)s::text))
  AND CASE WHEN expires_at <= coalesce(%(now)s::float8,
                                       extract(epoch FROM statement_timestamp())::float8)
                THEN %(expired)s::boolean
           WHEN state = 'running' THEN %(running)s::boolean
           WHEN state = 'completed' THEN %(completed)s::boolean
           ELSE %(released)s::boolean END
ORDER BY coalesce(created_at, 0) DESC, key_hash DESC
LIMIT %(limit)s;

-- name: find_key

-- One record by its whole key hash (the primary key).
SELECT {entry_columns}, octet_length(body),
       expires_at <= coalesce(%(now)s::float8, extract(epoch FROM statement_timestamp())::float8),
       body
FROM idempotency_keys WHERE key_hash = %(key_hash)s;

-- name: find_keys_by_prefix

-- Up to %(limit)s records whose key hash starts with %(prefix)s, compared literally (no LIKE
-- wildcards), in hash order; an empty prefix names none.
SELECT {entry_columns}, octet_length(body),
       expires_at <= coalesce(%(now)s::float8, extract(epoch FROM statement_timestamp())::float8),
       body
FROM idempotency_keys
WHERE length(%(prefix)s::text) > 0
  AND substr(key_hash, 1, length(%(prefix)s::text)) = %(prefix)s::text
ORDER BY key_hash LIMIT %(limit)s;

-- name: evict_key

-- Forget the record an operator looked at (its token): it becomes a tombstone, exactly as
-- release_key leaves one, so it reads as absent, the next claim runs the handler again with a
-- larger token, and an owner still running under this token matches no fenced write. Not
-- fenced by state: a running record is evicted too (the caller decides whether it may be).
UPDATE idempotency_keys
SET state = 'released', fingerprint = '', status = NULL, headers = NULL, body = NULL,
    replayable = true
WHERE key_hash = %(key_hash)s AND fencing_token = %(token)s AND state <> 'released';

-- ------------------------------------------------------------------ outbox (SPEC §5)
-- Job columns, in the order retrysafe.stores._postgres_outbox reads them:
-- id, idempotency_key, queue, state, method, url, destination, headers, body, created_at,
-- updated_at, due_at, deadline_at, attempts, sends, polls, last_delay, lease_token,
-- lease_expires_at, finished_at, last_status, last_outcome, last_error
-- Every statement that picks jobs by state (claims, lists, counts, purges) is limited to one
-- %(queue)s. Clock: %(now)s as above (NULL: the server's clock). A time the caller computed
-- (a due time, a purge cut-off) arrives twice: %(x_at)s, the caller's absolute time, used
-- with clock="caller", and %(x_in)s, the same time as an offset from the caller's now, added
-- to the server's clock when %(x_at)s is NULL (clock="server").
