"""Where train.grpo's completions come from: the in-process engines (`LocalRollout`, the default) or a
running `serve.rollout` server (`RemoteRollout`). Both have `sample_turns(prompts, seeds, samplings) -> [P][n]
Completion` (prompt i sampled with seed seeds[i] and its own SamplingParams: train/episodes.py samples every turn
of every episode through it, a task's one turn included) and `push(policy, cfg, out_dir)`, and for the same
weights, prompts, seeds and sampling both return the same tokens and logprob bits. The in-process engines keep
their KV caches between calls, and the server keeps its own, so each next turn's prompt finds the previous turn's
pages in the prefix cache; `prefix_cache()` reads the counters that show it. `sample(prompts, seeds, sampling)`
is the same with one SamplingParams for every prompt, the caches released after.

The in-process engines' KV caches are a page budget, not a step's sequences at full length (EngineConfig.for_budget):
sequences are admitted as pages free up, and one preempted for pages is prefilled again later, with the same tokens
and logprob bits (batch invariance: a row's bits do not depend on who else runs or how its prefix was cached).
`measure` turns the engines' counters into the metrics row's concurrency, preemption and decode-rate fields.
"""

import contextlib
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import jax
import numpy as np

from rlkjax.client import RolloutClient
from rlkjax.core import lora
from rlkjax.core.checkpoint import save_orbax_params
from rlkjax.core.lora import save_peft
from rlkjax.core.numerics import PAGE_SIZE
from rlkjax.core.sampling_params import SamplingParams
from rlkjax.core.shapes import cdiv
from rlkjax.engine import outputs
from rlkjax.engine.config import EngineConfig
from rlkjax.engine.engine import Engine
from train import fsdp


class Completion(NamedTuple):
    """One sampled completion (or an episode's turn), as both rollouts return it."""

    tokens: list[int]  # the sampled tokens, a sampled eos last when one ended it
    logprobs: np.ndarray  # [len(tokens)] float32: the sampler's logprob of each, the bits the learner must find
    policy_version: int  # the weights' version that sampled it (updates pushed since the run's start)


# The engines' counters a step's row reads twice (Engine.metrics; the server's /metrics as rlkjax_<name>_total).
ENGINE_COUNTERS = ("preemptions", "preempted_tokens", "decode_tokens", "decode_rounds", "decode_rows")


def model_eos(tokenizer, cfg) -> int | None:
    """The end-of-sequence id the engines stop at: the tokenizer's (None without one), inside the model's
    vocabulary. Requests that ask for ignore_eos sample past it (the engine's one eos rule)."""
    eos = tokenizer.eos_token_id
    if eos is not None and not 0 <= eos < cfg.vocab_size:
        raise ValueError(f"the tokenizer's eos id {eos} is outside the model's vocabulary of {cfg.vocab_size}")
    return eos


