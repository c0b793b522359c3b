-- lease skip: record that a run was skipped (claimed too late) unless some instance already claimed it.
-- KEYS[1..5]  the job's state, active, slots, runs, results keys (see lease_lib)
-- ARGV[1] run id    ARGV[2] slot    ARGV[3] token    ARGV[4] runner    ARGV[5] status ("skipped-late")
-- ARGV[6] message as a JSON literal    ARGV[7] history_size    ARGV[8] keep_ms    ARGV[9] history_ttl_ms
-- returns 1 if the skip was recorded, 0 if the run already had a state (claimed, finished or skipped)
local run, slot = ARGV[1], ARGV[2]
if get(run, 'status') then
  return 0
end
local now = server_now()
redis.call('HSET', STATE, run .. ':attempt', 1, run .. ':token', ARGV[3], run .. ':runner', ARGV[4],
  run .. ':lease_end', 0, run .. ':fence', 0, run .. ':slot', slot, run .. ':manual', '0', run .. ':started', now)
redis.call('ZADD', SLOTS, slot, run)
close_run(run, ARGV[5], now, ARGV[6])
trim(now, tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9]))
return 1
