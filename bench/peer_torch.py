"""The peer learner pass: bench.speed's learner rows' forward and backward, run by Hugging Face
transformers' Qwen3 in PyTorch on the same GPU, so rlkjax's learner speed has a reference.

    python -m bench.peer_torch --models qwen3-4b,qwen3-8b --batch 8 --seq 1024 --out peer.json
    python -m bench.peer_torch --models qwen3-tiny --batch 2 --seq 64 --repeats 1   # a smoke run on the CPU

The model: `Qwen3ForCausalLM` from a `Qwen3Config` with the preset's shapes (rlkjax.ModelConfig.preset),
random init, bf16 weights, attn_implementation="sdpa" (causal, no mask: PyTorch's flash attention on a GPU).
The pass: the lm_head's logits at every position but the last, log_softmax in fp32, gathered at the next
tokens (the per-token logprobs a GRPO loss is made of), summed; backward to every parameter, gradients set
to None first (each pass allocates them, as the JAX pass returns them). The same counting as bench.speed's
learner rows: B x T tokens per pass; after the first pass (which compiles, where compiled) one warm-up pass,
then the median of --repeats timed passes (CUDA events around each whole pass); MFU from rlkjax.core.flops (6 x
matmul parameters per token + causal attention, real tokens only: there is no padding).
What differs from ours: our pass reads fp32 master weights (cast to bf16 inside) and returns fp32
gradients, and adds the GRPO loss's element-wise terms on [B, T - 1]; this one holds bf16 weights and
gradients. Memory here is torch.cuda.max_memory_allocated over the variant (weights, gradients,
activations); ours is XLA's compiled peak of the call (fp32 master weights and gradients included).

Variants: eager; compile (torch.compile in its default mode: Inductor, no CUDA graphs, no max-autotune);
checkpoint (model.gradient_checkpointing_enable(), non-reentrant: each layer recomputed in the backward);
compile_checkpoint. --compile-scope layers compiles each decoder layer and the logprob head (PyTorch's
regional compilation: the layers share one compiled graph, so a 36-layer model compiles in seconds);
`model` compiles the whole pass as one function. A variant that runs out of memory is a row saying so.
torch and transformers come from the `peer` extra (`pip install -e .[peer]`); no other module imports them.
"""

import collections
import gc
import json
import time
from pathlib import Path

import numpy as np

import rlkjax
from bench import _flags
from bench._report import new_report, save_report
from rlkjax.core import flops

VARIANTS = ("eager", "compile", "checkpoint", "compile_checkpoint")


def qwen3_config_fields(cfg: rlkjax.ModelConfig) -> dict:
    """Qwen3Config's keyword arguments for a ModelConfig's shapes (transformers v5 names)."""
    hf = cfg.to_hf_config()
    keys = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
    keys += ("head_dim", "intermediate_size", "tie_word_embeddings", "max_position_embeddings", "rms_norm_eps")
    return {k: hf[k] for k in keys} | {
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
    }


def pass_flops(cfg: rlkjax.ModelConfig, batch: int, seq: int) -> float:
    """Model FLOPs of one pass over batch x seq tokens: rlkjax.core.flops', as bench.speed's learner rows count."""
    return flops.sequence_flops(cfg, [seq] * batch, backward=True).model


def torch_hardware() -> dict:
    """bench._report's hardware record, read through PyTorch (JAX must not take the GPU's memory here)."""
    import torch

    if not torch.cuda.is_available():
        return {"platform": "cpu", "device_kind": "cpu", "device_count": 1, "platform_version": None}
    return {
        "platform": "gpu",
        "device_kind": torch.cuda.get_device_name(0),
        "device_count": torch.cuda.device_count(),
        "platform_version": f"cuda {torch.version.cuda}",
        "memory_bytes_limit": torch.cuda.get_device_properties(0).total_memory,
    }


