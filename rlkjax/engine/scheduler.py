"""The rollout engine's scheduling policy, host-side only: which sequences hold a batch slot, who
owns which KV pages, who is preempted when pages run out, how the samples of a request fork from
their leader, and which rows go into each prefill call and decode round. It decides; the engine
(rlkjax.engine.engine) runs the jitted programs it asks for. No decision here changes a token or a logprob:
a sequence's bits depend only on its own prompt, seed and positions, whatever row, batch, chunk or
turn it gets. Its knobs are the engine's settings (rlkjax.engine.config).

Fair turns. Batch slots go to the group (one HTTP request's prompts, or one request) that holds the
fewest of them, earliest arrival first on a tie; within a group, started sequences (preempted, or
forks parked holding their prompt's pages) go first, then the rest in arrival order. So a request
of one sequence that arrives while a 256-sequence request fills the batch takes the next slot that
frees, rather than the slot after the other request's last sequence; and when pages run out, the
victim is the newest sequence of the group that holds the most slots, not the newcomer.
"""

from collections import Counter, deque

from rlkjax.core.checks import sample_seed
from rlkjax.core.numerics import PAGE_SIZE
from rlkjax.core.shapes import cdiv
from rlkjax.engine.config import EngineConfig
from rlkjax.engine.prefix_cache import PrefixCache
from rlkjax.engine.records import PageAllocator, Round, Sequence


