-- saga_create: create a run and apply its first transition.
-- KEYS: the common layout (helpers.lua). ARGV[1]: the spec.
-- Returns {0 APPLIED} | {3 EXISTS} (the run already exists: a re-sent start is a duplicate).
local function saga_create(keys, args)
  local spec = cjson.decode(args[1])
  if redis.call('EXISTS', keys[1]) == 1 then
    return record_duplicate(keys, spec, nil)
  end
  apply_writes(keys, spec)
  redis.call('ZADD', keys[5], spec.at, spec.run_id)
  redis.call('SADD', keys[3], spec.mid)
  append_outbox(keys[4], spec.outbox)
  append_history(keys[2], spec.history, spec.at)
  finish(keys, spec)
  return {APPLIED, spec.mid}
end
redis.register_function('saga_create', saga_create)
