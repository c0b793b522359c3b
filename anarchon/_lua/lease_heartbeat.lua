-- lease heartbeat: push the lease end of the caller's attempt forward.
-- KEYS[1..5]  the job's state, active, slots, runs, results keys (see lease_state)
-- ARGV[1] run id    ARGV[2] token of the caller's attempt    ARGV[3] lease_ms
-- returns the lease ms left after the extension, or 0 when refused: the token is not the current attempt's
-- (a backup took over), the run is no longer running, the attempt handed it back (a negative lease end: this
-- heartbeat was sent before the hand-back and arrived after it), or its lease has ended by the server's clock.
-- The holder has given the run up by then (it waits for a heartbeat's answer only until its lease ends, less a
-- margin): a heartbeat come that late, sent before a partition say, would bring back a lease nobody holds, which
-- blocks the job's next slot as an overlap, or runs beside a run of the job started meanwhile.
-- include: lease_run
-- include: lease_state
local run, token, lease_ms = ARGV[1], ARGV[2], tonumber(ARGV[3])
local r = load_run(run)
local now = server_now()
if not r or r.status ~= 'running' or r.token ~= token or r.lease_end <= now then
  return 0
end
r.lease_end = now + lease_ms
save_run(run, r)
return lease_ms
