"""Where the shared-state Redis is: `--redis-url`, parsed, and the one place a client is built from it.

Two forms:
- ``redis://[[USER]:PASSWORD@]HOST:PORT[/DB]`` (also ``rediss://`` and ``unix://``): one Redis, as
  redis-py reads it;
- ``redis+sentinel://[[USER]:PASSWORD@]HOST[:PORT][,HOST[:PORT]...]/MASTER[/DB]``: Redis Sentinels
  (port 26379 unless given), asked for the current master of the group MASTER. Every new connection
  asks them again, so after a failover (docs/deploy.md "Redis with Sentinel") the services'
  reconnects reach the promoted replica. The credentials are the master's (and its replicas');
  the Sentinels themselves are asked without a password.

The URL is a secret (it may hold a password): errors name the addresses, never the credentials.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from ampd.config import ConfigError

__all__ = ["RedisTarget", "SENTINEL_PORT", "parse", "pool", "sync_client", "unreachable"]

SENTINEL_SCHEME = "redis+sentinel"
PLAIN_SCHEMES = ("redis", "rediss", "unix")
SENTINEL_PORT = 26379
SENTINEL_FORM = "redis+sentinel://HOST:PORT[,HOST:PORT...]/MASTER[/DB]"


@dataclass(frozen=True)
class RedisTarget:
    url: str  # as given (holds any password)
    sentinels: tuple[tuple[str, int], ...] = ()  # () for one Redis
    master: str = ""
    db: int = 0
    username: str | None = None
    password: str | None = None

    @property
    def via_sentinel(self) -> bool:
        return bool(self.sentinels)

    def where(self) -> str:
        """The addresses, without credentials, for errors and logs."""
        if self.via_sentinel:
            hosts = ", ".join(f"{_host(h)}:{p}" for h, p in self.sentinels)
            return f"Redis Sentinel {hosts} (master {self.master!r})"
        scheme, _, rest = self.url.partition("://")
        return f"Redis {scheme}://{rest.rpartition('@')[2]}"


def _host(h: str) -> str:
    return f"[{h}]" if ":" in h else h


def parse(url: str) -> RedisTarget:
    """The target of ``url``; ConfigError (naming --redis-url and the expected form) when malformed."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in (*PLAIN_SCHEMES, SENTINEL_SCHEME):
        raise ConfigError(f"--redis-url: expected redis://HOST:PORT[/DB] or {SENTINEL_FORM}, got a URL with "
                          f"scheme {scheme + '://' if sep else 'none'}")
    if scheme != SENTINEL_SCHEME:
        return RedisTarget(url)
    if "?" in rest or "#" in rest:
        raise ConfigError(f"--redis-url: a {SENTINEL_SCHEME} URL takes no query or fragment ({SENTINEL_FORM})")
    netloc, _, path = rest.partition("/")
    creds, at, hosts = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, pw = creds.partition(":")
        username, password = (user or None), (pw if colon else None)
        if not colon:  # "PASSWORD@" alone, as redis:// reads a bare user-info
            username, password = None, user
    sentinels = tuple(_hostport(h) for h in hosts.split(","))
    parts = path.split("/") if path else []
    if not parts or not parts[0]:
        raise ConfigError(f"--redis-url: names no master group after the Sentinels ({SENTINEL_FORM})")
    if len(parts) > 2 or (len(parts) == 2 and not parts[1].isdigit()):
        raise ConfigError(f"--redis-url: after the master group only a database number may follow ({SENTINEL_FORM})")
    return RedisTarget(url, sentinels, parts[0], int(parts[1]) if len(parts) == 2 else 0, username, password)


def _hostport(text: str) -> tuple[str, int]:
    if not text:
        raise ConfigError(f"--redis-url: an empty Sentinel address ({SENTINEL_FORM})")
    if text.startswith("["):  # [IPv6]:PORT
        host, close, tail = text[1:].partition("]")
        if not close or (tail and not tail.startswith(":")):
            raise ConfigError(f"--redis-url: bad Sentinel address {text!r}")
        port_text = tail[1:]
    else:
        host, _, port_text = text.partition(":")
    if not host:
        raise ConfigError(f"--redis-url: Sentinel address {text!r} has no host")
    if not port_text:
        return host, SENTINEL_PORT
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ConfigError(f"--redis-url: Sentinel address {text!r} has no valid port")
    return host, int(port_text)


