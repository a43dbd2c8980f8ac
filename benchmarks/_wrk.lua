-- Load script for benchmarks/middleware_bench.py.
-- BENCH_MODE: "none" (no key), "first" (a new key per request), "replay" (100 warmed keys).
local mode = os.getenv("BENCH_MODE") or "none"
local prefix = os.getenv("BENCH_PREFIX") or "k"
local body = '{"title":"hello","text":"a trivial post for the benchmark"}'
local counter = 0
local threads = 0

function setup(thread)
  threads = threads + 1
  thread:set("tid", threads)
end

function request()
  counter = counter + 1
  local headers = { ["Content-Type"] = "application/json" }
  if mode == "first" then
    headers["Idempotency-Key"] = prefix .. "-" .. tid .. "-" .. counter
  elseif mode == "replay" then
    headers["Idempotency-Key"] = prefix .. "-replay-" .. (counter % 100)
  end
  return wrk.format("POST", "/posts", headers, body)
end
