-- idmp trim: trim a job's runs stream after a record, by the stream's own IDMP settings, which may be larger than
-- the trimming instance's (another deploy's, raised while it runs), and by the server's clock. Entries stay
-- - at least as many as the server may remember ids (IDMP-MAXSIZE), or history_size if more: a claim retried
--   after its answer was lost reads its entry back (told "lost" otherwise, and nobody runs the run), and a deploy
--   that raises the settings adds the remembered runs back from them (see idmp_configure);
-- - every entry of the last two IDMP durations: a skip's claim looks for the claim of its slot among the entries
--   of the duration before the slot, up to a duration after the slot (see idmp_skip).
-- KEYS[1]  the job's runs stream
-- ARGV[1]  history_size     ARGV[2]  history_ttl_ms ("0": none)
-- returns the stream's length after the trim (0 when there is no stream)
-- include: server_now
-- include: stream_info
local key = KEYS[1]
if redis.call('EXISTS', key) == 0 then
  return 0
end
local fields = stream_info(key)
local now = server_now()
local kept_ms = 2 * tonumber(fields['idmp-duration']) * 1000
-- The oldest entries past the count, and none of the last two durations: usually the one entry the record's
-- claim added. MINID deletes the entries whose id is below the given one: the id just after the last to go, as
-- claims sent together share a ms, and MINID of the next ms would delete them all.
local excess = tonumber(fields['length']) - math.max(tonumber(ARGV[1]), tonumber(fields['idmp-maxsize']))
if excess > 0 then
  local oldest = redis.call('XRANGE', key, '-', now - kept_ms - 1, 'COUNT', excess)
  if #oldest > 0 then
    local ms, seq = string.match(oldest[#oldest][1], '^(%d+)%-(%d+)$')
    redis.call('XTRIM', key, 'MINID', ms .. '-' .. string.format('%d', tonumber(seq) + 1))
  end
end
local ttl_ms = tonumber(ARGV[2])
if ttl_ms > 0 then
  redis.call('XTRIM', key, 'MINID', now - math.max(ttl_ms, kept_ms))
end
return redis.call('XLEN', key)
