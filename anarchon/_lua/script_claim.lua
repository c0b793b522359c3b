-- script claim: append a claim for a run unless the job's recent entries already hold one.
-- KEYS[1]  the job's runs stream
-- ARGV[1] slot (epoch ms)    ARGV[2] token    ARGV[3] runner    ARGV[4] window_ms
-- ARGV[5] history_size       ARGV[6] history_ttl_ms ("0": none)
-- ARGV[7] "skip" for a late skip's claim (see below), absent for a run's claim
-- returns {answer, entry id}
--   "won"   this call appended the claim, or the caller's own token already holds it (a retried claim)
--   "lost"  another token claimed the run within the window
--   "late"  (a skip's claim) the slot is more than window_ms past: nothing is claimed (the run's claim, kept while
--           its slot was in the window, may be gone)
-- Entries older than window_ms are not looked at: a claim arriving later than that wins again. A late skip's
-- claim looks further back, to window_ms before the slot: an instance whose clock runs ahead claims a slot early,
-- by up to window_ms (less jitter_ms and max_late_ms) if the window is sized for the instances' clocks, and its
-- entry is kept while the slot is inside the window (see the trim below), for as long as a skip may come.
-- TIME followed by writes needs effects replication: server_now asks for it.

-- include: server_now
local runs = KEYS[1]
local slot, token, runner = ARGV[1], ARGV[2], ARGV[3]
local window_ms, history_size, ttl_ms = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local now = server_now()
local oldest = now - window_ms
local scan_from = oldest
if ARGV[7] == 'skip' then
  scan_from = tonumber(slot) - window_ms
  if tonumber(slot) < oldest then return { 'late', '' } end
end

-- Newest first, a page at a time: the claims that lose (every instance but one claims each run) find the
-- winner's entry among the newest, and read no further; the first claim of a run reads the whole window. The
-- page after an entry starts at the id just below it (Redis 5 has no exclusive ranges).
-- Entries are written as: slot, token, runner, so fields[2] is the slot and fields[4] the token.
local from, page = '+', 8
while true do
  local entries = redis.call('XREVRANGE', runs, from, scan_from, 'COUNT', page)
  for _, entry in ipairs(entries) do
    local fields = entry[2]
    if fields[2] == slot then
      if fields[4] == token then return { 'won', entry[1] } end
      return { 'lost', entry[1] }
    end
  end
  if #entries < page then break end
  local ms, sequence = string.match(entries[#entries][1], '^(%d+)-(%d+)$')
  if sequence ~= '0' then
    from = ms .. '-' .. string.format('%d', tonumber(sequence) - 1)
  else
    from = string.format('%d', tonumber(ms) - 1) .. '-18446744073709551615'
  end
  page = 256
end
local id = redis.call('XADD', runs, '*', 'slot', slot, 'token', token, 'runner', runner)

-- Trim to about history_size entries (and history_ttl_ms), never inside the window a claim still reads, nor an
-- early claim whose slot is inside it (made at most window_ms before its slot), which a late skip's claim of the
-- slot still looks for. One made further ahead goes: kept, a clock years ahead would hold up the trim for years.
local function delete_before(cutoff, count)
  for _, entry in ipairs(redis.call('XRANGE', runs, '-', cutoff - 1, 'COUNT', count)) do
    local entry_slot = tonumber(entry[2][2])
    if entry_slot < cutoff or tonumber(string.match(entry[1], '^%d+')) < entry_slot - window_ms then
      redis.call('XDEL', runs, entry[1])
    end
  end
end
local excess = redis.call('XLEN', runs) - history_size
if excess > 0 then delete_before(oldest, math.min(excess, 100)) end
if ttl_ms > 0 then delete_before(math.min(oldest, now - ttl_ms), 100) end
return { 'won', id }
