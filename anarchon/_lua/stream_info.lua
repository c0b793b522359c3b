-- A stream's XINFO STREAM reply as a table of its fields (its IDMP settings among them, on Redis 8.6), pasted in
-- where a script says "-- include: stream_info".
local function stream_info(key)
  local info = redis.call('XINFO', 'STREAM', key)
  local fields = {}
  for i = 1, #info, 2 do fields[info[i]] = info[i + 1] end
  return fields
end
