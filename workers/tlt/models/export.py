"""Export the drafter (vLLM / SGLang EAGLE folder) and the policy (Hugging Face folder).

    export_drafter(drafter, "out/drafter")            # config.json + model.safetensors
    drafter = load_drafter("out/drafter", target=policy)
    export_policy(policy, "out/policy", tokenizer="var/models/smollm2-135m")
    zip_folder("out/drafter", "out/drafter.zip")      # what the platform offers for download

Drafter folder format (EAGLE-1, as vLLM's `LlamaForCausalLMEagle` / SGLang's `LlamaForCausalLMEagle`
load it with `speculative_config={"method": "eagle", "model": <folder>, ...}`):

- `config.json`: the target's Hugging Face config with `num_hidden_layers: 1`. `architectures`
  stay the target's (e.g. `LlamaForCausalLM`; the engine maps it to its EAGLE variant). A
  `tlt_drafter` key records what this is (method, fc input order, the target's layer count);
  loaders ignore unknown keys.
- `model.safetensors`, exactly these tensors (H hidden, I intermediate, hd head dim):
    fc.weight                                   [H, 2H]  on cat(embed(x_{i+1}), h_i), in that order
    layers.0.self_attn.{q,k,v}_proj.weight      [n_heads*hd | n_kv*hd, H]  (+ .bias for Qwen2)
    layers.0.self_attn.o_proj.weight            [H, n_heads*hd]
    layers.0.post_attention_layernorm.weight    [H]
    layers.0.mlp.{gate,up}_proj.weight          [I, H]
    layers.0.mlp.down_proj.weight               [H, I]
  No `layers.0.input_layernorm` (the EAGLE layer's input norm is an identity) and no
  `embed_tokens` / `lm_head`: the engine shares the target's.
- The drafter reads the target's last-layer hidden state after the final norm; its output goes to
  the target's LM head with no extra norm.

Policy folder: `Transformer.save_pretrained` (config.json + model.safetensors, HF names) plus the
tokenizer files copied from the source folder (or a `tokenizers.Tokenizer` saved as tokenizer.json).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import zipfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .drafter import Drafter
from .transformer import ModelConfig, Transformer

DRAFTER_MARKER = "tlt_drafter"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "generation_config.json", "vocab.json", "merges.txt", "tokenizer.model")


def drafter_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The exact {name: shape} of an exported drafter's model.safetensors for a target config."""
    H, I, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    shapes = {
        "fc.weight": (H, 2 * H),
        "layers.0.self_attn.q_proj.weight": (q, H),
        "layers.0.self_attn.k_proj.weight": (kv, H),
        "layers.0.self_attn.v_proj.weight": (kv, H),
        "layers.0.self_attn.o_proj.weight": (H, q),
        "layers.0.post_attention_layernorm.weight": (H,),
        "layers.0.mlp.gate_proj.weight": (I, H),
        "layers.0.mlp.up_proj.weight": (I, H),
        "layers.0.mlp.down_proj.weight": (H, I),
    }
    if cfg.attention_bias:
        shapes.update({"layers.0.self_attn.q_proj.bias": (q,), "layers.0.self_attn.k_proj.bias": (kv,),
                       "layers.0.self_attn.v_proj.bias": (kv,)})
    return shapes


def _write_atomic(folder: Path, write) -> Path:
    """Write into `<folder>.tmp`, then swap it in, so a reader never sees half a folder."""
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write(tmp)
    if folder.exists():
        shutil.rmtree(folder)
    tmp.rename(folder)
    return folder


def file_sha256(paths) -> str:
    """sha256 over the bytes of `paths` in order (hex)."""
    h = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 22), b""):
                h.update(block)
    return h.hexdigest()


def model_card(*, target_name: str, target_dir: str | Path, rl_step: int, training_tokens: int, depth: int,
               acceptance_length: float | None = None, heldout_prompts: int = 0,
               tokenizer_dir: str | Path | None = None) -> dict:
    """What a drafter version is and how to serve it (the registry's model card, model_card.json).

    target_dir: the policy folder this drafter was trained for (its weights' and tokenizer's
    sha256 identify it; the tokenizer from tokenizer_dir when given: an RL checkpoint's policy
    folder holds only weights); depth: the draft length to serve it with (the run's longest chain arm);
    acceptance_length: tokens per verify pass our engine measured on held-out prompts at export.
    """
    target_dir = Path(target_dir)
    tokenizer = Path(tokenizer_dir or target_dir) / "tokenizer.json"
    path = "<this folder>"
    return {
        "format": "eagle",
        "target_model": target_name,
        "target_sha256": file_sha256(sorted(target_dir.glob("*.safetensors"))),
        "tokenizer_sha256": file_sha256([tokenizer]) if tokenizer.is_file() else None,
        "rl_step": int(rl_step),
        "training_tokens": int(training_tokens),
        "acceptance_length": acceptance_length,
        "heldout_prompts": int(heldout_prompts),
        "vllm_speculative_config": {"method": "eagle", "model": path, "num_speculative_tokens": int(depth)},
        "sglang_args": ["--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", path,
                        "--speculative-num-steps", str(depth), "--speculative-eagle-topk", "1",
                        "--speculative-num-draft-tokens", str(depth + 1)],
    }


