-- Shared by the lease scripts (prepended to claim, heartbeat, finish and skip; Lua scripts cannot include).
-- Every script that calls lease_lib receives the job's five keys as KEYS[1..5]:
--   state (hash), active (set), slots (sorted set), runs (stream), results (sorted set).
-- The state hash holds one field per run, named by the run id, whose value is
--   status|attempt|token|runner|lease_end|fence|slot|manual|started
-- (one field, so a claim reads and writes a run in one command; lease_end is 0 for a run that never ran, and
-- minus the moment of the hand-back for a running one whose attempt handed it back; token is the attempt's, or
-- for a run closed by a claim (skipped, or given up out of attempts) that claim's), the job-wide counter
-- "fence", "since"
-- (lease_since.lua), "forgotten": the latest slot of a run that trim dropped (see trim), and "deferred": the
-- slots of the last keep_ms whose claims came early while another run was live and were told to come again at
-- the slot, separated by spaces (lease_claim).

-- TIME followed by writes needs effects replication, the default from Redis 5.0 (the oldest supported).

local STATE, ACTIVE, SLOTS, RUNS, RESULTS = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local RUN_PATTERN = '^([^|]*)|([^|]*)|([^|]*)|([^|]*)|([^|]*)|([^|]*)|([^|]*)|([^|]*)|([^|]*)$'

-- The slot and the manual flag ("1"/"0") a run id carries: "<slot>" or "m<slot>-<tag>".
local function run_slot(run)
  local manual, slot = string.match(run, '^(m?)(%d+)')
  return slot, manual == 'm' and '1' or '0'
end

local function server_now()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- A run's state as a table (nil when the store has none), and with `with_fence`, the job's fence counter and
-- its "forgotten" slot: read in the same command, so that a claim costs one read.
local function load_run(run, with_fence)
  local value, fence_counter, forgotten
  if with_fence then
    local fields = redis.call('HMGET', STATE, run, 'fence', 'forgotten')
    value, fence_counter, forgotten = fields[1], tonumber(fields[2] or '0'), tonumber(fields[3] or '0')
  else
    value = redis.call('HGET', STATE, run)
  end
  if not value then return nil, fence_counter, forgotten end
  local status, attempt, token, runner, lease_end, fence, slot, manual, started = string.match(value, RUN_PATTERN)
  return { status = status, attempt = tonumber(attempt), token = token, runner = runner,
    lease_end = tonumber(lease_end), fence = tonumber(fence), slot = slot, manual = manual, started = started },
    fence_counter, forgotten
end

-- A run's state as stored.
local function run_value(status, attempt, token, runner, lease_end, fence, slot, manual, started)
  return status .. '|' .. attempt .. '|' .. token .. '|' .. runner .. '|' .. lease_end .. '|' .. fence .. '|' ..
    slot .. '|' .. manual .. '|' .. started
end

-- Write a run's state; `fence_counter`, when given, is the job's new fence counter, written in the same command.
local function save_run(run, r, fence_counter)
  local value = run_value(r.status, r.attempt, r.token, r.runner, r.lease_end, r.fence, r.slot, r.manual, r.started)
  if fence_counter then
    redis.call('HSET', STATE, run, value, 'fence', fence_counter)
  else
    redis.call('HSET', STATE, run, value)
  end
end

-- Give a running attempt's run back unfinished: its lease ends now, negated to mark it handed back (a backup's
-- next claim takes it over; a later heartbeat or copy of its claim is refused).
local function hand_back(run, r, now)
  r.lease_end = -now
  save_run(run, r)
end

-- History ordering: newest slot first, then highest attempt. Built as text because a Lua number would print
-- 15 digits in exponent form.
local function result_score(slot, attempt)
  return slot .. string.format('%02d', math.min(attempt, 99))
end