class Scheduler:
    def __init__(self, config: EngineConfig):
        self.pages = (PrefixCache if config.prefix_cache else PageAllocator)(config.num_pages)
        self.config = config
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0
        self.preempted_tokens = 0  # positions whose K/V preempted sequences gave back (prefilled again on return)
        self._admissions = 0  # admission order: prefill goes oldest first, preemption takes the newest

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def started(self) -> bool:
        """Some sequence holds pages or tokens of the current weights (it must finish before a swap)."""
        return bool(self.running) or any(s.started for s in self.waiting)

    def _run(self, seq: Sequence):
        seq.admitted, self._admissions = self._admissions, self._admissions + 1
        self.running.append(seq)

    # ----- admission -----
    def admit(self, fresh: bool = True):
        """Fill free batch slots in fair turns (module docstring) while pages last. Once a sequence
        finds no pages, only those holding theirs already (parked forks) are still admitted: a
        later, smaller sequence must not take the pages the first one waits for. While a weight swap
        waits (fresh=False) only started sequences are admitted, so they finish on the weights they
        began with and the swap can happen. A sequence takes the kept pages holding its prefix first
        (rlkjax.engine.prefix_cache) and prefills only the rest."""
        held = Counter(s.request.group for s in self.running)
        queues: dict = {}
        for s in sorted(self.waiting, key=lambda s: not s.started):  # stable: arrival order otherwise
            if fresh or s.started:
                queues.setdefault(s.request.group, deque()).append(s)
        arrival = {g: min(s.request.id for s in q) for g, q in queues.items()}
        out_of_pages = False
        while queues and len(self.running) < self.config.max_batch:
            group = min(queues, key=lambda g: (held[g], arrival[g]))
            seq = queues[group].popleft()
            if not queues[group]:
                del queues[group]
            need = cdiv(len(seq.tokens), PAGE_SIZE) - len(seq.pages)  # > 0: it holds none (parked forks hold all)
            taken = ([], seq.cached) if need <= 0 else None if out_of_pages else self.pages.take(seq.tokens, need)
            if taken is None:
                out_of_pages = True
                continue
            self.waiting.remove(seq)
            seq.pages += taken[0]
            seq.cached = taken[1]  # positions a cached prefix holds already (a parked fork keeps its own)
            held[group] += 1
            self._run(seq)

    # ----- pages -----
    def grow(self, seq: Sequence, positions_needed: int):
        """Make sure seq owns pages for positions [0, positions_needed); preempt others if needed."""
        while len(seq.pages) * PAGE_SIZE < positions_needed:
            page = self.pages.alloc(1)
            if page is None:
                self._preempt(self._victim(seq))
                continue
            seq.pages += page

    def _victim(self, keep: Sequence) -> Sequence:
        """Who gives up its pages: a waiting fork holding pages first, else the newest running
        sequence of the group holding the most slots (not a newcomer that just got its turn)."""
        holding = [s for s in self.waiting if s.pages]
        if holding:
            return holding[-1]
        held = Counter(s.request.group for s in self.running)
        victim = max(
            (s for s in self.running if s is not keep), key=lambda s: (held[s.request.group], s.admitted), default=None
        )
        if victim is None:
            raise RuntimeError("KV cache too small for a single sequence")
        return victim

    def _release(self, seq: Sequence):
        """Release a leaving sequence's pages; the prefix cache keeps its full pages whose K/V is written
        (a round still in flight writes only positions from len(tokens) - 1 on)."""
        self.pages.keep(seq.tokens, seq.pages, min(seq.cached, len(seq.tokens) - 1))
        self.pages.release(seq.pages)

    def _preempt(self, seq: Sequence):
        """Free a sequence's pages; it is recomputed from its tokens when readmitted (same bits), less
        what the prefix cache still holds then."""
        self._release(seq)
        self.preempted_tokens += seq.cached
        seq.pages, seq.cached = [], 0
        if seq in self.running:
            self.running.remove(seq)
            self.waiting.appendleft(seq)
        self.preemptions += 1

    def clear(self):
        """Forget every sequence and free every page (after a failed step: the engine ended their requests)."""
        self.waiting.clear()
        self.running.clear()
        self.pages.reset()

    def drop(self, seq: Sequence):
        """A finished or cancelled sequence leaves: its slot and pages are free (a round still in
        flight may write those pages: their next users' work is queued after it)."""
        self._release(seq)
        seq.pages = []
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    # ----- forks -----
    def fork(self, leader: Sequence) -> tuple[list[int], list[int]]:
        """Start the other samples from the leader's cached prompt: full pages shared, the partial
        page holding the prompt's tail copied for each sample before anyone writes to it. Returns
        the page copies (sources, destinations) for the engine to run now. A sample with no free
        slot waits holding its pages (admitted in its group's turn, needing no new pages); one with
        no free pages waits to recompute its prompt from scratch."""
        req = leader.request
        full = leader.cached // PAGE_SIZE
        shared, tail = leader.pages[:full], leader.pages[full:]
        src, dst, parked = [], [], []
        for j in range(1, req.sampling.n):
            own = self.pages.alloc(len(tail))
            if own is None:
                self.waiting.append(Sequence(req, j, sample_seed(req.sampling.seed, j), list(req.prompt)))
                continue
            self.pages.share(shared)
            if leader.cached % PAGE_SIZE:
                src.append(tail[0])
                dst.append(own[0])
            child = Sequence(
                req, j, sample_seed(req.sampling.seed, j), list(req.prompt), pages=shared + own, cached=leader.cached
            )
            if len(self.running) < self.config.max_batch:
                self._run(child)
            else:
                parked.append(child)
        self.waiting.extendleft(reversed(parked))
        req.pending_forks = 0
        return src, dst

    # ----- the rows of each call -----
    def prefill_rows(self) -> list[Sequence]:
        """The running sequences whose prompts are not cached yet, oldest first, as many as one
        prefill call's token budget takes (one chunk each)."""
        prefilling = sorted((s for s in self.running if not s.decoding), key=lambda s: s.admitted)
        return prefilling[: cdiv(self.config.token_budget, self.config.prefill_chunk)]

    def _ahead(self, seqs, previous: Round | None) -> tuple[dict, dict]:
        """Per sequence: the tokens the round in flight may still add (it samples its whole budget
        unless it stops), and the budget of the next round after those."""
        in_flight = dict(zip(previous.seqs, previous.budget)) if previous else {}
        ahead = {s: in_flight.get(s, 0) for s in seqs}
        budget = {
            s: min(self.config.decode_steps, s.request.sampling.max_tokens - s.generated - ahead[s]) for s in seqs
        }
        return ahead, budget

    def pages_ahead(self, previous: Round) -> bool:
        """Whether the free pages cover the next round after the one in flight, without preempting
        (else the engine reads that round first, so nothing is in flight when someone is preempted)."""
        seqs = [s for s in self.running if s.decoding]
        ahead, budget = self._ahead(seqs, previous)
        need = sum(max(0, cdiv(len(s.tokens) - 1 + ahead[s] + budget[s], PAGE_SIZE) - len(s.pages)) for s in seqs)
        return need <= self.pages.available

    def round_rows(self, previous: Round | None) -> tuple[list[Sequence], dict, dict]:
        """The next decode round's rows: every running sequence whose prompt is cached and that may
        sample past the round in flight, with pages grown for the positions it will write. Returns
        (rows, ahead, budget) as `_ahead` defines them."""
        seqs = [s for s in self.running if s.decoding]
        ahead, budget = self._ahead(seqs, previous)
        seqs = [s for s in seqs if budget[s] > 0]  # the others end in the round in flight
        for s in seqs:  # the round writes positions len(tokens) - 1 + ahead ... len(tokens) - 2 + ahead + budget
            if s in self.running:  # growing an earlier one may have preempted it (only with nothing in flight)
                self.grow(s, len(s.tokens) - 1 + ahead[s] + budget[s])
        seqs = [s for s in seqs if s in self.running]
        assert len(seqs) <= self.config.max_batch, "admission and forks keep the batch within max_batch"
        return seqs, ahead, budget
