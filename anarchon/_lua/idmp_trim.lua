-- idmp trim: trim a job's runs stream after a record, to what the stream's own IDMP settings need kept. Those may
-- be larger than the trimming instance's (another deploy's, raised while it runs): trimmed to its own, the stream
-- would hold fewer entries than the server remembers ids, and a claim retried after its answer was lost would
-- read nothing back (told "lost", and nobody runs the run), and a deploy that raises the settings again could
-- not add the remembered runs back (see idmp_configure).
-- KEYS[1]  the job's runs stream
-- ARGV[1]  history_size     ARGV[2]  the record's end (epoch ms)     ARGV[3]  history_ttl_ms ("0": none)
-- returns the stream's length after the trim (0 when there is no stream)
local key = KEYS[1]
if redis.call('EXISTS', key) == 0 then
  return 0
end
local info = redis.call('XINFO', 'STREAM', key)
local fields = {}
for i = 1, #info, 2 do fields[info[i]] = info[i + 1] end
-- "~": whole stream nodes only, so that at least as many stay, and at most 100 nodes go in one call (the rest
-- with the next record's trim)
redis.call('XTRIM', key, 'MAXLEN', '~', math.max(tonumber(ARGV[1]), tonumber(fields['idmp-maxsize'])))
local ttl_ms = tonumber(ARGV[3])
if ttl_ms > 0 then
  -- A claim reads its run's entry back as long as the server remembers the run's id: for the stream's duration
  local kept_ms = math.max(ttl_ms, tonumber(fields['idmp-duration']) * 1000)
  redis.call('XTRIM', key, 'MINID', tonumber(ARGV[2]) - kept_ms)
end
return redis.call('XLEN', key)
