-- server time: the clock of the node that holds a job's keys. Sent as a script for its key: on a cluster the key
-- takes it to the job's node (whose clock stamps the job's stream ids), in that node's queue, where a TIME,
-- which has no key, would go to any node, in a queue of its own.
-- KEYS[1]  a key of the job (not read)
-- returns TIME's reply: { seconds, microseconds }
return redis.call('TIME')
