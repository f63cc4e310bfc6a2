"""One speed harness: strict vs fast side by side, with the ceilings measured in the same run.

    python -m bench.speed                       # everything (~10 minutes on one H200)
    python -m bench.speed --quick               # 0.6B + 8B decode at batch 1/64, small learner/score rows
    python -m bench.speed --only decode,kernels --models qwen3-8b
    python -m bench.speed --merge a.json b.json --out all.json   # one table from runs side by side

Sections (each row: fast, strict, strict/fast time, fraction of a ceiling):
- ceilings: device-to-device copy bandwidth (bytes read + written) and `jnp.dot` bf16 at 8192^3;
- decode: tokens/s at batch 1/16/64/256 x context 512/2048 (`--contexts` takes any; a side whose
  cache does not fit records its error), `--steps` decode steps (forward + fused sampling) inside
  ONE jitted fori_loop, so GPU time, not Python; HBM fraction = (weight bytes + KV bytes read per
  step) / step time / copy bandwidth. The cache is filled with random values (the time does not
  depend on them; prefilling 256 x 2048 tokens would take longer than the decode);
- prefill: 16 x 2048 prompt tokens, one call;
- learner: value and gradient of the GRPO loss (train.loss.grpo_loss: bf16 policy from fp32 master
  weights, token-level PPO-clip) on random sequences; MFU = (6 x matmul params x tokens + causal
  attention 6 x L x Hq x Dh x T^2 per sequence) / time / 989 TFLOP/s; memory from XLA's compiled
  memory analysis (arguments + outputs + temporaries: the peak of that call); `--learner-remat off,qkv,on`
  runs each row at those train.grpo --remat levels (layers recomputed in the backward) for the speed they cost,
  `--learner-dense` with XLA's dense attention backward instead of the Pallas flash one,
  `--learner-copies` with the matmul backward multiplying transposed copies (the default reads its
  operands in place); the `train` side (`--learner-sides`) times train.grpo's own one-device learner step
  (fsdp.sharded_value_and_grad on a one-device mesh: the same whole-weights pass, plus the fp32
  running sum of gradients it donates) next to `strict` (grpo_loss on whole weights, layers unrolled);
- score: the learner's forward + logprobs (`rlkjax.score`'s jitted core, the verify pass);
- kernels: each kernel alone against its XLA counterpart at decode and learner shapes.
Times are medians of `--repeats` timed calls after a warm-up call. JSON to --out.
The rows live in bench/speed_model.py (decode, prefill, learner, score), bench/speed_kernels.py,
bench/speed_sweep.py; merging and the table in bench/speed_table.py; timing and ceilings in bench/_timing.py.
"""

import json

import rlkjax
from bench import _flags
from bench._report import new_report, save_report
from bench._timing import ceilings
from bench.speed_kernels import kernel_rows
from bench.speed_model import decode_rows, learner_row, prefill_row, score_row
from bench.speed_sweep import sweep_rows
from bench.speed_table import merge_reports, print_table
from rlkjax.core import numerics
from train import grpo


def ints(text):
    return [int(x) for x in text.split(",")]


def parser():
    ap = _flags.parser(__doc__)
    _flags.add_models(ap, "qwen3-0.6b,qwen3-4b,qwen3-8b", "decode model shapes (random weights)")
    ap.add_argument("--batches", default="1,16,64,256", help="decode batch sizes (comma-separated)")
    ap.add_argument("--contexts", default="512,2048", help="decode context lengths (comma-separated)")
    ap.add_argument("--steps", type=int, default=32, help="decode steps per timed loop")
    _flags.add_repeats(ap, 3, "timed calls per row (median)")
    ap.add_argument(
        "--layer-unroll",
        default="1",
        help="decode rows once per value: layers per iteration of the sampler's layer loop (same bits)",
    )
    ap.add_argument("--learner-models", default="qwen3-1.7b,qwen3-4b", help="learner model shapes (random weights)")
    ap.add_argument("--learner-seqs", default="1024,4096", help="learner sequence lengths (comma-separated)")
    ap.add_argument(
        "--learner-sides",
        default="fast,strict,train",
        help="learner rows: fast and strict (grpo_loss on whole weights), train (train.grpo's one-device step, strict)",
    )
    ap.add_argument(
        "--learner-remat",
        default="off",
        help="train.grpo --remat levels of each learner row, comma-separated (off,qkv,on: side by side)",
    )
    ap.add_argument(
        "--learner-dense",
        action="store_true",
        help="learner rows also with XLA's dense attention backward (side by side with the flash one)",
    )
    ap.add_argument(
        "--learner-copies",
        action="store_true",
        help="learner rows also with the matmul backward on transposed copies of dy, w, x (side by side)",
    )
    ap.add_argument("--learner-tokens", type=int, default=8192, help="tokens per learner call (batch = tokens / seq)")
    ap.add_argument("--prefill", default="16x2048", help="prefill rows x prompt tokens")
    ap.add_argument("--score-model", default="qwen3-8b", help="the one of --models whose scoring pass is timed")
    ap.add_argument("--score", default="16x1024", help="scored rows x tokens")
    ap.add_argument(
        "--only",
        default="decode,prefill,learner,score,kernels",
        help="sections to run, comma-separated: decode, prefill, learner, score, kernels, sweep",
    )
    ap.add_argument(
        "--sweep",
        default="matmul,qkv,rmsnorm,learner_matmul,attention,attention_bwd,decode_attention",
        help="parts of the tile sweep (--only sweep): matmul, qkv, rmsnorm, learner_matmul, attention "
        "(forward: query tiles per program, warps, stages; bits compared), attention_bwd, decode_attention "
        "(a decode step's attention at 2k-32k keys: KV split size x the merge kernel's launch; bits compared)",
    )
    ap.add_argument("--quick", action="store_true", help="a subset that takes a few minutes on one H200")
    _flags.add_out(ap, "JSON path (default bench/results/speed_<date>.json)")
    ap.add_argument(
        "--merge",
        nargs="+",
        metavar="JSON",
        help="measure nothing: join these runs' JSON (e.g. the sections of one run on a host's GPUs, "
        "side by side) into one report at --out and print its table",
    )
    return ap


