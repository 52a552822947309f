"""Lua scripts run atomically inside Redis. Keys are built from the prefix passed as ARGV[1]
(see ``elastico.state.keys``: all keys share one hash tag, so one slot)."""

# ARGV[1] = key prefix, ARGV[2] = JSON Transaction (see elastico.state.store.Transaction).
# Returns nil on success or {error_kind, detail...}; on error nothing has been written.
APPLY = r"""
local p = ARGV[1]
local tx = cjson.decode(ARGV[2])
if tx.epoch ~= cjson.null then
  local cur = tonumber(redis.call('GET', p .. 'leader:epoch') or '0')
  if cur ~= tx.epoch then return {'stale_epoch', tostring(cur)} end
end
if tx.claim_request ~= cjson.null then
  local owner = redis.call('HGET', p .. 'requests', tx.claim_request[1])
  if owner then return {'duplicate', owner} end
end
for _, w in ipairs(tx.jobs) do
  local v = tonumber(redis.call('HGET', p .. 'job:' .. w.job_id, 'version') or '0')
  if v ~= w.expected_version then return {'version', w.job_id, tostring(v), tostring(w.expected_version)} end
end
local pending = {}
local order = {}
for _, d in ipairs(tx.gpus) do
  local k = p .. 'gpu:' .. d.node_id .. ':' .. string.format('%d', d.gpu_index)
  local u = pending[k]
  if not u then
    if redis.call('EXISTS', k) == 0 then return {'unknown_gpu', d.node_id .. ':' .. string.format('%d', d.gpu_index)} end
    local vals = redis.call('HMGET', k, 'share_cap', 'mem_cap', 'share_used', 'mem_used')
    u = {tonumber(vals[1] or '0'), tonumber(vals[2] or '0'), tonumber(vals[3] or '0'), tonumber(vals[4] or '0')}
    pending[k] = u
    table.insert(order, k)
  end
  u[3] = u[3] + d.share_units
  u[4] = u[4] + d.mem_mib
  if (d.share_units > 0 and u[3] > u[1]) or (d.mem_mib > 0 and u[4] > u[2]) then
    return {'capacity', d.node_id .. ':' .. string.format('%d', d.gpu_index)}
  end
end
-- every check passed: write
if tx.claim_request ~= cjson.null then
  redis.call('HSET', p .. 'requests', tx.claim_request[1], tx.claim_request[2])
end
for _, w in ipairs(tx.jobs) do
  redis.call('HSET', p .. 'job:' .. w.job_id, 'data', w.data, 'version', string.format('%d', w.new_version), 'state', w.state)
  if w.index_score ~= cjson.null then
    redis.call('ZADD', p .. 'jobs', string.format('%d', w.index_score), w.job_id)
  end
  if w.state == 'succeeded' or w.state == 'failed' or w.state == 'cancelled' then
    redis.call('SREM', p .. 'jobs:active', w.job_id)
  else
    redis.call('SADD', p .. 'jobs:active', w.job_id)
  end
end
for _, k in ipairs(order) do
  local u = pending[k]
  redis.call('HSET', k, 'share_used', string.format('%d', math.max(0, u[3])), 'mem_used', string.format('%d', math.max(0, u[4])))
end
for _, op in ipairs(tx.desired) do
  if op.data == cjson.null then
    redis.call('HDEL', p .. 'desired:' .. op.node_id, op.job_id)
  else
    redis.call('HSET', p .. 'desired:' .. op.node_id, op.job_id, op.data)
  end
  redis.call('INCR', p .. 'desired:' .. op.node_id .. ':gen')
end
for _, e in ipairs(tx.events) do
  redis.call('XADD', p .. 'events', 'MAXLEN', '~', ARGV[3], '*', 'job_id', e.job_id, 'state', e.state,
             'reason', e.reason, 'message', e.message, 'version', string.format('%d', e.version), 'time_s', e.time_s)
end
return nil
"""

# KEYS[1] = leader key, KEYS[2] = epoch key; ARGV[1] = holder, ARGV[2] = ttl ms.
# Returns the epoch when ``holder`` holds the lease after the call, nil otherwise.
ACQUIRE = r"""
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return tonumber(redis.call('GET', KEYS[2]) or '0')
end
if holder then return nil end
local e = redis.call('INCR', KEYS[2])
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return e
"""

# KEYS[1] = leader key; ARGV[1] = holder. Deletes the lease only if ``holder`` owns it.
RELEASE = r"""
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
