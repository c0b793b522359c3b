-- idmp configure: give a job's runs stream the IDMP settings wanted, never shorter than it has, without forgetting
-- the runs it remembers.
-- KEYS[1]  the job's runs stream (made, empty, when there is none: XCFGSET needs a stream; made by an entry added
--          with IDMP, as every later one is, so that an entry added without IDMP is another strategy's: see
--          the backend's start)
-- ARGV[1]  IDMP-DURATION (s)     ARGV[2]  IDMP-MAXSIZE     ARGV[3]  the producer id (the job)
-- returns {copied, duration, max_size}: the settings the stream has now, and -1 when it had them already (nothing
--   set), else how many runs it was made to remember again.
--   A new stream gets the settings asked for. A stream that has settings keeps the longer duration and the
--   larger size of its own and those asked for: instances of two deploys may run side by side (or one of the
--   previous deploy start again), and each accepted its jobs' max_late_ms against its own duration; a shorter
--   one would make the server forget a run that an instance of the other deploy may still claim late.
--   XCFGSET clears every idempotent id a stream tracks when it changes a setting: a late claim of a run the
--   stream remembered would then win it again. So the first entry of each run among those of the longer of the two
--   durations (the newest IDMP-MAXSIZE) is added again, a copy with the run's slot as idempotent id: a late
--   claim reads the winner's token back from the copy. The originals stay, for claims reading theirs back now.
--   One script: no claim comes between the clearing and the adding.
-- include: server_now
-- include: stream_info
local key, duration, max_size, producer = KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3]
local made = redis.call('EXISTS', key) == 0
if made then
  -- Its producer id has a colon, which no job name has: it takes no place among a job's remembered runs.
  redis.call('XDEL', key, redis.call('XADD', key, 'IDMP', 'anarchon:made', 1, '*', 'created', 1))
end
local current = stream_info(key)
local old_duration, old_max_size = tonumber(current['idmp-duration']), tonumber(current['idmp-maxsize'])
if not made then
  duration, max_size = math.max(duration, old_duration), math.max(max_size, old_max_size)
end
if old_duration == duration and old_max_size == max_size then
  return { -1, duration, max_size }
end
redis.call('XCFGSET', key, 'IDMP-DURATION', duration, 'IDMP-MAXSIZE', max_size)
local now = server_now()
-- The server forgets an id up to a second after its duration
local since = now - math.max(duration, old_duration) * 1000 - 1000
local entries = redis.call('XREVRANGE', key, '+', since, 'COUNT', max_size)
local again, copied = 0, {}
for i = #entries, 1, -1 do -- oldest first
  local fields = entries[i][2]
  for f = 1, #fields, 2 do
    if fields[f] == 'slot' then
      local slot = fields[f + 1]
      if not copied[slot] then
        copied[slot] = true
        redis.call('XADD', key, 'IDMP', producer, slot, '*', unpack(fields))
        again = again + 1
      end
      break
    end
  end
end
return { again, duration, max_size }