def build_pass(cfg, variant, scope, batch, seq, device):
    """A fresh random model for `variant` and its pass: run() zeroes the gradients, runs forward and
    backward, returns the summed logprobs. Also the model (its parameter count goes in the row)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    config = Qwen3Config(**qwen3_config_fields(cfg))
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.train()
    if "checkpoint" in variant:
        model.gradient_checkpointing_enable()  # transformers' default: use_reentrant=False
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq), device=device)

    def head(hidden, weight, targets):  # the lm_head, then logprobs of the next tokens in fp32
        logits = torch.nn.functional.linear(hidden, weight).float()
        return torch.log_softmax(logits, dim=-1).gather(-1, targets[..., None]).sum()

    def logprob_sum(tokens):
        hidden = model.model(input_ids=tokens, use_cache=False).last_hidden_state
        return head(hidden[:, :-1], model.lm_head.weight, tokens[:, 1:])

    if "compile" in variant and scope == "layers":
        for layer in model.model.layers:
            layer.compile()
        head = torch.compile(head)
    elif "compile" in variant:
        logprob_sum = torch.compile(logprob_sum)

    def run():
        model.zero_grad(set_to_none=True)
        loss = logprob_sum(tokens)
        loss.backward()
        return loss

    return model, run


def time_passes(run, repeats, cuda):
    """(seconds of the first pass, median seconds of `repeats` timed passes after one warm-up pass)."""
    import torch

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    start = time.perf_counter()
    run()
    sync()
    first = time.perf_counter() - start
    run()
    sync()
    times = []
    for _ in range(repeats):
        if cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            run()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end) / 1e3)
        else:
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
    return first, float(np.median(times))


def profile_pass(run, cuda, trace_path):
    """Device time per kernel name of one traced pass, in bench.profile's shape ({device_us, kernels:
    [{kernel, us, calls, share}]}); on the CPU (a smoke run) the operators' own CPU time."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        run()
        if cuda:
            torch.cuda.synchronize()
    prof.export_chrome_trace(str(trace_path))
    total, count = collections.Counter(), collections.Counter()
    for e in prof.events():
        if cuda and e.device_type == DeviceType.CUDA and not e.is_user_annotation:
            total[e.name] += e.time_range.elapsed_us()
        elif not cuda and e.device_type == DeviceType.CPU:
            total[e.name] += e.self_cpu_time_total
        else:
            continue
        count[e.name] += 1
    all_us = sum(total.values())
    rows = [{"kernel": n, "us": t, "calls": count[n], "share": t / all_us} for n, t in total.most_common()]
    return {"device_us": all_us, "kernels": rows}


def run_variant(cfg, name, variant, args, device):
    """One row: tokens/s, MFU, peak memory, or the error (out of memory: `oom` true) that stopped it."""
    import torch

    cuda = device == "cuda"
    work = pass_flops(cfg, args.batch, args.seq)
    row = {"model": name, "variant": variant, "batch": args.batch, "seq": args.seq, "model_flops": work}
    row |= {"compile_mode": "default", "compile_scope": args.compile_scope} if "compile" in variant else {}
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    torch._dynamo.reset()  # each variant compiles from nothing
    torch._dynamo.utils.counters.clear()
    try:
        model, run = build_pass(cfg, variant, args.compile_scope, args.batch, args.seq, device)
        row["parameters"] = sum(p.numel() for p in model.parameters())
        row["first_pass_s"], dt = time_passes(run, args.repeats, cuda)
        row["tokens_per_s"] = args.batch * args.seq / dt
        row["ms_per_pass"] = 1e3 * dt
        kind = torch.cuda.get_device_name(0) if cuda else "cpu"
        row["mfu"] = flops.mfu(work, dt, kind)
        row["oom"] = False
        if args.profile:
            trace = Path(args.profile) / f"{name}_{variant}.json.gz"
            row["profile"] = profile_pass(run, cuda, trace) | {"trace": str(trace)}
    except Exception as e:  # out of memory, or a failed compile: a result too, as bench.speed records it
        row["oom"] = isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    counters = torch._dynamo.utils.counters["stats"]
    row |= {"compiled_graphs": counters["unique_graphs"]} if "compile" in variant else {}
    row["peak_memory_GiB"] = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    return row


def fmt(value, spec):
    return "-" if value is None else format(value, spec)