@contextlib.contextmanager
def timed(rollout):
    """Add the block's wall seconds to rollout.sample_s (the decode rate's denominator)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        rollout.sample_s += time.perf_counter() - start


def run_to_the_end(engine: Engine) -> int:
    """Step `engine` until its requests are done; returns the most rows one of its decode rounds ran (each step
    dispatches one round at most: the step's growth in decode_rows is that round's rows)."""
    peak = 0
    while engine.busy or engine.weights_pending:
        rows = engine.stats["decode_rows"]
        engine.step()
        peak = max(peak, engine.stats["decode_rows"] - rows)
    return peak


class LocalRollout:
    """One engine per sampler device, each with a full copy of the weights; prompt i goes to sampler
    device i mod M. With several processes each runs its own devices' engines and the completions
    are exchanged, so every process returns the same groups."""

    def __init__(
        self,
        policy,
        cfg,
        numerics,
        mesh,
        devices,
        *,
        rows: int,
        max_length: int,
        group: int,
        kv_pages: int | None = None,
        eos_token_id,
        first_version: int = 0,
    ):
        """policy: on the learner's `mesh`; devices: the sampler devices; rows: the most sequences (prompts x
        group) one engine runs in a step, each of up to max_length tokens (prompt + completion), in requests of
        up to `group` samples; kv_pages: each engine's KV cache in pages of 16 tokens, page 0 included, at most
        what every row at full length takes (None: that, so nothing is ever preempted); eos_token_id: `model_eos`,
        which ends every completion whose sampling does not ask for ignore_eos."""
        # A page budget, not a shape: sequences are admitted as pages free up, and one preempted for pages is
        # prefilled again later with the same bits (rlkjax.engine.scheduler).
        need = 1 + rows * cdiv(max_length, PAGE_SIZE)
        kv_pages = need if kv_pages is None else min(kv_pages, need)
        self.sizing = EngineConfig.for_budget(kv_pages, rows, max_length, group)
        self.mesh, self.devices = mesh, devices
        self.first_version = first_version  # a resumed run's weights have had `start` updates: versions continue
        self.engines = {}
        self.sample_s = 0.0  # wall seconds inside sample_turns, for the decode rate
        self.sequences_peak = 0  # the most sequences one engine decoded in a round; `measure` resets it
        local = fsdp.local_copy(policy, mesh)
        for device in devices:
            if device.process_index == jax.process_index():
                with jax.default_device(device):
                    self.engines[device] = Engine(
                        jax.device_put(local, device), cfg, numerics, self.sizing, eos_token_id
                    )

    def sample(self, prompts, seeds, sampling: SamplingParams) -> list[list[Completion]]:
        groups = self.sample_turns(prompts, seeds, [sampling] * len(prompts))
        self.release_cache()
        return groups

    def sample_turns(self, prompts, seeds, samplings: list[SamplingParams]) -> list[list[Completion]]:
        """Like sample, with one SamplingParams per prompt (an episode's turns ask for what their context has left),
        and the KV caches kept, so the prefix cache holds every ended turn for the next (release_cache() after
        the last)."""
        owners = [self.devices[i % len(self.devices)] for i in range(len(prompts))]
        reqs = {
            i: self.engines[device].submit(p, sampling, seed=s)
            for i, (p, s, sampling, device) in enumerate(zip(prompts, seeds, samplings, owners, strict=True))
            if device in self.engines
        }
        # One thread per engine, so engines on different devices decode at the same time (JAX releases
        # the GIL while a device works); each engine's bits do not depend on the others.
        with timed(self), ThreadPoolExecutor(len(self.engines) or 1) as pool:
            peaks = list(pool.map(run_to_the_end, self.engines.values()))
        self.sequences_peak = max([self.sequences_peak, *peaks])
        # Every process fills the rows it sampled; the exchange moves them as int32 bits.
        shape = (len(prompts), max(s.n for s in samplings))
        width = max(s.max_tokens for s in samplings)
        mine = {
            "tokens": np.zeros((*shape, width), np.int32),
            "logprob_bits": np.zeros((*shape, width), np.int32),
            "length": np.zeros(shape, np.int32),
            "version": np.zeros(shape, np.int32),
        }
        for i, req in reqs.items():
            for j, c in enumerate(outputs.results(req)):  # its end, off its output queue
                n = len(c.tokens)
                mine["tokens"][i, j, :n] = c.tokens
                mine["logprob_bits"][i, j, :n] = np.asarray(c.logprobs, np.float32).view(np.int32)
                mine["length"][i, j] = n
                mine["version"][i, j] = self.first_version + c.policy_version
        every = fsdp.exchange(mine)
        groups = []
        for i, device in enumerate(owners):
            theirs = {k: v[device.process_index, i] for k, v in every.items()}
            groups.append(
                [
                    Completion(
                        theirs["tokens"][j, :n].tolist(),
                        theirs["logprob_bits"][j, :n].view(np.float32),
                        int(theirs["version"][j]),
                    )
                    for j, n in enumerate(theirs["length"][: samplings[i].n])
                ]
            )
        return groups

    def counters(self) -> dict:
        """This process's engines' counters since they started, summed (`rollout_fields` takes two readings):
        preemptions, preempted_tokens, decode_tokens, decode_rounds, decode_rows; and sample_s."""
        metrics = [engine.metrics() for engine in self.engines.values()]
        return {k: sum(m[k] for m in metrics) for k in ENGINE_COUNTERS} | {"sample_s": self.sample_s}

    def release_cache(self):
        """The learner's step gets the KV caches' memory (on its devices) until the next rollout."""
        for device, engine in self.engines.items():
            if device in self.mesh.devices.flat:
                engine.release_cache()

    def prefix_cache(self) -> dict:
        """This process's engines' prefix-cache counters since they started: query_tokens (prompt positions
        admitted) and hit_tokens (those the cache held: prefill saved)."""
        metrics = [engine.metrics() for engine in self.engines.values()]
        return {k: sum(m[f"prefix_cache_{k}"] for m in metrics) for k in ("query_tokens", "hit_tokens")}

    def release_weights(self):
        """Free the weights of the engines on the learner's devices until push() gives the next ones (cast from the
        updated master: the bits any sync gives), so the learner's step and update have that memory too."""
        for device, engine in self.engines.items():
            if device in self.mesh.devices.flat:
                engine.release_weights()

    def push(self, policy, cfg, out_dir):
        local = fsdp.local_copy(policy, self.mesh)  # every process takes part, samplers or not
        for device, engine in self.engines.items():  # device to device, no disk
            engine.update_weights(jax.device_put(local, device))  # live before the next request is admitted


def completion(sample: dict) -> Completion:
    """A sample as rlkjax.client returns it (its logprobs already the float32 values the server wrote)."""
    return Completion(list(sample["tokens"]), np.asarray(sample["logprobs"], np.float32), int(sample["policy_version"]))


