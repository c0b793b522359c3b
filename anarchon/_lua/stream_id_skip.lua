-- stream-id skip: record a late run that no instance claimed and none can claim any more, once.
-- KEYS[1]  the job's runs stream     KEYS[2]  its results sorted set
-- ARGV[1]  the run's slot (epoch ms), whose claim the stream refused: its last id is at or past <slot>-0
-- ARGV[2]  the record (JSON), added at the slot's first result score (slot * 100 + 1, as for attempt 1)
-- returns 1 if the skip was recorded; 0 if an entry holds the slot (claimed), if the stream holds no entry
--   before it (trimmed, or lost with the store's data: whether it was claimed cannot be told), or if the slot
--   already has a result (another instance recorded the skip first, with its own message)
local slot = ARGV[1]
local at_or_before = redis.call('XREVRANGE', KEYS[1], slot .. '-0', '-', 'COUNT', 1)[1]
if at_or_before == nil or at_or_before[1] == slot .. '-0' then
  return 0
end
-- Scores built as text (slot * 100 + attempt): Lua would write the number in its exponent form.
if #redis.call('ZRANGEBYSCORE', KEYS[2], slot .. '00', slot .. '99', 'LIMIT', 0, 1) > 0 then
  return 0
end
return redis.call('ZADD', KEYS[2], slot .. '01', ARGV[2])
