"""What the adapter-identity canary costs a volunteer per version (models/canary.py).

    python bench/canary_cost.py --json-out /tmp/canary_cost.json

A real engine (transformers, or --engine vllm) on the tiny model loads versions whose LoRA-B the bench sets
(as training would), each with the canary the learner computes at publish. Per version it times:
  load_s      engine.load_adapter alone (what every version costs with or without a canary)
  canary_s    engine.score of the probe + judge: the canary's own cost, load to verdict minus load_s
  batch_s     one batch of work on the same engine (--prompts x --group-size, --max-new-tokens)
and reports canary_s / batch_s (the canary's cost as a fraction of a batch), mean with min / max.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # `python bench/canary_cost.py`: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.results import provenance, write_result  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=["transformers", "vllm"], default="transformers")
    p.add_argument("--versions", type=int, default=5)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group-size", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--json-out", default=None)
    args = p.parse_args()

    import torch

    from asyncrl.client.engine import make_engine
    from asyncrl.models import tinymodel
    from asyncrl.models.canary import canary_tokens, judge, make_canary
    from asyncrl.models.lora import export_lora, load_base_model, with_lora
    from asyncrl.protocol import messages

    torch.set_num_threads(1)
    tiny = str(tinymodel.write_tiny_model(Path(tempfile.mkdtemp(prefix="asyncrl-canary-")) / "m", instruct=True))
    lora = messages.LoraSpec(8, 16.0, 0.0, ("q_proj", "k_proj", "v_proj", "o_proj"))
    base, tokenizer = load_base_model(tiny)
    learner = with_lora(base, lora).eval()
    engine = make_engine(args.engine, tiny, lora, out=lambda s: None)
    sampling = messages.SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens)
    prompts = [list(tokenizer(f"Question {i}: what is {i} + {i}?")["input_ids"]) for i in range(args.prompts)]
    gen = torch.Generator().manual_seed(0)
    rows = []
    for v in range(args.versions):
        with torch.no_grad():
            for name, param in learner.named_parameters():
                if "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=gen) * 0.1 * (v + 1))
        specs, blobs = export_lora(learner, "bf16")
        t0 = time.perf_counter()
        canary = make_canary(learner, tokenizer, "bf16")
        publish_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        engine.load_adapter(v, specs, blobs)
        t1 = time.perf_counter()
        verdict = judge(engine.score(*canary_tokens(canary)), canary, dtype="fp32")
        t2 = time.perf_counter()
        engine.generate(prompts, args.group_size, sampling)
        t3 = time.perf_counter()
        rows.append({"version": v, "passed": verdict.passed, "diff": verdict.diff, "base_diff": verdict.base_diff,
                     "learner_canary_s": publish_s, "load_s": t1 - t0, "canary_s": t2 - t1, "batch_s": t3 - t2,
                     "canary_fraction_of_batch": (t2 - t1) / (t3 - t2)})
        print(f"v{v}: load {t1 - t0:.3f}s canary {t2 - t1:.3f}s batch {t3 - t2:.2f}s "
              f"({(t2 - t1) / (t3 - t2):.3%}) passed={verdict.passed}", flush=True)

    def spread(key):
        vals = [r[key] for r in rows]
        return {"mean": statistics.fmean(vals), "min": min(vals), "max": max(vals)}

    result = {"engine": engine.name, "versions": rows, "canary_s": spread("canary_s"),
              "canary_fraction_of_batch": spread("canary_fraction_of_batch"),
              "learner_canary_s": spread("learner_canary_s"), "load_s": spread("load_s"),
              "batch": {"prompts": args.prompts, "group_size": args.group_size, "max_new_tokens": args.max_new_tokens},
              **provenance()}
    write_result(args.json_out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
