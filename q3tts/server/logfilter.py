"""Keep secrets out of the server's logs: uvicorn logs each request's path with its query string (the access
log for HTTP, `uvicorn.error` for WebSocket handshakes), and a browser can pass the API key only there
(`?api_key=`). `install()` adds a filter to those loggers that replaces the values of secret-looking query
parameters with `***` in every record, whatever the route."""

from __future__ import annotations

import logging
import re

# a query parameter whose name says it is a credential: its value, up to the next '&', space, quote or '#'
SECRET_PARAM = re.compile(r"([?&](?:api[_-]?key|key|token|access[_-]?token|auth|password|secret)=)[^&\s\"'#]*",
                          re.IGNORECASE)
LOGGERS = ("uvicorn.access", "uvicorn.error")


def redact(text: str) -> str:
    return SECRET_PARAM.sub(r"\1***", text)


class RedactSecrets(logging.Filter):
    """Rewrites a record's message and string arguments; never drops a record."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str):
            record.msg = redact(record.msg)
        if isinstance(record.args, tuple):
            record.args = tuple(redact(a) if isinstance(a, str) else a for a in record.args)
        elif isinstance(record.args, dict):
            record.args = {k: redact(v) if isinstance(v, str) else v for k, v in record.args.items()}
        return True


def install() -> None:
    """Once per logger (idempotent); filters on a logger survive uvicorn's logging dictConfig."""
    for name in LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, RedactSecrets) for f in logger.filters):
            logger.addFilter(RedactSecrets())