def pool(target: RedisTarget, *, max_connections: int, wait_s: float, **kw):
    """An asyncio connection pool that blocks up to ``wait_s`` when all ``max_connections`` are in
    use; through Sentinel, each new connection asks the Sentinels where the master is."""
    import redis.asyncio as aioredis
    from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool

    if not target.via_sentinel:
        return aioredis.BlockingConnectionPool.from_url(target.url, max_connections=max_connections, timeout=wait_s,
                                                        **kw)

    manager = Sentinel(list(target.sentinels), sentinel_kwargs=_sentinel_kwargs(kw))
    return _blocking_sentinel_pool(SentinelConnectionPool, aioredis.BlockingConnectionPool)(target.master, manager, max_connections=max_connections, timeout=wait_s,
                                db=target.db, username=target.username, password=target.password, **kw)


@functools.cache
def _blocking_sentinel_pool(sentinel_pool: type, blocking_pool: type) -> type:
    """redis-py's Sentinel pool with the blocking pool's bound (it has none of its own): a call
    that finds every connection in use waits for one instead of failing at once."""
    return type("BlockingSentinelPool", (sentinel_pool, blocking_pool), {"__module__": __name__})


def _sentinel_kwargs(kw: dict, aio: bool = True) -> dict:
    """How each Sentinel is asked: the caller's socket timeouts, and no retry of one Sentinel (the
    client moves on to the next at once; redis-py's default retries one that is down for seconds)."""
    from redis.backoff import NoBackoff

    if aio:
        from redis.asyncio.retry import Retry
    else:
        from redis.retry import Retry

    return {**{k: v for k, v in kw.items() if k.startswith("socket_")}, "retry": Retry(NoBackoff(), 0)}


def sync_client(url: str, **kw):
    """A blocking redis-py client of ``url`` (either form)."""
    import redis
    from redis.sentinel import Sentinel

    target = parse(url)
    if not target.via_sentinel:
        return redis.Redis.from_url(url, **kw)
    return Sentinel(list(target.sentinels), sentinel_kwargs=_sentinel_kwargs(kw, aio=False)).master_for(
        target.master, db=target.db, username=target.username, password=target.password, **kw)


async def unreachable(target: RedisTarget, waited_s: float, exc: BaseException) -> ConfigError:
    """The one-line start-up error for a Redis that did not answer within ``waited_s``. Through
    Sentinel it asks each Sentinel once more, to say which part failed: no Sentinel answered, none
    knows the master group, or the master they name did not answer."""
    from redis.exceptions import AuthenticationError, ResponseError

    why = _reason(exc).split(" : ", 1)[0]
    if isinstance(exc, (AuthenticationError, ResponseError)):
        return ConfigError(f"--redis-url: {target.where()} refused the connection: {why}")
    if not target.via_sentinel:
        return ConfigError(f"--redis-url: {target.where()} did not answer within {waited_s:g} s ({why})")
    import redis.asyncio as aioredis

    silent, answered, masters = [], [], {}
    for host, port in target.sentinels:
        client = aioredis.Redis(host=host, port=port, **_sentinel_kwargs({"socket_timeout": 2.0,
                                                                          "socket_connect_timeout": 2.0}))
        try:
            addr = await client.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", target.master)
            answered.append(f"{_host(host)}:{port}")
            if addr:
                masters[f"{_host(host)}:{port}"] = ":".join(a.decode() if isinstance(a, bytes) else str(a) for a in addr)
        except Exception as e:  # noqa: BLE001 - each Sentinel's failure is reported, whatever it is
            silent.append(f"{_host(host)}:{port} ({_reason(e)})")
        finally:
            await client.aclose()
    if len(silent) == len(target.sentinels):
        return ConfigError(f"--redis-url: no Redis Sentinel answered within {waited_s:g} s: {', '.join(silent)}")
    if not masters:
        return ConfigError(f"--redis-url: the Redis Sentinels {', '.join(answered)} know no master group {target.master!r}")
    named = ", ".join(sorted(set(masters.values())))
    return ConfigError(f"--redis-url: master {target.master!r} at {named} (named by {target.where()}) did not "
                       f"answer within {waited_s:g} s ({why})")


def _reason(exc: BaseException) -> str:
    """The first line of ``exc``'s message without redis-py's "Error 111 connecting to HOST:PORT."
    (the address is named once, by the caller)."""
    text = str(exc).split("\n")[0] or type(exc).__name__
    return re.sub(r"^Error -?\d+ connecting to \S+?\. ", "", text).rstrip(".")
