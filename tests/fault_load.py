"""Hostile traffic against a real server on loopback, for the lifecycle test (not a test module): small
requests on every route, some streamed, with clients that leave mid-stream, bodies with a bad field (some
refused only after their first prompts reached the engine), per-request timeouts too short to finish, and
a weight update in the middle. Each request's outcome is tallied; what the server's counters say is the
test's business."""

import asyncio
import collections
import json
import random

import aiohttp

# Shares of the traffic (the rest is ordinary requests).
DISCONNECT, BAD_FIELD, TIMEOUT = 0.10, 0.05, 0.05


def _prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(1, 256) for _ in range(rng.randrange(1, 24))]


def _bad_body(rng: random.Random) -> tuple[str, dict]:
    """A body with one bad field. The batch with a bad second prompt passes the HTTP checks: its first
    prompt is queued in the engine before the second is refused."""
    prompt = _prompt(rng)
    return rng.choice(
        [
            ("/generate", {"prompt": [prompt, [1, 99999]], "n": 2, "max_new_tokens": 4}),
            ("/generate", {"prompt": prompt, "temperature": "hot"}),
            ("/v1/completions", {"prompt": [prompt, [1, -5]], "max_tokens": 4, "n": 2}),
            ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "colour": "red"}),
            ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "top_p": 7}),
        ]
    )


def _body(rng: random.Random, stream: bool, timeout: float | None = None) -> tuple[str, dict]:
    n, tokens = rng.randrange(1, 4), rng.randrange(1, 9)
    if not stream and timeout is None and rng.random() < 0.5:  # /generate has no timeout field
        return "/generate", {"prompt": _prompt(rng), "n": n, "max_new_tokens": tokens}
    body = {"prompt": _prompt(rng), "n": n, "max_tokens": tokens, "stream": stream}
    if timeout is not None:
        body |= {"timeout": timeout, "max_tokens": 48}
    return "/v1/completions", body


async def _one(session, url: str, rng: random.Random) -> str:
    """Send one request of a kind drawn from rng; returns how it ended, as the client saw it."""
    draw = rng.random()
    if draw < DISCONNECT:  # read the first event of a stream, then drop the connection
        path, body = _body(rng, stream=True)
        body["max_tokens"] = 48
        async with session.post(url + path, json=body) as r:
            await r.content.readline()
            r.close()
        return "disconnected"
    if draw < DISCONNECT + BAD_FIELD:
        path, body = _bad_body(rng)
        async with session.post(url + path, json=body) as r:
            return f"bad:{r.status}"
    stream = rng.random() < 0.4
    timeout = 0.001 if draw < DISCONNECT + BAD_FIELD + TIMEOUT else None
    path, body = _body(rng, stream, timeout)
    async with session.post(url + path, json=body) as r:
        text = await r.text()
    if not stream:
        return f"{'timeout' if timeout else 'plain'}:{r.status}"
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    done = events[-1:] == ["[DONE]"]
    error = any('"error"' in e for e in events[:-1])
    return f"{'timeout' if timeout else 'stream'}:{r.status}:{'error' if error else 'ok'}:{'done' if done else 'cut'}"


async def run(url: str, admin_key: str, checkpoint: str, requests: int, concurrency: int = 24, seed: int = 0):
    """Send `requests` requests, at most `concurrency` at once, and a weight update once a third have ended.
    Returns (a Counter of outcomes, the update's status and body)."""
    rng = random.Random(seed)
    gate = asyncio.Semaphore(concurrency)
    outcomes: collections.Counter = collections.Counter()
    timeout = aiohttp.ClientTimeout(total=600)  # generous: a busy machine compiles slowly
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def guarded(r: random.Random):
            async with gate:
                outcomes[await _one(session, url, r)] += 1

        async def update():  # once a third of the requests have ended: the rest run across the swap
            while sum(outcomes.values()) < requests // 3:
                await asyncio.sleep(0.05)
            headers = {"Authorization": f"Bearer {admin_key}"}
            async with session.post(url + "/update_weights", json={"path": checkpoint}, headers=headers) as r:
                return r.status, json.loads(await r.text())

        updated = asyncio.ensure_future(update())
        await asyncio.gather(*(guarded(random.Random(rng.random())) for _ in range(requests)))
        return outcomes, await updated
