"""Leased slots in a Redis sorted set: a bound on how many of something run at once across every
process, that a process dying cannot leak. A slot is a token scored by when its lease runs out;
taking one prunes the lapsed ones first, so the slots of a dead process come back when their
leases do (DESIGN.md §4's leases, applied to counting). Every time is Redis's own (TIME), so
processes whose clocks disagree still agree on the count.

Used by the API's open-streams quota (worker/service/quota.py) and the workers' per-endpoint
webhook bound (worker/runner/deliveries.py).
"""

from __future__ import annotations

NOW_MS = "local clock = redis.call('TIME')\nlocal now = clock[1] * 1000 + math.floor(clock[2] / 1000)\n"

# KEYS: the set. ARGV: token, limit, lease ms. Prunes lapsed slots; 1 if the slot is taken, 0 at the limit.
TAKE = (
    NOW_MS
    + """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then return 0 end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""
)

# KEYS: the set. ARGV: lease ms, tokens... Renews those of the tokens still held (XX: a lapsed one
# stays gone).
RENEW = (
    NOW_MS
    + """
local expiry = now + tonumber(ARGV[1])
for index = 2, #ARGV do redis.call('ZADD', KEYS[1], 'XX', expiry, ARGV[index]) end
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return 0
"""
)
