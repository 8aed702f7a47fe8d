"""Passwords never reach logs, errors or reports, whatever characters they hold."""

import pytest

from ackflow.core.secrets import hide, redact

HOSTILE = ["p@ss", "a:b", "sl/ash", "pe%rcent", "ünï©ødé", "@@", "a@b:c/d%e", "x" * 200, "p'q"]


@pytest.mark.parametrize("pw", HOSTILE)
def test_amqp_url_passwords_never_leak(pw):
    for url, rest in (
        (f"amqp://app:{pw}@127.0.0.1:5672/%2F", "127.0.0.1:5672/%2F"),
        (f"amqps://app:{pw}@h/v", "@h/v"),
        (f"amqp://:{pw}@host", "@host"),
        (f"error connecting to amqp://app:{pw}@host:1/x: refused", "host:1/x: refused"),
    ):
        out = redact(url)
        assert out == url.replace(pw, "***", 1), out  # nothing of it left, the rest kept
        assert rest in out


@pytest.mark.parametrize("pw", HOSTILE)
def test_postgres_dsn_passwords_never_leak(pw):
    url = f"postgresql://app:{pw}@db.local:5432/shop"
    assert redact(url) == "postgresql://app:***@db.local:5432/shop"
    quoted = pw.replace("\\", "\\\\").replace("'", "\\'")
    out = redact(f"host=db user=app password='{quoted}' dbname=shop")
    assert pw not in out and "dbname=shop" in out
    if " " not in pw and "'" not in pw:
        out = redact(f"host=db password={pw} dbname=shop")
        assert pw not in out and "dbname=shop" in out


def test_hide_removes_a_given_secret_and_url_passwords():
    assert hide("token abc and amqp://u:p@ss@h", "abc") == "token *** and amqp://u:***@h"


def test_no_password_means_nothing_to_hide():
    assert redact("amqp://127.0.0.1:5672/%2F") == "amqp://127.0.0.1:5672/%2F"
    assert redact("postgresql://app@db/shop") == "postgresql://app@db/shop"
