-- stream trim: delete a stream's entries older than a cutoff (history_ttl_ms of the claim-only strategies).
-- KEYS[1]  the stream
-- ARGV[1]  the cutoff (epoch ms): entries whose id's time part is below it are deleted
-- returns how many entries were deleted: at most 100 per call, and every record trims again. XRANGE ... COUNT
-- with XDEL instead of XTRIM MINID, which Redis 5 does not have. The stream keeps its last id (XDEL does not
-- lower it), so stream-id still refuses a slot at or below the last one claimed.
local old = redis.call('XRANGE', KEYS[1], '-', tonumber(ARGV[1]) - 1, 'COUNT', 100)
for _, entry in ipairs(old) do
  redis.call('XDEL', KEYS[1], entry[1])
end
return #old
