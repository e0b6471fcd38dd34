-- Enqueue, idempotent by id. ARGV: id, payload, delay_ms. Returns 1, or 0 when
-- the id is already queued, in flight or dead.
local now = q_now()
if q_add(ARGV[1], ARGV[2], now + tonumber(ARGV[3]), now) then return 1 end
return 0