def markdown(rows) -> str:
    """The rows as a markdown table, then each model's best variant (highest tokens/s)."""
    lines = ["| model | variant | tokens/s | MFU | peak GiB | first pass s | note |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        note = "out of memory" if r.get("oom") else r.get("error", r.get("skipped", ""))[:60]
        lines.append(
            f"| {r['model']} | {r['variant']} | {fmt(r.get('tokens_per_s'), ',.0f')} | {fmt(r.get('mfu'), '.1%')} "
            f"| {fmt(r.get('peak_memory_GiB'), '.1f')} | {fmt(r.get('first_pass_s'), '.1f')} | {note} |"
        )
    for name, best in best_rows(rows).items():
        lines.append(f"\nbest {name}: {best['variant']}, {best['tokens_per_s']:,.0f} tokens/s")
    return "\n".join(lines)


def best_rows(rows) -> dict:
    """Each model's fastest variant that ran."""
    best = {}
    for r in rows:
        if "tokens_per_s" in r and r["tokens_per_s"] > best.get(r["model"], {}).get("tokens_per_s", 0):
            best[r["model"]] = r
    return best


def profile_text(best: dict, top: int) -> str:
    """The best variants' kernel tables, in bench.profile's columns (us per pass, share, calls, name)."""
    out = []
    for name, row in best.items():
        prof = row["profile"]
        out.append(
            f"peer {name} {row['batch']}x{row['seq']} {row['variant']}: {prof['device_us']:.1f} us of device time"
        )
        for k in prof["kernels"][:top]:
            out.append(f"  {k['us']:10.1f} us  {100 * k['share']:5.1f}%  x{k['calls']:<6} {k['kernel'][:90]}")
    return "\n".join(out) + "\n"


def parser():
    ap = _flags.parser(__doc__)
    _flags.add_models(ap, "qwen3-4b,qwen3-8b", "rlkjax presets whose shapes to build (random)")
    ap.add_argument("--batch", type=int, default=8, help="sequences per pass (B)")
    ap.add_argument("--seq", type=int, default=1024, help="tokens per sequence (T)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated: " + ", ".join(VARIANTS))
    ap.add_argument(
        "--compile-scope",
        choices=("layers", "model"),
        default="layers",
        help="what torch.compile compiles: each decoder layer and the logprob head, or the whole pass",
    )
    _flags.add_repeats(ap, 3, "timed passes per variant (median)")
    ap.add_argument("--budget-s", type=float, default=None, help="start no variant after this many seconds")
    ap.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="trace one more pass of each variant here; the best's kernel table goes to a .txt beside --out",
    )
    ap.add_argument("--top", type=int, default=30, help="kernels kept per profile table")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda where PyTorch sees a GPU)")
    _flags.add_out(ap, "JSON path (default bench/results/peer_torch_<date>.json)")
    return ap


def main():
    args = parser().parse_args()
    variants = args.variants.split(",")
    if unknown := [v for v in variants if v not in VARIANTS]:
        raise SystemExit(f"--variants: {unknown} not among {', '.join(VARIANTS)}")
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    report = new_report("bench.peer_torch", packages=("torch", "transformers"), devices=torch_hardware())
    report["settings"] = {"attn_implementation": "sdpa", "dtype": "bfloat16", "device": device}
    out = args.out or f"bench/results/peer_torch_{report['date'][:10]}.json"
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    for name in args.models.split(","):
        cfg = rlkjax.ModelConfig.preset(name)
        for variant in variants:
            if args.budget_s is not None and time.perf_counter() - start > args.budget_s:
                row = {"model": name, "variant": variant, "skipped": f"past --budget-s {args.budget_s:g}"}
            else:
                row = run_variant(cfg, name, variant, args, device)
                gc.collect()  # the variant's model, gradients and compiled graphs go before the next one
                if device == "cuda":
                    torch.cuda.empty_cache()
            if "profile" in row:  # each row keeps its top kernels; the .txt shows the best's
                row["profile"]["kernels"] = row["profile"]["kernels"][: args.top]
            print(json.dumps({k: v for k, v in row.items() if k != "profile"}), flush=True)
            report["results"].append(row)
            save_report(report, out)  # after every row, so a run cut short keeps what it measured
    best = best_rows(report["results"])
    report["best"] = {name: r["variant"] for name, r in best.items()}
    for r in report["results"]:  # only the best variants' traces stay in --profile's DIR
        if "profile" in r and r is not best[r["model"]]:
            Path(r["profile"].pop("trace")).unlink(missing_ok=True)
    save_report(report, out)
    if args.profile:
        text = profile_text(best, args.top)
        Path(out).with_name(Path(out).stem + "_profile.txt").write_text(text)
        print(text)
    print(markdown(report["results"]))


if __name__ == "__main__":
    main()
