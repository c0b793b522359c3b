-- lease claim: decide who runs one run of a job; the answers follow the documented flowchart.
-- KEYS[1..5]  the job's state, active, slots, runs, results keys (see lease_state)
-- ARGV[1]  run id: the slot (epoch ms) for a scheduled run, "m<slot>-<tag>" for a manual one
-- ARGV[2]  token of this attempt     ARGV[3] runner (instance id)
-- ARGV[4]  lease_ms                  ARGV[5] max_attempts
-- ARGV[6]  overlap: "1" allowed; "0" forbidden; "wait" forbidden, and a run with no state yet, claimed while another
--          run of the job holds a live lease, waits for it ("running") instead of being skipped: a catch-up's claim
--          of a slot gone by, which runs the slots it missed one after another
-- ARGV[7]  history_size              ARGV[8] keep_ms               ARGV[9] history_ttl_ms ("0": none)
-- returns "<answer> <attempt> <fence> <lease_ms_left>" (one string: a client reads it faster than an array), and
--   " given-up" after a "done" when this claim gave the run up: its attempts were used up (recorded interrupted);
--              also to a copy of that claim sent again (its answer was lost), so that the instance says so
--   "won"      the caller runs it: a new attempt was stored (or the caller's own token already holds it,
--              when a claim whose reply was lost is retried: its lease renewed, with the next fence, as nobody
--              heard its first); lease_ms_left is its lease. Such a retry whose lease
--              ran out while another run of the job went live is "running".
--   "running"  another attempt holds a live lease, or (overlap forbidden) the run's lease expired but another
--              run of the job holds a live one; lease_ms_left says when to try again (the caller is a backup)
--              A scheduled run claimed before its slot by the server's clock, while another run of the job
--              holds a live lease and overlap is forbidden, is "running" with attempt 0: lease_ms_left says when
--              to claim it again (at its slot); nothing is stored for it but its slot in "deferred". So is one
--              claimed while the live run is of a later slot, begun early (again when that run's lease ends).
--              Or it is a catch-up's claim ("wait"): attempt 0, lease_ms_left says when that run's lease ends.
--   "overlap"  another run of the job holds a live lease and overlap is forbidden: recorded as skipped-overlap;
--              also to a copy of that claim sent again (its answer was lost), with the lease left of a run live
--              now (0 if none)
--   "done"     the run finished, was skipped, or used up its attempts (then it was recorded as interrupted),
--              or trim has forgotten it: its slot is not after the job's "forgotten" slot (attempt and fence 0),
--              or the caller's own attempt has handed it back (this is a copy of its claim that came late)
-- include: lease_run
local run, token, runner, lease_ms_text = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
-- The run's state, the job's fence counter and its "forgotten" slot (see lease_state): one read.
local fields = redis.call('HMGET', KEYS[1], run, 'fence', 'forgotten')
local now -- the server's ms (TIME), read once where needed

-- Start attempt `attempt` (text) of the run of `slot` (manual: "1" or "0"): a runs entry, the run's state, the
-- job's next fence. Claims stay short: trimming (of the runs stream too) is left to finish, which follows every
-- won claim.
local function start(attempt, fence_counter, slot, manual)
  local entry = redis.call('XADD', KEYS[4], '*', 'run', run, 'slot', slot, 'attempt', attempt, 'token', token,
    'runner', runner)
  -- The attempt starts now. An id of sequence 0 is the server's ms (nearly every claim: no TIME needed); a later
  -- sequence means the stream's last id was at or past the clock, ahead of it after the clock was set back (or a
  -- failover to a server whose clock is behind), and a lease counted from it would hold the run from backups for
  -- as long as the clock is behind.
  local started = now or string.match(entry, '^(%d+)%-0$') or server_now()
  local fence = next_fence(fence_counter, started)
  local lease_end = string.format('%d', started + lease_ms_text)
  local value = run_value('running', attempt, token, runner, lease_end, fence, slot, manual, started)
  redis.call('HSET', KEYS[1], run, value, 'fence', fence)
  if (fence_counter or '0') == '0' then
    -- The job's first attempt on this store (first deployed, or the store lost its data): a catch-up reaches back
    -- to this run's slot and no further (unless one that asked before any claim set an earlier moment), or to the
    -- server's now where that is earlier (a claim made early, by a clock ahead: see lease_since).
    redis.call('HSETNX', KEYS[1], 'since', math.min(tonumber(slot) - 1, started))
  end
  redis.call('SADD', KEYS[2], run)
  return 'won ' .. attempt .. ' ' .. fence .. ' ' .. lease_ms_text
