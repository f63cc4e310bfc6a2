"""The engine with its prefix cache on and off: decode speed, and what a second turn saves.

    python -m bench.prefix_cache_speed --model qwen3-0.6b --batch 64 --prompt 512 --new 128 --out PATH

For each setting (cache on, then off), on one engine: a first turn of --batch requests (random prompts of --prompt
tokens, --new sampled tokens each) and a second turn whose prompts are each first turn's prompt + completion +
--turn new tokens, as an episode's next turn is. Both turns run twice: the first time compiles, the second is timed.
Reported per setting: the second turn's prefill tokens computed and taken from the cache, and both turns' wall time
and decode tokens per second; and whether the second turn's tokens and logprob bits are the same with the cache on
and off (they must be: a cached page holds what prefill would write).
"""

import time

import numpy as np

import rlkjax
from bench import _flags
from bench._report import new_report, save_report
from rlkjax.engine import Engine
from rlkjax.engine_config import EngineConfig
from rlkjax.sampling_params import SamplingParams


def run_turns(params, cfg, args, prefix_cache: bool) -> dict:
    rng = np.random.default_rng(0)
    first = [rng.integers(0, cfg.vocab_size, args.prompt).tolist() for _ in range(args.batch)]
    extra = [rng.integers(0, cfg.vocab_size, args.turn).tolist() for _ in range(args.batch)]
    length = args.prompt + 2 * args.new + args.turn
    sizing = EngineConfig.for_batch([length] * args.batch)
    pages = 2 * sizing.num_pages  # room for the first turn's kept pages beside the second turn's
    config = EngineConfig(**{**vars(sizing), "num_pages": pages, "prefix_cache": prefix_cache})
    engine = Engine(params, cfg, "strict", config)
    sampling = SamplingParams(max_tokens=args.new, temperature=1.0, ignore_eos=True)

    def turn(prompts):
        before = dict(engine.stats)
        start = time.perf_counter()
        reqs = [engine.submit(p, sampling, seed=i) for i, p in enumerate(prompts)]
        engine.run_until_done()
        seconds = time.perf_counter() - start
        done = [r.results[0] for r in reqs]
        counts = {k: engine.stats[k] - before[k] for k in ("prefill_tokens", "decode_tokens")}
        return done, {"seconds": seconds, "decode_tokens_per_s": counts["decode_tokens"] / seconds, **counts}

    result = {}
    for _ in range(2):  # the first pass compiles, the second is timed
        engine.pages.forget()  # each attempt starts from an empty cache
        done, result["first_turn"] = turn(first)
        second = [p + list(c.tokens) + e for p, c, e in zip(first, done, extra)]
        done2, result["second_turn"] = turn(second)
    result["second_turn_prompt_tokens"] = sum(map(len, second))
    result["metrics"] = {k: v for k, v in engine.metrics().items() if k.startswith("prefix_cache")}
    result["tokens"] = [list(c.tokens) for c in done2]
    result["logprob_bits"] = [np.asarray(c.logprobs, np.float32).view(np.uint32).tolist() for c in done2]
    return result


def main() -> None:
    p = _flags.parser(__doc__)
    _flags.add_model(p, "qwen3-0.6b")
    p.add_argument("--batch", type=int, default=64, help="requests per turn")
    p.add_argument("--prompt", type=int, default=512, help="first turn's prompt tokens")
    p.add_argument("--new", type=int, default=128, help="tokens sampled per turn")
    p.add_argument("--turn", type=int, default=32, help="tokens the second turn adds after the first completion")
    _flags.add_out(p)
    args = p.parse_args()
    cfg = rlkjax.ModelConfig.preset(args.model)
    params = rlkjax.init_params(cfg, seed=0)
    on, off = run_turns(params, cfg, args, True), run_turns(params, cfg, args, False)
    same = on["tokens"] == off["tokens"] and on["logprob_bits"] == off["logprob_bits"]
    for side in (on, off):
        del side["tokens"], side["logprob_bits"]
    report = new_report("bench.prefix_cache_speed") | {
        "results": {"cache_on": on, "cache_off": off, "second_turn_same_bits": same}
    }
    for name, side in (("on", on), ("off", off)):
        t1, t2 = side["first_turn"], side["second_turn"]
        print(
            f"cache {name:3}: first turn {t1['seconds']:.2f} s ({t1['decode_tokens_per_s']:,.0f} decode tokens/s); "
            f"second turn {t2['seconds']:.2f} s, {t2['prefill_tokens']:,} prefill tokens computed of "
            f"{side['second_turn_prompt_tokens']:,} ({t2['decode_tokens_per_s']:,.0f} decode tokens/s)"
        )
    print(f"second turn's tokens and logprob bits equal with the cache on and off: {same}")
    save_report(report, args.out)


if __name__ == "__main__":
    main()
