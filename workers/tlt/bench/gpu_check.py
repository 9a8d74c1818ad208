"""GPU readiness on a bare node (torch + transformers only: no Ray, no vLLM, no network).

    scripts/gpu-check.sh                      # what a lent GPU machine runs; under 8 minutes
    python -m workers.tlt.bench.gpu_check [--device cuda] [--shape 1b|tiny] [--rows 8] [--response-len 512]

With a random-init 1B-class Llama shape it runs, and reports in one JSON line (the last stdout line):

    invariance  per operation of a decode step (linear, RMSNorm, attention), in float32 and bfloat16:
              rows that get other bits beside others (a verify pass) than alone (a decode step), at
              PyTorch's own shapes and padded (`_padded`) as the engine pads the tail's passes on CUDA
    learner   one GRPO step through FSDP2 at one rank (the learner group's rank body, in-process:
              NCCL on CUDA, bf16 compute with fp32 master weights), tokens/s and peak memory
    publish   the rank's bucketed weight publish (what the rollout workers read), seconds and bytes
    rollout   the built-in engine's batched decoding on the same shape: a full batch, then the tail
              (batch 1) plain and with SD (a random drafter: the acceptance is meaningless, the
              kernels and the verify path are what is checked), tokens/s; whether greedy SD gave
              plain decoding's tokens, with fixed shapes and without (`_unpadded`), and where not,
              the token it departed at and plain decoding's top-two logit margin there

Checks correctness of the code paths on the device, not speed claims.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from unittest import mock
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import Tensor

SHAPES = {  # Llama-3.2-1B-like, and a tiny one for trying the script on a CPU
    "1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2),
}


def _policy_folder(shape: str, root: Path) -> Path:
    from ..models.transformer import ModelConfig, Transformer, init_weights

    torch.manual_seed(0)
    model = Transformer(ModelConfig(**SHAPES[shape], eos_token_id=2, max_position_embeddings=4096))
    init_weights(model)
    model.save_pretrained(root / "policy")
    return root / "policy"


def _cfg(dtype: str) -> SimpleNamespace:
    """The fields of config.TLTConfig the rank reads (pydantic is not on a bare node)."""
    # compute_dtype float32: on CUDA the rank's FSDP2 policy computes in bfloat16 already (a bfloat16 rollout)
    grpo = SimpleNamespace(lr=1e-6, clip_eps=0.2, kl_coef=0.0, grad_clip=1.0, mini_batches=1, micro_batch=4,
                           micro_batch_tokens=8192, sync_bucket_mb=64, compute_dtype="float32")
    return SimpleNamespace(grpo=grpo, model=SimpleNamespace(dtype=dtype),
                           rollout=SimpleNamespace(temperature=1.0, top_p=1.0, top_k=0))


def learner_check(folder: Path, device: str, dtype: str, rows: int, response_len: int) -> dict:
    from ..learn.grpo import RolloutBatch
    from ..cluster.learner_rank import LearnerRankImpl, free_port

    rank = LearnerRankImpl()
    rank.setup(0, 1, "127.0.0.1", free_port(), str(folder), _cfg(dtype), pad_id=0,
               device="cuda" if device.startswith("cuda") else "cpu", threads=torch.get_num_threads())
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(0)
    batch = RolloutBatch(prompts=[torch.randint(3, vocab, (64,), generator=g).tolist() for _ in range(rows)],
                         responses=[torch.randint(3, vocab, (response_len >> (i % 3),), generator=g).tolist()
                                    for i in range(rows)],
                         rewards=[float(i % 2) for i in range(rows)], group_size=2)
    rank.step(batch, False)  # warm-up
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    out = rank.step(batch, False)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    secs = time.perf_counter() - t
    t = time.perf_counter()
    manifest = rank.publish(1, 64 << 20, shared_memory=True)
    publish_s = time.perf_counter() - t
    res = {"learner_step_s": round(secs, 3),
           "learner_tokens_per_s": round(out["metrics"]["learner/tokens"] / secs, 1),
           "learner_loss_finite": bool(torch.isfinite(torch.tensor(out["metrics"]["learner/loss"]))),
           "publish_s": round(publish_s, 3), "publish_bytes": manifest.nbytes}
    if device.startswith("cuda"):
        res["learner_peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    rank.close()
    return res


def rollout_check(folder: Path, device: str, dtype: str, batch: int, new_tokens: int) -> dict:
    from ..models import linear
    from ..models.drafter import Drafter
    from ..models.transformer import Transformer
    from ..rollout.engine import SpecPolicy, generate
    from ..rollout.sampling import SamplingParams

    policy = Transformer.from_pretrained(folder, dtype=getattr(torch, dtype), device=device).eval()
    drafter = Drafter.for_target(policy).eval()
    vocab = policy.config.vocab_size
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, vocab, (32,), generator=g).tolist() for _ in range(batch)]
    greedy = SamplingParams(temperature=0.0)
    out: dict = {}
    with torch.no_grad():
        for fixed in (False, True):  # PyTorch's own shapes, then one padded shape per few-row product
            linear.CUDA_FIXED_SHAPES = fixed
            tag = "" if fixed else "_unpadded"
            tails: dict[str, list[int]] = {}
            for name, rows, spec, d in (("batch", prompts, SpecPolicy(enabled=False, threshold=0), None),
                                        ("tail_plain", prompts[:1], SpecPolicy(enabled=False, threshold=0), None),
                                        ("tail_sd", prompts[:1], SpecPolicy(enabled=True, threshold=1, arm="d4k1v4",
                                                                            ngram_arm=False), drafter)):
                generate(policy, rows, greedy, max_new_tokens=8, eos_ids=[], spec=spec, drafter=d,
                         harvest_hidden=False)  # warm-up
                t = time.perf_counter()
                res = generate(policy, rows, greedy, max_new_tokens=new_tokens, eos_ids=[], spec=spec, drafter=d,
                               harvest_hidden=False)
                if device.startswith("cuda"):
                    torch.cuda.synchronize()
                secs = time.perf_counter() - t
                out[f"rollout_{name}{tag}_tokens_per_s"] = round(sum(int(n) for n in res.lengths) / secs, 1)
                tails[name] = list(res.tokens[0])
            plain, sd = tails["tail_plain"], tails["tail_sd"]
            out[f"rollout_sd_equals_plain{tag}"] = plain == sd  # lossless: greedy SD = plain
            if plain != sd:  # where SD departed, and how near a tie plain decoding's top two logits were
                i = next(i for i, (a, b) in enumerate(zip(plain, sd)) if a != b)
                seq = torch.tensor([prompts[0] + plain[:i]], device=device)
                top2 = policy(seq).logits[0, -1].float().topk(2).values
                out[f"rollout_sd_departs_at{tag}"] = i
                out[f"rollout_sd_departure_margin{tag}"] = round(float(top2[0] - top2[1]), 5)
    return out


def _differing_rows(fn, x: Tensor, counts=(2, 5, 13, 32)) -> int:
    """Rows whose bits differ between fn over the first n rows and fn over each row alone, summed over n."""
    alone = torch.cat([fn(x[i:i + 1]) for i in range(max(counts))])
    return sum(int((fn(x[:n]) != alone[:n]).flatten(1).any(-1).sum()) for n in counts)


def _differing_passes(q: Tensor, keys: Tensor, values: Tensor, before: int, counts=(2, 5, 13)) -> int:
    """Passes of n chained queries (as a verify pass) in which the first query's output differs in bits
    from that query alone (as a decode step); `before` cached keys precede it."""
    from ..models.transformer import cached_attention

    def first(n: int) -> Tensor:
        S = before + n
        sees = torch.arange(S, device=q.device)[None, :] <= before + torch.arange(n, device=q.device)[:, None]
        return cached_attention(q[:, :, :n], keys[:, :, :S], values[:, :, :S], sees[None])[:, :, 0]

    alone = first(1)
    return sum(int(not torch.equal(first(n), alone)) for n in counts)


def invariance_check(device: str) -> dict:
    """Per operation of a decode step: rows (queries) that get other bits beside others than alone,
    at PyTorch's own shapes and at the fixed shapes the engine runs on CUDA (linear.padded_rows).
    Greedy SD is token-identical to plain decoding only where every operation the engine runs gives 0.
    `explicit` attention is the CPU's invariant formulation (transformer.cached_attention), run here
    for comparison."""
    from ..models import linear, transformer

    out: dict = {}
    g = torch.Generator(device=device).manual_seed(2)
    rand = lambda *shape, scale=1.0: torch.randn(*shape, generator=g, device=device) * scale  # noqa: E731
    try:
        for dtype in (torch.float32, torch.bfloat16):
            name = str(dtype).removeprefix("torch.")
            x = rand(64, 2048).to(dtype)
            ops = {f"linear_{n}": (lambda a, w=rand(n, 2048, scale=0.02).to(dtype): F.linear(a, w))
                   for n in (2048, 8192, 32000)}
            ops["rmsnorm"] = transformer.RMSNorm(2048, 1e-5).to(device)
            for op, fn in ops.items():
                out[f"{name}_{op}_rows_differing"] = _differing_rows(fn, x)
                out[f"{name}_{op}_padded_rows_differing"] = _differing_rows(lambda a, fn=fn: linear.padded_rows(fn, a), x)
            q, keys, values = rand(1, 32, 64, 64).to(dtype), rand(1, 8, 364, 64).to(dtype), rand(1, 8, 364, 64).to(dtype)
            for path in ("sdpa", "explicit"):  # (our float32 CPU kernel left out: it never runs on a GPU)
                with mock.patch.object(transformer, "invariant_attention", lambda _q, p=path: p == "explicit"), \
                        mock.patch.object(transformer, "kernel_attention", lambda *_: False):
                    for fixed in (False, True):
                        linear.CUDA_FIXED_SHAPES = fixed
                        key = f"{name}_attention_{path}{'_padded' if fixed else ''}_passes_differing"
                        out[key] = _differing_passes(q, keys, values, before=300)
    finally:
        linear.CUDA_FIXED_SHAPES = True
    return out

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m workers.tlt.bench.gpu_check", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--response-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=32, help="rollout batch (the tail is 1)")
    p.add_argument("--new-tokens", type=int, default=128)
    args = p.parse_args(argv)
    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    t0 = time.perf_counter()
    out: dict = {"check": "gpu", "device": args.device, "shape": args.shape, "torch": torch.__version__}
    if args.device.startswith("cuda"):
        out["gpu"] = torch.cuda.get_device_name(0)
    with tempfile.TemporaryDirectory(prefix="tlt-gpu-check-") as tmp:
        folder = _policy_folder(args.shape, Path(tmp))
        for name, fn in (("invariance", lambda: invariance_check(args.device)),
                         ("learner", lambda: learner_check(folder, args.device, dtype, args.rows, args.response_len)),
                         ("rollout", lambda: rollout_check(folder, args.device, dtype, args.batch, args.new_tokens))):
            print(f"[gpu-check] {name}", file=sys.stderr, flush=True)
            try:
                out.update(fn())
                out[f"{name}_ok"] = True
            except Exception as exc:  # noqa: BLE001 - reported in the JSON line, the other check still runs
                out[f"{name}_ok"], out[f"{name}_error"] = False, f"{type(exc).__name__}: {exc}"[:500]
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out))
    return 0 if all(out.get(f"{c}_ok") for c in ("invariance", "learner", "rollout")) else 1


if __name__ == "__main__":
    raise SystemExit(main())
