-- Agent runs and their logical tool calls, the audit log (SPEC §7), on SQLite: the statements
-- of retrysafe.agents._store, with the names and parameters of agents.postgres.sql. Times are
-- Unix seconds (REAL) on the agent layer's clock, stored as given (:now is always given).

-- name: insert_agent_run
INSERT INTO agent_runs (id, state, max_steps, max_attempts, created_at, updated_at)
VALUES (:id, 'active', :max_steps, :max_attempts, :now, :now)
ON CONFLICT (id) DO NOTHING
RETURNING {run_columns};

-- name: get_agent_run
SELECT {run_columns}
FROM agent_runs WHERE id = :id;

-- name: lock_agent_run
-- PostgreSQL locks the run's row here to serialise the claims of one run. A claim on SQLite
-- runs in BEGIN IMMEDIATE, which holds the database's write lock already: a plain read.
SELECT id FROM agent_runs WHERE id = :run_id;

-- name: list_agent_runs
SELECT r.id, r.state, r.max_steps, r.max_attempts, r.reason, r.created_at, r.updated_at,
       (SELECT count(*) FROM agent_calls c WHERE c.run_id = r.id AND c.state <> 'refused'),
       (SELECT count(*) FROM agent_calls c WHERE c.run_id = r.id AND c.state = 'unknown')
FROM agent_runs r ORDER BY r.created_at DESC, r.id LIMIT :limit;

-- name: stop_agent_run
UPDATE agent_runs SET state = 'stopped', reason = :reason, updated_at = :now WHERE id = :id;

-- name: agent_signature_conflict
-- A call of the same tool in this run recorded under another signature (the tool changed).
SELECT idempotency_key FROM agent_calls
WHERE run_id = :run_id AND tool = :tool AND signature <> :signature LIMIT 1;

-- name: unknown_agent_call
-- An earlier logical call of the same write tool with the same arguments in this run whose
-- outcome is unknown: a new step must not send that effect again under a new key (SPEC §0:
-- a timeout means "I don't know"); the claimant joins it instead. Uses agent_calls_tool.
SELECT idempotency_key FROM agent_calls
WHERE run_id = :run_id AND tool = :tool AND kind = 'write'
  AND arguments_hash = :arguments_hash AND state = 'unknown'
ORDER BY created_at, idempotency_key LIMIT 1;

-- name: count_agent_calls
-- Logical calls recorded in the run (refusals are not calls).
SELECT count(*) FROM agent_calls WHERE run_id = :run_id AND state <> 'refused';

-- name: insert_agent_call
-- Insert if absent, in one statement: of concurrent claimants of one key exactly one gets the
-- row back; the others get no row and read the existing call.
INSERT INTO agent_calls
    (idempotency_key, run_id, step, tool, kind, signature, arguments_hash, arguments, state,
     owner, lease_expires_at, error, created_at, updated_at, finished_at)
VALUES (:key, :run_id, :step, :tool, :kind, :signature, :arguments_hash, :arguments, :state,
        :owner, :lease_expires_at, :error, :now, :now, :finished_at)
ON CONFLICT (idempotency_key) DO NOTHING
RETURNING {call_columns};

-- name: get_agent_call
SELECT {call_columns}
FROM agent_calls WHERE idempotency_key = :key;

-- name: list_agent_calls
SELECT {call_columns}
FROM agent_calls WHERE run_id = :run_id ORDER BY created_at, step, idempotency_key;

-- name: take_over_agent_call
-- Compare-and-swap: a running call whose lease expired, or (when allowed) an unknown one.
UPDATE agent_calls SET
    state = 'running', fencing_token = fencing_token + 1, owner = :owner,
    lease_expires_at = :lease_expires_at, updated_at = :now, finished_at = NULL
WHERE idempotency_key = :key AND fencing_token = :token
  AND ((state = 'running' AND lease_expires_at <= :now)
       OR (state = 'unknown' AND :allow_unknown))
RETURNING fencing_token;

-- name: start_agent_attempt
UPDATE agent_calls SET attempts = attempts + 1, lease_expires_at = :lease_expires_at,
    updated_at = :now
WHERE idempotency_key = :key AND fencing_token = :token AND state = 'running'
RETURNING attempts;

-- name: extend_agent_call_lease
-- The live claimant's heartbeat (SPEC §3 "Lease renewal", §7): fenced like finish_agent_call,
-- so once the call was taken over (another token), finished or interrupted nothing changes
-- (rowcount 0). The lease only moves forward: renewals run in threads of their own, and a late
-- one must not shorten the lease a newer one set. updated_at stays: a renewal is no change.
UPDATE agent_calls SET lease_expires_at = max(lease_expires_at, :lease_expires_at)
WHERE idempotency_key = :key AND fencing_token = :token AND state = 'running';

-- name: finish_agent_call
UPDATE agent_calls SET state = :state, result = :result, result_summary = :result_summary,
    error = :error, updated_at = :now, finished_at = :now
WHERE idempotency_key = :key AND fencing_token = :token AND state = 'running';

-- name: interrupt_agent_calls
-- A resumed run: calls left running by a process that stopped have an unknown outcome.
UPDATE agent_calls SET state = 'unknown', updated_at = :now, finished_at = :now,
    error = 'interrupted: the process running this call stopped, so its outcome is unknown'
WHERE run_id = :run_id AND state = 'running';