end

-- The two commonest claims are answered before the shared functions are defined (lease_state, lease_close): Lua
-- builds each function a script defines anew on every call, and they would cost these claims a fifth more.
if not fields[1] then
  -- A run's first claim, with no other run of the job in progress or overlap allowed, starts its first attempt:
  -- nearly every claim that wins. Its slot is compared with the forgotten one as text: both are integers
  -- without leading zeros (tonumber, which calls strtod, costs more than the rest of the comparison).
  local slot, manual = run_slot(run)
  local forgotten = fields[3] or '0'
  if (#slot > #forgotten or (#slot == #forgotten and slot > forgotten))
      and (ARGV[6] == '1' or redis.call('SCARD', KEYS[2]) == 0) then
    return start('1', fields[2], slot, manual)
  end
else
  -- A backup's claim of a run another attempt holds with a live lease: where instances share jobs, every one
  -- asks for every run and all but one are told this. Read from the state's fields, with no table made.
  local status, attempt, holder, lease_end, fence = string.match(fields[1], RUN_HEAD_PATTERN)
  if status == 'running' and holder ~= token then
    now = server_now()
    if tonumber(lease_end) > now then
      return 'running ' .. attempt .. ' ' .. fence .. ' ' .. string.format('%d', lease_end - now)
    end
  end
end

-- include: lease_state

local function reply(answer, attempt, fence, lease_ms_left)
  return answer .. ' ' .. attempt .. ' ' .. fence .. ' ' .. lease_ms_left
end

local r, job_fence, forgotten = parse_run(fields[1]), tonumber(fields[2] or '0'), tonumber(fields[3] or '0')
-- include: lease_close
local lease_ms, max_attempts, overlap_allowed = tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6] == '1'
local waits_for_overlap = ARGV[6] == 'wait'
local slot, manual = run_slot(run)

-- The other run of the job whose lease, live at `now`, ends last, and that end (nil if none): when a claim that
-- waits for the job's other runs can go ahead. The same whatever order SMEMBERS lists them in (sorted for an
-- intset, hash or insertion order once a manual run id joined; ties go to the greater run id).
-- Third: whether one of the live runs is of a scheduled slot still ahead of `now` (begun early, by an instance
-- whose clock runs ahead). Fourth: whether one is of a scheduled slot later than this run's.
local function live_other(now)
  local latest, latest_end, early, later = nil, now, false, false
  for _, other in ipairs(redis.call('SMEMBERS', ACTIVE)) do
    local o = other ~= run and load_run(other)
    if o and o.lease_end > now and o.manual == '0' then
      if tonumber(o.slot) > now then early = true end
      if tonumber(o.slot) > tonumber(slot) then later = true end
    end
    if o and (o.lease_end > latest_end or (o.lease_end == latest_end and latest and other > latest)) then
      latest, latest_end = other, o.lease_end
    end
  end
  if latest then return latest, latest_end, early, later end
  return nil
end

-- Decide whether this claim starts an attempt; every other answer returns on the way.
local attempt -- the attempt this claim starts
if not r then
  if tonumber(slot) <= forgotten then -- ended long ago and forgotten: this claim comes later than keep_ms allows
    return reply('done', 0, 0, 0)
  end
  if not overlap_allowed and redis.call('SCARD', ACTIVE) > 0 then
    now = server_now()
    local other, other_end, early_other = live_other(now)
    if other and manual == '0' and (tonumber(slot) > now or early_other) then
      -- Claimed before its slot by the store's clock (the caller's clock runs ahead) while another run is live:
      -- whether one is still live when the slot comes decides, not whether one is now. The caller claims again
      -- at the slot. Or the live run is of a later slot, begun early by an instance whose clock runs a whole
      -- period or more ahead: this slot, due, is not skipped for it, but claimed again when its lease ends.
      -- Nothing is stored for the run but its slot in the job's "deferred" list (those of the last keep_ms): a
      -- late skip of it, which would close the run its early claimant is still to claim, is refused (lease_skip).
      local keep_since, deferred = now - tonumber(ARGV[8]), {}
      for other_slot in string.gmatch(redis.call('HGET', STATE, 'deferred') or '', '%d+') do
        if tonumber(other_slot) > keep_since and other_slot ~= slot then deferred[#deferred + 1] = other_slot end
      end
      deferred[#deferred + 1] = slot
      redis.call('HSET', STATE, 'deferred', table.concat(deferred, ' '))
      return reply('running', 0, 0, math.max(tonumber(slot), early_other and other_end or 0) - now)
    end
    if other and waits_for_overlap then -- nothing stored: it claims again when that lease ends
      return reply('running', 0, 0, other_end - now)
    end
    if other then
      local skipped = { status = 'skipped-overlap', attempt = 1, token = token, runner = runner, lease_end = 0,
        fence = 0, slot = slot, manual = manual, started = now }
      close_run(run, skipped, 'skipped-overlap', now, '"run ' .. other .. ' was still running"')
      -- A run that ends here has no finish to trim after it: the claim trims (as below, for one out of attempts).
      trim(now, tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9]))
      return reply('overlap', 0, 0, other_end - now)
    end
  end
  attempt = 1
