"""/v1/completions and /v1/chat/completions: OpenAI's request and response shapes (and vLLM's extensions)
over the rollout engine, non-streaming or as server-sent events.

A request becomes one engine request per prompt (n samples each); choice i*n + j is sample j of prompt i.
The request body is read into a typed request (serve.protocol); the job talks to the engine through the
engine client (serve.engine_client) only. Each sample's text grows as the engine's rounds arrive (serve.text,
grown by the client's output generator on the event loop): a stop string ends that sample's text where it
appears and stops the sample in the engine (the tokens it sampled after the stop are dropped; the request's
other samples go on), and a stream gets every round's new text at once (less a tail that might still become
a stop string; with tools, less an unfinished <tool_call> block, whose call goes out as `tool_calls` deltas
once it closes: serve/tool_calls.py). Token logprobs are the engine's float32 values, written as the doubles
that hold them exactly; echoed prompt logprobs come from `rlkjax.score`, the learner's own pass, over the
weights that served the request.

temperature 0 is greedy (the argmax; its logprobs are those of the temperature-1 distribution). top_k, top_p,
min_p (vLLM's names) truncate the distribution tokens are drawn from; the logprobs returned stay those of the
full distribution (the learner's) unless truncated_logprobs asks for the renormalised ones. Top logprobs
(completions: logprobs=k, chat: top_logprobs=k, k <= 20) are the engine's: the k most likely ids of the same
distribution, the sampled token's entry the same bits as its own logprob. Completions give them as OpenAI's
legacy {token string: logprob} per position: a top entry's string is its id decoded alone, the sampled
token's is its string in `tokens`; when two ids have the same string the sampled token's value is kept, else
the more likely one's, and the extension `top_token_ids` lists the k ids themselves.
"""

import json
import time

from aiohttp import web

from serve.config import ServerConfig
from serve.engine_client import EngineClient, Submission
from serve.http import EngineFailed, RequestTimeout, ShuttingDown, json_response, read_json
from serve.protocol import ChatCompletionRequest, CompletionRequest, OpenAIRequest
from serve.text import SampleText, offsets, token_pieces
from serve.tool_calls import ToolCallStream, tool_message


