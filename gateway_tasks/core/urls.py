"""URLs safe to show (the same address without the credentials in it), and the Redis URL forms
the gateway reads: one server (``redis://``, ``rediss://``, ``unix://``) or a Redis Cluster
(``redis+cluster://host1:port,host2:port``, ``rediss+cluster://`` for TLS)."""

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


CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
REDIS_SCHEMES = ("redis", "rediss", "unix", *CLUSTER_SCHEMES)
TLS_SCHEMES = ("rediss", "rediss+cluster")
TLS_CERT_REQS = ("none", "optional", "required")


def is_cluster_url(url: str) -> bool:
    """Whether ``url`` names a Redis Cluster (``redis+cluster://``, ``rediss+cluster://``)."""
    return urlsplit(url).scheme in CLUSTER_SCHEMES if url else False


def cluster_nodes(url: str) -> list[tuple[str, int]]:
    """The (host, port) seed nodes of a cluster URL, in order: ``host:port`` separated by
    commas after the userinfo (``[::1]:7000`` for an IPv6 address; the port defaults to 6379).
    ValueError names what is malformed (never the credentials)."""
    hosts = urlsplit(url).netloc.rsplit("@", 1)[-1]
    nodes = []
    for item in hosts.split(","):
        item = item.strip()
        if item.startswith("["):
            host, _, rest = item[1:].partition("]")
            port_text = rest[1:] if rest.startswith(":") else rest
        else:
            host, _, port_text = item.partition(":")
        if not host or (port_text and not port_text.isdigit()) or not 0 < int(port_text or 6379) < 65536:
            raise ValueError(f"{item!r} is not host:port")
        nodes.append((host, int(port_text or 6379)))
    return nodes


def node_url(url: str, host: str, port: int) -> str:
    """A cluster URL as the single-server URL of one of its nodes (same userinfo, TLS and
    query; ``rediss+cluster`` becomes ``rediss``, the path ``/0``): what redis-py parses
    into a node's connection options."""
    parts = urlsplit(url)
    userinfo = parts.netloc.rsplit("@", 1)[0] + "@" if "@" in parts.netloc else ""
    address = f"[{host}]" if ":" in host else host
    return urlunsplit(parts._replace(scheme=parts.scheme.split("+", 1)[0],
                                     netloc=f"{userinfo}{address}:{port}", path="/0"))


def with_redis_auth_and_tls(url: str, *, username: str = "", password: str = "", ca_file: str = "",
                            cert_file: str = "", key_file: str = "", cert_reqs: str = "required") -> str:
    """A Redis URL completed with separately configured credentials (ACL user and password,
    used only when the URL has none of its own) and, for ``rediss://``, the TLS options
    (``ssl_cert_reqs``, ``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile``) the URL does not
    set already -- the one form redis-py, kombu and Celery's result backend all read.  A cluster
    URL (``rediss+cluster://``) gets the same, for every node."""
    if not url:
        return url
    parts = urlsplit(url)
    netloc, query = parts.netloc, parse_qsl(parts.query, keep_blank_values=True)
    if password and "@" not in netloc:
        user = quote(username, safe="") if username else ""
        netloc = f"{user}:{quote(password, safe='')}@{netloc}"
    if parts.scheme in TLS_SCHEMES:
        have = {k for k, _ in query}
        for key, value in (("ssl_cert_reqs", cert_reqs), ("ssl_ca_certs", ca_file),
                           ("ssl_certfile", cert_file), ("ssl_keyfile", key_file)):
            if value and key not in have:
                query.append((key, value))
    return urlunsplit(parts._replace(netloc=netloc, query=urlencode(query)))
