-- idmp skip claim: claim a late run for the record of its skip, where the answer can tell whether the run was
-- claimed. Not once the server tracks as many idempotent ids as a producer may keep (IDMP-MAXSIZE): the run's own
-- id may have been pushed out by later runs' (the claim would win a run that ran, or is running), and a new id
-- would push out the oldest one the server keeps (a late claim of that run would win it again).
-- A claim made before the slot by an instance whose clock ran ahead is forgotten by the server that much sooner
-- than the slot's duration (the caller skips no later than a duration after the slot): it is looked for among
-- the entries of the duration before the slot whose ids the server may have forgotten, those of more than a
-- duration ago (the server forgets an id within a second after its duration). Trims keep every entry of the
-- last two durations (see idmp_trim).
-- KEYS[1]  the job's runs stream
-- ARGV[1]  the producer id (the job)     ARGV[2]  the run's slot (its idempotent id)     ARGV[3]  MINID (~)
-- ARGV[4..] the entry's fields and values
-- returns the ID of the run's entry (this claim's, or the one of the claim that came first); false, claiming
--   nothing, when there is no stream (a store that lost it), it tracks IDMP-MAXSIZE ids already, or the run's
--   duration is over
-- include: server_now
-- include: stream_info
local key, slot = KEYS[1], ARGV[2]
if redis.call('EXISTS', key) == 0 then
  return false
end
local fields = stream_info(key)
if tonumber(fields['iids-tracked']) >= tonumber(fields['idmp-maxsize']) then
  return false
end
local now = server_now()
local duration_ms = tonumber(fields['idmp-duration']) * 1000
-- Past the run's duration by the server's clock (the caller checks it a round trip earlier, or by another deploy's
-- shorter duration), the server may have forgotten the claim of a run that started on time: nothing is claimed.
if now > tonumber(slot) + duration_ms then
  return false
end
local since = math.max(0, tonumber(slot) - duration_ms)
local till = math.min(tonumber(slot), now - duration_ms + 1000)
if till >= since then
  for _, entry in ipairs(redis.call('XRANGE', key, since, till)) do
    local values = entry[2]
    for f = 1, #values, 2 do
      if values[f] == 'slot' then
        if values[f + 1] == slot then
          return entry[1]
        end
        break
      end
    end
  end
end
return redis.call('XADD', key, 'NOMKSTREAM', 'IDMP', ARGV[1], slot, 'MINID', '~', ARGV[3], '*', unpack(ARGV, 4))