class Job:
    """One HTTP request's samples: submitted through the engine client, their text followed as it grows."""

    def __init__(self, client: EngineClient, model: str, req: OpenAIRequest, chat: bool):
        self.client, self.model, self.req, self.chat = client, model, req, chat
        self.params = req.to_sampling_params()  # what the engine samples with (max_tokens at least 1)
        self.prompts, self.n = [list(p) for p in req.prompts], self.params.n
        tok = client.tokenizer
        self.texts = [SampleText(tok, p, list(req.stop), req.include_stop) for p in self.prompts for _ in range(self.n)]
        self.sub: Submission | None = None  # None: nothing sampled (max_tokens 0, echo only)
        self.requests = []
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{time.time_ns():x}"
        self.created = int(time.time())
        self.prompt_logprobs: list | None = None  # per prompt, when echo asks for them
        self.prompt_tops: list | None = None  # per prompt and token: (top ids, top logprobs) or None
        self.names: dict[int, str] = {}  # a top entry's string: its id decoded alone
        self.version = None  # policy version of the weights that served the request
        streams_calls = chat and req.stream and req.parse_tools
        self.call_streams = [ToolCallStream() for _ in self.texts] if streams_calls else None

    # ----- running -----
    def submit(self):
        if self.req.max_tokens == 0:  # echo only: nothing to sample
            return
        self.sub = self.client.submit(self.prompts, self.params, list(self.req.seeds), rounds=True)
        self.requests = self.sub.requests

    async def wait(self):
        """The response's stream collected: the texts grown to their ends."""
        if self.sub is not None:
            await self.client.wait(self.sub, self.req.timeout, self.texts)
        self._finish()
        await self._score_prompts()

    def _finish(self):
        """After the engine finished: check each sample's text holds the engine's tokens (up to its stop string)."""
        for i, r in enumerate(self.requests):
            for j, c in enumerate(r.results):
                text = self.texts[i * self.n + j]
                kept = c.tokens if not text.stopped else c.tokens[: len(text.tokens)]
                assert text.tokens == kept, f"the text holds every token the engine kept: {text.tokens} {c.tokens}"
        versions = {c.policy_version for r in self.requests for c in r.results} or {self.client.policy_version}
        self.version = versions.pop() if len(versions) == 1 else None

    async def _score_prompts(self):
        """echo with logprobs: each prompt's token logprobs by the learner's pass (first token: none)."""
        if not (self.req.echo and self.req.logprobs):
            return
        k = self.params.top_logprobs
        version, scored = await self.client.score(self.prompts, self.params.temperature, k, self.version)
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
        if self.req.max_tokens == 0:
            return "length"
        reason = self.requests[choice // self.n].results[choice % self.n].finish_reason
        return "stop" if self.texts[choice].stopped else reason

    def _echo(self, i: int) -> tuple[str, list[str], list, list]:
        """Prompt i's text, token strings, logprobs and top logprobs for echo."""
        pieces = token_pieces(self.client.tokenizer, self.prompts[i])
        if not self.prompt_logprobs:
            return "".join(pieces), pieces, [], []
        return "".join(pieces), pieces, self.prompt_logprobs[i], self.prompt_tops[i]

    def _result_tops(self, choice: int) -> list:
        """The engine's top logprobs of a finished sample, per token: (top ids, top logprobs) or None."""
        if self.req.max_tokens == 0:
            return []
        c, kept = self.requests[choice // self.n].results[choice % self.n], len(self.texts[choice].tokens)
        if c.top_ids is None:
            return [None] * kept
        return list(zip(c.top_ids[:kept].tolist(), c.top_logprobs[:kept].tolist()))

    def _name(self, token: int) -> str:
        if token not in self.names:
            self.names[token] = self.client.tokenizer.decode([token])
        return self.names[token]

    def _top_entries(self, token: int, piece: str, top) -> list[tuple[int, str, float]]:
        """(id, string, logprob) of a token's top logprobs, most likely first: the sampled token's string is its
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
        for t, name, lp in self._top_entries(token, piece, top):
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
        if self.params.top_logprobs:
            out["top_logprobs"] = [self._top_dict(t, p, top) for t, p, top in zip(ids, pieces, tops)]
            out["top_token_ids"] = [None if top is None else top[0] for top in tops]
        return out

    def _chat_logprobs(self, tokens, lps, pieces, tops) -> dict:
        content = []
        for t, p, lp, top in zip(tokens, pieces, lps, tops):
            alts = [{"token": s, "logprob": a, "bytes": list(s.encode())} for _, s, a in self._top_entries(t, p, top)]
            content.append({"token": p, "logprob": lp, "bytes": list(p.encode()), "top_logprobs": alts})
        return {"content": content}

    def _extras(self, choice: int, choice_obj: dict) -> dict:
        if self.req.return_token_ids:  # vLLM's extension
            choice_obj["prompt_token_ids"] = self.prompts[choice // self.n]
            choice_obj["token_ids"] = self.texts[choice].tokens
        if self.version is not None:
            choice_obj["policy_version"] = self.version
        return choice_obj

    def _message(self, text: str) -> dict:
        return {"role": "assistant", "content": text} | ({"tool_calls": []} if self.req.has_tools else {})

    def response(self) -> dict:
        choices = []
        for k, text in enumerate(self.texts):
            reason = self._finish_reason(k)
            if self.chat:
                message, called = tool_message(text.text) if self.req.parse_tools else (self._message(text.text), False)
                obj = {
                    "index": k,
                    "message": message,
                    "logprobs": (
                        self._chat_logprobs(text.tokens, text.logprobs, text.pieces, self._result_tops(k))
                        if self.req.logprobs
                        else None
                    ),
                    "finish_reason": "tool_calls" if called else reason,
                }
            else:
                echo = self._echo(k // self.n) if self.req.echo else None
                head = echo[0] if echo else ""
                tops = self._result_tops(k)
                lp = (
                    self._text_logprobs(k, text.tokens, text.logprobs, text.pieces, tops, 0, echo)
                    if self.req.logprobs
                    else None
                )
                obj = {"index": k, "text": head + text.text, "logprobs": lp, "finish_reason": reason}
            choices.append(self._extras(k, obj))
        return {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "seed": self.req.seed,
            "usage": self._usage(),
        }

    # ----- streaming -----
    def _chunk(self, choices: list, usage=None) -> bytes:
        data = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "seed": self.req.seed,
        }
        if self.req.include_usage:
            data["usage"] = usage
        return b"data: " + json.dumps(data, allow_nan=False).encode() + b"\n\n"

    def _delta(self, choice: int, tokens, lps, pieces, tops, reason=None, offset=0) -> dict:
        if self.chat:
            obj = {
                "index": choice,
                "delta": {"content": "".join(pieces)} if pieces or reason is None else {},
                "logprobs": self._chat_logprobs(tokens, lps, pieces, tops) if self.req.logprobs else None,
                "finish_reason": reason,
            }
        else:
            lp = self._text_logprobs(choice, tokens, lps, pieces, tops, offset) if self.req.logprobs else None
            obj = {"index": choice, "text": "".join(pieces), "logprobs": lp, "finish_reason": reason}
        if self.req.return_token_ids:  # vLLM's extension: this chunk's token ids
            obj["token_ids"] = list(tokens)
        return obj

    def _deltas(self, choice: int, tokens, lps, pieces, tops, reason=None, offset=0) -> list[dict]:
        """A round's chunks of one sample: one delta, or with tool calls parsed, the content, then each call
        that closed as its name and its arguments (tool_calls.py); the last chunk has the finish_reason."""
        if self.call_streams is None:
            return [self._delta(choice, tokens, lps, pieces, tops, reason, offset)]
        content, calls, released = self.call_streams[choice].add(tokens, lps, pieces, tops, reason is not None)
        chunks = []
        if content or released:  # the released tokens' logprobs go with the content they settle
            chunk = {"index": choice, "delta": {"content": content} if content else {}, "finish_reason": None}
            rows = tuple(zip(*released)) if released else ([], [], [], [])
            chunk["logprobs"] = self._chat_logprobs(*rows) if self.req.logprobs else None
            if self.req.return_token_ids:
                chunk["token_ids"] = list(rows[0])
            chunks.append(chunk)
        for index, call in calls:
            head = {"index": index, "id": call["id"], "type": "function"}
            head["function"] = {"name": call["function"]["name"], "arguments": ""}
            arguments = {"index": index, "function": {"arguments": call["function"]["arguments"]}}
            for part in (head, arguments):
                chunks.append(
                    {"index": choice, "delta": {"tool_calls": [part]}, "logprobs": None, "finish_reason": None}
                )
        if reason is not None:
            if not chunks:
                chunks.append({"index": choice, "delta": {}, "logprobs": None, "finish_reason": None})
            chunks[-1]["finish_reason"] = "tool_calls" if self.call_streams[choice].calls else reason
        return chunks

    async def stream(self, request: web.Request) -> web.StreamResponse:
        """Server-sent events: a chunk per engine round with every sample's new text, each sample's last chunk
        with its finish_reason in the round it ends, the usage chunk if asked, then [DONE]. A client that goes
        away cancels the sequences and frees their pages. An error after the stream began (the request's
        timeout, a shutdown's deadline, an engine failure) cancels what is left and sends an error event in
        OpenAI's shape, then [DONE], as vLLM does, so clients that read until [DONE] end too."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        offset = [0] * len(self.texts)
        try:
            await response.prepare(request)
            await self._stream_heads(response, offset)
            if self.sub is not None:
                async for event in self.client.outputs(self.sub, self.texts, self.req.timeout):
                    if event[0] == "tokens":
                        _, k, tokens, lps, pieces, tops, reason = event
                        for chunk in self._deltas(k, tokens, lps, pieces, tops, reason, offset[k]):
                            await response.write(self._chunk([chunk]))
                        offset[k] += sum(map(len, pieces))
            if self.req.include_usage:
                await response.write(self._chunk([], self._usage()))
            await response.write(b"data: [DONE]\n\n")
        except (RequestTimeout, ShuttingDown, EngineFailed) as e:
            self.client.cancel(self.requests)
            # a shutdown or an engine failure is not a timeout: the server_error type, as their 503 and 500 have
            kind = "timeout" if isinstance(e, RequestTimeout) else "server_error"
            error = {"error": {"message": str(e), "type": kind, "param": None, "code": None}}
            await response.write(b"data: " + json.dumps(error).encode() + b"\n\ndata: [DONE]\n\n")
        except ConnectionResetError:  # the client left while we wrote: nothing to answer, nothing to log
            pass
        finally:  # whatever ended the stream (the client gone: a cancelled handler, a reset), nothing stays in flight
            if self.sub is not None:
                self.client.release(self.sub)
        return response

    async def _stream_heads(self, response, offset):
        """The first chunk of each sample: the assistant role (chat) or the echoed prompt (completions)."""
        if self.chat:
            heads = [
                {"index": k, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for k in range(len(self.texts))
            ]
            await response.write(self._chunk(heads))
        elif self.req.echo:
            await self._score_prompts()
            for k in range(len(self.texts)):
                echo = self._echo(k // self.n)
                lp = self._text_logprobs(k, [], [], [], [], 0, echo) if self.req.logprobs else None
                await response.write(
                    self._chunk([{"index": k, "text": echo[0], "logprobs": lp, "finish_reason": None}])
                )
                offset[k] = len(echo[0])
        if self.req.max_tokens == 0:  # nothing sampled: every sample ends here
            await response.write(
                self._chunk([self._delta(k, [], [], [], [], "length") for k in range(len(self.texts))])
            )


async def completions(client: EngineClient, config: ServerConfig, request: web.Request):
    body = await read_json(request, config.read_timeout)
    req = CompletionRequest.parse(body, client.limits, client.tokenizer)
    return await _serve(client, config, request, req, chat=False)


async def chat_completions(client: EngineClient, config: ServerConfig, request: web.Request):
    body = await read_json(request, config.read_timeout)
    req = ChatCompletionRequest.parse(body, client.limits, client.tokenizer, client.chat_template, config.source.model)
    return await _serve(client, config, request, req, chat=True)


async def _serve(client: EngineClient, config: ServerConfig, request: web.Request, req: OpenAIRequest, chat: bool):
    job = Job(client, config.source.model, req, chat)
    job.submit()
    if req.stream:
        return await job.stream(request)
    await job.wait()
    return json_response(job.response())
