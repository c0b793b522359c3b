-- What every lease script needs before anything else (pasted in where a script says "-- include: lease_run",
-- ahead of lease_state): the server's clock, the slot a run id names, and a run's state as stored (its layout
-- is described in lease_state). The claim answers its commonest cases with these alone.

-- include: server_now

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
