-- The operator console's reads (retrysafe.ui, `retrysafe ui`) on SQLite: pages of jobs and
-- deliveries and the overview's attempt chart. Every page is a keyset page, newest first:
-- the position of its last row, (created_at, id), is where the next page starts, so page 500
-- costs what page 1 costs (a row-value seek into the index) and a job inserted meanwhile
-- neither repeats nor hides a row.

-- name: page_jobs

-- One page of :queue's jobs, newest first, after the keyset position (:after_at, :after_id)
-- when given. Filters (each NULL when unused): :states a JSON array of states; :since and
-- :until bound created_at (half-open); :host the destination's host:port (exact, :host_exact)
-- or the host followed by ':' (any port). The walk is the index outbox_jobs_created (queue,
-- created_at) backwards; the filters are checked on the rows it visits.
SELECT {job_columns}
FROM outbox_jobs
WHERE queue = :queue
  AND (:states IS NULL OR state IN (SELECT value FROM json_each(:states)))
  AND (:since IS NULL OR created_at >= :since)
  AND (:until IS NULL OR created_at < :until)
  AND (:host IS NULL
       OR (:host_exact AND substr(destination, instr(destination, '://') + 3) = :host)
       OR (NOT :host_exact
           AND substr(destination, instr(destination, '://') + 3, length(:host)) = :host))
  AND (created_at, id) < (:after_at, :after_id)
ORDER BY created_at DESC, id DESC
LIMIT :limit;

-- name: attempt_buckets

-- Attempts started since :since, counted per :width-second bucket and outcome class: the
-- overview's chart of the last hour. (A scan of outbox_attempts: no index on started_at, so
-- an attempt's insert, on the worker's hot path, updates no more indexes for the console.)
SELECT CAST((started_at - :since) / :width AS INTEGER) AS bucket, outcome, count(*)
FROM outbox_attempts
WHERE started_at >= :since
GROUP BY bucket, outcome;

-- name: page_deliveries

-- One page of an endpoint's deliveries (all endpoints when :endpoint_id is NULL), newest
-- first, after the keyset position (:after_at, :after_id); :states a JSON array or NULL.
SELECT d.job_id, d.event_id, v.event_type, d.endpoint_id, j.url, j.state, j.attempts, j.sends,
       j.last_status, j.last_outcome, j.last_error, j.due_at, d.created_at, j.updated_at
FROM webhook_deliveries d
JOIN outbox_jobs j ON j.id = d.job_id
JOIN webhook_events v ON v.id = d.event_id
WHERE (:endpoint_id IS NULL OR d.endpoint_id = :endpoint_id)
  AND (:states IS NULL OR j.state IN (SELECT value FROM json_each(:states)))
  AND (d.created_at, d.job_id) < (:after_at, :after_id)
ORDER BY d.created_at DESC, d.job_id DESC
LIMIT :limit;

-- name: dead_deliveries

-- The webhook dead-letter queue, newest first: walked from the jobs of the 'webhooks' queue in
-- the dead-letter states (index outbox_jobs_due: queue, state, …), not from every delivery, so
-- its cost follows the dead letters, not the deliveries.
SELECT d.job_id, d.event_id, v.event_type, d.endpoint_id, j.url, j.state, j.attempts, j.sends,
       j.last_status, j.last_outcome, j.last_error, j.due_at, d.created_at, j.updated_at
FROM outbox_jobs j
JOIN webhook_deliveries d ON d.job_id = j.id
JOIN webhook_events v ON v.id = d.event_id
WHERE j.queue = 'webhooks' AND j.state IN (SELECT value FROM json_each(:states))
  AND (d.created_at, d.job_id) < (:after_at, :after_id)
ORDER BY d.created_at DESC, d.job_id DESC
LIMIT :limit;

-- name: queues

-- Every queue that holds a job: a skip scan of the index outbox_jobs_created (queue, …), one
-- seek per queue, so the cost follows the number of queues, not of jobs.
WITH RECURSIVE q(queue) AS (
    SELECT min(queue) FROM outbox_jobs
    UNION ALL
    SELECT (SELECT min(queue) FROM outbox_jobs WHERE queue > q.queue) FROM q
    WHERE q.queue IS NOT NULL
)
SELECT queue FROM q WHERE queue IS NOT NULL;

-- name: page_agent_runs

-- One page of agent runs, newest first, after the keyset position (:after_at, :after_id);
-- each with its logical calls (not refused) and its calls of unknown outcome. agent_runs has
-- no index on created_at: a page is a top-N scan of the runs (16 ms a page at 100,000 runs
-- here), then two indexed counts per shown run (agent_calls_run (run_id, created_at)).
SELECT r.id, r.state, r.max_steps, r.max_attempts, r.reason, r.created_at, r.updated_at,
       (SELECT count(*) FROM agent_calls c WHERE c.run_id = r.id AND c.state <> 'refused'),
       (SELECT count(*) FROM agent_calls c WHERE c.run_id = r.id AND c.state = 'unknown')
FROM agent_runs r
WHERE (r.created_at, r.id) < (:after_at, :after_id)
ORDER BY r.created_at DESC, r.id DESC
LIMIT :limit;
