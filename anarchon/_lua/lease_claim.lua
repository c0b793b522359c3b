-- lease claim: decide who runs one run of a job; the answers follow the documented flowchart.
-- KEYS[1..5]  the job's state, active, slots, runs, results keys (see lease_lib)
-- ARGV[1]  run id: the slot in ms for scheduled runs, "m<ms>-<token>" for manual runs
-- ARGV[2]  slot (scheduled time, epoch ms)       ARGV[3] token of this attempt     ARGV[4] runner (instance id)
-- ARGV[5]  lease_ms                               ARGV[6] max_attempts
-- ARGV[7]  overlap allowed: "1" or "0"            ARGV[8] manual: "1" or "0"
-- ARGV[9]  history_size (caps the runs stream; the state is trimmed by finish, which follows every won claim)
-- returns {answer, attempt, fence, lease_ms_left}
--   "won"      the caller runs it: a new attempt was stored (or the caller's own token already holds it,
--              when a claim whose reply was lost is retried); lease_ms_left is its lease
--   "running"  another attempt holds a live lease; lease_ms_left says when to try again (the caller is a backup)
--   "overlap"  another run of the job holds a live lease and overlap is forbidden: recorded as skipped-overlap
--   "done"     the run finished, was skipped, or used up its attempts (then it was recorded as interrupted)
local run, slot, token, runner = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local lease_ms, max_attempts = tonumber(ARGV[5]), tonumber(ARGV[6])
local overlap_allowed, manual = ARGV[7] == '1', ARGV[8]
local now = server_now()

local function start_attempt(attempt)
  local fence = redis.call('HINCRBY', STATE, 'fence', 1)
  redis.call('HSET', STATE, run .. ':attempt', attempt, run .. ':token', token, run .. ':status', 'running',
    run .. ':runner', runner, run .. ':lease_end', now + lease_ms, run .. ':fence', fence,
    run .. ':slot', slot, run .. ':manual', manual, run .. ':started', now)
  redis.call('SADD', ACTIVE, run)
  redis.call('ZADD', SLOTS, slot, run)
  redis.call('XADD', RUNS, 'MAXLEN', '~', ARGV[9], '*', 'run', run, 'slot', slot, 'attempt', attempt,
    'token', token, 'runner', runner, 'fence', fence, 'manual', manual, 'started', now)
  return { 'won', attempt, fence, lease_ms }
end

local current = redis.call('HMGET', STATE, run .. ':status', run .. ':attempt', run .. ':token',
  run .. ':lease_end', run .. ':fence')
local status = current[1]
if not status then
  if not overlap_allowed then
    -- Any other run with a live lease blocks this one: an older run still going, or a newer one when this
    -- claim comes late. Either way the two would run at the same time.
    for _, other in ipairs(redis.call('SMEMBERS', ACTIVE)) do
      local lease_end = tonumber(get(other, 'lease_end') or '0')
      if other ~= run and lease_end > now then
        redis.call('HSET', STATE, run .. ':attempt', 1, run .. ':token', token, run .. ':runner', runner,
          run .. ':lease_end', 0, run .. ':fence', 0, run .. ':slot', slot, run .. ':manual', manual,
          run .. ':started', now)
        redis.call('ZADD', SLOTS, slot, run)
        close_run(run, 'skipped-overlap', now, '"run ' .. other .. ' was still running"')
        return { 'overlap', 0, 0, lease_end - now }
      end
    end
  end
  return start_attempt(1)
end

local attempt, lease_end, fence = tonumber(current[2]), tonumber(current[4]), tonumber(current[5])
if status ~= 'running' then
  return { 'done', attempt, fence, 0 }
end
if current[3] == token then
  return { 'won', attempt, fence, lease_end - now }
end
if lease_end > now then
  return { 'running', attempt, fence, lease_end - now }
end
if attempt >= max_attempts then
  close_run(run, 'interrupted', now, '"lease expired; no attempts left"')
  return { 'done', attempt, fence, 0 }
end
record_result(run, 'interrupted', now, '"lease expired; taken over by attempt ' .. (attempt + 1) .. '"')
return start_attempt(attempt + 1)
