-- The operator console's reads (retrysafe.ui, `retrysafe ui`) on PostgreSQL: the statements
-- of console.sqlite.sql with the same names and parameters (psycopg placeholders). Every page
-- is a keyset page, newest first: the position of its last row, (created_at, id), is where
-- the next page starts, so page 500 costs what page 1 costs.

-- name: page_jobs

-- One page of %(queue)s's jobs, newest first, after the keyset position (%(after_at)s,
-- %(after_id)s) when given; the filters as on SQLite. The walk is the index
-- outbox_jobs_created (queue, created_at) backwards.
SELECT {job_columns}
FROM outbox_jobs
WHERE queue = %(queue)s
  AND (%(states)s::jsonb IS NULL
       OR state = ANY(ARRAY(SELECT jsonb_array_elements_text(%(states)s::jsonb))))
  AND (%(since)s::float8 IS NULL OR created_at >= %(since)s::float8)
  AND (%(until)s::float8 IS NULL OR created_at < %(until)s::float8)
  AND (%(host)s::text IS NULL
       OR (%(host_exact)s
           AND substr(destination, position('://' IN destination) + 3) = %(host)s::text)
       OR (NOT %(host_exact)s
           AND substr(destination, position('://' IN destination) + 3,
                      length(%(host)s::text)) = %(host)s::text))
  AND (created_at, id) < (%(after_at)s::float8, %(after_id)s::text)
ORDER BY created_at DESC, id DESC
LIMIT %(limit)s;

-- name: attempt_buckets

-- Attempts started since %(since)s per %(width)s-second bucket and outcome class (a scan of
-- outbox_attempts, as on SQLite).
SELECT floor((started_at - %(since)s::float8) / %(width)s::float8)::int AS bucket, outcome,
       count(*)
FROM outbox_attempts
WHERE started_at >= %(since)s::float8
GROUP BY bucket, outcome;

-- name: page_deliveries

-- One page of an endpoint's deliveries (all when %(endpoint_id)s is NULL), newest first.
SELECT d.job_id, d.event_id, v.event_type, d.endpoint_id, j.url, j.state, j.attempts, j.sends,
       j.last_status, j.last_outcome, j.last_error, j.due_at, d.created_at, j.updated_at
FROM webhook_deliveries d
JOIN outbox_jobs j ON j.id = d.job_id
JOIN webhook_events v ON v.id = d.event_id
WHERE (%(endpoint_id)s::text IS NULL OR d.endpoint_id = %(endpoint_id)s::text)
  AND (%(states)s::jsonb IS NULL
       OR j.state = ANY(ARRAY(SELECT jsonb_array_elements_text(%(states)s::jsonb))))
  AND (d.created_at, d.job_id) < (%(after_at)s::float8, %(after_id)s::text)
ORDER BY d.created_at DESC, d.job_id DESC
LIMIT %(limit)s;

-- name: dead_deliveries

-- The webhook dead-letter queue, newest first, walked from the 'webhooks' queue's jobs in the
-- dead-letter states (as on SQLite).
SELECT d.job_id, d.event_id, v.event_type, d.endpoint_id, j.url, j.state, j.attempts, j.sends,
       j.last_status, j.last_outcome, j.last_error, j.due_at, d.created_at, j.updated_at
FROM outbox_jobs j
JOIN webhook_deliveries d ON d.job_id = j.id
JOIN webhook_events v ON v.id = d.event_id
WHERE j.queue = 'webhooks'
  AND j.state = ANY(ARRAY(SELECT jsonb_array_elements_text(%(states)s::jsonb)))
  AND (d.created_at, d.job_id) < (%(after_at)s::float8, %(after_id)s::text)
ORDER BY d.created_at DESC, d.job_id DESC
LIMIT %(limit)s;

-- name: queues

-- Every queue that holds a job: a skip scan of the index outbox_jobs_created (queue, …).
WITH RECURSIVE q(queue) AS (
    SELECT min(queue) FROM outbox_jobs
    UNION ALL
    SELECT (SELECT min(queue) FROM outbox_jobs WHERE queue > q.queue) FROM q
    WHERE q.queue IS NOT NULL
)
SELECT queue FROM q WHERE queue IS NOT NULL;

-- name: page_agent_runs

-- One page of agent runs, newest first, after the keyset position (as on SQLite).
SELECT r.id, r.state, r.max_steps, r.max_attempts, r.reason, r.created_at, r.updated_at,
       (SELECT count(*) FROM agent_calls c WHERE c.run_id = r.id AND c.state <> 'refused'),
       (SELECT count(*) FROM agent_calls c WHERE c.run_id = r.id AND c.state = 'unknown')
FROM agent_runs r
WHERE (r.created_at, r.id) < (%(after_at)s::float8, %(after_id)s::text)
ORDER BY r.created_at DESC, r.id DESC
LIMIT %(limit)s;
