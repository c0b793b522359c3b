-- A run's state, shared by every lease script (pasted in where a script says "-- include: lease_state", after
-- lease_run, whose functions it uses: a script sent to Redis cannot include another). Every lease script receives the job's five keys as KEYS[1..5]:
--   state (hash), active (set), slots (sorted set), runs (stream), results (sorted set).
-- The state hash holds one field per run, named by the run id, whose value is
--   status|attempt|token|runner|lease_end|fence|slot|manual|started
-- (one field, so a claim reads and writes a run in one command; lease_end is 0 for a run that never ran, and
-- minus the moment of the hand-back for a running one whose attempt handed it back; token is the attempt's, or
-- for a run closed by a claim (skipped, or given up out of attempts) that claim's), the job-wide counter
-- "fence", "since"
-- (lease_since.lua), "forgotten": the latest slot of a run that trim dropped (see lease_close), and "deferred": the
-- slots of the last keep_ms whose claims came early while another run was live and were told to come again at
-- the slot, separated by spaces (lease_claim).

-- TIME followed by writes needs effects replication: server_now asks for it.

local STATE, ACTIVE, SLOTS, RUNS, RESULTS = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]

-- A run's state as a table, read from its stored value (nil for none). Only lease_end becomes a number: the
-- other fields are mostly copied into values and replies, where a number would cost a conversion each way
-- (tonumber calls strtod, and a number joined to text is printed by sprintf); compare attempt and fence with
-- tonumber.
local function parse_run(value)
  if not value then return nil end
  local status, attempt, token, runner, lease_end, fence, slot, manual, started = string.match(value, RUN_PATTERN)
  return { status = status, attempt = attempt, token = token, runner = runner, lease_end = tonumber(lease_end),
    fence = fence, slot = slot, manual = manual, started = started }
end

-- A run's state as a table (nil when the store has none).
local function load_run(run)
  return parse_run(redis.call('HGET', STATE, run))
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
