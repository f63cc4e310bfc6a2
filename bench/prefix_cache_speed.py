"""The engine with its prefix cache on and off: decode speed, and what a second turn saves.

    python -m bench.prefix_cache_speed --model qwen3-0.6b --batch 64 --prompt 512 --new 128 --repeats 5 --out PATH

Two engines over the same weights, one with the cache on and one with it off. Each attempt runs, on each engine
in turn, a first turn of --batch requests (random prompts of --prompt tokens, --new sampled tokens each) and a
second turn whose prompts are each first turn's prompt + completion + --turn new tokens, as an episode's next
turn is. The first attempt compiles; the next --repeats are timed, alternating the engines (and which one goes
first) so that drift in the GPU's clock falls on both. Reported per setting: the median, lowest and highest
decode tokens per second and wall time of each turn, the second turn's prefill tokens computed and taken from
the cache, and whether the second turn's tokens and logprob bits are the same with the cache on and off (they
must be: a cached page holds what prefill would write).
"""

import statistics
import time

import numpy as np

import rlkjax
from bench import _flags
from bench._report import new_report, save_report
from rlkjax.core.sampling_params import SamplingParams
from rlkjax.engine.config import EngineConfig
from rlkjax.engine.engine import Engine


def make_engine(params, cfg, args, prefix_cache: bool) -> Engine:
    length = args.prompt + 2 * args.new + args.turn
    sizing = EngineConfig.for_batch([length] * args.batch)
    pages = 2 * sizing.num_pages  # room for the first turn's kept pages beside the second turn's
    config = EngineConfig(**{**vars(sizing), "num_pages": pages, "prefix_cache": prefix_cache})
    return Engine(params, cfg, "strict", config)


def turn(engine: Engine, prompts, sampling) -> tuple[list, dict]:
    before = dict(engine.stats)
    start = time.perf_counter()
    reqs = [engine.submit(p, sampling, seed=i) for i, p in enumerate(prompts)]
    engine.run_until_done()
    seconds = time.perf_counter() - start
    counts = {k: engine.stats[k] - before[k] for k in ("prefill_tokens", "decode_tokens")}
    return [r.results[0] for r in reqs], {
        "seconds": seconds,
        "decode_tokens_per_s": counts["decode_tokens"] / seconds,
        **counts,
    }


def attempt(engine: Engine, args, cfg, sampling) -> tuple[list, dict]:
    """One episode of two turns from an empty cache; returns the second turn's completions and both turns' stats."""
    rng = np.random.default_rng(0)
    first = [rng.integers(0, cfg.vocab_size, args.prompt).tolist() for _ in range(args.batch)]
    extra = [rng.integers(0, cfg.vocab_size, args.turn).tolist() for _ in range(args.batch)]
    engine.pages.forget()
    done, first_stats = turn(engine, first, sampling)
    second = [p + list(c.tokens) + e for p, c, e in zip(first, done, extra)]
    done2, second_stats = turn(engine, second, sampling)
    return done2, {
        "first_turn": first_stats,
        "second_turn": second_stats,
        "second_turn_prompt_tokens": sum(map(len, second)),
    }


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarise(attempts: list[dict]) -> dict:
    out = {"second_turn_prompt_tokens": attempts[0]["second_turn_prompt_tokens"]}
    for name in ("first_turn", "second_turn"):
        rows = [a[name] for a in attempts]
        out[name] = {
            "seconds": spread([r["seconds"] for r in rows]),
            "decode_tokens_per_s": spread([r["decode_tokens_per_s"] for r in rows]),
            "prefill_tokens": rows[-1]["prefill_tokens"],
            "decode_tokens": rows[-1]["decode_tokens"],
        }
    return out


def main() -> None:
    p = _flags.parser(__doc__)
    _flags.add_model(p, "qwen3-0.6b")
    p.add_argument("--batch", type=int, default=64, help="requests per turn")
    p.add_argument("--prompt", type=int, default=512, help="first turn's prompt tokens")
    p.add_argument("--new", type=int, default=128, help="tokens sampled per turn")
    p.add_argument("--turn", type=int, default=32, help="tokens the second turn adds after the first completion")
    p.add_argument("--repeats", type=int, default=5, help="timed attempts per setting, after one that compiles")
    _flags.add_out(p)
    args = p.parse_args()
    cfg = rlkjax.ModelConfig.preset(args.model)
    params = rlkjax.init_params(cfg, seed=0)
    sampling = SamplingParams(max_tokens=args.new, temperature=1.0, ignore_eos=True)
    engines = {"on": make_engine(params, cfg, args, True), "off": make_engine(params, cfg, args, False)}
    attempts: dict[str, list] = {"on": [], "off": []}
    last = {}
    for i in range(args.repeats + 1):
        order = ("on", "off") if i % 2 else ("off", "on")  # neither setting always runs first
        for name in order:
            last[name], stats = attempt(engines[name], args, cfg, sampling)
            if i:  # the first attempt compiles
                attempts[name].append(stats)
    bits = {n: [np.asarray(c.logprobs, np.float32).view(np.uint32).tolist() for c in d] for n, d in last.items()}
    tokens = {n: [list(c.tokens) for c in d] for n, d in last.items()}
    same = tokens["on"] == tokens["off"] and bits["on"] == bits["off"]
    results = {f"cache_{n}": summarise(a) for n, a in attempts.items()}
    results["cache_on"]["metrics"] = {k: v for k, v in engines["on"].metrics().items() if k.startswith("prefix_cache")}
    results["second_turn_same_bits"] = same
    for name in ("on", "off"):
        side = results[f"cache_{name}"]
        t1, t2 = side["first_turn"], side["second_turn"]
        rate = t1["decode_tokens_per_s"]
        print(
            f"cache {name:3}: first turn {rate['median']:,.0f} decode tokens/s "
            f"(median of {args.repeats}, {rate['min']:,.0f}-{rate['max']:,.0f}); "
            f"second turn {t2['seconds']['median']:.3f} s, {t2['prefill_tokens']:,} prefill tokens computed of "
            f"{side['second_turn_prompt_tokens']:,}"
        )
    print(f"second turn's tokens and logprob bits equal with the cache on and off: {same}")
    save_report(new_report("bench.prefix_cache_speed") | {"results": results}, args.out)


if __name__ == "__main__":
    main()
