-- Agent runs and their logical tool calls, the audit log (SPEC §7), on PostgreSQL: the
-- statements of retrysafe.agents._store, with the names and parameters of agents.sqlite.sql.
-- Times are Unix seconds on the agent layer's clock, stored as given whatever the store's
-- clock (the agent layer compares leases itself: a lease written on the server's clock and
-- read against the caller's would mix two clocks).

-- name: insert_agent_run
INSERT INTO agent_runs (id, state, max_steps, max_attempts, created_at, updated_at)
VALUES (%(id)s, 'active', %(max_steps)s, %(max_attempts)s, %(now)s, %(now)s)
ON CONFLICT (id) DO NOTHING
RETURNING {run_columns};

-- name: get_agent_run
SELECT {run_columns}
FROM agent_runs WHERE id = %(id)s;

-- name: lock_agent_run
-- Serialises the claims of one run (held until commit), as SQLite's BEGIN IMMEDIATE does: the
-- signature check, the count of calls and the insert see no concurrent claim of this run.
SELECT id FROM agent_runs WHERE id = %(run_id)s FOR UPDATE;

-- name: list_agent_runs
SELECT r.id, r.state, r.max_steps, r.max_attempts, r.reason, r.created_at, r.updated_at,
       (SELECT count(*) FROM agent_calls c WHERE c.run_id = r.id AND c.state <> 'refused'),
       (SELECT count(*) FROM agent_calls c WHERE c.run_id = r.id AND c.state = 'unknown')
FROM agent_runs r ORDER BY r.created_at DESC, r.id LIMIT %(limit)s;

-- name: stop_agent_run
UPDATE agent_runs SET state = 'stopped', reason = %(reason)s, updated_at = %(now)s
WHERE id = %(id)s;

-- name: agent_signature_conflict
-- A call of the same tool in this run recorded under another signature (the tool changed).
SELECT idempotency_key FROM agent_calls
WHERE run_id = %(run_id)s AND tool = %(tool)s AND signature <> %(signature)s LIMIT 1;

-- name: unknown_agent_call
-- An earlier logical call of the same write tool with the same arguments in this run whose
-- outcome is unknown: a new step must not send that effect again under a new key (SPEC §0:
-- a timeout means "I don't know"); the claimant joins it instead. Uses agent_calls_tool.
SELECT idempotency_key FROM agent_calls
WHERE run_id = %(run_id)s AND tool = %(tool)s AND kind = 'write'
  AND arguments_hash = %(arguments_hash)s AND state = 'unknown'
ORDER BY created_at, idempotency_key LIMIT 1;

-- name: count_agent_calls
-- Logical calls recorded in the run (refusals are not calls).
SELECT count(*) FROM agent_calls WHERE run_id = %(run_id)s AND state <> 'refused';

-- name: insert_agent_call
-- Insert if absent, in one statement: of concurrent claimants of one key exactly one gets the
-- row back; the others get no row and read the existing call.
INSERT INTO agent_calls
    (idempotency_key, run_id, step, tool, kind, signature, arguments_hash, arguments, state,
     owner, lease_expires_at, error, created_at, updated_at, finished_at)
VALUES (%(key)s, %(run_id)s, %(step)s, %(tool)s, %(kind)s, %(signature)s, %(arguments_hash)s,
        %(arguments)s, %(state)s, %(owner)s, %(lease_expires_at)s, %(error)s, %(now)s, %(now)s,
        %(finished_at)s)
ON CONFLICT (idempotency_key) DO NOTHING
RETURNING {call_columns};

-- name: get_agent_call
SELECT {call_columns}
FROM agent_calls WHERE idempotency_key = %(key)s;

-- name: list_agent_calls
SELECT {call_columns}
FROM agent_calls WHERE run_id = %(run_id)s ORDER BY created_at, step, idempotency_key;

-- name: take_over_agent_call
-- Compare-and-swap: a running call whose lease expired, or (when allowed) an unknown one.
UPDATE agent_calls SET
    state = 'running', fencing_token = fencing_token + 1, owner = %(owner)s,
    lease_expires_at = %(lease_expires_at)s, updated_at = %(now)s, finished_at = NULL
WHERE idempotency_key = %(key)s AND fencing_token = %(token)s
  AND ((state = 'running' AND lease_expires_at <= %(now)s)
       OR (state = 'unknown' AND %(allow_unknown)s::boolean))
RETURNING fencing_token;

-- name: start_agent_attempt
UPDATE agent_calls SET attempts = attempts + 1, lease_expires_at = %(lease_expires_at)s,
    updated_at = %(now)s
WHERE idempotency_key = %(key)s AND fencing_token = %(token)s AND state = 'running'
RETURNING attempts;

-- name: extend_agent_call_lease
-- The live claimant's heartbeat (SPEC §3 "Lease renewal", §7): fenced like finish_agent_call,
-- so once the call was taken over (another token), finished or interrupted nothing changes
-- (no row). The lease only moves forward: renewals run in threads of their own, and a late one
-- must not shorten the lease a newer one set. updated_at stays: a renewal is no change.
UPDATE agent_calls
SET lease_expires_at = greatest(lease_expires_at, %(lease_expires_at)s::float8)
WHERE idempotency_key = %(key)s AND fencing_token = %(token)s AND state = 'running';

-- name: finish_agent_call
UPDATE agent_calls SET state = %(state)s, result = %(result)s,
    result_summary = %(result_summary)s, error = %(error)s, updated_at = %(now)s,
    finished_at = %(now)s
WHERE idempotency_key = %(key)s AND fencing_token = %(token)s AND state = 'running';

-- name: interrupt_agent_calls
-- A resumed run: calls left running by a process that stopped have an unknown outcome.
UPDATE agent_calls SET state = 'unknown', updated_at = %(now)s, finished_at = %(now)s,
    error = 'interrupted: the process running this call stopped, so its outcome is unknown'
WHERE run_id = %(run_id)s AND state = 'running';
