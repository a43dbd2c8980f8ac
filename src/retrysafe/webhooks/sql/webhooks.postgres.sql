-- Webhooks (SPEC §6) on PostgreSQL: the statements of retrysafe.webhooks._store, with the names
-- and parameters of webhooks.sqlite.sql (psycopg placeholders, %(name)s).
--
-- Clock: %(now)s NULL (clock="server", the default) means the database server's clock, the
-- statement's start time, like the outbox's statements on the same jobs; a float is the
-- caller's clock (clock="caller"). A cut-off the caller computed arrives twice: %(before_at)s,
-- its absolute time (clock="caller"), and %(before_in)s, its offset from the caller's now,
-- added to the server's clock when %(before_at)s is NULL.
-- %(states)s and %(job_ids)s are JSON arrays of text (NULL: no filter), as in SQLite.
-- Deliveries are outbox jobs (queue 'webhooks'): the statements here that touch outbox_jobs
-- only park, retarget, delete or purge a webhook's own jobs; workers claim them with the
-- outbox's claim_jobs (FOR UPDATE SKIP LOCKED), so any number of webhook workers share a
-- database.

-- name: insert_endpoint

INSERT INTO webhook_endpoints
    (id, url, secrets, event_types, description, schedule, rate_limit, enabled,
     disabled_reason, created_at, updated_at)
SELECT %(id)s::text, %(url)s::text, %(secrets)s::text, %(event_types)s::text,
       %(description)s::text, %(schedule)s::text, %(rate_limit)s::float8, %(enabled)s::boolean,
       %(disabled_reason)s::text, t.now, t.now
FROM (SELECT coalesce(%(now)s::float8,
                      extract(epoch FROM statement_timestamp())::float8) AS now) AS t
RETURNING {endpoint_columns};

-- name: get_endpoint

SELECT {endpoint_columns}
FROM webhook_endpoints WHERE id = %(id)s;

-- name: get_endpoints

-- The endpoints of the JSON array %(ids)s (the webhook worker's reads of one event-loop
-- iteration, in one statement); an id with no endpoint has no row.
SELECT {endpoint_columns}
FROM webhook_endpoints
WHERE id = ANY(ARRAY(SELECT jsonb_array_elements_text(%(ids)s::jsonb)));

-- name: list_endpoints

SELECT {endpoint_columns}
FROM webhook_endpoints ORDER BY created_at, id;

-- name: update_endpoint

UPDATE webhook_endpoints
SET url = %(url)s, secrets = %(secrets)s, event_types = %(event_types)s,
    description = %(description)s, schedule = %(schedule)s,
    rate_limit = %(rate_limit)s::float8,
    updated_at = coalesce(%(now)s::float8, extract(epoch FROM statement_timestamp())::float8)
WHERE id = %(id)s
RETURNING {endpoint_columns};

-- name: set_endpoint_enabled

-- Enabling or disabling starts a new failure run. only_if_enabled: change it only while it
-- is enabled (an automatic disabling lands once, whatever number of attempts ask for it).
UPDATE webhook_endpoints
SET enabled = %(enabled)s::boolean, disabled_reason = %(reason)s::text, failure_count = 0,
    first_failure_at = NULL,
    updated_at = coalesce(%(now)s::float8, extract(epoch FROM statement_timestamp())::float8)
WHERE id = %(id)s AND (NOT %(only_if_enabled)s::boolean OR enabled)
RETURNING {endpoint_columns};

-- name: record_endpoint_failure

-- One statement: the row lock makes concurrent workers' increments add up.
UPDATE webhook_endpoints
SET failure_count = failure_count + 1,
    first_failure_at = coalesce(first_failure_at, %(now)s::float8,
                                extract(epoch FROM statement_timestamp())::float8)
WHERE id = %(id)s
RETURNING failure_count, first_failure_at, enabled;

-- name: reset_endpoint_failures

UPDATE webhook_endpoints SET failure_count = 0, first_failure_at = NULL
WHERE id = %(id)s AND failure_count > 0;

-- name: end_delivery_runs

