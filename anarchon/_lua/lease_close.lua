-- Ending runs: their history records, closing them, trimming the job's history. Shared by the lease scripts that
-- end runs (claim, finish, skip), pasted in after lease_run and lease_state, whose keys and functions it uses.

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
-- runs. A backup that waits to take a run over for a run_now or an earlier slot's run marks when it asked, in
-- lease_end (lease_claim): a run it still waits for is not abandoned. The rest is done, without history_ttl_ms,
-- once the finished runs are a tenth over history_size (at least one): most finishes then cost an SRANDMEMBER and
-- a ZCARD here instead of six commands.
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
      close_run(run, r, 'interrupted', now, '"abandoned: ' .. ended .. '; no instance took the run over"')
      -- Its state keeps no attempt's token: a finish of its holder that comes this late (with "interrupted")
      -- must be refused, not taken for a retry of a finish that ended the run.
      r.token = ''
      save_run(run, r)
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
