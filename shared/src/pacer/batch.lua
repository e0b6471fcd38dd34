-- One `batch` call of the pacer's script from another script (the run store's fetch
-- and commit): `keys` the pacer's four keys, `cfg` its ARGV[2..15] (store.rs
-- `config_args`; the clock, ARGV[11], is `now`), `ops` the batch's ops, each an array
-- (its name, then its arguments). The replies, one per op, or nil when the pacer
-- failed (an error, a reply not understood): its ops are then as good as not made.
local function pacer_batch(keys, cfg, now, ops)
  local argv = {'batch'}
  for k = 1, #cfg do argv[k + 1] = cfg[k] end
  argv[11] = string.format('%d', now)
  for _, o in ipairs(ops) do
    for _, a in ipairs(o) do argv[#argv + 1] = a end
  end
  local ok, replies = pcall(pacer_call, keys, argv)
  if ok and type(replies) == 'table' and not replies.err then return replies end
  return nil
end
