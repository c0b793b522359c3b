-- stream trim: trim a claim-only strategy's stream.
-- KEYS[1]  the stream
-- ARGV[1]  cutoff (epoch ms, "0": none): entries whose id's time part is below it are deleted (history_ttl_ms)
-- ARGV[2]  history_size ("0": no limit): beyond this many entries, the oldest are deleted too, but only
-- ARGV[3]  those whose id's time part is below this (epoch ms): a claim may still read a newer one back
-- returns how many entries were deleted: at most 100 per rule and call, and every record trims again. XRANGE ...
-- COUNT with XDEL instead of XTRIM MINID, which Redis 5 does not have. The stream keeps its last id (XDEL does
-- not lower it), so stream-id still refuses a slot at or below the last one claimed.
local function delete_before(ms, count)
  if ms <= 0 or count <= 0 then return 0 end
  local old = redis.call('XRANGE', KEYS[1], '-', ms - 1, 'COUNT', count)
  for _, entry in ipairs(old) do
    redis.call('XDEL', KEYS[1], entry[1])
  end
  return #old
end

local deleted = delete_before(tonumber(ARGV[1]), 100)
local size = tonumber(ARGV[2])
if size > 0 then
  deleted = deleted + delete_before(tonumber(ARGV[3]), math.min(redis.call('XLEN', KEYS[1]) - size, 100))
end
return deleted
