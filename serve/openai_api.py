"""/v1/completions and /v1/chat/completions: OpenAI's request and response shapes (and vLLM's extensions)
over the rollout engine, non-streaming or as server-sent events.

A request becomes one engine request per prompt (n samples each); choice i*n + j is sample j of prompt i.
Each sample's text grows as the engine's rounds arrive (serve.text, through the engine's `on_tokens`
hook, on the engine thread): a stop string ends that sample in the round it appears (its tokens after the
stop are dropped; the request's other samples go on), and a stream gets every round's new text at once
(less a tail that might still become a stop string). Token logprobs are the engine's float32 values,
written as the doubles that hold them exactly; echoed prompt logprobs come from `rlkjax.score`, the
learner's own pass, over the weights that served the request.

temperature 0 is greedy (the argmax; its logprobs are those of the temperature-1 distribution). top_k, top_p,
min_p (vLLM's names) truncate the distribution tokens are drawn from; the logprobs returned stay those of the
full distribution (the learner's) unless truncated_logprobs asks for the renormalised ones. Top alternatives
(completions: logprobs=k, chat: top_logprobs=k, k <= 20) are the engine's: the k most likely ids of the same
distribution, the sampled token's entry the same bits as its own logprob. Completions give them as OpenAI's
legacy {token string: logprob} per position: an alternative's string is its id decoded alone, the sampled
token's is its string in `tokens`; when two ids have the same string the sampled token's value is kept, else
the more likely one's, and the extension `top_token_ids` lists the k ids themselves.
"""

import asyncio
import json
import logging
import time

from aiohttp import web

import rlkjax
from rlkjax.chat import ChatTemplateError
from serve.http import (
    BadRequest,
    EngineFailed,
    RequestTimeout,
    ShuttingDown,
    _fields,
    _json,
    _json_response,
    _opt,
    _prompts,
)
from serve.openai_params import CHAT_FIELDS, COMPLETION_FIELDS, Sampling, bool_field, sampling
from serve.text import SampleText, offsets, token_pieces
from serve.tool_calls import history_message, request_tools, tool_message

log = logging.getLogger("serve.rollout")


