-- format: read the store format, writing this version's when the store has none yet.
-- KEYS[1]  the format key ("<prefix>format")
-- ARGV[1]  the store format this version writes
-- returns the stored format as text (the caller refuses to go on if it is newer than it reads)
local stored = redis.call('GET', KEYS[1])
if not stored then
  redis.call('SET', KEYS[1], ARGV[1])
  return ARGV[1]
end
return stored