def export_drafter(drafter: Drafter, folder: str | Path, card: dict | None = None) -> Path:
    """Write `drafter` as an EAGLE folder (format in the module doc), with its model card as
    model_card.json when given; returns the folder."""
    folder = Path(folder)
    cfg = drafter.config
    state = {k: v.detach().contiguous().cpu() for k, v in drafter.weights.items()}
    expected = drafter_tensor_shapes(cfg)
    got = {k: tuple(v.shape) for k, v in state.items()}
    if got != expected:
        raise RuntimeError(f"drafter weights do not match the EAGLE layout: {sorted(set(got) ^ set(expected))}")
    hf = cfg.to_hf()
    hf[DRAFTER_MARKER] = {"method": "eagle", "fc_input": ["embedding(next_token)", "target_hidden"],
                          "target_num_hidden_layers": cfg.num_hidden_layers}
    hf["num_hidden_layers"] = 1
    hf["torch_dtype"] = str(drafter.fc.weight.dtype).removeprefix("torch.")

    def write(tmp: Path) -> None:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(hf, indent=2))
        if card is not None:
            (tmp / "model_card.json").write_text(json.dumps(card, indent=2))

    return _write_atomic(folder, write)


def load_drafter(folder: str | Path, target: Transformer) -> Drafter:
    """Load an EAGLE drafter folder for `target` (weights cast to the target's dtype and device)."""
    folder = Path(folder)
    hf = json.loads((folder / "config.json").read_text())
    hf_target = {**hf, "num_hidden_layers": target.config.num_hidden_layers}
    hf_target.pop(DRAFTER_MARKER, None)
    hf_target.pop("torch_dtype", None)
    cfg = ModelConfig.from_hf(hf_target)
    for key in ("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim"):
        if getattr(cfg, key) != getattr(target.config, key):
            raise ValueError(f"drafter {key}={getattr(cfg, key)} does not match the target's {getattr(target.config, key)}")
    state = load_file(str(folder / "model.safetensors"))
    with torch.device("meta"):
        drafter = Drafter(cfg, target)
    drafter.load_state_dict({k: v.to(target.dtype) for k, v in state.items()}, strict=True, assign=True)
    return drafter.to(device=target.device)


def export_policy(model: Transformer, folder: str | Path, tokenizer: str | Path | object | None = None) -> Path:
    """Save the policy as a Hugging Face folder, with the tokenizer files of `tokenizer`.

    tokenizer: a folder to copy tokenizer.json / tokenizer_config.json / ... from, or a
    `tokenizers.Tokenizer` (saved as tokenizer.json), or None.
    """
    folder = Path(folder)

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp)
        if tokenizer is None:
            return
        if isinstance(tokenizer, (str, os.PathLike)):
            src = Path(tokenizer)
            found = [f for f in TOKENIZER_FILES if (src / f).is_file()]
            if "tokenizer.json" not in found and "tokenizer.model" not in found:
                raise FileNotFoundError(f"no tokenizer files in {src}")
            for f in found:
                shutil.copy2(src / f, tmp / f)
        else:
            tokenizer.save(str(tmp / "tokenizer.json"))

    return _write_atomic(folder, write)


def zip_folder(folder: str | Path, zip_path: str | Path) -> Path:
    """Zip a folder (files at the archive root, sorted, fixed timestamps: same input, same bytes)."""
    folder, zip_path = Path(folder), Path(zip_path)
    zip_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = zip_path.with_name(zip_path.name + ".tmp")
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for f in sorted(p for p in folder.rglob("*") if p.is_file()):
            info = zipfile.ZipInfo(f.relative_to(folder).as_posix(), date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            with f.open("rb") as src, zf.open(info, "w") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
    tmp.replace(zip_path)
    return zip_path
