-- Shared by the lease scripts (prepended to claim, heartbeat, finish and skip; Lua scripts cannot include).
-- Every script that calls lease_lib receives the job's five keys as KEYS[1..5]:
--   state (hash), active (set), slots (sorted set), runs (stream), results (sorted set).
-- Per-run fields in the state hash are "<run>:<field>"; the job-wide fence counter is the field "fence".

if redis.replicate_commands then redis.replicate_commands() end -- TIME before writes; a no-op from Redis 5

local STATE, ACTIVE, SLOTS, RUNS, RESULTS = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local RUN_FIELDS = { 'attempt', 'token', 'status', 'runner', 'lease_end', 'fence', 'slot', 'manual', 'started' }

local function server_now()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function get(run, field)
  return redis.call('HGET', STATE, run .. ':' .. field)
end

-- History ordering: newest slot first, then highest attempt. Built as text because a Lua number would print
-- 15 digits in exponent form.
local function result_score(slot, attempt)
  return slot .. string.format('%02d', math.min(tonumber(attempt), 99))
end

-- One history record as JSON. Every value is a number or a name anarchon validated (no quotes possible),
-- except message, which arrives as a JSON literal encoded by the client ('null' or "…").
local function record_result(run, status, ended, message_json)
  local f = redis.call('HMGET', STATE, run .. ':slot', run .. ':attempt', run .. ':runner', run .. ':token',
    run .. ':fence', run .. ':manual', run .. ':started')
  local member = '{"run":"' .. run .. '","slot":' .. f[1] .. ',"attempt":' .. f[2] .. ',"status":"' .. status ..
    '","runner":"' .. f[3] .. '","token":"' .. f[4] .. '","fence":' .. f[5] .. ',"manual":' ..
    (f[6] == '1' and 'true' or 'false') .. ',"started":' .. f[7] .. ',"ended":' .. ended ..
    ',"message":' .. message_json .. '}'
  redis.call('ZADD', RESULTS, result_score(f[1], f[2]), member)
end

-- End a run for good: its final status in the state, out of the active set, one history record.
local function close_run(run, status, now, message_json)
  redis.call('HSET', STATE, run .. ':status', status)
  redis.call('SREM', ACTIVE, run)
  record_result(run, status, now, message_json)
end

-- Keep about history_size runs and history_ttl_ms of history. A run is dropped from the state only when it
-- is finished and older than keep_ms (the longest a late claim or a catch-up could still ask for it).
-- A run left active by instances that all died is closed as interrupted once nobody can claim it any more.
local function trim(now, history_size, keep_ms, ttl_ms)
  local horizon = now - keep_ms
  -- A few at random per call: the check stays cheap however many runs are in progress, and over many calls
  -- every abandoned run is found.
  for _, run in ipairs(redis.call('SRANDMEMBER', ACTIVE, 3)) do
    local lease_end = tonumber(get(run, 'lease_end') or '0')
    local slot = tonumber(get(run, 'slot') or '0')
    if lease_end < horizon and slot < horizon then
      close_run(run, 'interrupted', now, '"abandoned: lease expired and no instance claimed the run again"')
    end
  end
  local candidates = {}
  local excess = redis.call('ZCARD', SLOTS) - history_size
  if excess > 0 then
    candidates = redis.call('ZRANGEBYSCORE', SLOTS, '-inf', '(' .. horizon, 'LIMIT', 0, math.min(excess, 100))
  end
  if ttl_ms > 0 then
    local expired = redis.call('ZRANGEBYSCORE', SLOTS, '-inf', '(' .. math.min(now - ttl_ms, horizon),
      'LIMIT', 0, 100)
    for _, run in ipairs(expired) do candidates[#candidates + 1] = run end
  end
  for _, run in ipairs(candidates) do
    if redis.call('SISMEMBER', ACTIVE, run) == 0 then
      local fields = {}
      for i, name in ipairs(RUN_FIELDS) do fields[i] = run .. ':' .. name end
      redis.call('HDEL', STATE, unpack(fields))
      redis.call('ZREM', SLOTS, run)
    end
  end
  redis.call('ZREMRANGEBYRANK', RESULTS, 0, -(history_size + 1))
  if ttl_ms > 0 then
    local cutoff = now - ttl_ms
    redis.call('ZREMRANGEBYSCORE', RESULTS, '-inf', '(' .. cutoff .. '00')
    local old = redis.call('XRANGE', RUNS, '-', cutoff, 'COUNT', 100)
    for _, entry in ipairs(old) do redis.call('XDEL', RUNS, entry[1]) end
  end
end
