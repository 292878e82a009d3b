"""--redis-url: one Redis or Sentinels naming the master (ampd.state.url)."""
from __future__ import annotations

import pytest

from ampd.config import ConfigError
from ampd.state.url import SENTINEL_PORT, parse


def test_a_plain_url_is_left_to_redis_py():
    t = parse("redis://:pw@10.0.0.1:6379/2")
    assert not t.via_sentinel and t.url == "redis://:pw@10.0.0.1:6379/2"
    assert "pw" not in t.where() and "10.0.0.1:6379" in t.where()
    assert not parse("unix:///run/redis.sock").via_sentinel


def test_sentinels_master_and_db():
    t = parse("redis+sentinel://user:secret@s1:26380,s2,[::1]:26381/ampd-main/3")
    assert t.sentinels == (("s1", 26380), ("s2", SENTINEL_PORT), ("::1", 26381))
    assert (t.master, t.db, t.username, t.password) == ("ampd-main", 3, "user", "secret")
    assert "secret" not in t.where() and "s1:26380" in t.where() and "[::1]:26381" in t.where()
    t = parse("redis+sentinel://:pw@h:1/m")
    assert (t.username, t.password, t.db) == (None, "pw", 0)


@pytest.mark.parametrize("url, says", [
    ("http://h:1/0", "scheme http://"),
    ("localhost:6379", "scheme none"),
    ("redis+sentinel://h:1", "names no master"),
    ("redis+sentinel://h:1/", "names no master"),
    ("redis+sentinel://h:1/m/x", "database number"),
    ("redis+sentinel://h:1/m/0/9", "database number"),
    ("redis+sentinel://h:99999/m", "no valid port"),
    ("redis+sentinel://h:p/m", "no valid port"),
    ("redis+sentinel://h:1,,h:2/m", "empty Sentinel"),
    ("redis+sentinel://:1/m", "no host"),
    ("redis+sentinel://h:1/m?x=1", "no query"),
])
def test_malformed_urls_name_the_flag_and_the_form(url, says):
    with pytest.raises(ConfigError) as e:
        parse(url)
    assert str(e.value).startswith("--redis-url: ") and says in str(e.value)


def test_errors_never_show_the_password():
    with pytest.raises(ConfigError) as e:
        parse("redis+sentinel://u:hunter2@h:1")
    assert "hunter2" not in str(e.value)
