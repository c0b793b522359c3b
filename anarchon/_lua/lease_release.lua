-- lease release: the caller's attempt gives its run back unfinished (its scheduler is stopping), so that a
-- backup takes it over now, as the next attempt, instead of once the lease has run out. Nothing is recorded
-- here: the takeover records this attempt's end, as after a crash (or, with no attempts left, closes the run).
-- The lease end becomes minus the server's now: over, as for a crash from now on (trim gives backups keep_ms
-- from this moment), and marked handed back. A heartbeat the caller sent before this (from its heartbeat
-- thread, on another connection) that arrives after it is refused instead of taking the lease back for another
-- lease_ms, and the takeover's record says the run was handed back. Older versions read it as expired.
-- KEYS[1..5]  the job's state, active, slots, runs, results keys (see lease_state)
-- ARGV[1] run id    ARGV[2] token of the caller's attempt
-- returns 1 if released, 0 if refused (not the current attempt's token, or the run already ended)
-- include: lease_run
-- include: lease_state
local run, token = ARGV[1], ARGV[2]
local r = load_run(run)
if not r or r.status ~= 'running' or r.token ~= token then
  return 0
end
hand_back(run, r, server_now())
return 1
