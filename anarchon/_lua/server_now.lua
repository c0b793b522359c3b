-- The server's clock in ms (TIME), pasted in where a script says "-- include: server_now".
local function server_now()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
