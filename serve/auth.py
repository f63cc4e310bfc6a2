"""The admin key of POST /update_weights: the right key is always let in; wrong keys are counted and logged.

Limits keyed on the client address cannot tell the trainer from anyone else on its machine: every
local process connects from 127.0.0.1, so refusing an address after a few wrong keys let any of them
lock the trainer's weight pushes out. So the key is compared first, and the right one passes however
many wrong ones came before it. Wrong keys are counted per address over a fixed window: past the limit
they get 429 with Retry-After (a misconfigured client is told to back off), and the log names the
address and its count for each failure up to the limit, then at every power of two, so a flood of
wrong keys cannot fill the log. What resists guessing is the key's length, not the counter: a key of
32 random bytes (`python -c "import secrets; print(secrets.token_urlsafe(32))"`) cannot be guessed
at any request rate; shorter keys get a warning at start-up.
"""

import hmac
import logging
import time

from aiohttp import web

from serve.http import error_response

log = logging.getLogger("serve.rollout")

WINDOW_S, MAX_FAILURES = 60.0, 5  # wrong keys from one address per window before they get 429
MIN_KEY_CHARS = 16  # shorter keys are guessable: warned about at start-up
MAX_TRACKED = 1024  # addresses past which expired windows are dropped


class AdminAuth:
    def __init__(self, key: str):
        self.key = key.encode("utf-8", "surrogateescape")  # headers and os.environ decode bytes this way
        self.failures: dict[str, tuple[float, int]] = {}  # address -> (window start, wrong keys in it)
        if len(key) < MIN_KEY_CHARS:
            log.warning(
                "the admin key has %d characters; a key under %d can be guessed: use a random one, e.g. "
                "secrets.token_urlsafe(32)",
                len(key),
                MIN_KEY_CHARS,
            )

    def check(self, request: web.Request) -> web.Response | None:
        """None if the request carries `Authorization: Bearer <the key>` (the scheme in any case,
        RFC 7235); else the error to answer: 401, or 429 past MAX_FAILURES wrong keys from its
        address in the window."""
        scheme, _, presented = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(
            presented.strip().encode("utf-8", "surrogateescape"), self.key
        ):
            return None
        peer, now = request.remote or "?", time.monotonic()
        start, count = self.failures.get(peer, (now, 0))
        if now - start >= WINDOW_S:
            start, count = now, 0
        count += 1
        self.failures[peer] = (start, count)
        if len(self.failures) > MAX_TRACKED:
            self.failures = {p: (s, c) for p, (s, c) in self.failures.items() if now - s < WINDOW_S}
        if count <= MAX_FAILURES or count & (count - 1) == 0:
            sock = request.transport.get_extra_info("peername") if request.transport else None
            log.warning(
                "rejected admin key from %s (port %s): %d wrong keys from this address in %.0f s",
                peer,
                sock[1] if sock else "?",
                count,
                WINDOW_S,
            )
        if count <= MAX_FAILURES:
            return error_response(401, "missing or wrong admin key (Authorization: Bearer <key>)")
        retry = max(1, round(start + WINDOW_S - now))
        response = error_response(
            429,
            f"wrong admin key, {count} from {peer} in {WINDOW_S:.0f} s: retry in {retry} s (the right key is accepted)",
        )
        response.headers["Retry-After"] = str(retry)
        return response


def admin_gate(admin: AdminAuth | None, request: web.Request, what: str) -> web.Response | None:
    """The answer that refuses an admin route's request, or None to let it through: 403 when the server has no
    admin key (`what` is disabled), else the key check's 401/429."""
    if admin is None:
        return error_response(403, f"{what} are disabled: start the server with --admin-key-file or RLKJAX_ADMIN_KEY")
    return admin.check(request)
