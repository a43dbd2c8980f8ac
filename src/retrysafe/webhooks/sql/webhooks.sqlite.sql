-- Webhooks (SPEC §6) on SQLite: the statements of retrysafe.webhooks._store, with the names and
-- parameters of webhooks.postgres.sql (sqlite3 placeholders, :name).
--
-- Clock: SQLite's is always the caller's: :now is the caller's time, :before_at a cut-off the
-- caller computed (:before_in, its offset from now, is for PostgreSQL's server clock only).
-- :states and :job_ids are JSON arrays of text (NULL: no filter). :enabled is a boolean
-- (stored 0/1). Deliveries are outbox jobs (queue 'webhooks'): the statements here that touch
-- outbox_jobs only park, retarget, delete or purge a webhook's own jobs.

-- name: insert_endpoint

INSERT INTO webhook_endpoints
    (id, url, secrets, event_types, description, schedule, rate_limit, enabled,
     disabled_reason, created_at, updated_at)
VALUES (:id, :url, :secrets, :event_types, :description, :schedule, :rate_limit, :enabled,
        :disabled_reason, :now, :now)
RETURNING {endpoint_columns};

-- name: get_endpoint

SELECT {endpoint_columns}
FROM webhook_endpoints WHERE id = :id;

-- name: get_endpoints

-- The endpoints of the JSON array :ids (the webhook worker's reads of one event-loop
-- iteration, in one statement); an id with no endpoint has no row.
SELECT {endpoint_columns}
FROM webhook_endpoints WHERE id IN (SELECT value FROM json_each(:ids));

-- name: list_endpoints

SELECT {endpoint_columns}
FROM webhook_endpoints ORDER BY created_at, id;

-- name: update_endpoint

UPDATE webhook_endpoints
SET url = :url, secrets = :secrets, event_types = :event_types, description = :description,
    schedule = :schedule, rate_limit = :rate_limit, updated_at = :now
WHERE id = :id
RETURNING {endpoint_columns};

-- name: set_endpoint_enabled

-- Enabling or disabling starts a new failure run. :only_if_enabled: change it only while it
-- is enabled (an automatic disabling lands once, whatever number of attempts ask for it).
UPDATE webhook_endpoints
SET enabled = :enabled, disabled_reason = :reason, failure_count = 0,
    first_failure_at = NULL, updated_at = :now
WHERE id = :id AND (NOT :only_if_enabled OR enabled)
RETURNING {endpoint_columns};

-- name: record_endpoint_failure

UPDATE webhook_endpoints
SET failure_count = failure_count + 1, first_failure_at = COALESCE(first_failure_at, :now)
WHERE id = :id
RETURNING failure_count, first_failure_at, enabled;

-- name: reset_endpoint_failures

UPDATE webhook_endpoints SET failure_count = 0, first_failure_at = NULL
WHERE id = :id AND failure_count > 0;

-- name: end_delivery_runs

-- reset_endpoint_failures for the endpoint of every delivery (job id) of the JSON array :ids:
-- the 2xx answers of one batch of attempt records, in the records' transaction.
UPDATE webhook_endpoints SET failure_count = 0, first_failure_at = NULL
WHERE failure_count > 0
  AND id IN (SELECT endpoint_id FROM webhook_deliveries
             WHERE job_id IN (SELECT value FROM json_each(:ids)));

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

-- name: add_event

-- insert_event without reading the row back, for the caller's clock (the event as stored
-- is the caller's own): one changed row, or none when the event id exists.
INSERT INTO webhook_events (id, event_type, payload, created_at)
VALUES (:id, :event_type, :payload, :now)
ON CONFLICT (id) DO NOTHING;

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

-- name: delivery_contexts

-- delivery_context of every job of the JSON array :ids, each row led by its job id (the
-- webhook worker's reads of one event-loop iteration, in one statement); a job that is no
-- delivery has no row.
SELECT d.job_id, d.event_id, e.id, e.url, e.secrets, e.event_types, e.description, e.schedule,
       e.rate_limit, e.enabled, e.disabled_reason, e.failure_count, e.first_failure_at,
       e.created_at, e.updated_at
FROM webhook_deliveries d JOIN webhook_endpoints e ON e.id = d.endpoint_id
WHERE d.job_id IN (SELECT value FROM json_each(:ids));

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

-- Up to two delivery ids that start with :prefix, compared literally (no LIKE wildcards, so
-- any text is safe here); an empty prefix names no delivery.
SELECT job_id FROM webhook_deliveries
WHERE length(:prefix) > 0 AND substr(job_id, 1, length(:prefix)) = :prefix
ORDER BY job_id LIMIT 2;

-- name: purge_deliveries

-- Delete terminal deliveries (their jobs; the delivery rows and attempts cascade).
DELETE FROM outbox_jobs
WHERE id IN (
    SELECT d.job_id FROM webhook_deliveries d
    JOIN outbox_jobs j ON j.id = d.job_id
    JOIN webhook_events v ON v.id = d.event_id
    WHERE j.state IN (SELECT value FROM json_each(:states)) AND j.updated_at <= :before_at
      AND (:endpoint_id IS NULL OR d.endpoint_id = :endpoint_id)
      AND (:event_type IS NULL OR v.event_type = :event_type)
    LIMIT :batch
);

