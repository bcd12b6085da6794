-- saga_mark_sent: remove confirmed messages from the shard outbox.
-- KEYS[1]: the shard outbox hash. ARGV: message ids that the broker confirmed.
-- Called only after a positive publisher confirm; an entry still present after a crash is re-published
-- by the relay (its id is deterministic, so consumers see a duplicate).
-- Returns the number of entries removed.
local function saga_mark_sent(keys, args)
  if #args == 0 then return 0 end
  local removed = 0
  for i = 1, #args, 1000 do
    removed = removed + redis.call('HDEL', keys[1], unpack(args, i, math.min(i + 999, #args)))
  end
  return removed
end
redis.register_function('saga_mark_sent', saga_mark_sent)
