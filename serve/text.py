"""Token ids -> text for the OpenAI routes: incremental detokenisation, per-token strings that join
back into the text, text offsets, and stop strings.

A token's string is the text it adds: tokens [prefix, read) were decoded, tokens [prefix, len) are
decoded again, and the difference is the new text, held back while it ends in U+FFFD (a UTF-8
character whose bytes are split over tokens: it completes with a later token). This is vLLM's
`detokenize_incrementally` scheme; decoding a short window keeps it linear in the length.
"""

REPLACEMENT = "\ufffd"
CONTEXT = 5  # prompt tokens decoded with the first completion tokens (a tokenizer may merge across the seam)


def token_pieces(tokenizer, tokens: list[int], context: list[int] = ()) -> list[str]:
    """The string each token adds to the text, given the tokens before it (`context`); they join into the text."""
    state = Pieces(tokenizer, list(context))
    state.add(tokens)
    if state.pieces:
        state.pieces[-1] += state.flush()
    return state.pieces


class Pieces:
    """Per-token strings of a growing token list (after `context`)."""

    def __init__(self, tokenizer, context: list[int]):
        self.tokenizer = tokenizer
        self.ids = list(context[-CONTEXT:])
        self.prefix, self.read = 0, len(self.ids)
        self.pieces: list[str] = []
        self.held = 0  # trailing tokens of a character still incomplete (their text comes with a later token)

    def add(self, tokens: list[int]) -> None:
        """Append tokens; every token but a held-back tail gets its string now (held ones get "" and the
        text moves to the token that completes it)."""
        for t in tokens:
            self.ids.append(int(t))
            before = self.tokenizer.decode(self.ids[self.prefix : self.read])
            after = self.tokenizer.decode(self.ids[self.prefix :])
            if after.endswith(REPLACEMENT):
                self.pieces.append("")
                self.held += 1
            elif len(after) > len(before):
                self.pieces.append(after[len(before) :])
                self.prefix, self.read, self.held = self.read, len(self.ids), 0
            else:  # a token with no text of its own (a special token)
                self.pieces.append("")
                self.held = 0

    def flush(self) -> str:
        """Text still held back at the end (an incomplete character decodes as U+FFFD): it belongs to the last token."""
        before = self.tokenizer.decode(self.ids[self.prefix : self.read])
        after = self.tokenizer.decode(self.ids[self.prefix :])
        self.prefix, self.read, self.held = len(self.ids), len(self.ids), 0
        return after[len(before) :] if len(after) > len(before) else ""


class SampleText:
    """One sample's text as it grows, with stop strings: `add` says when the text hit one.

    stop: strings ending the text at their first occurrence (found in the decoded text, so a stop string
    split over several tokens is found); include_stop: keep the stop string in the text (vLLM's
    include_stop_str_in_output). tokens/logprobs/pieces keep every token up to the one that completed the
    stop string; `text` is cut at the stop string and the pieces are cut to match, so they join into it.
    """

    def __init__(self, tokenizer, prompt: list[int], stop: list[str], include_stop: bool):
        self.pieces_state = Pieces(tokenizer, prompt)
        self.stop, self.include_stop = stop, include_stop
        self.tokens: list[int] = []
        self.logprobs: list = []
        self.pieces: list[str] = []
        self.text = ""
        self.stopped = False
        self.flushed = False

    def add(self, tokens, logprobs) -> int | None:
        """Append a round's tokens; returns how many of them to keep when a stop string ended the text, else None."""
        assert not self.stopped, "no tokens after a stop"
        for k, (t, lp) in enumerate(zip(tokens, logprobs)):
            start = len(self.text)
            self.pieces_state.add([t])
            piece = self.pieces_state.pieces[-1]
            self.tokens.append(int(t))
            self.logprobs.append(lp)
            self.pieces.append(piece)
            self.text += piece
            if self._cut(start):
                return k + 1
        return None

    def _cut(self, start: int) -> bool:
        """Look for a stop string in the text that the last piece completed; cut the text there."""
        longest = max((len(s) for s in self.stop), default=0)
        if not longest or not self.pieces[-1]:
            return False
        lo = max(0, start - longest + 1)
        hits = [(self.text.find(s, lo), s) for s in self.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return False
        at, s = min(hits)
        self._truncate(at + len(s) if self.include_stop else at)
        self.stopped = True
        return True

    def _truncate(self, length: int) -> None:
        """Cut the text to `length` characters and the pieces to match (a piece past the cut becomes "")."""
        self.text, cut, kept = self.text[:length], 0, []
        for piece in self.pieces:
            kept.append(piece[: max(0, length - cut)])
            cut += len(piece)
        self.pieces = kept

    def finish(self) -> None:
        """The sample ended (length or a stop token): the held-back tail joins the last token's string."""
        if self.flushed:
            return
        self.flushed = True
        if self.stopped or not self.pieces:
            return
        tail = self.pieces_state.flush()
        self.pieces[-1] += tail
        self.text += tail

    def safe_tokens(self, sent: int) -> int:
        """How many tokens can be streamed now: a stop string may still start in the last (longest - 1)
        characters, so those are held back until the sample stops or the text moves past them."""
        if self.stopped or self.flushed:
            return len(self.tokens)
        limit = len(self.text) - max((len(s) for s in self.stop), default=1) + 1
        end, count = 0, 0
        for piece in self.pieces:
            end += len(piece)
            if end > limit:
                break
            count += 1
        count = min(count, len(self.tokens) - self.pieces_state.held)  # a split character waits for its last token
        return max(sent, count)


def offsets(pieces: list[str], start: int = 0) -> list[int]:
    """Character offset of each piece in the joined text (OpenAI's text_offset)."""
    out = []
    for piece in pieces:
        out.append(start)
        start += len(piece)
    return out
