-- lease finish: record how the caller's attempt ended and release the run.
-- KEYS[1..5]  the job's state, active, slots, runs, results keys (see lease_state)
-- ARGV[1] run id    ARGV[2] token of the caller's attempt
-- ARGV[3] status: "ok" | "error" | "interrupted"    ARGV[4] message as a JSON literal ('null' or "…")
-- ARGV[5] history_size    ARGV[6] keep_ms    ARGV[7] history_ttl_ms ("0": none)
-- returns 1 if recorded, now or by an earlier try of this call whose reply was lost; 0 if refused (not the current
--   attempt's token, the run ended otherwise, or the attempt handed it back)
-- include: lease_run
-- include: lease_state
-- include: lease_close
local run, token = ARGV[1], ARGV[2]
local r = load_run(run)
if not r or r.token ~= token then
  return 0
end
if r.status ~= 'running' then
  -- A run ended with the caller's token and this status was ended by this call, tried again after its reply was
  -- lost: a takeover, a claim that gives the run up and trim's closing of an abandoned run leave no such token.
  return r.status == ARGV[3] and 1 or 0
end
if r.lease_end < 0 then -- the caller's attempt handed the run back: a backup takes it over, as its record says
  return 0
end
local now = server_now()
close_run(run, r, ARGV[3], now, ARGV[4])
trim(now, tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7]))
return 1
