-- Operator actions. ARGV[1] selects one:
--   retry_dead ARGV[2]=id: a dead turn back in the queue, due now, with fresh deliveries. Returns 1, or 0 if not dead.
--   deregister ARGV[2]=identity, KEYS[Q_NKEYS+1..2] workers, info: a worker leaves (and
--     wakes another idle worker, which takes over its watch of the next due time and
--     the turns its last handlers queued). Returns 1.
local op = ARGV[1]
if op == 'retry_dead' then
  local id = ARGV[2]
  if redis.call('ZREM', Q_DEAD, id) == 0 then return 0 end
  redis.call('HDEL', Q_REASONS, id)
  local r = q_read(id)
  if not r then return 0 end
  r.deliveries = 0
  local now = q_now()
  q_schedule(id, r, now, now)
  return 1
elseif op == 'deregister' then
  redis.call('ZREM', KEYS[Q_NKEYS + 1], ARGV[2])
  redis.call('HDEL', KEYS[Q_NKEYS + 2], ARGV[2])
  local watch = redis.call('GET', Q_TIMER)
  if watch and string.match(watch, '^%-?%d+|(.*)$') == ARGV[2] then
    redis.call('DEL', Q_TIMER)
  end
  -- Its handlers may have queued turns due now with no token, counting on its
  -- own next fetch (lib.lua q_schedule, quiet); it fetches no more: one token
  -- makes another worker look (and take over the watch).
  q_wake()
  return 1
end
return redis.error_reply('unknown op ' .. op)
