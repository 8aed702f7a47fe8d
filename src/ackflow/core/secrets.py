"""Keep passwords out of logs, errors, reports and metrics.

:func:`redact` hides the password of a connection string, in URL form
(``scheme://user:password@host/...``) or in libpq's ``key=value`` form
(``password=...``), and anywhere such a string appears inside a longer text.
"""

from __future__ import annotations

import re

# The password runs to the LAST "@" of the URL (URL parsers split the authority there, so
# ``amqp://app:p@ss@host`` has the password ``p@ss``); hiding too much is the safe side.
_URL_PASSWORD = re.compile(r"(?P<head>[a-zA-Z][a-zA-Z0-9+.-]*://[^:/@\s]*):(?P<pw>\S*)@")
_KV_PASSWORD = re.compile(r"(?P<head>\bpassword\s*=\s*)(?P<pw>'(?:[^'\\]|\\.)*'|\S+)", re.I)


def redact(text: str) -> str:
    """``text`` with every password of a connection string replaced by ``***``.

    >>> redact("amqp://app:s3cret@127.0.0.1:5672/%2F")
    'amqp://app:***@127.0.0.1:5672/%2F'
    >>> redact("amqp://app:p@ss@host/vh")
    'amqp://app:***@host/vh'
    >>> redact("host=db user=app password='a b' dbname=x")
    'host=db user=app password=*** dbname=x'
    """
    text = _URL_PASSWORD.sub(lambda m: f"{m.group('head')}:***@", text)
    return _KV_PASSWORD.sub(lambda m: f"{m.group('head')}***", text)


def hide(text: str, secret: str | None) -> str:
    """``text`` with ``secret`` (if any) and connection-string passwords replaced."""
    if secret:
        text = text.replace(secret, "***")
    return redact(text)
