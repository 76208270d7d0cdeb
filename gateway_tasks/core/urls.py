"""URLs safe to show: the same address without the credentials in it."""

from __future__ import annotations

from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

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


REDIS_SCHEMES = ("redis", "rediss", "unix")
TLS_CERT_REQS = ("none", "optional", "required")


def with_redis_auth_and_tls(url: str, *, username: str = "", password: str = "", ca_file: str = "",
                            cert_file: str = "", key_file: str = "", cert_reqs: str = "required") -> str:
    """A Redis URL completed with separately configured credentials (ACL user and password,
    used only when the URL has none of its own) and, for ``rediss://``, the TLS options
    (``ssl_cert_reqs``, ``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile``) the URL does not
    set already -- the one form redis-py, kombu and Celery's result backend all read."""
    if not url:
        return url
    parts = urlsplit(url)
    netloc, query = parts.netloc, parse_qsl(parts.query, keep_blank_values=True)
    if password and "@" not in netloc:
        user = quote(username, safe="") if username else ""
        netloc = f"{user}:{quote(password, safe='')}@{netloc}"
    if parts.scheme == "rediss":
        have = {k for k, _ in query}
        for key, value in (("ssl_cert_reqs", cert_reqs), ("ssl_ca_certs", ca_file),
                           ("ssl_certfile", cert_file), ("ssl_keyfile", key_file)):
            if value and key not in have:
                query.append((key, value))
    return urlunsplit(parts._replace(netloc=netloc, query=urlencode(query)))