-- reset_endpoint_failures for the endpoint of every delivery (job id) of the JSON array
-- %(ids)s: the 2xx answers of one batch of attempt records, in the records' transaction.
-- Only endpoints with a run are locked, in id order, so
-- concurrent workers never wait on each other in a cycle.
UPDATE webhook_endpoints SET failure_count = 0, first_failure_at = NULL
WHERE id IN (
    SELECT e.id FROM webhook_endpoints e
    WHERE e.failure_count > 0
      AND e.id IN (SELECT d.endpoint_id FROM webhook_deliveries d
                   WHERE d.job_id = ANY(ARRAY(SELECT jsonb_array_elements_text(%(ids)s::jsonb))))
    ORDER BY e.id
    FOR UPDATE
);

-- name: delete_endpoint_jobs

-- The endpoint's jobs (their deliveries and attempts cascade). A job in flight is deleted
-- too: the worker's fenced writes then change nothing.
DELETE FROM outbox_jobs
WHERE id IN (SELECT job_id FROM webhook_deliveries WHERE endpoint_id = %(id)s);

-- name: delete_endpoint

DELETE FROM webhook_endpoints WHERE id = %(id)s;

-- name: cancel_endpoint_jobs

-- Park the endpoint's pending deliveries (disabled endpoint): kept, replayable. A delivery a
-- worker is claiming right now is waited for and then left alone (no longer pending): the
-- worker's decide hook parks it after its attempt, the endpoint being disabled.
WITH t AS (
    SELECT coalesce(%(now)s::float8, extract(epoch FROM statement_timestamp())::float8) AS now
)
UPDATE outbox_jobs
SET state = 'cancelled', finished_at = (SELECT now FROM t), updated_at = (SELECT now FROM t),
    last_error = coalesce(%(reason)s::text, last_error)
WHERE state = 'pending'
  AND id IN (SELECT job_id FROM webhook_deliveries WHERE endpoint_id = %(id)s);

-- name: retarget_endpoint_jobs

-- A new endpoint URL applies to every delivery not succeeded yet, whatever its lease state:
-- pending, parked, dead letters, and in flight (a live worker's current attempt still goes
-- to the URL it read at its claim; a crashed worker's expired lease is re-claimed with
-- the new URL). The lease and fencing token are left alone.
UPDATE outbox_jobs
SET url = %(url)s, destination = %(destination)s,
    updated_at = coalesce(%(now)s::float8, extract(epoch FROM statement_timestamp())::float8)
WHERE state <> 'succeeded'
  AND id IN (SELECT job_id FROM webhook_deliveries WHERE endpoint_id = %(id)s);

-- name: insert_event

-- Idempotent on the event id: a second insert returns no row (a concurrent one waits for the
-- first to commit, then inserts nothing).
INSERT INTO webhook_events (id, event_type, payload, created_at)
SELECT %(id)s::text, %(event_type)s::text, %(payload)s::bytea,
       coalesce(%(now)s::float8, extract(epoch FROM statement_timestamp())::float8)
ON CONFLICT (id) DO NOTHING
RETURNING id, event_type, payload, created_at;

-- name: add_event

-- insert_event without reading the row back, for the caller's clock (the event as stored
-- is the caller's own): one changed row, or none when the event id exists.
INSERT INTO webhook_events (id, event_type, payload, created_at)
SELECT %(id)s::text, %(event_type)s::text, %(payload)s::bytea,
       coalesce(%(now)s::float8, extract(epoch FROM statement_timestamp())::float8)
ON CONFLICT (id) DO NOTHING;

-- name: get_event

SELECT id, event_type, payload, created_at FROM webhook_events WHERE id = %(id)s;

-- name: insert_delivery

INSERT INTO webhook_deliveries (job_id, event_id, endpoint_id, created_at)
SELECT %(job_id)s::text, %(event_id)s::text, %(endpoint_id)s::text,
       coalesce(%(now)s::float8, extract(epoch FROM statement_timestamp())::float8);

-- name: park_job

