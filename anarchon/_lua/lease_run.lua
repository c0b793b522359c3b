-- What every lease script needs before anything else (pasted in where a script says "-- include: lease_run",
-- ahead of lease_state): the server's clock, the slot a run id names, and a run's state as stored (its layout
-- is described in lease_state). The claim answers its commonest cases with these alone.

-- include: server_now

-- The fence of an attempt started at `started` (the server's ms), the job's fence counter being `fence_counter`
-- (text or a number; false before the job's first attempt): one more, or `started` × 1000 where that is more, as
-- it is for nearly every claim (fewer than a thousand claims of a job in a ms). So fences keep growing past a
-- store that lost the job's state (its counter starts again) or a failover that lost the latest claims, unless
-- the clock of the server they come from then is behind the one before.
local function next_fence(fence_counter, started)
  return string.format('%d', math.max((fence_counter or 0) + 1, started * 1000))
end

-- The slot and the manual flag ("1"/"0") a run id carries: "<slot>" or "m<slot>-<tag>".
local function run_slot(run)
  local manual, slot = string.match(run, '^(m?)(%d+)')
  return slot, manual == 'm' and '1' or '0'
end

local RUN_PATTERN = '^([^|]*)|([^|]*)|([^|]*)|([^|]*)|([^|]*)|([^|]*)|([^|]*)|([^|]*)|([^|]*)$'
-- Status, attempt, token, lease_end and fence alone: what a backup's claim of a running attempt answers from,
-- read with fewer strings made.
local RUN_HEAD_PATTERN = '^([^|]*)|([^|]*)|([^|]*)|[^|]*|([^|]*)|([^|]*)|'

-- A run's state as stored.
local function run_value(status, attempt, token, runner, lease_end, fence, slot, manual, started)
  return status .. '|' .. attempt .. '|' .. token .. '|' .. runner .. '|' .. lease_end .. '|' .. fence .. '|' ..
    slot .. '|' .. manual .. '|' .. started
end
