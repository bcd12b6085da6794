-- saga_poison: a verified message's transition failed on every delivery (a bug or corrupt state, not
-- bad input): mark the run it names failed, with the reason, so it does not wait forever. Deliberately
-- independent of the engine and of the run's other fields, which may be what is broken.
-- KEYS: the common layout (helpers.lua); only KEYS[1] (run), KEYS[2] (history) and
-- KEYS[7] (live runs) are touched.
-- ARGV[1]: {"at", "mid", "reason", "error"}.
-- Returns {0 APPLIED} | {4 NO_RUN} | {1 DUPLICATE} (the run had already ended: nothing changed).
local function saga_poison(keys, args)
  local spec = cjson.decode(args[1])
  if redis.call('EXISTS', keys[1]) == 0 then
    return {NO_RUN, ''}
  end
  local status = redis.call('HGET', keys[1], 'status')
  local detail = cjson.encode({message_id = spec.mid, error = spec.error})
  append_history(keys[2], {{'message.poisoned', '', '', detail}}, spec.at)
  if status == 'completed' or status == 'failed' then
    return {DUPLICATE, spec.mid}
  end
  if not redis.call('HGET', keys[1], 'intent') then
    redis.call('HSET', keys[1], 'intent', 'failed')
  end
  redis.call('HSET', keys[1], 'status', 'failed', 'reason', spec.reason, 'finished_at', spec.at)
  redis.call('HINCRBY', keys[1], 'rev', 1)  -- a kept copy of the record is stale now
  count_live(keys, status, 'failed')
  index_status(keys, spec, status, 'failed')
  append_history(keys[2], {{'run.failed', '', '', cjson.encode({reason = spec.reason})}}, spec.at)
  announce(keys, spec)
  return {APPLIED, spec.mid}
end
redis.register_function('saga_poison', saga_poison)
