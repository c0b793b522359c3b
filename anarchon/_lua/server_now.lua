-- The server's clock in ms (TIME), pasted in where a script says "-- include: server_now", before any command.

-- Writes after TIME (or XADD with an id of '*') need effects replication: the default from Redis 5.0, the only way
-- from 7.0 (where this call does nothing). A Redis 5 or 6 set to `lua-replicate-commands no` would refuse them
-- otherwise. (The embedded store has no such call, nor the need.)
if redis.replicate_commands then redis.replicate_commands() end

local function server_now()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