class Job:
    """One HTTP request's samples: submitted to the engine, their text followed round by round."""

    def __init__(self, server, prompts: list[list[int]], s: Sampling, seeds, seed, chat: bool, tools=(False, False)):
        self.server, self.prompts, self.s, self.seeds, self.seed, self.chat = server, prompts, s, seeds, seed, chat
        self.has_tools, self.parse_tools = tools  # the request had tools; its tool calls are parsed (chat)
        self.n = s.params.n
        tok = server.tokenizer
        self.texts = [SampleText(tok, p, s.stop, s.include_stop) for p in prompts for _ in range(s.params.n)]
        self.tops = [[] for _ in self.texts]  # per choice and token (hooked): (top ids, top logprobs) or None
        self.sent = [0] * len(self.texts)  # tokens streamed per choice
        self.closed = [False] * len(self.texts)  # its last chunk (with finish_reason) streamed
        self.requests = []
        self.queue: asyncio.Queue | None = None
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{time.time_ns():x}"
        self.created = int(time.time())
        self.prompt_logprobs: list | None = None  # per prompt, when echo asks for them
        self.prompt_tops: list | None = None  # per prompt and token: (top ids, top logprobs) or None
        self.names: dict[int, str] = {}  # an alternative's string: its id decoded alone
        self.version = None  # policy version of the weights that served the request

    # ----- running -----
    def submit(self, stream: bool):
        if stream:
            self.queue = asyncio.Queue()
            self.loop = asyncio.get_running_loop()
        if self.s.max_tokens == 0:  # echo only: nothing to sample
            return
        # The hook detokenises on the engine thread, between rounds: only for what needs the text as it grows.
        # Otherwise the text is made once the request is done, off the engine's path.
        hooked = stream or bool(self.s.stop)
        hooks = [
            lambda j, toks, lps, top, reason, i=i: self._on_tokens(i * self.n + j, toks, lps, top, reason)
            for i in range(len(self.prompts))
        ]
        self.requests = self.server.submit(self.prompts, self.s.params, self.seeds, hooks if hooked else None)
        for i, r in enumerate(self.requests):
            if self.queue is not None:
                self.server.when_done(r, lambda i=i: self.queue.put_nowait(("done", i)))

    def _on_tokens(self, choice: int, tokens, logprobs, top, reason):
        """Engine thread, after each round: grow the sample's text; stream what is safe to send (all of
        it once the engine's `reason` or a stop string ends the sample)."""
        text, tops = self.texts[choice], self.tops[choice]
        try:
            keep = text.add(tokens, [float(x) for x in logprobs])
            rows = [None] * len(tokens) if top is None else [(i.tolist(), lp.tolist()) for i, lp in zip(*top)]
            tops += rows[: len(text.tokens) - len(tops)]  # those of the tokens the text kept
        except Exception:  # a bug of ours must not end the engine thread; the response checks its tokens
            log.exception("on_tokens failed for %s choice %d", self.id, choice)
            return None
        if self.queue is not None:
            # The engine's finish reason, so a sample's last chunk goes now, not when the prompt's other
            # samples are done too; a stop string found in the text ends it as well.
            reason = "stop" if keep is not None else reason
            if reason:
                text.finish()
            sent = self.sent[choice]
            safe = len(text.tokens) if reason else text.safe_tokens(sent)
            if safe > sent or reason:
                part = (text.tokens[sent:safe], text.logprobs[sent:safe], text.pieces[sent:safe], tops[sent:safe])
                part += (reason,)
                self.sent[choice], self.closed[choice] = safe, reason is not None
                self.loop.call_soon_threadsafe(self.queue.put_nowait, ("tokens", choice, *part))
        return keep

    async def wait(self):
        await self.server.wait(self.requests, self.s.timeout)
        self._finish()
        await self._score_prompts()

    def _finish(self):
        """After the engine finished: flush each sample's text and check it holds the engine's tokens."""
        for i, r in enumerate(self.requests):
            for j, c in enumerate(r.results):
                text = self.texts[i * self.n + j]
                if not text.tokens and c.tokens and not text.stopped:  # no hook: the whole text now
                    text.add(c.tokens, c.logprobs.tolist())
                text.finish()
                assert text.tokens == c.tokens, f"the hook saw every token the engine kept: {text.tokens} {c.tokens}"
        versions = {c.policy_version for r in self.requests for c in r.results} or {self.server.engine.policy_version}
        self.version = versions.pop() if len(versions) == 1 else None

    async def _score_prompts(self):
        """echo with logprobs: each prompt's token logprobs by the learner's pass (first token: none)."""
        if not (self.s.echo and self.s.logprobs):
            return
        engine = self.server.engine
        version, params = engine.policy_version, engine.params
        if self.version is not None and self.version != version:
            raise ShuttingDown("the weights changed before the prompt could be scored; retry")
        cfg, numerics, temp, k = (
            self.server.cfg,
            self.server.config.numerics,
            self.s.params.temperature,
            self.s.params.top_logprobs,
        )
        starts = [1] * len(self.prompts)  # every prompt token but the first has a logprob
        # One call for all the prompts: the learner's pass gives a row the same bits alone or batched.
        scored = await asyncio.to_thread(rlkjax.score, params, cfg, self.prompts, starts, temp, numerics, k)
        rows = scored if k else [(row, None, None) for row in scored]
        self.prompt_logprobs = [[None] + lps.tolist() for lps, _, _ in rows]
        self.prompt_tops = [
            [None] * (len(lps) + 1) if ids is None else [None] + list(zip(ids.tolist(), alts.tolist()))
            for lps, ids, alts in rows
        ]
        self.version = version

    # ----- response pieces -----
    def _usage(self) -> dict:
        prompt = sum(map(len, self.prompts))  # each prompt once, however many samples it has
        completion = sum(len(t.tokens) for t in self.texts)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _finish_reason(self, choice: int) -> str:
        if self.s.max_tokens == 0:
            return "length"
        reason = self.requests[choice // self.n].results[choice % self.n].finish_reason
        return "stop" if self.texts[choice].stopped else reason

    def _echo(self, i: int) -> tuple[str, list[str], list, list]:
        """Prompt i's text, token strings, logprobs and alternatives for echo."""
        pieces = token_pieces(self.server.tokenizer, self.prompts[i])
        if not self.prompt_logprobs:
            return "".join(pieces), pieces, [], []
        return "".join(pieces), pieces, self.prompt_logprobs[i], self.prompt_tops[i]

    def _result_tops(self, choice: int) -> list:
        """The engine's alternatives of a finished sample, per token: (top ids, top logprobs) or None."""
        if self.s.max_tokens == 0:
            return []
        c = self.requests[choice // self.n].results[choice % self.n]
        if c.top_ids is None:
            return [None] * len(c.tokens)
        return list(zip(c.top_ids.tolist(), c.top_logprobs.tolist()))

    def _name(self, token: int) -> str:
        if token not in self.names:
            self.names[token] = self.server.tokenizer.decode([token])
        return self.names[token]

    def _alternatives(self, token: int, piece: str, top) -> list[tuple[int, str, float]]:
        """(id, string, logprob) of a token's alternatives, most likely first: the sampled token's string is its
        piece of the text, another's its id decoded alone."""
        if top is None:
            return []
        return [(t, piece if t == token else self._name(t), lp) for t, lp in zip(*top)]

    def _top_dict(self, token: int, piece: str, top) -> dict | None:
        """OpenAI's legacy {string: logprob}: on equal strings the sampled token's value wins, else the first
        (the more likely) one's; the ids themselves are in top_token_ids."""
        if top is None:
            return None
        out = {}
        for t, name, lp in self._alternatives(token, piece, top):
            if t == token or name not in out:
                out[name] = lp
        return out

    def _text_logprobs(self, choice: int, tokens, lps, pieces, tops, start: int, echo=None) -> dict:
        """OpenAI's completion logprobs: tokens (strings that join into the text), token_logprobs, text_offset,
        top_logprobs (logprobs=k >= 1); token_ids and top_token_ids are extensions."""
        ids = list(tokens)
        if echo is not None:
            _, prompt_pieces, prompt_lps, prompt_tops = echo
            ids = self.prompts[choice // self.n] + ids
            pieces, lps, tops = prompt_pieces + pieces, prompt_lps + list(lps), prompt_tops + list(tops)
        out = {"tokens": pieces, "token_logprobs": list(lps), "text_offset": offsets(pieces, start), "token_ids": ids}
        if self.s.params.top_logprobs:
            out["top_logprobs"] = [self._top_dict(t, p, top) for t, p, top in zip(ids, pieces, tops)]
            out["top_token_ids"] = [None if top is None else top[0] for top in tops]
        return out

    def _chat_logprobs(self, tokens, lps, pieces, tops) -> dict:
        content = []
        for t, p, lp, top in zip(tokens, pieces, lps, tops):
            alts = [{"token": s, "logprob": a, "bytes": list(s.encode())} for _, s, a in self._alternatives(t, p, top)]
            content.append({"token": p, "logprob": lp, "bytes": list(p.encode()), "top_logprobs": alts})
        return {"content": content}

    def _extras(self, choice: int, choice_obj: dict) -> dict:
        if self.s.return_token_ids:  # vLLM's extension
            choice_obj["prompt_token_ids"] = self.prompts[choice // self.n]
            choice_obj["token_ids"] = self.texts[choice].tokens
        if self.version is not None:
            choice_obj["policy_version"] = self.version
        return choice_obj

    def _message(self, text: str) -> dict:
        return {"role": "assistant", "content": text} | ({"tool_calls": []} if self.has_tools else {})

    def response(self) -> dict:
        choices = []
        for k, text in enumerate(self.texts):
            reason = self._finish_reason(k)
            if self.chat:
                message, called = tool_message(text.text) if self.parse_tools else (self._message(text.text), False)
                obj = {
                    "index": k,
                    "message": message,
                    "logprobs": (
                        self._chat_logprobs(text.tokens, text.logprobs, text.pieces, self._result_tops(k))
                        if self.s.logprobs
                        else None
                    ),
                    "finish_reason": "tool_calls" if called else reason,
                }
            else:
                echo = self._echo(k // self.n) if self.s.echo else None
                head = echo[0] if echo else ""
                tops = self._result_tops(k)
                lp = (
                    self._text_logprobs(k, text.tokens, text.logprobs, text.pieces, tops, 0, echo)
                    if self.s.logprobs
                    else None
                )
                obj = {"index": k, "text": head + text.text, "logprobs": lp, "finish_reason": reason}
            choices.append(self._extras(k, obj))
        return {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.server.config.model,
            "choices": choices,
            "seed": self.seed,
            "usage": self._usage(),
        }

    # ----- streaming -----
    def _chunk(self, choices: list, usage=None) -> bytes:
        data = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.server.config.model,
            "choices": choices,
            "seed": self.seed,
        }
        if self.s.include_usage:
            data["usage"] = usage
        return b"data: " + json.dumps(data, allow_nan=False).encode() + b"\n\n"

    def _delta(self, choice: int, tokens, lps, pieces, tops, reason=None, offset=0) -> dict:
        if self.chat:
            obj = {
                "index": choice,
                "delta": {"content": "".join(pieces)} if pieces or reason is None else {},
                "logprobs": self._chat_logprobs(tokens, lps, pieces, tops) if self.s.logprobs else None,
                "finish_reason": reason,
            }
        else:
            lp = self._text_logprobs(choice, tokens, lps, pieces, tops, offset) if self.s.logprobs else None
            obj = {"index": choice, "text": "".join(pieces), "logprobs": lp, "finish_reason": reason}
        if self.s.return_token_ids:  # vLLM's extension: this chunk's token ids
            obj["token_ids"] = list(tokens)
        return obj

    async def stream(self, request: web.Request) -> web.StreamResponse:
        """Server-sent events: a chunk per engine round with every sample's new text, each sample's last chunk
        with its finish_reason in the round it ends, the usage chunk if asked, then [DONE]. A client that goes
        away cancels the sequences and frees their pages. An error after the stream began (the request's
        timeout, a shutdown's deadline, an engine failure) cancels what is left and sends an error event in
        OpenAI's shape, then [DONE], as vLLM does, so clients that read until [DONE] end too."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        done, offset = set(), [0] * len(self.texts)
        deadline = None if self.s.timeout is None else time.monotonic() + self.s.timeout
        try:
            await response.prepare(request)
            await self._stream_heads(response, offset)
            while len(done) < len(self.requests):
                left = None if deadline is None else max(deadline - time.monotonic(), 0)
                try:
                    event = await asyncio.wait_for(self.queue.get(), left)
                except TimeoutError:
                    raise RequestTimeout(
                        f"the request did not finish within its timeout of {self.s.timeout:g} s"
                    ) from None
                if event[0] == "tokens":
                    _, k, tokens, lps, pieces, tops, reason = event
                    await response.write(self._chunk([self._delta(k, tokens, lps, pieces, tops, reason, offset[k])]))
                    offset[k] += sum(map(len, pieces))
                elif event[1] not in done:  # when_done may report a request twice
                    done.add(event[1])
                    await self._stream_tails(response, event[1], offset)
            if self.s.include_usage:
                await response.write(self._chunk([], self._usage()))
            await response.write(b"data: [DONE]\n\n")
        except (RequestTimeout, ShuttingDown, EngineFailed) as e:
            self.server.cancel(self.requests)
            # a shutdown or an engine failure is not a timeout: the server_error type, as their 503 and 500 have
            kind = "timeout" if isinstance(e, RequestTimeout) else "server_error"
            error = {"error": {"message": str(e), "type": kind, "param": None, "code": None}}
            await response.write(b"data: " + json.dumps(error).encode() + b"\n\ndata: [DONE]\n\n")
        except ConnectionResetError:  # the client left while we wrote: nothing to answer, nothing to log
            pass
        finally:  # whatever ended the stream (the client gone: a cancelled handler, a reset), nothing stays in flight
            if any(not r.done.is_set() for r in self.requests):
                self.server.cancel(self.requests)
            self.server.in_flight.difference_update(self.requests)
        return response

    async def _stream_heads(self, response, offset):
        """The first chunk of each sample: the assistant role (chat) or the echoed prompt (completions)."""
        if self.chat:
            heads = [
                {"index": k, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for k in range(len(self.texts))
            ]
            await response.write(self._chunk(heads))
        elif self.s.echo:
            await self._score_prompts()
            for k in range(len(self.texts)):
                echo = self._echo(k // self.n)
                lp = self._text_logprobs(k, [], [], [], [], 0, echo) if self.s.logprobs else None
                await response.write(
                    self._chunk([{"index": k, "text": echo[0], "logprobs": lp, "finish_reason": None}])
                )
                offset[k] = len(echo[0])
        if self.s.max_tokens == 0:  # nothing sampled: every sample ends here
            await response.write(
                self._chunk([self._delta(k, [], [], [], [], "length") for k in range(len(self.texts))])
            )

    async def _stream_tails(self, response, i: int, offset):
        """Prompt i's request is done: the samples whose last chunk is not out yet (cancelled ones) get it."""
        r = self.requests[i]
        self.server.check_ended([r])
        for j in range(len(r.results)):
            k = i * self.n + j
            if self.closed[k]:
                continue
            text = self.texts[k]
            text.finish()
            sent = self.sent[k]
            self.sent[k] = len(text.tokens)
            tops = self.tops[k][sent:]
            chunk = self._delta(
                k, text.tokens[sent:], text.logprobs[sent:], text.pieces[sent:], tops, self._finish_reason(k), offset[k]
            )
            await response.write(self._chunk([chunk]))


async def completions(server, request: web.Request):
    body = _fields(await _json(request, server.config.read_timeout), COMPLETION_FIELDS, {"prompt"})
    prompt = body["prompt"]
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt)):
        prompts = [server.encode(p) for p in ([prompt] if isinstance(prompt, str) else prompt)]
    else:
        prompts = _prompts(prompt)
    return await _serve(server, request, body, prompts, chat=False)


async def chat_completions(server, request: web.Request):
    body = _fields(await _json(request, server.config.read_timeout), CHAT_FIELDS, {"messages"})
    if server.chat_template is None:
        raise BadRequest(f"{server.config.model} has no chat template (tokenizer_config.json): use /v1/completions")
    messages = body["messages"]
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise BadRequest("messages must be a non-empty list of {'role': ..., 'content': ...} objects")
    rendered = []
    for i, m in enumerate(messages):
        if not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}].role must be a string")
        try:
            rendered.append(history_message(i, m))
        except BadRequest:
            raise
        except ValueError as e:
            raise BadRequest(f"messages[{i}]: {e}") from None
    tools, parse = request_tools(body)
    if parse and bool_field(body, "stream"):
        raise BadRequest(
            'tool calls are parsed in non-streamed responses only: send stream: false, or tool_choice: "none" '
            "to stream the raw text"
        )
    kwargs = _opt(body, "chat_template_kwargs", {})
    if not isinstance(kwargs, dict):
        raise BadRequest("chat_template_kwargs must be an object")
    taken = sorted(set(kwargs) & {"messages", "add_generation_prompt", "tools"})
    if taken:  # the request's own fields set these
        raise BadRequest(f"chat_template_kwargs cannot set {taken}: they are the request's messages and fields")
    try:
        add = bool_field(body, "add_generation_prompt", True)
        text = server.chat_template.render(rendered, add, tools=tools, **kwargs)
    except ChatTemplateError as e:
        raise BadRequest(str(e)) from None
    return await _serve(server, request, body, [server.encode(text)], chat=True, tools=(tools is not None, parse))


async def _serve(server, request: web.Request, body: dict, prompts: list, chat: bool, tools=(False, False)):
    if len(prompts) > server.config.max_prompts:
        raise BadRequest(f"at most {server.config.max_prompts} prompts per request, got {len(prompts)}")
    s = sampling(server, body, chat=chat, prompt_len=max(map(len, prompts), default=0))
    seeds, seed = server.seeds(body, len(prompts), s.params.n)
    job = Job(server, prompts, s, seeds, seed, chat, tools)
    job.submit(stream=s.stream)
    if s.stream:
        return await job.stream(request)
    await job.wait()
    return _json_response(job.response())
