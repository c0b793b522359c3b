-- stream-id skip: record the skip of a late run that no instance claimed and none can claim any more, once.
-- The caller has read the runs stream first (no entry holds the slot, one before it is still there): that stays
-- true, as the stream's ids only grow. The stream is another key, in another cluster slot: not read here.
-- KEYS[1]  the job's results sorted set
-- ARGV[1]  the run's slot (epoch ms)
-- ARGV[2]  the record (JSON), added at the slot's first result score (slot * 100 + 1, as for attempt 1)
-- returns 1 if the skip was recorded; 0 if the slot already has a result (another instance recorded the skip
--   first, with its own message)
local slot = ARGV[1]
-- Scores built as text (slot * 100 + attempt): Lua would write the number in its exponent form.
if #redis.call('ZRANGEBYSCORE', KEYS[1], slot .. '00', slot .. '99', 'LIMIT', 0, 1) > 0 then
  return 0
end
return redis.call('ZADD', KEYS[1], slot .. '01', ARGV[2])