else
  if r.status ~= 'running' then
    if r.token == token then
      -- A copy of the claim that closed the run (the state keeps its token), sent again after its answer was
      -- lost: told what the first was told, so that its instance says it
      if r.status == 'interrupted' then
        return reply('done', r.attempt, r.fence, 0) .. ' given-up'
      end
      if r.status == 'skipped-overlap' then
        now = server_now()
        local left = 0
        if not overlap_allowed then
          local _, other_end = live_other(now)
          if other_end then left = other_end - now end
        end
        return reply('overlap', 0, 0, left)
      end
    end
    return reply('done', r.attempt, r.fence, 0)
  end
  now = now or server_now() -- read above when another attempt holds the run
  -- The lease end of another run of the job that is live now (nil if none, or if overlap is allowed): a retried
  -- claim whose lease ran out waits for it, and so does a takeover. Such a wait marks the run asked for now
  -- (its lease end set to now, keeping a hand-back's sign): trim closes as abandoned only a run nobody asked for
  -- in keep_ms, and a backup may wait longer than that for a long run (a run_now) to end. A wait for a later
  -- slot's run does not mark it: the job has moved on, and behind a job whose runs follow each other closely such
  -- waits would never end; trim closes the run once keep_ms has passed.
  local function wait_for_live_other()
    if overlap_allowed then return nil end
    local _, lease_end, _, later = live_other(now)
    if lease_end and not later then
      r.lease_end = r.lease_end < 0 and -now or now
      save_run(run, r)
    end
    return lease_end
  end
  if r.token == token then
    -- This attempt's own claim again (the answer to the first was lost). Nobody took the run over: its lease is
    -- renewed, as a heartbeat would renew it, so that the caller can run the job: one that ran out meanwhile, and
    -- one nearly out, which the caller would give up before its first heartbeat could reach the store; unless the
    -- lease ran out and another run of the job started meanwhile and is live (overlap forbidden): the caller waits.
    if r.lease_end < 0 then -- it handed the run back since: this is an old copy of its claim, come late
      return reply('done', r.attempt, r.fence, 0)
    end
    if r.lease_end <= now then
      local live_end = wait_for_live_other()
      if live_end then
        return reply('running', r.attempt, r.fence, live_end - now)
      end
    end
    -- Nobody has heard this attempt's fence (its answer was lost), and other runs may have taken fences since, on
    -- this server or on one whose claims a failover lost: the renewed lease takes the next, so the fences its
    -- holders hear keep growing.
    local new_fence = next_fence(job_fence, now)
    r.fence = new_fence
    r.lease_end = now + lease_ms
    save_run(run, r, new_fence)
    return reply('won', r.attempt, r.fence, lease_ms)
  end
  if r.lease_end > now then
    return reply('running', r.attempt, r.fence, r.lease_end - now)
  end
  local ended = r.lease_end < 0 and 'handed back' or 'lease expired'
  if tonumber(r.attempt) >= max_attempts then
    close_run(run, r, 'interrupted', now, '"' .. ended .. '; no attempts left"')
    r.token = token -- recorded as the attempt's; kept as this claim's, for a copy of it that may come again
    save_run(run, r)
    trim(now, tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9]))
    return reply('done', r.attempt, r.fence, 0) .. ' given-up'
  end
  local live_end = wait_for_live_other()
  if live_end then -- taking the run over now would run it beside another one: wait for that one's lease
    return reply('running', r.attempt, r.fence, live_end - now)
  end
  record_result(run, r, 'interrupted', now, '"' .. ended .. '; taken over by attempt ' .. (r.attempt + 1) .. '"')
  attempt = r.attempt + 1
end

return start(tostring(attempt), fields[2], slot, manual)
