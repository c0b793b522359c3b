-- idmp skip claim: claim a late run for the record of its skip, where the answer can tell whether the run was
-- claimed. Not once the server tracks as many idempotent ids as a producer may keep (IDMP-MAXSIZE): the run's own
-- id may have been pushed out by later runs' (the claim would win a run that ran, or is running), and a new id
-- would push out the oldest one the server keeps (a late claim of that run would win it again).
-- A claim made before the slot by an instance whose clock ran ahead is forgotten by the server that much sooner
-- than the slot's duration: its entry is looked for among those of the stream's duration before the slot.
-- KEYS[1]  the job's runs stream
-- ARGV[1]  the producer id (the job)     ARGV[2]  the run's slot (its idempotent id)     ARGV[3]  MAXLEN (~)
-- ARGV[4..] the entry's fields and values
-- returns the ID of the run's entry (this claim's, or the one of the claim that came first); false, claiming
--   nothing, when there is no stream (a store that lost it) or it tracks IDMP-MAXSIZE ids already
local key, slot = KEYS[1], ARGV[2]
if redis.call('EXISTS', key) == 0 then
  return false
end
local info = redis.call('XINFO', 'STREAM', key)
local fields = {}
for i = 1, #info, 2 do fields[info[i]] = info[i + 1] end
if tonumber(fields['iids-tracked']) >= tonumber(fields['idmp-maxsize']) then
  return false
end
local since = math.max(0, tonumber(slot) - tonumber(fields['idmp-duration']) * 1000)
for _, entry in ipairs(redis.call('XRANGE', key, since, '+')) do
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
return redis.call('XADD', key, 'NOMKSTREAM', 'IDMP', ARGV[1], slot, 'MAXLEN', '~', ARGV[3], '*', unpack(ARGV, 4))
