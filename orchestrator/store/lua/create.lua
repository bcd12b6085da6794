-- saga_create: create a run and apply its first transition.
-- KEYS: the common layout (helpers.lua). ARGV[1]: the spec.
-- Returns {0 APPLIED, mid, revision} | {3 EXISTS} (the run already exists: a re-sent start is a duplicate).
local function saga_create(keys, args)
  local spec = cjson.decode(args[1])
  if redis.call('EXISTS', keys[1]) == 1 then
    return record_duplicate(keys, spec, nil)
  end
  redis.call('ZADD', keys[5], spec.at, spec.run_id)
  return commit(keys, spec, false)  -- no status before: the run did not exist
end
redis.register_function('saga_create', saga_create)