def model_sections(args, sections, record, bw, rate):
    """Decode (once per --layer-unroll), score and prefill rows, model by model (one model's weights at a time)."""
    for name in args.models.split(","):
        cfg = rlkjax.ModelConfig.preset(name)
        params = rlkjax.init_params(cfg, seed=0)
        for unroll in ints(args.layer_unroll) if "decode" in sections else ():
            record(
                decode_rows(
                    cfg, params, ints(args.batches), ints(args.contexts), args.steps, args.repeats, bw, name, unroll
                )
            )
        if "score" in sections and name == args.score_model:
            record([score_row(cfg, params, name, *map(int, args.score.split("x")), args.repeats)])
        if "prefill" in sections:
            record([prefill_row(cfg, params, *map(int, args.prefill.split("x")), args.repeats, rate, name)])
        del params


def learner_section(args, record, rate):
    """Learner rows per model and length, with the backward variants asked for side by side."""
    for name in args.learner_models.split(","):
        for seq in ints(args.learner_seqs):
            for remat in args.learner_remat.split(","):
                for flash in sorted({True, not args.learner_dense}, reverse=True):
                    for in_place in sorted({True, not args.learner_copies}, reverse=True):
                        strict = numerics.NumericsOptions(
                            attention_backward="flash" if flash else "dense",
                            matmul_backward="in_place" if in_place else "copies",
                        )
                        cfg = rlkjax.ModelConfig.preset(name)
                        # The backward switches change only the strict side: the fast side runs once.
                        sides = args.learner_sides.split(",") if flash and in_place else ("strict",)
                        row = learner_row(cfg, name, seq, args.learner_tokens, args.repeats, rate, remat, sides, strict)
                        record([dict(row, flash_backward=flash, matmul_backward_in_place=in_place)])


def main():
    args = parser().parse_args()
    if args.merge:
        report = merge_reports(args.merge)
        save_report(report, args.out)
        print_table(report)
        return
    if args.quick:
        args.models, args.batches, args.learner_models, args.learner_seqs = (
            "qwen3-0.6b,qwen3-8b",
            "1,64",
            "qwen3-1.7b",
            "1024",
        )
    # As `python -m train.grpo` does, before JAX starts (its default is 75% of the GPU): the train side of the
    # 4B x 2 x 4096 learner row ran out of memory inside that 75%, which train.grpo does not use.
    grpo.claim_device_memory()
    sections = set(args.only.split(","))
    report = new_report("bench.speed")
    out = args.out or f"bench/results/speed_{report['date'][:10]}.json"

    def record(rows):  # saved after every row, so a run cut short keeps what it measured
        report["results"].extend(rows)
        save_report(report, out)

    report["ceilings"] = c = ceilings(args.repeats)
    print(json.dumps(c), flush=True)
    bw, rate = c["copy_bandwidth_Bps"], c["dot_bf16_flops"]
    if "sweep" in sections:
        report["sweep"] = sweep_rows(bw, rate, args.repeats, set(args.sweep.split(",")))
        save_report(report, out)
    if sections & {"decode", "prefill", "score"}:
        model_sections(args, sections, record, bw, rate)
    if "learner" in sections:
        learner_section(args, record, rate)
    if "kernels" in sections:
        record(kernel_rows(bw, rate, args.repeats))
    print_table(report)


if __name__ == "__main__":
    main()
