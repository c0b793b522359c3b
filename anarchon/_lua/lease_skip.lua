-- lease skip: record that a run was skipped (claimed too late) unless some instance already claimed it.
-- KEYS[1..5]  the job's state, active, slots, runs, results keys (see lease_state)
-- ARGV[1] run id    ARGV[2] token    ARGV[3] runner    ARGV[4] status ("skipped-late")
-- ARGV[5] message as a JSON literal    ARGV[6] history_size    ARGV[7] keep_ms    ARGV[8] history_ttl_ms
-- ARGV[9] late_after_ms: the job's jitter_ms + max_late_ms
-- returns 1 if the skip was recorded, 0 if the run already had a state (claimed, finished or skipped), if
--   the server's clock is not yet late_after_ms past the slot (the caller's clock is ahead: the run is left to
--   the instances whose clocks say it is due), or if it is more than keep_ms past it (the run's state may have
--   been trimmed: no record beats a skip recorded beside a run that did run), or if it is in the job's
--   "deferred" list (an early claim of it was told to claim again at the slot, and may still: lease_claim).
--   A run the caller's own token holds (its claim won, the answer was lost, and the retry came too late to
--   start it) is handed back, as lease_release does, and 0 returned: instances that claimed it meanwhile were
--   told it was running and stand by to take it over, as after a crash. With none, trim closes it once keep_ms
--   has passed ("abandoned: handed back").
-- include: lease_run
-- include: lease_state
-- include: lease_close
local run, token = ARGV[1], ARGV[2]
local now = server_now()
local r = load_run(run)
if r then
  if r.status == 'running' and r.token == token then
    hand_back(run, r, now)
  end
  return 0
else
  local slot, manual = run_slot(run)
  if now <= tonumber(slot) + tonumber(ARGV[9]) or now > tonumber(slot) + tonumber(ARGV[7]) then
    return 0
  end
  local deferred = redis.call('HGET', STATE, 'deferred')
  if deferred and string.find(' ' .. deferred .. ' ', ' ' .. slot .. ' ', 1, true) then
    return 0 -- a claim of it came early and was told to come again at the slot (lease_claim): it may still
  end
  r = { status = ARGV[4], attempt = 1, token = token, runner = ARGV[3], lease_end = 0, fence = 0, slot = slot,
    manual = manual, started = now }
end
close_run(run, r, ARGV[4], now, ARGV[5])
trim(now, tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8]))
return 1