-- One history record as JSON. Every value is a number or a name anarchon validated (no quotes possible),
-- except message, which arrives as a JSON literal encoded by the client ('null' or "…").
local function record_result(run, r, status, ended, message_json)
  local member = '{"run":"' .. run .. '","slot":' .. r.slot .. ',"attempt":' .. r.attempt .. ',"status":"' ..
    status .. '","runner":"' .. r.runner .. '","token":"' .. r.token .. '","fence":' .. r.fence ..
    ',"manual":' .. (r.manual == '1' and 'true' or 'false') .. ',"started":' .. r.started .. ',"ended":' ..
    ended .. ',"message":' .. message_json .. '}'
  redis.call('ZADD', RESULTS, result_score(r.slot, r.attempt), member)
end

-- End a run for good: its final status in the state, out of the active set and into the slots set (from
-- where trim may drop it once no claim can ask for it), one history record. Its score there is its slot, or the
-- moment it ended if later: a backup that waited on a run longer than keep_ms asks for it after it ends, and must
-- find it done, not gone.
local function close_run(run, r, status, now, message_json)
  r.status = status
  save_run(run, r)
  redis.call('SREM', ACTIVE, run)
  redis.call('ZADD', SLOTS, math.max(tonumber(r.slot), now), run)
  record_result(run, r, status, now, message_json)
end

-- Keep about history_size runs and history_ttl_ms of history. A run is dropped from the state only when it
-- is finished (then it is in the slots set) and both its slot and its end are older than keep_ms (the longest a
-- late claim or a catch-up could still ask for it after its slot, or a backup's next look after its end).
-- The latest slot dropped is kept as "forgotten": a claim that comes later still (a backup cut off from the
-- store, or paused, for longer than keep_ms) finds the run gone, and is answered "done" instead of winning it
-- again. No other claim can ask for that slot: it is older than keep_ms (when every instance gives the job the
-- same keep_ms; one with a longer keep_ms is refused the slots between, though they never ran).
-- A run left active by instances that all died, or handed back when every instance stopped, is closed as
-- interrupted once nobody can claim it any more: at each trim, so that its record comes with the job's next
-- runs. The rest is done, without history_ttl_ms, once the finished runs are a tenth over history_size (at
-- least one): most finishes then cost an SRANDMEMBER and a ZCARD here instead of six commands.
local function trim(now, history_size, keep_ms, ttl_ms)
  local horizon = now - keep_ms
  -- A few at random per call: the check stays cheap however many runs are in progress, and over many calls
  -- every abandoned run is found.
  for _, run in ipairs(redis.call('SRANDMEMBER', ACTIVE, 3)) do
    local r = load_run(run)
    if not r then
      redis.call('SREM', ACTIVE, run)
    elseif math.abs(r.lease_end) < horizon and tonumber(r.slot) < horizon then
      local ended = r.lease_end < 0 and 'handed back' or 'lease expired'
      close_run(run, r, 'interrupted', now, '"abandoned: ' .. ended .. ' and no instance claimed the run again"')
    end
  end
  local slack = math.max(1, math.floor(history_size / 10))
  if ttl_ms == 0 and redis.call('ZCARD', SLOTS) <= history_size + slack then
    return
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
  if #candidates > 0 then -- most trims drop nothing: they read no "forgotten" either
    local forgotten, forgotten_slot = tonumber(redis.call('HGET', STATE, 'forgotten') or '0'), nil
    for _, run in ipairs(candidates) do
      redis.call('HDEL', STATE, run)
      redis.call('ZREM', SLOTS, run)
      local slot = run_slot(run)
      if tonumber(slot) > forgotten then forgotten, forgotten_slot = tonumber(slot), slot end
    end
    if forgotten_slot then redis.call('HSET', STATE, 'forgotten', forgotten_slot) end
  end
  redis.call('ZREMRANGEBYRANK', RESULTS, 0, -(history_size + 1))
  redis.call('XTRIM', RUNS, 'MAXLEN', '~', history_size)
  if ttl_ms > 0 then
    local cutoff = now - ttl_ms
    redis.call('ZREMRANGEBYSCORE', RESULTS, '-inf', '(' .. cutoff .. '00')
    local old = redis.call('XRANGE', RUNS, '-', cutoff, 'COUNT', 100)
    for _, entry in ipairs(old) do redis.call('XDEL', RUNS, entry[1]) end
  end
end