-- A delivery recorded for a disabled endpoint: kept, CANCELLED until replayed.
UPDATE outbox_jobs
SET state = 'cancelled',
    finished_at = coalesce(%(now)s::float8, extract(epoch FROM statement_timestamp())::float8),
    last_error = 'endpoint disabled'
WHERE id = %(id)s;

-- name: delivery_context

-- What the worker needs per attempt: the event id and the endpoint of a job.
SELECT d.event_id, e.id, e.url, e.secrets, e.event_types, e.description, e.schedule,
       e.rate_limit, e.enabled, e.disabled_reason, e.failure_count, e.first_failure_at,
       e.created_at, e.updated_at
FROM webhook_deliveries d JOIN webhook_endpoints e ON e.id = d.endpoint_id
WHERE d.job_id = %(job_id)s;

-- name: delivery_contexts

-- delivery_context of every job of the JSON array %(ids)s, each row led by its job id (the
-- webhook worker's reads of one event-loop iteration, in one statement); a job that is no
-- delivery has no row.
SELECT d.job_id, d.event_id, e.id, e.url, e.secrets, e.event_types, e.description, e.schedule,
       e.rate_limit, e.enabled, e.disabled_reason, e.failure_count, e.first_failure_at,
       e.created_at, e.updated_at
FROM webhook_deliveries d JOIN webhook_endpoints e ON e.id = d.endpoint_id
WHERE d.job_id = ANY(ARRAY(SELECT jsonb_array_elements_text(%(ids)s::jsonb)));

-- name: list_deliveries

SELECT d.job_id, d.event_id, v.event_type, d.endpoint_id, j.url, j.state, j.attempts, j.sends,
       j.last_status, j.last_outcome, j.last_error, j.due_at, d.created_at, j.updated_at
FROM webhook_deliveries d
JOIN outbox_jobs j ON j.id = d.job_id
JOIN webhook_events v ON v.id = d.event_id
WHERE (%(event_id)s::text IS NULL OR d.event_id = %(event_id)s::text)
  AND (%(endpoint_id)s::text IS NULL OR d.endpoint_id = %(endpoint_id)s::text)
  AND (%(event_type)s::text IS NULL OR v.event_type = %(event_type)s::text)
  AND (%(states)s::jsonb IS NULL
       OR j.state = ANY(ARRAY(SELECT jsonb_array_elements_text(%(states)s::jsonb))))
  AND (%(job_ids)s::jsonb IS NULL
       OR d.job_id = ANY(ARRAY(SELECT jsonb_array_elements_text(%(job_ids)s::jsonb))))
ORDER BY d.created_at, d.job_id LIMIT %(limit)s;

-- name: find_delivery_by_prefix

-- Up to two delivery ids that start with %(prefix)s, compared literally (no LIKE wildcards,
-- so any text is safe here); an empty prefix names no delivery.
SELECT job_id FROM webhook_deliveries
WHERE length(%(prefix)s::text) > 0 AND substr(job_id, 1, length(%(prefix)s::text)) = %(prefix)s::text
ORDER BY job_id LIMIT 2;

-- name: purge_deliveries

-- Delete one batch of terminal deliveries (their jobs; the delivery rows and attempts
-- cascade); jobs another transaction holds (a claim or a finish in progress) are skipped.
WITH t AS (
    SELECT coalesce(%(before_at)s::float8,
                    extract(epoch FROM statement_timestamp())::float8 + %(before_in)s::float8)
           AS before
)
DELETE FROM outbox_jobs
WHERE id IN (
    SELECT d.job_id FROM webhook_deliveries d
    JOIN outbox_jobs j ON j.id = d.job_id
    JOIN webhook_events v ON v.id = d.event_id
    WHERE j.state = ANY(ARRAY(SELECT jsonb_array_elements_text(%(states)s::jsonb)))
      AND j.updated_at <= (SELECT before FROM t)
      AND (%(endpoint_id)s::text IS NULL OR d.endpoint_id = %(endpoint_id)s::text)
      AND (%(event_type)s::text IS NULL OR v.event_type = %(event_type)s::text)
    LIMIT %(batch)s
    FOR UPDATE OF j SKIP LOCKED
);
