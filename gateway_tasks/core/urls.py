"""URLs safe to show: the same address without the credentials in it."""

from __future__ import annotations

from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

# query parameters that carry a secret (redis-py reads ?password= and ?username=)
SECRET_QUERY_KEYS = frozenset({"password", "username", "api_key", "key", "token"})


def without_credentials(url: str) -> str:
    """``url`` without its userinfo (``user:password@``) and secret query parameters."""
    parts = urlsplit(url)
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    kept = [(k, v) for k, v in pairs if k.lower() not in SECRET_QUERY_KEYS]
    if "@" not in parts.netloc and len(kept) == len(pairs):
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[-1], query=urlencode(kept)))