class RemoteRollout:
    """A `serve.rollout` server; its policy_version is the server's own count of weight updates (a
    restarted server starts again from 0, also on --resume)."""

    devices = ()  # the server's devices are not this process's: a step's FLOPs count the learner's alone
    sequences_peak = None  # /metrics has no per-round peak: `measure` leaves it out

    def __init__(self, url, admin_key):
        self.client = RolloutClient(url, admin_key=admin_key or os.environ.get("RLKJAX_ADMIN_KEY"))
        self.client.wait_until_ready()  # a server started beside the trainer may still be warming up
        self.sample_s = 0.0  # wall seconds waiting for completions, for the decode rate

    def sample(self, prompts, seeds, sampling: SamplingParams) -> list[list[Completion]]:
        return self.sample_turns(prompts, seeds, [sampling] * len(prompts))

    def sample_turns(self, prompts, seeds, samplings: list[SamplingParams]) -> list[list[Completion]]:
        """Like LocalRollout.sample_turns. One SamplingParams for every prompt (a step's first turns, a task's one
        turn): one /generate request, whose P x n samples the server admits together. Several (an episode's later
        turns, each asking for what its context has left): one request per prompt through vLLM's token route
        (/inference/v1/generate), sent together so the server batches them."""
        if len(set(samplings)) == 1:
            groups = self._generate(prompts, seeds, samplings[0])
        else:
            with timed(self), ThreadPoolExecutor(min(len(prompts), 64) or 1) as pool:
                groups = list(pool.map(self.client.generate_tokens, prompts, samplings, seeds))
        return [[completion(s) for s in g] for g in groups]

    def _generate(self, prompts, seeds, sampling: SamplingParams) -> list[list[dict]]:
        carried = dict(n=sampling.n, max_tokens=sampling.max_tokens, temperature=sampling.temperature)
        carried |= dict(stop_token_ids=sampling.stop_token_ids, ignore_eos=sampling.ignore_eos)
        if sampling != SamplingParams(**carried):
            raise ValueError(f"{sampling} has fields /generate does not carry (it takes {sorted(carried)})")
        with timed(self):
            return self.client.generate(
                prompts,
                n=sampling.n,
                max_tokens=sampling.max_tokens,
                temperature=sampling.temperature,
                seed=seeds,
                stop_token_ids=sampling.stop_token_ids,
                ignore_eos=sampling.ignore_eos,  # the server's eos is its tokenizer's, the one the engines here stop at
            )

    def counters(self) -> dict:
        """The server's counters since it started (its /metrics; other clients' work counts too), as
        LocalRollout.counters names them."""
        served = self.client.counters()
        names = {"decode_tokens": "generated_tokens_total"}
        return {k: served[names.get(k, f"{k}_total")] for k in ENGINE_COUNTERS} | {"sample_s": self.sample_s}

    def release_cache(self):
        """Nothing to free here: the server's memory is its own."""

    def prefix_cache(self) -> dict:
        """The server's prefix-cache counters since it started (its /metrics)."""
        return self.client.prefix_cache()

    def release_weights(self):
        """Nothing to free here: the server's memory is its own."""

    def push(self, params, cfg, out_dir):
        if cfg.lora is not None:  # the adapters only, as PEFT files (bf16 values, exact in their float32)
            path = Path(out_dir) / "sync_adapter"
            save_peft(path, cfg, lora.split(params)[1])
            self.client.load_lora_adapter("policy", str(path.absolute()))
            return
        path = Path(out_dir) / "sync"
        save_orbax_params(path, cfg, params)
        self.client.update_weights(str(path.absolute()))


@contextlib.contextmanager
def measure(rollout):
    """The metrics row's rollout fields for the sampling inside the block (a step's completions, or every turn of
    its episodes), in the dict it yields, filled when the block ends:
      rollout_sequences_mean      sequences decoding together, mean over decode rounds (per engine)
      rollout_sequences_peak      the most in one round (in-process engines only)
      rollout_preemptions         sequences that gave their KV pages back for others, to be prefilled again
      rollout_preempted_tokens    the positions they gave back (prefilled again, less what the prefix cache kept)
      rollout_decode_tokens_per_s tokens sampled per second of sampling
      rollout_kv_pages, rollout_batch_slots  each in-process engine's KV cache in pages and its max_batch
    The concurrency is what the KV page budget and the batch slots admitted. In-process, the counters are this
    process's engines'; a server's count its other clients' work too."""
    fields = {}
    if rollout.sequences_peak is not None:
        rollout.sequences_peak = 0
    before = rollout.counters()
    yield fields
    after = rollout.counters()
    delta = {k: after[k] - before[k] for k in after}
    fields["rollout_sequences_mean"] = delta["decode_rows"] / delta["decode_rounds"] if delta["decode_rounds"] else 0.0
    if rollout.sequences_peak is not None:
        fields["rollout_sequences_peak"] = rollout.sequences_peak
    fields["rollout_preemptions"] = int(delta["preemptions"])
    fields["rollout_preempted_tokens"] = int(delta["preempted_tokens"])
    seconds = delta["sample_s"]
    fields["rollout_decode_tokens_per_s"] = delta["decode_tokens"] / seconds if seconds else 0.0
    if rollout.sequences_peak is not None:  # in process: the budget these figures come from
        fields |= {"rollout_kv_pages": rollout.sizing.num_pages, "rollout_batch_slots": rollout.sizing.max_batch}
