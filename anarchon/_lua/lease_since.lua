-- lease since: the moment from which the job's slots count for catch-up, kept in the job's state hash (field
-- "since"; slots after it count). Set by the job's first claim on the store (lease claim: just before that
-- run's slot), or by a catch-up that asks before any: to the caller's now for a job no instance ever claimed (a new
-- job has missed nothing; nor can a store that lost its data tell what ran). A job claimed on a store written
-- before claims set it gets 0: any slot of the period may have been missed.
-- KEYS[1]  the job's state key
-- ARGV[1]  now, ms since the epoch (the caller's clock, as its catch-up period is); the server's, where that is
--          earlier: a caller whose clock runs ahead would put the job's first start later than it was, and the
--          slots in between, which no instance claimed, out of every catch-up's reach
-- returns the moment, ms since the epoch
-- include: server_now
local since = redis.call('HGET', KEYS[1], 'since')
if since then
  return tonumber(since)
end
if redis.call('HEXISTS', KEYS[1], 'fence') == 1 then
  since = 0
else
  since = math.min(tonumber(ARGV[1]), server_now())
end
redis.call('HSET', KEYS[1], 'since', since)
return since
